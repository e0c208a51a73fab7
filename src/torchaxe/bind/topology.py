"""The machine as core binding sees it: sockets, NUMA nodes, physical cores and their
SMT siblings, L3 groups, the CPUs this process may use, and each accelerator's node.

Everything is read below an injectable root (``/`` on a real machine; a canned tree
such as ``tests/data/sysfs/xeon-2s-smt`` in the tests):

- ``sys/devices/system/cpu/online`` and ``cpuN/topology/*`` (package, core, SMT
  siblings), ``cpuN/cache/index*/`` (the level-3 cache and the CPUs that share it);
- ``sys/devices/system/node/nodeN/cpulist`` and ``distance``;
- the cgroup cpuset (``proc/self/cgroup``, then ``sys/fs/cgroup/...`` for cgroup v2
  ``cpuset.cpus.effective`` or v1 ``cpuset.effective_cpus``), which is what a
  container started with ``--cpuset-cpus`` sees;
- the affinity mask (``os.sched_getaffinity`` on ``/``, ``proc/self/status``
  ``Cpus_allowed_list`` in a canned tree);
- the devices, through the backends' ``device_locations`` (PCI ``numa_node``).

A file that is missing gets a warning and a fallback (no NUMA information: one node;
no core ids: every CPU its own core), never a traceback.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from torchaxe.backends.pci import DeviceLocation
from torchaxe.cpulist import format_cpulist, parse_cpulist
from torchaxe.errors import TorchaxeError


@dataclass(frozen=True)
class Core:
    """One physical core: its logical CPUs (SMT siblings) and where it sits."""

    id: int
    cpus: tuple[int, ...]
    socket: int
    node: int
    #: Index into ``Topology.l3_groups``; None when the cache is not described.
    l3: int | None = None


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    socket: int | None = None
    #: ``distance`` row (10 = local), indexed like ``Topology.nodes``; None if absent.
    distances: tuple[int, ...] | None = None


@dataclass
class Topology:
    cores: list[Core]
    nodes: list[NumaNode]
    l3_groups: list[tuple[int, ...]]
    #: CPUs this process may run on: affinity mask ∩ cgroup cpuset ∩ online.
    allowed: tuple[int, ...]
    #: The cgroup's cpuset (the container's limit), None where there is none to read.
    cgroup_cpus: tuple[int, ...] | None
    #: This process's affinity mask.
    affinity: tuple[int, ...]
    devices: list[DeviceLocation] = field(default_factory=list)
    device_kind: str = "cpu"
    warnings: list[str] = field(default_factory=list)
    root: str = "/"

    # ------------------------------------------------------------- questions

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(c for core in self.cores for c in core.cpus))

    @property
    def sockets(self) -> list[int]:
        return sorted({core.socket for core in self.cores})

    @property
    def smt(self) -> bool:
        return any(len(core.cpus) > 1 for core in self.cores)

    def node(self, node_id: int) -> NumaNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def node_of_cpu(self) -> dict[int, int]:
        return {cpu: core.node for core in self.cores for cpu in core.cpus}

    def allowed_cores(self, nodes: tuple[int, ...] | None = None) -> list[Core]:
        """Physical cores with at least one allowed CPU (their CPUs cut to the allowed
        ones), optionally only on these nodes, in CPU order."""
        allowed = set(self.allowed)
        out = []
        for core in self.cores:
            if nodes is not None and core.node not in nodes:
                continue
            cpus = tuple(c for c in core.cpus if c in allowed)
            if cpus:
                out.append(Core(core.id, cpus, core.socket, core.node, core.l3))
        return sorted(out, key=lambda c: c.cpus[0])

    def nodes_of_socket(self, socket: int) -> tuple[int, ...]:
        return tuple(n.id for n in self.nodes if n.socket == socket)

    def distance(self, a: int, b: int) -> int:
        """NUMA distance (10 local); without a distance table, 10 or 20."""
        index = [n.id for n in self.nodes]
        row = self.node(a).distances
        if row is not None and b in index and index.index(b) < len(row):
            return row[index.index(b)]
        return 10 if a == b else 20

    def node_for_cpus(self, cpus: tuple[int, ...]) -> int | None:
        """The node holding most of these CPUs."""
        where = self.node_of_cpu()
        counts = Counter(where[c] for c in cpus if c in where)
        return counts.most_common(1)[0][0] if counts else None

    # ------------------------------------------------------------- output

    def to_dict(self) -> dict[str, Any]:
        allowed = set(self.allowed)
        return {
            "schema": "torchaxe.topo/1",
            "root": self.root,
            "sockets": [{"id": s, "nodes": list(self.nodes_of_socket(s)),
                         "cpus": sorted(c for core in self.cores if core.socket == s for c in core.cpus)}
                        for s in self.sockets],
            "numa_nodes": [{"id": n.id, "cpus": list(n.cpus), "socket": n.socket,
                            "cores": sum(1 for core in self.cores if core.node == n.id),
                            "allowed_cpus": [c for c in n.cpus if c in allowed],
                            "distances": list(n.distances) if n.distances is not None else None}
                           for n in self.nodes],
            "cores": [{"id": c.id, "cpus": list(c.cpus), "socket": c.socket, "node": c.node, "l3": c.l3}
                      for c in self.cores],
            "l3_groups": [list(g) for g in self.l3_groups],
            "smt": self.smt,
            "allowed_cpus": list(self.allowed),
            "cgroup_cpus": list(self.cgroup_cpus) if self.cgroup_cpus is not None else None,
            "affinity": list(self.affinity),
            "device_kind": self.device_kind,
            "devices": [d.to_dict() for d in self.devices],
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------- reading


class _Reader:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.warnings: list[str] = []
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warnings.append(message)

    def text(self, relative: str) -> str | None:
        try:
            return (self.root / relative).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self.warn_once(relative, f"cannot read {relative}: {exc.strerror or exc}")
            return None

    def cpulist(self, relative: str) -> tuple[int, ...] | None:
        text = self.text(relative)
        if text is None:
            return None
        try:
            return parse_cpulist(text, relative)
        except TorchaxeError as exc:
            self.warn_once(relative, str(exc))
            return None


_CPU_DIR = re.compile(r"cpu(\d+)$")
_NODE_DIR = re.compile(r"node(\d+)$")


def read_topology(root: str | os.PathLike = "/", target: str = "auto", environ: Mapping[str, str] | None = None,
                  vendor_tool: Callable[[], str | None] | None = None) -> Topology:
    """Read the machine below ``root``. ``target`` picks the devices: ``cpu`` none,
    ``cuda``/``npu`` that backend's, ``auto`` whichever finds devices (npu first).
    ``environ`` supplies ``*_VISIBLE_DEVICES`` (default ``os.environ``);
    ``vendor_tool`` returns ``npu-smi info -t topo`` text (see the npu backend)."""
    root_path = Path(root)
    live = str(root) == "/"
    r = _Reader(root_path)
    cpu_base = "sys/devices/system/cpu"
    if not (root_path / cpu_base).is_dir():
        if not live:
            raise TorchaxeError(f"no CPU topology under {root_path / cpu_base}: not a sysfs tree")
        r.warn_once("cpu", f"{cpu_base} is missing: every CPU treated as its own core on one NUMA node")

    online = r.cpulist(f"{cpu_base}/online")
    if online is None:
        try:
            online = tuple(sorted(int(m.group(1)) for p in (root_path / cpu_base).iterdir()
                                  if (m := _CPU_DIR.match(p.name))))
        except OSError:
            online = ()
        if not online and live and hasattr(os, "sched_getaffinity"):
            online = tuple(sorted(os.sched_getaffinity(0)))
        if online:
            r.warn_once("online", f"{cpu_base}/online is missing: taking CPUs {format_cpulist(online)}")
    if not online:
        raise TorchaxeError(f"no CPUs found under {root_path / cpu_base}")

    # Nodes first: cores take their node from here.
    nodes_raw: dict[int, tuple[int, ...]] = {}
    distances: dict[int, tuple[int, ...]] = {}
    node_base = root_path / "sys/devices/system/node"
    try:
        node_dirs = sorted((int(m.group(1)), p) for p in node_base.iterdir() if (m := _NODE_DIR.match(p.name)))
    except OSError:
        node_dirs = []
    for node_id, path in node_dirs:
        cpus = r.cpulist(f"sys/devices/system/node/{path.name}/cpulist")
        if cpus is None:
            r.warn_once(f"node{node_id}", f"sys/devices/system/node/{path.name}/cpulist is missing: node {node_id} skipped")
            continue
        if not cpus:
            continue  # a memory-only node (CXL, HBM): no CPUs to bind to
        nodes_raw[node_id] = tuple(c for c in cpus if c in set(online))
        dist = r.text(f"sys/devices/system/node/{path.name}/distance")
        if dist:
            try:
                distances[node_id] = tuple(int(x) for x in dist.split())
            except ValueError:
                r.warn_once(f"dist{node_id}", f"node {node_id}: distance {dist!r} unreadable")
    if not nodes_raw:
        r.warn_once("nodes", "no NUMA information (sys/devices/system/node): treating the machine as one NUMA node")
        nodes_raw = {0: tuple(online)}
    node_of = {cpu: n for n, cpus in nodes_raw.items() for cpu in cpus}
    for cpu in online:
        if cpu not in node_of:
            first = min(nodes_raw)
            r.warn_once(f"orphan{cpu}", f"CPU {cpu} is in no NUMA node's cpulist: counted on node {first}")
            node_of[cpu] = first

    # Cores, sockets, L3 groups.
    socket_of: dict[int, int] = {}
    siblings_of: dict[int, tuple[int, ...]] = {}
    l3_of: dict[int, tuple[int, ...]] = {}
    for cpu in online:
        base = f"{cpu_base}/cpu{cpu}"
        pkg = r.text(f"{base}/topology/physical_package_id")
        if pkg is None or not pkg.lstrip("-").isdigit():
            r.warn_once("pkg", f"{base}/topology/physical_package_id is missing: CPUs without one counted on socket 0")
            socket_of[cpu] = 0
        else:
            socket_of[cpu] = max(int(pkg), 0)
        sibs = r.cpulist(f"{base}/topology/thread_siblings_list") or r.cpulist(f"{base}/topology/core_cpus_list")
        if sibs is None:
            core_id = r.text(f"{base}/topology/core_id")
            if core_id is None:
                r.warn_once("core", f"{base}/topology is missing: CPUs without it treated as their own core (no SMT)")
            siblings_of[cpu] = (cpu,) if core_id is None else ("core", socket_of[cpu], core_id)  # type: ignore[assignment]
        else:
            siblings_of[cpu] = tuple(c for c in sibs if c in set(online)) or (cpu,)
        l3 = _l3_of(r, base)
        if l3 is not None:
            l3_of[cpu] = tuple(c for c in l3 if c in set(online))

    groups: dict[Any, list[int]] = {}
    for cpu in online:
        groups.setdefault(siblings_of[cpu], []).append(cpu)
    l3_index: dict[tuple[int, ...], int] = {}
    for cpu in online:
        if cpu in l3_of and l3_of[cpu] not in l3_index:
            l3_index[l3_of[cpu]] = len(l3_index)
    if online and not l3_of:
        r.warn_once("l3", f"{cpu_base}/cpuN/cache has no level-3 cache: L3 groups unknown")
    cores: list[Core] = []
    for i, cpus in enumerate(sorted((sorted(v) for v in groups.values()), key=lambda c: c[0])):
        first = cpus[0]
        cores.append(Core(i, tuple(cpus), socket_of[first], node_of[first],
                          l3_index.get(l3_of[first]) if first in l3_of else None))

    node_ids = sorted(nodes_raw)
    nodes = []
    for n in node_ids:
        sockets = Counter(socket_of[c] for c in nodes_raw[n])
        row = distances.get(n)
        nodes.append(NumaNode(n, nodes_raw[n], sockets.most_common(1)[0][0] if sockets else None,
                              row if row is not None and len(row) >= len(node_ids) else None))
    # The distance file has a column for every node, memory-only ones included:
    # keep the columns of the nodes with CPUs.
    if node_dirs and distances:
        all_ids = [n for n, _ in node_dirs]
        fixed = []
        for node in nodes:
            row = distances.get(node.id)
            if row is not None and len(row) == len(all_ids):
                row = tuple(row[all_ids.index(n)] for n in node_ids)
            elif row is not None and len(row) != len(node_ids):
                row = None
            fixed.append(NumaNode(node.id, node.cpus, node.socket, row))
        nodes = fixed

    cgroup = _cgroup_cpus(r)
    affinity = _affinity(r, live, online)
    allowed = tuple(sorted(set(affinity) & set(online) & (set(cgroup) if cgroup is not None else set(online))))
    if not allowed:
        r.warn_once("allowed", f"affinity {format_cpulist(affinity)} and cgroup cpuset "
                               f"{format_cpulist(cgroup or ())} do not overlap: using the affinity mask")
        allowed = tuple(sorted(set(affinity) & set(online))) or tuple(online)

    topo = Topology(cores=cores, nodes=nodes, l3_groups=[tuple(sorted(g)) for g in l3_index],
                    allowed=allowed, cgroup_cpus=cgroup, affinity=affinity,
                    warnings=r.warnings, root=str(root))
    _add_devices(topo, root_path, target, os.environ if environ is None else environ, vendor_tool)
    return topo


def _l3_of(r: _Reader, base: str) -> tuple[int, ...] | None:
    cache = r.root / base / "cache"
    try:
        indexes = sorted(p.name for p in cache.iterdir() if p.name.startswith("index"))
    except OSError:
        return None
    for name in indexes:
        if r.text(f"{base}/cache/{name}/level") == "3":
            kind = r.text(f"{base}/cache/{name}/type")
            if kind in (None, "Unified", "Data"):
                return r.cpulist(f"{base}/cache/{name}/shared_cpu_list")
    return None


def _cgroup_cpus(r: _Reader) -> tuple[int, ...] | None:
    """The cpuset of this process's cgroup: v1 if the cpuset controller is mounted
    there (hybrid hosts), else v2. Inside a cgroup namespace the listed path may not
    exist below the mount: then the parents up to the mount's root are tried."""
    text = r.text("proc/self/cgroup")
    if text is None:
        return None
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "cpuset" in controllers.split(","):
            v1 = path
    candidates = []
    if v1 is not None:
        candidates.append(("sys/fs/cgroup/cpuset", v1, ("cpuset.effective_cpus", "cpuset.cpus")))
    if v2 is not None:
        candidates.append(("sys/fs/cgroup", v2, ("cpuset.cpus.effective",)))
    for mount, path, files in candidates:
        parts = [p for p in path.strip("/").split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = "/".join([mount, *parts[:depth]])
            for name in files:
                cpus = r.cpulist(f"{folder}/{name}")
                if cpus:
                    return cpus
    return None


def _affinity(r: _Reader, live: bool, online: tuple[int, ...]) -> tuple[int, ...]:
    if live and hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    status = r.text("proc/self/status")
    if status:
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                try:
                    return parse_cpulist(line.split(":", 1)[1], "Cpus_allowed_list")
                except TorchaxeError as exc:
                    r.warn_once("status", str(exc))
    r.warn_once("affinity", "proc/self/status has no Cpus_allowed_list: taking every online CPU as allowed")
    return tuple(online)


def _add_devices(topo: Topology, root: Path, target: str, environ: Mapping[str, str],
                 vendor_tool: Callable[[], str | None] | None) -> None:
    from torchaxe.backends.cuda import CudaBackend
    from torchaxe.backends.npu import NpuBackend

    target = (target or "auto").lower()
    if target == "cpu":
        return
    backends = {"npu": NpuBackend, "cuda": CudaBackend}
    order = ["npu", "cuda"] if target == "auto" else [target]
    for name in order:
        if name not in backends:
            raise TorchaxeError(f"unknown target {target!r}: choose one of auto, cpu, cuda, npu")
        devices = backends[name]().device_locations(root, environ, vendor_tool if name == "npu" else None)
        if devices:
            topo.device_kind = name
            topo.devices = [_settle_node(topo, d) for d in devices]
            return
    if target != "auto":
        topo.warnings.append(f"no {target} devices found under {root}: planning for the CPU only")


def _settle_node(topo: Topology, device: DeviceLocation) -> DeviceLocation:
    """Fill an unknown node from the vendor's CPU affinity, or from a machine with
    only one node; refuse a node that has no CPUs here."""
    from dataclasses import replace

    known = {n.id for n in topo.nodes}
    node, note = device.numa_node, device.note
    if node is not None and node not in known:
        note = "; ".join(x for x in (note, f"numa_node {node} is not a node with CPUs here") if x)
        node = None
    if node is None and device.cpus:
        node = topo.node_for_cpus(device.cpus)
        if node is not None:
            note = "; ".join(x for x in (note, f"node {node} from the CPU affinity npu-smi reports") if x)
    if node is None and len(topo.nodes) == 1:
        node = topo.nodes[0].id
        note = "; ".join(x for x in (note, f"the machine has one NUMA node: node {node}") if x)
    if node is None:
        topo.warnings.append(f"{device.kind}:{device.index}"
                             f"{' (' + device.pci + ')' if device.pci else ''}: NUMA node unknown "
                             f"({note or 'no information'}): its ranks are spread over the nodes")
    return replace(device, numa_node=node, note=note)
