"""Writes the canned sysfs/proc trees the binding tests read (run from anywhere:
``python tests/data/sysfs/make_trees.py``). The layouts are those of real machines
(CPU numbering, SMT sibling pairs, NUMA nodes, L3 groups, cgroup files, the driver's
/proc and PCI files); only the files torchaxe reads are written. ``firecracker-2cpu``
is not made here: it was copied from the 2-core VM the tests run on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent


def fmt(cpus):
    cpus = sorted(cpus)
    out, start, prev = [], None, None
    for c in cpus:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = c
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


class Tree:
    def __init__(self, name):
        self.base = HERE / name
        if self.base.exists():
            shutil.rmtree(self.base)

    def write(self, rel, text):
        path = self.base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n")

    def cpus(self, cpus, package, core_id, siblings, l3):
        """cpus: ids; package/core_id/siblings/l3: functions of the CPU id."""
        self.write("sys/devices/system/cpu/online", fmt(cpus))
        self.write("sys/devices/system/cpu/possible", fmt(cpus))
        for c in cpus:
            t = f"sys/devices/system/cpu/cpu{c}"
            self.write(f"{t}/topology/physical_package_id", str(package(c)))
            self.write(f"{t}/topology/core_id", str(core_id(c)))
            self.write(f"{t}/topology/thread_siblings_list", fmt(siblings(c)))
            self.write(f"{t}/cache/index3/level", "3")
            self.write(f"{t}/cache/index3/type", "Unified")
            self.write(f"{t}/cache/index3/shared_cpu_list", fmt(l3(c)))

    def nodes(self, nodes, distances):
        for i, cpus in enumerate(nodes):
            self.write(f"sys/devices/system/node/node{i}/cpulist", fmt(cpus))
            self.write(f"sys/devices/system/node/node{i}/distance", " ".join(map(str, distances[i])))
        self.write("sys/devices/system/node/online", fmt(range(len(nodes))))

    def pci(self, address, vendor, device, klass, numa_node):
        d = f"sys/bus/pci/devices/{address}"
        self.write(f"{d}/vendor", vendor)
        self.write(f"{d}/device", device)
        self.write(f"{d}/class", klass)
        self.write(f"{d}/numa_node", str(numa_node))

    def nvidia_proc(self, address, model, uuid, minor):
        self.write(f"proc/driver/nvidia/gpus/{address}/information",
                   f"Model: \t\t {model}\nIRQ:   \t\t {120 + minor}\nGPU UUID: \t {uuid}\n"
                   f"Video BIOS: \t 88.00.4f.00.09\nBus Type: \t PCIe\nDMA Size: \t 47 bits\n"
                   f"DMA Mask: \t 0x7fffffffffff\nBus Location: \t {address}\nDevice Minor: \t {minor}\n"
                   f"GPU Excluded:\t No\n")

    def status(self, allowed):
        self.write("proc/self/status", f"Name:\tpython\nState:\tR (running)\nThreads:\t1\n"
                   f"Cpus_allowed_list:\t{fmt(allowed)}\nMems_allowed_list:\t0-1\n")


def xeon_2s_smt():
    """2x Intel Xeon Gold 6248 (Cascade Lake, 20 cores, HT): CPUs 0-19 socket 0,
    20-39 socket 1, 40-79 their hyper-threads; one node and one L3 per socket. Core
    ids are not contiguous, as on these parts. 4 V100 SXM2, two per socket."""
    t = Tree("xeon-2s-smt")
    core_ids = [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 16, 17, 18, 19, 20, 24, 25, 26, 27, 28]
    cpus = range(80)
    sock = lambda c: (c % 40) // 20
    phys = lambda c: c % 40
    t.cpus(cpus, sock, lambda c: core_ids[phys(c) % 20], lambda c: [phys(c), phys(c) + 40],
           lambda c: [x for x in cpus if sock(x) == sock(c)])
    t.nodes([[x for x in cpus if sock(x) == 0], [x for x in cpus if sock(x) == 1]], [[10, 21], [21, 10]])
    gpus = [("0000:18:00.0", 0), ("0000:3b:00.0", 0), ("0000:86:00.0", 1), ("0000:af:00.0", 1)]
    for minor, (addr, node) in enumerate(gpus):
        t.pci(addr, "0x10de", "0x1db5", "0x030200", node)
        t.nvidia_proc(addr, "Tesla V100-SXM2-32GB", f"GPU-3f5c1b2e-8a4d-4c6e-9b7a-0d1e2f3a4b{minor:02d}", minor)
    t.pci("0000:5e:00.0", "0x15b3", "0x1017", "0x020000", 0)  # a ConnectX-5 NIC: not a GPU
    t.write("proc/self/cgroup", "0::/user.slice/user-1000.slice/session-3.scope\n")
    t.write("sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope/cpuset.cpus.effective", "0-79")
    t.status(cpus)


def epyc_2s_nps2():
    """2x AMD EPYC 7313 (Milan, 16 cores in 4 CCDs of 4 cores, one 32 MB L3 per CCD,
    SMT) in NPS2: 4 NUMA nodes, 2 per socket, 2 L3 groups per node. CPUs 0-15 socket
    0, 16-31 socket 1, 32-63 their SMT siblings. Two A100 PCIe found by PCI scan
    only (no /proc/driver/nvidia, as in many containers), one with its audio-less
    sibling function absent, plus an NVIDIA bridge function that is not a GPU."""
    t = Tree("epyc-2s-nps2")
    cpus = range(64)
    phys = lambda c: c % 32
    sock = lambda c: phys(c) // 16
    ccd = lambda c: phys(c) // 4
    node = lambda c: phys(c) // 8
    t.cpus(cpus, sock, lambda c: phys(c) % 16, lambda c: [phys(c), phys(c) + 32],
           lambda c: [x for x in cpus if ccd(x) == ccd(c)])
    t.nodes([[x for x in cpus if node(x) == n] for n in range(4)],
            [[10, 12, 32, 32], [12, 10, 32, 32], [32, 32, 10, 12], [32, 32, 12, 10]])
    t.pci("0000:41:00.0", "0x10de", "0x20f1", "0x030200", 1)
    t.pci("0000:c1:00.0", "0x10de", "0x20f1", "0x030200", 3)
    t.pci("0000:c2:00.0", "0x10de", "0x1ad8", "0x0c0330", 3)  # USB controller function, not a GPU
    t.write("proc/self/cgroup", "0::/\n")
    t.write("sys/fs/cgroup/cpuset.cpus.effective", "0-63")
    t.status(cpus)


def kunpeng920_2s():
    """2x Kunpeng 920-4826 (ARMv8.2, 48 cores, no SMT): 4 NUMA nodes of 24 cores,
    one L3 per die (= per node), clusters of 4 cores. Package ids come from ACPI
    PPTT offsets, so they are large and not 0/1. Four Ascend 910 (vendor 0x19e5,
    class 0x1200) one per node, /dev/davinci0-3, and a Huawei NIC (class 0x0200)."""
    t = Tree("kunpeng920-2s")
    cpus = range(96)
    pkg_ids = [36, 3180]
    t.cpus(cpus, lambda c: pkg_ids[c // 48], lambda c: c % 48 + (c // 48) * 65536, lambda c: [c],
           lambda c: [x for x in cpus if x // 24 == c // 24])
    for c in cpus:
        t.write(f"sys/devices/system/cpu/cpu{c}/topology/cluster_cpus_list", fmt(range(c // 4 * 4, c // 4 * 4 + 4)))
    t.nodes([range(n * 24, n * 24 + 24) for n in range(4)],
            [[10, 12, 20, 22], [12, 10, 22, 24], [20, 22, 10, 12], [22, 24, 12, 10]])
    npus = [("0000:01:00.0", 0), ("0000:41:00.0", 1), ("0000:81:00.0", 2), ("0000:c1:00.0", 3)]
    for i, (addr, node) in enumerate(npus):
        t.pci(addr, "0x19e5", "0xd801", "0x120000", node)
        t.write(f"dev/davinci{i}", "")
    t.write("dev/davinci_manager", "")
    t.pci("0000:7d:00.0", "0x19e5", "0x1822", "0x020000", 1)  # Hi1822 NIC: not an NPU
    t.write("npu-smi-topo.txt",
            "\t   NPU0       NPU1       NPU2       NPU3       CPU Affinity\n"
            "NPU0       X          HCCS       HCCS       HCCS       0-23\n"
            "NPU1       HCCS       X          HCCS       HCCS       24-47\n"
            "NPU2       HCCS       HCCS       X          HCCS       48-71\n"
            "NPU3       HCCS       HCCS       HCCS       X          72-95\n\n"
            "Legend:\n\n  X    = Self\n  HCCS = Connection traversing HCCS.\n")
    t.write("proc/self/cgroup", "0::/\n")
    t.write("sys/fs/cgroup/cpuset.cpus.effective", "0-95")
    t.status(cpus)


def container_cpuset():
    """A Docker container started with ``--cpuset-cpus=60-75`` (the seed's example)
    on 2x Xeon Platinum 8260 (24 cores, HT: CPUs 0-23 socket 0, 24-47 socket 1,
    48-95 the hyper-threads). 60-71 are the second threads of socket 0's cores
    12-23 and 72-75 those of socket 1's cores 24-27: the container spans both
    nodes and has no two threads of one core. cgroup v1, as Docker on a v1 host."""
    t = Tree("container-cpuset")
    cpus = range(96)
    phys = lambda c: c % 48
    sock = lambda c: phys(c) // 24
    t.cpus(cpus, sock, lambda c: phys(c) % 24, lambda c: [phys(c), phys(c) + 48],
           lambda c: [x for x in cpus if sock(x) == sock(c)])
    t.nodes([[x for x in cpus if sock(x) == 0], [x for x in cpus if sock(x) == 1]], [[10, 21], [21, 10]])
    cid = "4f2a7c1e9b3d"
    t.write("proc/self/cgroup", f"12:cpuset:/docker/{cid}\n11:memory:/docker/{cid}\n0::/docker/{cid}\n")
    t.write("sys/fs/cgroup/cpuset/cpuset.cpus", "60-75")
    t.write("sys/fs/cgroup/cpuset/cpuset.effective_cpus", "60-75")
    t.status(range(60, 76))


def vm_numa_unknown():
    """A cloud VM with 2 sockets of 4 cores (SMT), 2 NUMA nodes, and 2 GPUs whose
    ``numa_node`` reads -1: the hypervisor does not describe PCI locality."""
    t = Tree("vm-numa-unknown")
    cpus = range(16)
    phys = lambda c: c % 8
    sock = lambda c: phys(c) // 4
    t.cpus(cpus, sock, lambda c: phys(c) % 4, lambda c: [phys(c), phys(c) + 8],
           lambda c: [x for x in cpus if sock(x) == sock(c)])
    t.nodes([[x for x in cpus if sock(x) == 0], [x for x in cpus if sock(x) == 1]], [[10, 20], [20, 10]])
    for minor, addr in enumerate(["0000:00:1e.0", "0000:00:1f.0"]):
        t.pci(addr, "0x10de", "0x2237", "0x030200", -1)
        t.nvidia_proc(addr, "NVIDIA A10G", f"GPU-9d0e7a61-22c4-4b1f-8e3a-5c6d7e8f90a{minor}", minor)
    t.write("proc/self/cgroup", "0::/\n")
    t.write("sys/fs/cgroup/cpuset.cpus.effective", "0-15")
    t.status(cpus)


if __name__ == "__main__":
    for make in (xeon_2s_smt, epyc_2s_nps2, kunpeng920_2s, container_cpuset, vm_numa_unknown):
        make()
        print(f"wrote {make.__name__}")
