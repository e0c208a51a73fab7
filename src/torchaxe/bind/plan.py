"""Binding plans: which CPUs each local rank (and its data-loader workers) runs on,
and how many compute threads it starts.

Modes (the names torchrun's ``--numa-binding`` uses, for any device):

- ``exclusive`` (default): the physical cores of the device's NUMA node, split evenly
  among the ranks whose devices sit on that node; no two ranks share a core.
- ``node``: every allowed CPU of the device's node (ranks on one node share them).
- ``socket``: every allowed CPU of the socket holding the device's node.
- ``core-complex``: whole L3 groups (AMD CCDs/CCXs, ...) of the device's node, a
  different group for each rank where there are enough; otherwise ``exclusive``.
- ``cpus``: an explicit CPU list per rank (``--cpus``), cut to the allowed CPUs.
- ``none``: no binding.

Without devices (CPU training) ranks are spread over the NUMA nodes in rank order.
Within a rank's set, the last cores can be kept for data-loader workers (the main
thread and the compute threads get the rest); ``OMP_NUM_THREADS`` and
``MKL_NUM_THREADS`` are set to the number of compute cores, unless the user set them
(then they are kept and a warning says when they differ). When a node has fewer
cores than ranks, cores are borrowed from the nearest node (a warning names the
remote ranks); when the process may use fewer cores than there are ranks, ranks
share cores (oversubscribed: a warning).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from torchaxe.bind.topology import Core, Topology
from torchaxe.cpulist import format_cpulist, parse_cpulist
from torchaxe.errors import TorchaxeError

MODES = ("exclusive", "node", "socket", "core-complex", "none")
#: The thread-count variables a plan sets for each rank.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
SCHEMA = "torchaxe.bind-plan/1"


@dataclass(frozen=True)
class RankBinding:
    """One local rank's share of the machine."""

    local_rank: int
    #: Device index (``cuda:N``/``npu:N``) or None for CPU training.
    device: int | None
    #: The device's NUMA node (None: unknown or no device).
    device_node: int | None
    #: Every CPU of the rank: compute and loader CPUs.
    cpus: tuple[int, ...]
    #: The rank's process affinity: its main thread and compute threads.
    compute_cpus: tuple[int, ...]
    #: CPUs kept for its DataLoader workers; empty = workers share ``compute_cpus``.
    loader_cpus: tuple[int, ...]
    #: Compute threads (``OMP_NUM_THREADS``); None when nothing is set (mode none).
    threads: int | None
    #: Variables the rank sets (those the user did not set).
    env: dict[str, str] = field(default_factory=dict)

    def nodes(self, topo_node_of: Mapping[int, int]) -> tuple[int, ...]:
        return tuple(sorted({topo_node_of[c] for c in self.cpus if c in topo_node_of}))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("cpus", "compute_cpus", "loader_cpus"):
            d[key] = list(d[key])
        d["cpulist"] = format_cpulist(self.cpus)
        return d


@dataclass
class BindingPlan:
    """The binding of all local ranks on this machine."""

    mode: str
    ranks: list[RankBinding]
    device_kind: str = "cpu"
    allowed: tuple[int, ...] = ()
    #: Thread variables the user set, kept as they are.
    user_env: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: CPU -> NUMA node, for the table and for checks.
    node_of_cpu: dict[int, int] = field(default_factory=dict)

    @property
    def nproc(self) -> int:
        return len(self.ranks)

    def rank(self, local_rank: int) -> RankBinding:
        if not 0 <= local_rank < len(self.ranks):
            raise TorchaxeError(f"local rank {local_rank} is not in the plan (it has ranks 0-{len(self.ranks) - 1}); "
                                "give the number of local ranks with --nproc")
        return self.ranks[local_rank]

    def rank_nodes(self, rank: RankBinding) -> tuple[int, ...]:
        return rank.nodes(self.node_of_cpu)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "mode": self.mode, "nproc": self.nproc, "device_kind": self.device_kind,
                "allowed_cpus": list(self.allowed), "user_env": dict(self.user_env),
                "ranks": [dict(r.to_dict(), nodes=list(self.rank_nodes(r))) for r in self.ranks],
                "warnings": list(self.warnings), "notes": list(self.notes),
                "node_of_cpu": {str(k): v for k, v in sorted(self.node_of_cpu.items())}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> "BindingPlan":
        """Read a plan back (the launcher hands it to every rank as a JSON file)."""
        try:
            if data.get("schema") != SCHEMA:
                raise TorchaxeError(f"{where}: not a binding plan (schema {data.get('schema')!r}, expected {SCHEMA})")
            ranks = [RankBinding(local_rank=int(r["local_rank"]), device=r["device"], device_node=r["device_node"],
                                 cpus=tuple(int(c) for c in r["cpus"]),
                                 compute_cpus=tuple(int(c) for c in r["compute_cpus"]),
                                 loader_cpus=tuple(int(c) for c in r["loader_cpus"]),
                                 threads=None if r["threads"] is None else int(r["threads"]),
                                 env={str(k): str(v) for k, v in r["env"].items()})
                     for r in data["ranks"]]
            return cls(mode=str(data["mode"]), ranks=ranks, device_kind=str(data["device_kind"]),
                       allowed=tuple(int(c) for c in data["allowed_cpus"]),
                       user_env={str(k): str(v) for k, v in data["user_env"].items()},
                       warnings=list(data["warnings"]), notes=list(data["notes"]),
                       node_of_cpu={int(k): int(v) for k, v in data["node_of_cpu"].items()})
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise TorchaxeError(f"{where}: malformed binding plan ({type(exc).__name__}: {exc})") from None


def parse_loader_cores(value: str | int | None) -> int | None:
    """``auto`` (None) or a count >= 0."""
    if value is None or value == "auto":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise TorchaxeError(f"--loader-cores {value!r}: expected auto or a number of cores") from None
    if n < 0:
        raise TorchaxeError(f"--loader-cores {value}: must be 0 or more")
    return n


def plan_binding(topo: Topology, nproc: int, mode: str = "exclusive", cpus: Sequence[str] | None = None,
                 loader_cores: int | None = None, environ: Mapping[str, str] | None = None) -> BindingPlan:
    """Plan ``nproc`` local ranks on ``topo``. ``cpus`` (one CPU list per rank) makes
    the mode ``cpus``; ``loader_cores`` None is automatic (a quarter of a rank's
    cores from 4 cores up, in the exclusive kinds of mode); ``environ`` is the
    user's environment (whose thread variables are kept)."""
    import os

    environ = os.environ if environ is None else environ
    if nproc < 1:
        raise TorchaxeError(f"--nproc-per-node {nproc}: need at least one rank")
    if cpus:
        mode = "cpus"
    elif mode not in MODES:
        raise TorchaxeError(f"unknown binding mode {mode!r}: choose one of {', '.join(MODES)} (or give --cpus)")
    builder = _Planner(topo, nproc, mode, loader_cores, environ)
    return builder.build(list(cpus) if cpus else None)


class _Planner:
    def __init__(self, topo: Topology, nproc: int, mode: str, loader_cores: int | None,
                 environ: Mapping[str, str]) -> None:
        self.topo = topo
        self.nproc = nproc
        self.mode = mode
        self.loader_cores = loader_cores
        self.environ = environ
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.node_of = topo.node_of_cpu()
        self.usable_nodes = [n.id for n in topo.nodes if topo.allowed_cores((n.id,))]
        self.core_of = {c: core for core in topo.allowed_cores() for c in core.cpus}

    # ------------------------------------------------------------ homes

    def homes(self) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """Each rank's device and home node(s)."""
        topo, n = self.topo, self.nproc
        devices = topo.devices
        if not devices:
            k = len(self.usable_nodes)
            sizes = [len(topo.allowed_cores((m,))) for m in self.usable_nodes]
            if len(set(sizes)) > 1 and self.mode in ("exclusive", "core-complex"):
                # Data-parallel ranks wait for the slowest: equal shares matter more
                # than staying inside one node.
                self.notes.append(f"the nodes have unequal numbers of usable cores "
                                  f"({', '.join(f'node {m}: {s}' for m, s in zip(self.usable_nodes, sizes))}): "
                                  "cores are split evenly over the ranks in CPU order, so a rank may span nodes")
                return [None] * n, [tuple(self.usable_nodes)] * n
            if n >= k:
                homes = [(self.usable_nodes[r * k // n],) for r in range(n)]
            else:
                homes = [tuple(self.usable_nodes[r * k // n:(r + 1) * k // n]) for r in range(n)]
            return [None] * n, homes
        if len(devices) < n:
            self.warnings.append(f"{n} local ranks but {len(devices)} {topo.device_kind} devices: "
                                 f"rank r is placed by device r mod {len(devices)}")
        device_ids: list[int | None] = []
        homes: list[tuple[int, ...] | None] = []
        for r in range(n):
            d = devices[r % len(devices)]
            device_ids.append(d.index)
            node = d.numa_node
            if node is not None and node not in self.usable_nodes:
                nearest = min(self.usable_nodes, key=lambda m: (topo.distance(node, m), m))
                self.warnings.append(f"rank {r}: {topo.device_kind}:{d.index} sits on node {node}, where this process "
                                     f"may use no CPU (allowed {format_cpulist(topo.allowed)}): "
                                     f"using node {nearest}, which is remote to the device")
                node = nearest
            homes.append((node,) if node is not None else None)
        # Ranks whose device's node is unknown go where the fewest ranks are.
        load = defaultdict(int)
        for h in homes:
            if h is not None:
                load[h[0]] += 1
        for r, h in enumerate(homes):
            if h is None:
                node = min(self.usable_nodes, key=lambda m: (load[m], m))
                load[node] += 1
                homes[r] = (node,)
        return device_ids, homes  # type: ignore[return-value]

    # ------------------------------------------------------------ build

    def build(self, explicit: list[str] | None) -> BindingPlan:
        topo = self.topo
        devices, homes = self.homes()
        if self.mode == "none":
            ranks = [RankBinding(r, devices[r], self._device_node(r), topo.allowed, topo.allowed, (), None, {})
                     for r in range(self.nproc)]
            return self._plan(ranks)
        if explicit is not None:
            core_sets = self._explicit(explicit, homes)
        elif self.mode in ("node", "socket"):
            core_sets = self._shared(homes)
        else:
            core_sets = self._exclusive(homes, by_l3=self.mode == "core-complex")
        ranks = []
        for r, (cores, sharers) in enumerate(core_sets):
            ranks.append(self._rank(r, devices[r], cores, sharers))
        self._check_overlap(ranks)
        self._check_remote(ranks)
        return self._plan(ranks)

    def _device_node(self, r: int) -> int | None:
        devices = self.topo.devices
        return devices[r % len(devices)].numa_node if devices else None

    def _plan(self, ranks: list[RankBinding]) -> BindingPlan:
        user_env = {v: self.environ[v] for v in THREAD_VARS if v in self.environ}
        for var, value in user_env.items():
            wanted = sorted({r.threads for r in ranks if r.threads is not None})
            if wanted and value != str(wanted[0]) or len(wanted) > 1:
                self.warnings.append(f"{var}={value} is set in your environment and kept; the plan's compute share "
                                     f"is {', '.join(map(str, wanted))} thread(s) per rank")
        return BindingPlan(mode=self.mode, ranks=ranks, device_kind=self.topo.device_kind,
                           allowed=self.topo.allowed, user_env=user_env, warnings=self.warnings,
                           notes=self.notes, node_of_cpu=self.node_of)

    def _rank(self, r: int, device: int | None, cores: list[Core], sharers: int) -> RankBinding:
        n = len(cores)
        reserve = self.loader_cores
        if reserve is None:
            reserve = n // 4 if (n >= 4 and sharers == 1) else 0
        elif reserve >= n:
            keep = max(n - 1, 0)
            self.warnings.append(f"rank {r}: --loader-cores {reserve} but the rank has {n} core(s): "
                                 f"keeping {keep} for loaders")
            reserve = keep
        compute = cores[:n - reserve] if reserve else cores
        loader = cores[n - reserve:] if reserve else []
        threads = max(1, len(compute) // max(sharers, 1))
        env = {var: str(threads) for var in THREAD_VARS if var not in self.environ}
        cpus = tuple(sorted(c for core in cores for c in core.cpus))
        return RankBinding(r, device, self._device_node(r), cpus,
                           tuple(sorted(c for core in compute for c in core.cpus)),
                           tuple(sorted(c for core in loader for c in core.cpus)), threads, env)

    # ------------------------------------------------------------ modes

    def _shared(self, homes: list[tuple[int, ...]]) -> list[tuple[list[Core], int]]:
        topo = self.topo
        sets = []
        for home in homes:
            nodes = home
            if self.mode == "socket":
                sockets = {topo.node(n).socket for n in home}
                nodes = tuple(sorted({m for s in sockets for m in topo.nodes_of_socket(s)}))
            sets.append(tuple(nodes))
        count = defaultdict(int)
        for s in sets:
            count[s] += 1
        for nodes, k in sorted(count.items()):
            if k > 1:
                ranks = [r for r, s in enumerate(sets) if s == nodes]
                self.warnings.append(f"ranks {_ranks(ranks)} share the cores of node{'s' if len(nodes) > 1 else ''} "
                                     f"{','.join(map(str, nodes))} (mode {self.mode}); each starts "
                                     f"{max(1, len(topo.allowed_cores(nodes)) // k)} compute threads. "
                                     "--bind exclusive gives each rank cores of its own")
        return [(topo.allowed_cores(s), count[s]) for s in sets]

    def _exclusive(self, homes: list[tuple[int, ...]], by_l3: bool) -> list[tuple[list[Core], int]]:
        topo = self.topo
        all_cores = topo.allowed_cores()
        if self.nproc > len(all_cores):
            self.warnings.append(f"oversubscribed: {self.nproc} local ranks but this process may use only "
                                 f"{len(all_cores)} physical core(s) ({format_cpulist(topo.allowed)}): "
                                 "ranks share cores, one core each")
            pools = defaultdict(list)
            for r, home in enumerate(homes):
                pools[home].append(r)
            out: list = [None] * self.nproc
            for home, ranks in pools.items():
                cores = topo.allowed_cores(home)
                for i, r in enumerate(ranks):
                    core = cores[i % len(cores)]
                    sharers = sum(1 for j in range(len(ranks)) if j % len(cores) == i % len(cores))
                    out[r] = ([core], sharers)
            return out

        pools: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for r, home in enumerate(homes):
            pools[home].append(r)
        own = {home: topo.allowed_cores(home) for home in pools}
        # Cores of nodes no rank calls home can be lent as well.
        spare: dict[tuple[int, ...], list[Core]] = {}
        for home, ranks in pools.items():
            spare[home] = own[home][len(ranks):] if len(own[home]) > len(ranks) else []
        homed = {n for home in pools for n in home}
        for node in self.usable_nodes:
            if node not in homed:
                spare[(node,)] = topo.allowed_cores((node,))
        borrowed: dict[int, Core] = {}
        for home, ranks in sorted(pools.items()):
            short = len(ranks) - len(own[home])
            for r in ranks[len(ranks) - short:] if short > 0 else []:
                donor = min((h for h in spare if spare[h]), key=lambda h: (topo.distance(home[0], h[0]), h))
                core = spare[donor].pop()
                if donor in pools:
                    own[donor].remove(core)
                borrowed[r] = core
                self.warnings.append(f"rank {r}: node {','.join(map(str, home))} has {len(own[home])} core(s) for "
                                     f"{len(ranks)} ranks: rank {r} gets core {format_cpulist(core.cpus)} on node "
                                     f"{core.node}, remote to its {'device' if topo.devices else 'home node'}")
        out = [None] * self.nproc
        for home, ranks in pools.items():
            staying = [r for r in ranks if r not in borrowed]
            cores = own[home]
            split = self._split_l3(home, cores, len(staying)) if by_l3 else None
            if split is None:
                split = _split_even(cores, len(staying))
            for r, part in zip(staying, split):
                out[r] = (part, 1)
        for r, core in borrowed.items():
            out[r] = ([core], 1)
        return out  # type: ignore[return-value]

    def _split_l3(self, home: tuple[int, ...], cores: list[Core], k: int) -> list[list[Core]] | None:
        if k == 0:
            return []
        if any(core.l3 is None for core in cores):
            self._note_once("core-complex: the L3 caches are not described in sysfs: cores split as in exclusive")
            return None
        groups: dict[int, list[Core]] = defaultdict(list)
        for core in cores:
            groups[core.l3].append(core)  # type: ignore[index]
        ordered = [groups[g] for g in sorted(groups, key=lambda g: groups[g][0].cpus[0])]
        if len(ordered) < k:
            self._note_once(f"core-complex: node {','.join(map(str, home))} has {len(ordered)} L3 group(s) for "
                            f"{k} ranks: its cores are split as in exclusive")
            return None
        return [[c for grp in ordered[i * len(ordered) // k:(i + 1) * len(ordered) // k] for c in grp]
                for i in range(k)]

    def _explicit(self, explicit: list[str], homes) -> list[tuple[list[Core], int]]:
        topo = self.topo
        if len(explicit) == 1 and ";" in explicit[0]:
            explicit = [p for p in explicit[0].split(";")]
        if len(explicit) != self.nproc:
            raise TorchaxeError(f"--cpus gives {len(explicit)} CPU list(s) for {self.nproc} local ranks: "
                                "give one per rank (--cpus 0-7 --cpus 8-15, or \"0-7;8-15\")")
        allowed = set(topo.allowed)
        fallback = None
        out = []
        for r, text in enumerate(explicit):
            wanted = parse_cpulist(text, f"--cpus for rank {r}")
            if not wanted:
                raise TorchaxeError(f"--cpus for rank {r} is empty: give a CPU list such as 0-7")
            outside = [c for c in wanted if c not in allowed]
            kept = [c for c in wanted if c in allowed]
            if outside and kept:
                self.warnings.append(f"rank {r}: CPUs {format_cpulist(outside)} are not allowed here "
                                     f"(allowed {format_cpulist(topo.allowed)}): dropped, keeping {format_cpulist(kept)}")
            if not kept:
                if fallback is None:
                    fallback = self._exclusive(homes, by_l3=False)
                cores, _ = fallback[r]
                self.warnings.append(f"rank {r}: none of CPUs {format_cpulist(wanted)} is allowed here (allowed "
                                     f"{format_cpulist(topo.allowed)}): using the exclusive plan's "
                                     f"{format_cpulist(c for core in cores for c in core.cpus)}")
                out.append((cores, 1))
                continue
            by_core: dict[int, list[int]] = defaultdict(list)
            for c in kept:
                by_core[self.core_of[c].id].append(c)
            cores = sorted((Core(cid, tuple(sorted(cs)), self.core_of[cs[0]].socket, self.core_of[cs[0]].node,
                                 self.core_of[cs[0]].l3) for cid, cs in by_core.items()), key=lambda c: c.cpus[0])
            out.append((cores, 1))
        return out

    # ------------------------------------------------------------ checks

    def _note_once(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _check_overlap(self, ranks: list[RankBinding]) -> None:
        if self.mode in ("node", "socket"):
            return  # said per node in _shared
        seen: dict[int, int] = {}
        pairs: dict[tuple[int, int], set[int]] = defaultdict(set)
        for rank in ranks:
            for c in rank.cpus:
                if c in seen:
                    pairs[(seen[c], rank.local_rank)].add(c)
                else:
                    seen[c] = rank.local_rank
        if self.mode == "cpus":
            for (a, b), cpus in sorted(pairs.items()):
                self.warnings.append(f"ranks {a} and {b} share CPUs {format_cpulist(cpus)} (as --cpus asks)")

    def _check_remote(self, ranks: list[RankBinding]) -> None:
        for rank in ranks:
            if rank.device_node is None:
                continue
            nodes = rank.nodes(self.node_of)
            if rank.device_node not in nodes and not any(f"rank {rank.local_rank}:" in w for w in self.warnings):
                self.warnings.append(f"rank {rank.local_rank}: CPUs {format_cpulist(rank.cpus)} are on node(s) "
                                     f"{','.join(map(str, nodes))}, not on node {rank.device_node} where "
                                     f"{self.topo.device_kind}:{rank.device} sits")


def _split_even(cores: list[Core], k: int) -> list[list[Core]]:
    """Contiguous blocks, the first ``len % k`` one core larger."""
    if k == 0:
        return []
    base, extra = divmod(len(cores), k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(cores[start:start + size])
        start += size
    return out


def _ranks(ranks: list[int]) -> str:
    return format_cpulist(ranks)
