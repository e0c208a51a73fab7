"""Where a device sits: its PCI address and the NUMA node the kernel puts it on.

Shared by the cuda and npu backends' ``device_locations``. Everything is read below
an injectable root (``/`` on a real machine, a canned tree in the tests), so no
device, driver or torch is needed to answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_PCI = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


@dataclass(frozen=True)
class DeviceLocation:
    """One accelerator as the framework numbers it (``cuda:N``, ``npu:N``, after
    ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``) and where it sits."""

    index: int
    kind: str
    pci: str | None
    #: ``None`` when unknown: no sysfs file, or the firmware left it at -1.
    numa_node: int | None
    #: CPUs a vendor tool names as near the device (``npu-smi info -t topo``), if any.
    cpus: tuple[int, ...] | None = None
    #: Where the location was read, for the user.
    source: str = ""
    note: str | None = None

    def to_dict(self) -> dict:
        return {"index": self.index, "kind": self.kind, "pci": self.pci, "numa_node": self.numa_node,
                "cpus": list(self.cpus) if self.cpus is not None else None, "source": self.source,
                "note": self.note}


def normalize_pci(address: str) -> str | None:
    """``00000000:18:00.0`` (nvidia-smi), ``0000:18:00.0`` (sysfs) or ``18:00.0`` ->
    ``0000:18:00.0``; ``None`` if it is not a PCI address."""
    m = _PCI.match(address.strip())
    if not m:
        return None
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def pci_numa_node(root: Path, address: str) -> tuple[int | None, str | None]:
    """The NUMA node of a PCI device from ``/sys/bus/pci/devices/ADDR/numa_node``, and a
    note when it is unknown (file missing, unreadable, or -1)."""
    path = Path(root) / "sys/bus/pci/devices" / address / "numa_node"
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None, "no numa_node file in sysfs"
    except OSError as exc:
        return None, f"cannot read numa_node: {exc.strerror or exc}"
    try:
        node = int(text)
    except ValueError:
        return None, f"numa_node reads {text!r}"
    if node < 0:
        return None, f"numa_node reads {node}: the firmware does not say"
    return node, None


def scan_pci(root: Path, vendor: str, class_prefixes: tuple[str, ...]) -> list[str]:
    """PCI addresses (sorted, as the kernel enumerates them) of the devices with this
    vendor id (``0x10de``) whose class starts with one of the prefixes (``0x0302``)."""
    base = Path(root) / "sys/bus/pci/devices"
    found: list[str] = []
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return []
    for entry in entries:
        try:
            if (entry / "vendor").read_text().strip().lower() != vendor:
                continue
            klass = (entry / "class").read_text().strip().lower()
        except OSError:
            continue
        if klass.startswith(class_prefixes):
            address = normalize_pci(entry.name)
            if address:
                found.append(address)
    return sorted(found)


# ---------------------------------------------------------------- NVIDIA (cuda)

#: PCI class prefixes of NVIDIA compute devices: VGA controller, 3D controller.
_NVIDIA_CLASSES = ("0x0300", "0x0302")


def _nvidia_proc_gpus(root: Path) -> list[dict[str, str]]:
    """``/proc/driver/nvidia/gpus/*/information``: one dict per GPU with ``Bus
    Location``, ``GPU UUID``, ``Model`` (the driver writes ``Key:  value`` lines)."""
    base = Path(root) / "proc/driver/nvidia/gpus"
    gpus = []
    try:
        folders = sorted(base.iterdir())
    except OSError:
        return []
    for folder in folders:
        try:
            text = (folder / "information").read_text(errors="replace")
        except OSError:
            continue
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        fields.setdefault("Bus Location", folder.name)
        gpus.append(fields)
    return gpus


def nvidia_locations(root: Path, environ) -> list[DeviceLocation]:
    """CUDA devices in CUDA's numbering. The driver's ``/proc`` listing is used when
    present (it has UUIDs for ``CUDA_VISIBLE_DEVICES=GPU-...``), else a PCI scan for
    vendor 0x10de. CUDA numbers identical GPUs in PCI bus order (and always with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); with mixed models and the default
    ``FASTEST_FIRST`` the order may differ, which a note says."""
    root = Path(root)
    gpus = _nvidia_proc_gpus(root)
    source = "/proc/driver/nvidia/gpus"
    if not gpus:
        gpus = [{"Bus Location": a} for a in scan_pci(root, "0x10de", _NVIDIA_CLASSES)]
        source = "PCI scan (vendor 0x10de)"
    ordered = sorted(((normalize_pci(g["Bus Location"]) or g["Bus Location"], g) for g in gpus), key=lambda p: p[0])
    models = {g.get("Model") for _, g in ordered if g.get("Model")}
    order_note = None
    if len(models) > 1 and environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        order_note = ("GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: "
                      "CUDA may number them fastest first, not in this order")
    chosen, note = _visible(ordered, environ.get("CUDA_VISIBLE_DEVICES"), "CUDA_VISIBLE_DEVICES",
                            lambda g, token: g.get("GPU UUID", "").lower().startswith(token.lower()))
    out = []
    for index, (address, _fields) in enumerate(chosen):
        node, why = pci_numa_node(root, address)
        out.append(DeviceLocation(index, "cuda", address, node, None, source,
                                  "; ".join(n for n in (why, note, order_note) if n) or None))
    return out


def _visible(ordered, value, var, match_token):
    """Apply a ``*_VISIBLE_DEVICES`` list (indices, or ids ``match_token`` accepts),
    stopping at the first entry it cannot use, as the runtimes do."""
    if value is None:
        return ordered, None
    chosen = []
    for token in [t.strip() for t in value.split(",")]:
        if token.isdigit() and int(token) < len(ordered):
            chosen.append(ordered[int(token)])
        elif token and not token.isdigit() and not token.startswith("-"):
            hits = [g for g in ordered if match_token(g[1], token)]
            if len(hits) != 1:
                return chosen, f"{var}={value}: entry {token!r} not matched, devices after it ignored"
            chosen.append(hits[0])
        else:
            if token:
                return chosen, f"{var}={value}: entry {token!r} is not a device here, devices after it ignored"
            return chosen, None
    return chosen, None


# ------------------------------------------------------------------ Ascend (npu)

#: Huawei's PCI vendor id and the class of processing accelerators (Ascend NPUs).
_HUAWEI = "0x19e5"
_ACCELERATOR_CLASSES = ("0x1200",)
_TOPO_ROW = re.compile(r"^\s*NPU(\d+)\b.*?(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)\s*$")


def parse_npu_smi_topo(text: str) -> dict[int, tuple[int, ...]]:
    """``npu-smi info -t topo`` -> {NPU id: its "CPU Affinity" CPUs}. The table has a
    header row naming the NPUs and ending in ``CPU Affinity``, then one row per NPU
    whose last column is a CPU list (``144-167``). Rows without one are skipped."""
    from torchaxe.cpulist import parse_cpulist

    lines = text.splitlines()
    if not any("CPU Affinity" in line for line in lines):
        return {}
    out: dict[int, tuple[int, ...]] = {}
    for line in lines:
        m = _TOPO_ROW.match(line)
        if m and "CPU Affinity" not in line:
            out[int(m.group(1))] = parse_cpulist(m.group(2))
    return out


def ascend_locations(root: Path, environ, npu_smi_topo: str | None) -> list[DeviceLocation]:
    """Ascend NPUs in torch_npu's numbering (after ``ASCEND_RT_VISIBLE_DEVICES``).
    The PCI devices of vendor 0x19e5, class 0x1200 in bus order are taken as
    ``/dev/davinci0..N``; the text of ``npu-smi info -t topo`` adds each NPU's CPU
    affinity (used for the node when sysfs says -1). Unverified on Ascend hardware:
    built from the drivers' documented files and tested with canned trees."""
    root = Path(root)
    addresses = scan_pci(root, _HUAWEI, _ACCELERATOR_CLASSES)
    dev = root / "dev"
    try:
        davinci = sorted(int(p.name[7:]) for p in dev.iterdir() if re.fullmatch(r"davinci\d+", p.name))
    except OSError:
        davinci = []
    affinity = parse_npu_smi_topo(npu_smi_topo) if npu_smi_topo else {}
    count = max(len(addresses), len(davinci), len(affinity))
    source = []
    if addresses:
        source.append("PCI scan (vendor 0x19e5)")
    if affinity:
        source.append("npu-smi info -t topo")
    if not addresses and davinci:
        source.append("/dev/davinci*")
    mismatch = None
    if addresses and davinci and len(addresses) != len(davinci):
        mismatch = f"{len(davinci)} /dev/davinci devices but {len(addresses)} Ascend PCI devices: the mapping may be wrong"
    physical = [(i, {"pci": addresses[i] if i < len(addresses) else None}) for i in range(count)]
    chosen, note = _visible(physical, environ.get("ASCEND_RT_VISIBLE_DEVICES"), "ASCEND_RT_VISIBLE_DEVICES",
                            lambda g, token: False)
    out = []
    for index, (physical_id, fields) in enumerate(chosen):
        address = fields["pci"]
        if address is not None:
            node, why = pci_numa_node(root, address)
        else:
            node, why = None, "no PCI address found"
        out.append(DeviceLocation(index, "npu", address, node, affinity.get(physical_id), " + ".join(source),
                                  "; ".join(n for n in (why, note, mismatch) if n) or None))
    return out
