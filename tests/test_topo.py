"""Topology reading from canned sysfs trees (tests/data/sysfs/*, see its README)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from torchaxe.cpulist import format_cpulist, parse_cpulist
from torchaxe.bind.topology import read_topology
from torchaxe.backends.pci import normalize_pci, parse_npu_smi_topo
from torchaxe.errors import TorchaxeError

TREES = Path(__file__).parent / "data" / "sysfs"


def tree(name: str, tmp_path: Path | None = None) -> Path:
    if tmp_path is None:
        return TREES / name
    copy = tmp_path / name
    shutil.copytree(TREES / name, copy)
    return copy


# ----------------------------------------------------------------- cpu lists


@pytest.mark.parametrize("text, cpus", [("0-3,8", (0, 1, 2, 3, 8)), ("", ()), ("5", (5,)),
                                        ("0-7:2", (0, 2, 4, 6)), ("3,1,1-2\n", (1, 2, 3))])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a-b", "3-1", "1,,x", "-1"])
def test_parse_cpulist_refuses_garbage_in_one_line(text):
    with pytest.raises(TorchaxeError) as err:
        parse_cpulist(text, "--cpus")
    assert "\n" not in str(err.value) and "--cpus" in str(err.value)


def test_format_cpulist_round_trip():
    for cpus in [(0, 1, 2, 3, 8), (), (1,), (0, 2, 3, 4, 9, 10)]:
        assert parse_cpulist(format_cpulist(cpus)) == cpus
    assert format_cpulist([60, 61, 62, 75, 74]) == "60-62,74-75"


def test_normalize_pci():
    assert normalize_pci("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci("18:00.0") == "0000:18:00.0"
    assert normalize_pci("not a bus id") is None


# ----------------------------------------------------------------- real layouts


def test_xeon_two_sockets_with_smt():
    t = read_topology(tree("xeon-2s-smt"), environ={})
    assert t.sockets == [0, 1]
    assert [n.id for n in t.nodes] == [0, 1]
    assert len(t.cores) == 40 and t.smt
    assert all(len(c.cpus) == 2 and c.cpus[1] == c.cpus[0] + 40 for c in t.cores)
    assert t.node(1).cpus == tuple(range(20, 40)) + tuple(range(60, 80))
    assert len(t.l3_groups) == 2
    assert t.allowed == tuple(range(80)) and t.cgroup_cpus == tuple(range(80))
    assert t.device_kind == "cuda"
    assert [(d.index, d.pci, d.numa_node) for d in t.devices] == [
        (0, "0000:18:00.0", 0), (1, "0000:3b:00.0", 0), (2, "0000:86:00.0", 1), (3, "0000:af:00.0", 1)]
    assert t.devices[0].source == "/proc/driver/nvidia/gpus"
    assert t.distance(0, 1) == 21 and t.distance(1, 1) == 10
    assert t.warnings == []


def test_epyc_several_nodes_per_socket_and_l3_groups():
    t = read_topology(tree("epyc-2s-nps2"), environ={})
    assert len(t.nodes) == 4 and t.sockets == [0, 1]
    assert t.nodes_of_socket(0) == (0, 1) and t.nodes_of_socket(1) == (2, 3)
    assert len(t.l3_groups) == 8
    assert t.l3_groups[0] == (0, 1, 2, 3, 32, 33, 34, 35)
    node1 = [c for c in t.cores if c.node == 1]
    assert len({c.l3 for c in node1}) == 2
    # Found by a PCI scan (no /proc/driver/nvidia); the USB function of vendor 0x10de is no GPU.
    assert [(d.pci, d.numa_node) for d in t.devices] == [("0000:41:00.0", 1), ("0000:c1:00.0", 3)]
    assert "PCI scan" in t.devices[0].source
    assert t.distance(0, 1) == 12 and t.distance(0, 2) == 32


def test_kunpeng_four_nodes_no_smt_and_npus():
    t = read_topology(tree("kunpeng920-2s"), environ={}, target="npu")
    assert len(t.cores) == 96 and not t.smt
    assert len(t.nodes) == 4 and [len(n.cpus) for n in t.nodes] == [24] * 4
    assert t.sockets == [36, 3180]  # package ids from ACPI PPTT, not 0 and 1
    assert t.device_kind == "npu"
    assert [(d.index, d.pci, d.numa_node) for d in t.devices] == [
        (0, "0000:01:00.0", 0), (1, "0000:41:00.0", 1), (2, "0000:81:00.0", 2), (3, "0000:c1:00.0", 3)]


def test_auto_target_finds_npus_without_torch_npu():
    t = read_topology(tree("kunpeng920-2s"), environ={})
    assert t.device_kind == "npu" and len(t.devices) == 4


def test_npu_smi_topo_text_gives_affinity_and_fills_an_unknown_node(tmp_path):
    root = tree("kunpeng920-2s", tmp_path)
    text = (root / "npu-smi-topo.txt").read_text()
    assert parse_npu_smi_topo(text) == {0: tuple(range(24)), 1: tuple(range(24, 48)),
                                        2: tuple(range(48, 72)), 3: tuple(range(72, 96))}
    (root / "sys/bus/pci/devices/0000:81:00.0/numa_node").write_text("-1\n")
    without = read_topology(root, environ={}, target="npu")
    assert without.devices[2].numa_node is None
    assert any("npu:2" in w and "NUMA node unknown" in w for w in without.warnings)
    with_tool = read_topology(root, environ={}, target="npu", vendor_tool=lambda: text)
    assert with_tool.devices[2].numa_node == 2
    assert "npu-smi" in with_tool.devices[2].note
    assert not any("npu:2" in w for w in with_tool.warnings)


def test_ascend_visible_devices_renumber():
    t = read_topology(tree("kunpeng920-2s"), environ={"ASCEND_RT_VISIBLE_DEVICES": "2,3"}, target="npu")
    assert [(d.index, d.numa_node) for d in t.devices] == [(0, 2), (1, 3)]


def test_cuda_visible_devices_by_index_and_uuid():
    t = read_topology(tree("xeon-2s-smt"), environ={"CUDA_VISIBLE_DEVICES": "3,0"})
    assert [(d.index, d.pci, d.numa_node) for d in t.devices] == [(0, "0000:af:00.0", 1), (1, "0000:18:00.0", 0)]
    t = read_topology(tree("xeon-2s-smt"), environ={"CUDA_VISIBLE_DEVICES": "GPU-3f5c1b2e-8a4d-4c6e-9b7a-0d1e2f3a4b02"})
    assert [d.pci for d in t.devices] == ["0000:86:00.0"]
    t = read_topology(tree("xeon-2s-smt"), environ={"CUDA_VISIBLE_DEVICES": "1,7,0"})
    assert [d.pci for d in t.devices] == ["0000:3b:00.0"]  # CUDA stops at the first bad entry
    assert "7" in t.devices[0].note


def test_container_cpuset_cgroup_v1():
    t = read_topology(tree("container-cpuset"), environ={})
    assert t.cgroup_cpus == tuple(range(60, 76))
    assert t.allowed == tuple(range(60, 76))
    cores = t.allowed_cores()
    assert len(cores) == 16 and all(len(c.cpus) == 1 for c in cores)  # one thread of each core
    assert {c.node for c in cores} == {0, 1}
    assert len(t.allowed_cores((0,))) == 12 and len(t.allowed_cores((1,))) == 4
    assert t.devices == [] and t.device_kind == "cpu"


def test_cgroup_narrower_than_affinity_wins(tmp_path):
    root = tree("xeon-2s-smt", tmp_path)
    (root / "sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope/cpuset.cpus.effective").write_text("4-7\n")
    t = read_topology(root, environ={})
    assert t.allowed == (4, 5, 6, 7) and t.affinity == tuple(range(80))


def test_device_numa_node_minus_one():
    t = read_topology(tree("vm-numa-unknown"), environ={})
    assert [d.numa_node for d in t.devices] == [None, None]
    assert "-1" in t.devices[0].note
    assert sum("NUMA node unknown" in w for w in t.warnings) == 2


def test_minus_one_on_a_one_node_machine_is_node_zero(tmp_path):
    root = tree("vm-numa-unknown", tmp_path)
    shutil.rmtree(root / "sys/devices/system/node/node1")
    (root / "sys/devices/system/node/node0/cpulist").write_text("0-15\n")
    (root / "sys/devices/system/node/node0/distance").write_text("10\n")
    t = read_topology(root, environ={})
    assert [d.numa_node for d in t.devices] == [0, 0]
    assert not any("unknown" in w for w in t.warnings)


def test_real_capture_of_this_vm_matches_the_live_reading():
    canned = read_topology(tree("firecracker-2cpu"), environ={})
    assert len(canned.cores) == 2 and len(canned.nodes) == 1 and not canned.smt
    assert canned.cgroup_cpus == (0, 1)  # cgroup v1 cpuset at the root
    live = read_topology("/", target="cpu")
    assert live.warnings == [] or all("missing" not in w for w in live.warnings)
    assert set(live.allowed) <= set(live.cpus)


# ----------------------------------------------------------------- missing files


def test_no_node_folder_means_one_node(tmp_path):
    root = tree("xeon-2s-smt", tmp_path)
    shutil.rmtree(root / "sys/devices/system/node")
    t = read_topology(root, environ={})
    assert [n.id for n in t.nodes] == [0] and len(t.nodes[0].cpus) == 80
    assert any("one NUMA node" in w for w in t.warnings)


def test_missing_core_topology_means_each_cpu_is_a_core(tmp_path):
    root = tree("epyc-2s-nps2", tmp_path)
    for cpu in (root / "sys/devices/system/cpu").glob("cpu*/topology"):
        shutil.rmtree(cpu)
    t = read_topology(root, environ={})
    assert len(t.cores) == 64 and not t.smt
    assert any("topology is missing" in w for w in t.warnings)
    assert any("physical_package_id is missing" in w for w in t.warnings)


def test_missing_l3_and_pci_numa_node(tmp_path):
    root = tree("xeon-2s-smt", tmp_path)
    for cache in (root / "sys/devices/system/cpu").glob("cpu*/cache"):
        shutil.rmtree(cache)
    (root / "sys/bus/pci/devices/0000:86:00.0/numa_node").unlink()
    t = read_topology(root, environ={})
    assert t.l3_groups == [] and all(c.l3 is None for c in t.cores)
    assert t.devices[2].numa_node is None and "no numa_node" in t.devices[2].note


def test_not_a_sysfs_tree_is_one_line_error(tmp_path):
    with pytest.raises(TorchaxeError, match="no CPU topology under"):
        read_topology(tmp_path)


def test_missing_status_and_cgroup(tmp_path):
    root = tree("kunpeng920-2s", tmp_path)
    (root / "proc/self/status").unlink()
    (root / "proc/self/cgroup").unlink()
    t = read_topology(root, environ={})
    assert t.allowed == tuple(range(96)) and t.cgroup_cpus is None
    assert any("Cpus_allowed_list" in w for w in t.warnings)


# ----------------------------------------------------------------- output


def test_json_has_the_keys_the_issue_names():
    data = read_topology(tree("xeon-2s-smt"), environ={}).to_dict()
    json.dumps(data)
    assert {"id", "cpus"} <= set(data["numa_nodes"][0])
    assert data["allowed_cpus"] == list(range(80))
    assert {"index", "numa_node"} <= set(data["devices"][0])


def test_cli_topo_json_and_table(capsys):
    from torchaxe.cli import main

    assert main(["topo", "--json", "--sysfs-root", str(tree("epyc-2s-nps2"))]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [n["id"] for n in data["numa_nodes"]] == [0, 1, 2, 3]
    assert [d["numa_node"] for d in data["devices"]] == [1, 3]
    assert main(["topo", "--sysfs-root", str(tree("vm-numa-unknown"))]) == 0
    out = capsys.readouterr().out
    assert "node" in out and "cuda:0" in out and "unknown" in out and "warning:" in out


def test_cli_topo_bad_root_is_one_line(capsys, tmp_path):
    from torchaxe.cli import main

    assert main(["topo", "--sysfs-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchaxe: error:")
