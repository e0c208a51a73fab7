"""Binding plans on canned topologies: modes, fallbacks, warnings, JSON, table."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from torchaxe.cpulist import format_cpulist
from torchaxe.bind.plan import BindingPlan, parse_loader_cores, plan_binding
from torchaxe.bind.render import render_plan
from torchaxe.bind.topology import read_topology
from torchaxe.errors import TorchaxeError

TREES = Path(__file__).parent / "data" / "sysfs"


def topo(name, **kw):
    return read_topology(TREES / name, environ=kw.pop("environ", {}), **kw)


def no_shared_cpu(plan):
    seen = set()
    for r in plan.ranks:
        assert not seen & set(r.cpus), f"rank {r.local_rank} shares CPUs"
        seen |= set(r.cpus)


def cores_of(plan, r, t):
    return {c.id for c in t.cores if set(c.cpus) & set(plan.ranks[r].cpus)}


def test_exclusive_splits_the_devices_node_evenly():
    t = topo("xeon-2s-smt")
    plan = plan_binding(t, 4, environ={})
    assert plan.mode == "exclusive"
    no_shared_cpu(plan)
    node_of = t.node_of_cpu()
    for r in plan.ranks:
        assert {node_of[c] for c in r.cpus} == {r.device_node}
        assert len(cores_of(plan, r.local_rank, t)) == 10
        # whole cores: both SMT threads
        assert len(r.cpus) == 20
        assert r.threads == len({c for c in r.compute_cpus if c < 40})  # physical compute cores
        assert set(r.loader_cpus) | set(r.compute_cpus) == set(r.cpus)
        assert not set(r.loader_cpus) & set(r.compute_cpus)
        assert r.env == {"OMP_NUM_THREADS": str(r.threads), "MKL_NUM_THREADS": str(r.threads)}
    assert format_cpulist(plan.ranks[0].cpus) == "0-9,40-49"
    assert format_cpulist(plan.ranks[3].cpus) == "30-39,70-79"
    assert plan.ranks[0].threads == 8 and format_cpulist(plan.ranks[0].loader_cpus) == "8-9,48-49"
    assert plan.warnings == []


def test_node_and_socket_modes_share_and_say_so():
    t = topo("epyc-2s-nps2")
    node = plan_binding(t, 2, "node", environ={})
    assert [format_cpulist(r.cpus) for r in node.ranks] == ["8-15,40-47", "24-31,56-63"]
    assert node.warnings == []  # one rank per node: nothing shared
    socket = plan_binding(t, 2, "socket", environ={})
    assert [format_cpulist(r.cpus) for r in socket.ranks] == ["0-15,32-47", "16-31,48-63"]
    t4 = topo("xeon-2s-smt")
    shared = plan_binding(t4, 4, "node", environ={})
    assert shared.ranks[0].cpus == shared.ranks[1].cpus
    assert shared.ranks[0].threads == 10  # 20 cores shared by 2 ranks
    assert any("ranks 0-1 share the cores of node 0" in w for w in shared.warnings)


def test_core_complex_gives_whole_l3_groups():
    t = topo("epyc-2s-nps2", environ={"CUDA_VISIBLE_DEVICES": "0,0"})
    assert [d.numa_node for d in t.devices] == [1, 1]
    plan = plan_binding(t, 2, "core-complex", environ={})
    groups = [set(g) for g in t.l3_groups]
    for r in plan.ranks:
        assert set(r.cpus) in groups
    no_shared_cpu(plan)


def test_core_complex_with_fewer_groups_than_ranks_falls_back():
    t = topo("epyc-2s-nps2")
    plan = plan_binding(t, 8, "core-complex", environ={})
    no_shared_cpu(plan)
    assert any("L3 group(s) for 4 ranks" in n for n in plan.notes)
    assert any("8 local ranks but 2 cuda devices" in w for w in plan.warnings)


def test_kunpeng_npus_each_get_their_node():
    t = topo("kunpeng920-2s", target="npu")
    plan = plan_binding(t, 4, environ={})
    assert [format_cpulist(r.cpus) for r in plan.ranks] == ["0-23", "24-47", "48-71", "72-95"]
    assert [r.threads for r in plan.ranks] == [18] * 4  # a quarter kept for loader workers
    assert plan.device_kind == "npu"


def test_cpu_only_spreads_ranks_over_nodes():
    t = topo("kunpeng920-2s", target="cpu")
    plan = plan_binding(t, 2, environ={})
    assert [format_cpulist(r.cpus) for r in plan.ranks] == ["0-47", "48-95"]
    plan8 = plan_binding(t, 8, environ={})
    assert [plan8.rank_nodes(r) for r in plan8.ranks] == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)]
    no_shared_cpu(plan8)


def test_container_with_unequal_nodes_splits_evenly():
    t = topo("container-cpuset")
    plan = plan_binding(t, 2, environ={})
    assert [format_cpulist(r.cpus) for r in plan.ranks] == ["60-67", "68-75"]
    assert any("unequal" in n for n in plan.notes)
    for r in plan.ranks:
        assert set(r.cpus) <= set(range(60, 76))


def test_unknown_device_node_spreads_ranks():
    t = topo("vm-numa-unknown")
    plan = plan_binding(t, 2, environ={})
    assert [plan.rank_nodes(r) for r in plan.ranks] == [(0,), (1,)]
    no_shared_cpu(plan)


def test_device_node_outside_the_cpuset_uses_the_nearest_node(tmp_path):
    root = tmp_path / "x"
    shutil.copytree(TREES / "xeon-2s-smt", root)
    (root / "proc/self/status").write_text("Cpus_allowed_list:\t20-39,60-79\n")
    t = read_topology(root, environ={"CUDA_VISIBLE_DEVICES": "0"})
    plan = plan_binding(t, 1, environ={})
    assert set(plan.ranks[0].cpus) <= set(range(20, 40)) | set(range(60, 80))
    assert any("sits on node 0, where this process may use no CPU" in w for w in plan.warnings)


def test_more_ranks_than_cores_is_oversubscribed_with_a_warning():
    t = topo("firecracker-2cpu")
    plan = plan_binding(t, 3, environ={})
    assert [r.cpus for r in plan.ranks] == [(0,), (1,), (0,)]
    assert all(r.threads == 1 for r in plan.ranks)
    assert any(w.startswith("oversubscribed: 3 local ranks") for w in plan.warnings)


def test_node_short_of_cores_borrows_from_the_nearest_node(tmp_path):
    root = tmp_path / "k"
    shutil.copytree(TREES / "kunpeng920-2s", root)
    # only 2 cores of node 0 and all of node 1 allowed; 4 ranks all on npu 0's node
    (root / "proc/self/status").write_text("Cpus_allowed_list:\t0-1,24-47\n")
    t = read_topology(root, environ={"ASCEND_RT_VISIBLE_DEVICES": "0"}, target="npu")
    plan = plan_binding(t, 4, environ={})
    no_shared_cpu(plan)
    assert plan.ranks[0].cpus == (0,) and plan.ranks[1].cpus == (1,)
    assert {plan.rank_nodes(r) for r in plan.ranks[2:]} == {(1,)}
    assert sum("remote to its device" in w for w in plan.warnings) == 2


def test_two_ranks_never_share_a_core_unless_oversubscribed():
    for name, n in [("xeon-2s-smt", 4), ("xeon-2s-smt", 40), ("epyc-2s-nps2", 32), ("kunpeng920-2s", 96),
                    ("container-cpuset", 16), ("vm-numa-unknown", 8)]:
        t = topo(name)
        for mode in ("exclusive", "core-complex"):
            plan = plan_binding(t, n, mode, environ={})
            no_shared_cpu(plan)
            assert not any("oversubscribed" in w for w in plan.warnings)


def test_explicit_cpus():
    t = topo("xeon-2s-smt")
    plan = plan_binding(t, 2, cpus=["0-3", "20-23"], loader_cores=0, environ={})
    assert plan.mode == "cpus"
    assert [r.cpus for r in plan.ranks] == [(0, 1, 2, 3), (20, 21, 22, 23)]
    assert [r.threads for r in plan.ranks] == [4, 4]
    same = plan_binding(t, 2, cpus=["0-3;20-23"], loader_cores=0, environ={})
    assert [r.cpus for r in same.ranks] == [r.cpus for r in plan.ranks]
    smt = plan_binding(t, 1, cpus=["0-1,40-41"], environ={})
    assert smt.ranks[0].threads == 2  # two cores, four threads


def test_explicit_cpus_outside_the_allowed_set():
    t = topo("container-cpuset")
    plan = plan_binding(t, 2, cpus=["58-63", "0-3"], environ={})
    assert plan.ranks[0].cpus == (60, 61, 62, 63)
    assert any("CPUs 58-59 are not allowed here" in w for w in plan.warnings)
    assert set(plan.ranks[1].cpus) <= set(range(60, 76)) and plan.ranks[1].cpus
    assert any("none of CPUs 0-3 is allowed here" in w for w in plan.warnings)


def test_explicit_cpus_bad_input():
    t = topo("xeon-2s-smt")
    with pytest.raises(TorchaxeError, match="gives 1 CPU list"):
        plan_binding(t, 2, cpus=["0-3"], environ={})
    with pytest.raises(TorchaxeError, match="not a CPU number"):
        plan_binding(t, 1, cpus=["zero"], environ={})
    overlap = plan_binding(t, 2, cpus=["0-3", "2-5"], environ={})
    assert any("ranks 0 and 1 share CPUs 2-3" in w for w in overlap.warnings)


def test_user_thread_variables_are_kept_and_differences_said():
    t = topo("xeon-2s-smt")
    plan = plan_binding(t, 4, environ={"OMP_NUM_THREADS": "4"})
    assert plan.user_env == {"OMP_NUM_THREADS": "4"}
    assert all("OMP_NUM_THREADS" not in r.env and "MKL_NUM_THREADS" in r.env for r in plan.ranks)
    assert any("OMP_NUM_THREADS=4 is set in your environment and kept" in w for w in plan.warnings)
    same = plan_binding(t, 4, environ={"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"})
    assert same.warnings == [] and all(r.env == {} for r in same.ranks)


def test_loader_cores():
    t = topo("xeon-2s-smt")
    plan = plan_binding(t, 4, loader_cores=3, environ={})
    assert all(r.threads == 7 and len(r.loader_cpus) == 6 for r in plan.ranks)
    none = plan_binding(t, 4, loader_cores=0, environ={})
    assert all(r.loader_cpus == () and r.threads == 10 for r in none.ranks)
    too_many = plan_binding(t, 4, loader_cores=10, environ={})
    assert all(r.threads == 1 for r in too_many.ranks)
    assert any("--loader-cores 10 but the rank has 10 core(s)" in w for w in too_many.warnings)
    assert parse_loader_cores("auto") is None and parse_loader_cores("2") == 2
    with pytest.raises(TorchaxeError):
        parse_loader_cores("-1")
    with pytest.raises(TorchaxeError):
        parse_loader_cores("many")


def test_bad_mode_and_nproc():
    t = topo("xeon-2s-smt")
    with pytest.raises(TorchaxeError, match="unknown binding mode"):
        plan_binding(t, 1, "numa", environ={})
    with pytest.raises(TorchaxeError, match="at least one rank"):
        plan_binding(t, 0, environ={})


def test_mode_none_binds_nothing():
    plan = plan_binding(topo("xeon-2s-smt"), 2, "none", environ={})
    assert all(r.threads is None and r.env == {} for r in plan.ranks)


def test_json_round_trip_and_table():
    t = topo("kunpeng920-2s", target="npu")
    plan = plan_binding(t, 4, environ={"OMP_NUM_THREADS": "3"})
    data = json.loads(plan.to_json())
    assert {"local_rank", "cpus", "compute_cpus", "loader_cpus", "threads", "env", "device", "nodes"} <= set(data["ranks"][0])
    back = BindingPlan.from_dict(data)
    assert back.ranks == plan.ranks and back.user_env == plan.user_env and back.node_of_cpu == plan.node_of_cpu
    with pytest.raises(TorchaxeError, match="not a binding plan"):
        BindingPlan.from_dict({"schema": "x"})
    with pytest.raises(TorchaxeError, match="malformed"):
        BindingPlan.from_dict({**data, "ranks": [{"local_rank": 0}]})
    out = io.StringIO()
    render_plan(plan, out)
    text = out.getvalue()
    assert "rank" in text and "72-95" in text and "npu:3" in text and "kept: OMP_NUM_THREADS=3" in text
    with pytest.raises(TorchaxeError, match="local rank 4 is not in the plan"):
        plan.rank(4)
