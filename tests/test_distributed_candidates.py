"""The distributed axis's candidates, from the profile's ``distributed`` section: DDP's
settings where the evidence shows them worth a trial, the npu settings on npu only,
nothing for a run that is not distributed."""

from __future__ import annotations

import copy

import pytest

from torchaxe.advise.candidates import knob_candidates
from torchaxe.distributed.candidates import BUCKET_GROUP, HOOK_GROUP, UNVERIFIED, candidates
from torchaxe.runtime.knobs import knob_set_from_dict

MIB = 1024 * 1024


def _profile(**ddp_changes):
    """The example DDP script's profile: find_unused_parameters=True with nothing
    unused, default buckets, 2 buffers that do not change, the all-reduce 10% of the step."""
    ddp = {"bucket_cap_mb": 25.0, "gradient_as_bucket_view": False, "static_graph": False,
           "find_unused_parameters": True, "broadcast_buffers": True, "unused_parameter_bytes": 0,
           "parameter_bytes": 150 * MIB, "buckets": 3, "buffers": 2, "buffers_changed": False, "comm_hook": None,
           "forward_compute_seconds": 0.01, "backward_compute_seconds": 0.02,
           "backward_comm_seconds": 0.0025, "backward_overlap_seconds": 0.001}
    ddp.update(ddp_changes)
    return {
        "summary": {"step_seconds_median": 0.1},
        "distributed": {"rank": 0, "local_rank": 0, "world_size": 2, "local_world_size": 2, "nnodes": 1,
                        "host": "h", "backend": "gloo", "ddp": ddp,
                        "collectives": {"all_reduce": {"calls_per_step": 1.0, "seconds_per_step": 0.0001}},
                        "comm_seconds_per_step": 0.0101, "comm_exposed_seconds_per_step": 0.006,
                        "backwards_per_step": 4.0, "synced_backwards_per_step": 4.0},
    }


def _keys(profile, target="cpu", settings=None, notes=None):
    return [c.key for c in candidates(profile, target, settings or {}, notes=notes)]


@pytest.mark.parametrize("profile", [{}, {"distributed": None}, {"summary": {"step_seconds_median": 0.1}}])
@pytest.mark.parametrize("target", ["cpu", "cuda", "npu"])
def test_a_run_that_is_not_distributed_gets_none(profile, target):
    assert candidates(profile, target, {}) == []


def test_the_example_script_s_slow_settings_each_become_a_candidate():
    by_key = {c.key: c for c in candidates(_profile(), "cpu", {})}
    assert list(by_key) == ["knob:ddp-find-unused-false", "knob:ddp-static-graph", "knob:ddp-bucket-view",
                            "knob:ddp-broadcast-buffers-false", "knob:ddp-bucket-cap-12.5", "knob:ddp-bucket-cap-100",
                            "knob:ddp-bucket-cap-150", "knob:ddp-comm-fp16"]
    assert by_key["knob:ddp-find-unused-false"].knobs == {"ddp": {"find_unused_parameters": False}}
    assert by_key["knob:ddp-static-graph"].knobs == {"ddp": {"static_graph": True}}
    assert by_key["knob:ddp-bucket-view"].knobs == {"ddp": {"gradient_as_bucket_view": True}}
    assert by_key["knob:ddp-broadcast-buffers-false"].knobs == {"ddp": {"broadcast_buffers": False}}
    for key in ("knob:ddp-find-unused-false", "knob:ddp-static-graph", "knob:ddp-bucket-view",
                "knob:ddp-broadcast-buffers-false"):
        assert by_key[key].rec.accuracy.kind == "exact" and by_key[key].rec.axis == "distributed"
    assert "fails loudly" in by_key["knob:ddp-find-unused-false"].rec.detail
    # Every fragment is a valid knob set.
    for c in by_key.values():
        knob_set_from_dict(c.knobs, c.key)
    # The surest gain is measured first when the budget is short.
    assert max(by_key.values(), key=lambda c: c.priority).key == "knob:ddp-find-unused-false"


def test_static_graph_is_not_tried_on_a_run_that_skips_the_exchange_with_no_sync():
    # Accumulation under no_sync() (1 of 4 backward passes exchanges gradients): DDP's
    # static graph failed every such trial with an internal assert in its reducer.
    profile = _profile()
    profile["distributed"]["synced_backwards_per_step"] = 1.0
    notes: list[str] = []
    keys = _keys(profile, notes=notes)
    assert "knob:ddp-static-graph" not in keys and "knob:ddp-bucket-view" in keys
    assert any(n.startswith("DDP static_graph=True was not tried: the run exchanged gradients in 1 of its 4 "
                            "backward passes a step") for n in notes), notes


def test_settings_the_run_already_has_are_not_tried_again():
    profile = _profile(find_unused_parameters=False, static_graph=True, gradient_as_bucket_view=True,
                       broadcast_buffers=False)
    assert not any(k in _keys(profile) for k in ("knob:ddp-find-unused-false", "knob:ddp-static-graph",
                                                 "knob:ddp-bucket-view", "knob:ddp-broadcast-buffers-false"))


def test_unused_parameters_keep_the_search():
    keys = _keys(_profile(unused_parameter_bytes=4096))
    assert "knob:ddp-find-unused-false" not in keys and "knob:ddp-static-graph" in keys
    assert "knob:ddp-find-unused-false" not in _keys(_profile(unused_parameter_bytes=None))


@pytest.mark.parametrize("buffers, changed, tried", [
    (2, False, True),
    (2, True, False),    # BatchNorm statistics: the ranks would drift apart
    (2, None, False),    # unknown
    (0, False, False),   # nothing to broadcast: DDP syncs no buffers already
])
def test_buffer_broadcast_is_dropped_only_when_no_buffer_changes(buffers, changed, tried):
    notes: list[str] = []
    keys = _keys(_profile(buffers=buffers, buffers_changed=changed), notes=notes)
    assert ("knob:ddp-broadcast-buffers-false" in keys) == tried
    assert any("drift apart" in n for n in notes) == (changed is True)


def test_bucket_sizes_are_one_group_and_only_where_they_change_the_bucketing():
    cs = [c for c in candidates(_profile(), "cpu", {}) if c.key.startswith("knob:ddp-bucket-cap")]
    assert {c.group for c in cs} == {BUCKET_GROUP}
    assert [c.knobs["ddp"]["bucket_cap_mb"] for c in cs] == [12.5, 100.0, 150.0]
    # Two ranks: each gradient is one addition, whatever the buckets.
    assert all(c.rec.accuracy.kind == "exact" for c in cs)
    # More ranks: another order of additions, the loss is compared.
    many = _profile()
    many["distributed"]["world_size"] = 8
    assert all(c.rec.accuracy.kind == "unknown" for c in candidates(many, "cpu", {}) if c.group == BUCKET_GROUP)
    # A small model fits one bucket already: only a smaller bucket could change anything.
    small = [c.key for c in candidates(_profile(parameter_bytes=17412), "cpu", {}) if c.group == BUCKET_GROUP]
    assert small == []
    middle = [c.key for c in candidates(_profile(parameter_bytes=20 * MIB), "cpu", {}) if c.group == BUCKET_GROUP]
    assert middle == ["knob:ddp-bucket-cap-12.5"]
    # Four times the bucket holds every gradient of a 60-100 MB model: no separate "all" one.
    assert [c.key for c in candidates(_profile(parameter_bytes=90 * MIB), "cpu", {}) if c.group == BUCKET_GROUP] \
        == ["knob:ddp-bucket-cap-12.5", "knob:ddp-bucket-cap-100"]
    # An unset bucket size is DDP's default, 25 MB.
    assert "knob:ddp-bucket-cap-100" in _keys(_profile(bucket_cap_mb=None))


def test_a_small_all_reduce_leaves_buckets_and_compression_untried_with_a_note():
    notes: list[str] = []
    keys = _keys(_profile(backward_comm_seconds=0.0001), notes=notes)
    assert not any(k.startswith(("knob:ddp-bucket-cap", "knob:ddp-comm")) for k in keys)
    assert "knob:ddp-static-graph" in keys
    assert any("DDP's all-reduce took" in n and "were not tried" in n for n in notes)


def test_compression_bf16_only_where_ddp_takes_it_and_never_over_the_script_s_own_hook():
    def hooks(target, backend, **changes):
        profile = _profile(**changes)
        profile["distributed"]["backend"] = backend
        return {c.key: c for c in candidates(profile, target, {}) if c.group == HOOK_GROUP}

    cuda = hooks("cuda", "nccl")
    assert list(cuda) == ["knob:ddp-comm-bf16", "knob:ddp-comm-fp16"]
    assert cuda["knob:ddp-comm-bf16"].knobs == {"ddp": {"comm_hook": "bf16"}}
    assert all(c.rec.accuracy.kind == "unknown" and "loss is compared" in c.rec.accuracy.detail
               for c in cuda.values())
    assert "10%" in cuda["knob:ddp-comm-bf16"].rec.detail  # 2.5 ms x 4 backward passes of a 100 ms step
    assert list(hooks("cpu", "gloo")) == ["knob:ddp-comm-fp16"]
    npu = hooks("npu", "hccl")
    assert list(npu) == ["knob:ddp-comm-fp16"] and UNVERIFIED in npu["knob:ddp-comm-fp16"].rec.title
    assert hooks("cuda", "nccl", comm_hook="powerSGD_hook") == {}


def test_npu_env_candidates_on_npu_only_with_their_source():
    assert not any(k.startswith("knob:npu-") for t in ("cpu", "cuda") for k in _keys(_profile(), t))
    by_key = {c.key: c for c in candidates(_profile(), "npu", {}) if c.key.startswith("knob:npu-")}
    assert list(by_key) == ["knob:npu-task-queue-2", "knob:npu-cpu-affinity-2", "knob:npu-cpu-affinity-1",
                            "knob:npu-combined"]
    assert by_key["knob:npu-task-queue-2"].knobs == {"env": {"TASK_QUEUE_ENABLE": "2"}}
    assert by_key["knob:npu-cpu-affinity-2"].knobs == {"env": {"CPU_AFFINITY_CONF": "2"}}
    assert by_key["knob:npu-combined"].knobs == {"env": {"COMBINED_ENABLE": "1"}}
    for c in by_key.values():
        assert UNVERIFIED in c.rec.title and UNVERIFIED in c.rec.detail and "hiascend.com" in c.rec.detail
    # torch_npu's core binding and the bind axis's binding are one choice.
    assert by_key["knob:npu-cpu-affinity-1"].group == by_key["knob:npu-cpu-affinity-2"].group == "binding"
    # What the run's environment already sets is not tried again.
    settings = {"env": {"TASK_QUEUE_ENABLE": "2", "CPU_AFFINITY_CONF": "1", "COMBINED_ENABLE": "1"}}
    assert not any(k.startswith("knob:npu-") for k in _keys(_profile(), "npu", settings))
    # ASCEND_LAUNCH_BLOCKING=1 turns the queue off whatever TASK_QUEUE_ENABLE says.
    assert "knob:npu-task-queue-2" not in _keys(_profile(), "npu", {"env": {"ASCEND_LAUNCH_BLOCKING": "1"}})


def test_hccl_buffer_follows_buckets_above_it_on_npu():
    # The script's own buckets exceed HCCL's 200 MB buffer.
    (buff,) = [c for c in candidates(_profile(bucket_cap_mb=300.0, parameter_bytes=900 * MIB), "npu", {})
               if c.key == "knob:npu-hccl-buffsize"]
    assert buff.knobs == {"env": {"HCCL_BUFFSIZE": "300"}}
    assert "knob:npu-hccl-buffsize" not in _keys(_profile(bucket_cap_mb=300.0), "npu", {"env": {"HCCL_BUFFSIZE": "512"}})
    # A larger bucket tried on npu carries the buffer that holds it; not elsewhere.
    big = {c.key: c for c in candidates(_profile(bucket_cap_mb=100.0, parameter_bytes=900 * MIB), "npu", {})}
    assert big["knob:ddp-bucket-cap-400"].knobs == {"ddp": {"bucket_cap_mb": 400.0}, "env": {"HCCL_BUFFSIZE": "400"}}
    assert big["knob:ddp-bucket-cap-50"].knobs == {"ddp": {"bucket_cap_mb": 50.0}}
    cuda = {c.key: c for c in candidates(_profile(bucket_cap_mb=100.0, parameter_bytes=900 * MIB), "cuda", {})}
    assert cuda["knob:ddp-bucket-cap-400"].knobs == {"ddp": {"bucket_cap_mb": 400.0}}


def test_a_distributed_run_without_ddp_says_so_and_still_gets_the_npu_settings():
    profile = copy.deepcopy(_profile())
    profile["distributed"]["ddp"] = None
    notes: list[str] = []
    assert _keys(profile, "cpu", notes=notes) == []
    assert any("no DistributedDataParallel" in n for n in notes)
    assert _keys(profile, "npu") == ["knob:npu-task-queue-2", "knob:npu-cpu-affinity-2", "knob:npu-cpu-affinity-1",
                                     "knob:npu-combined"]


def test_the_script_s_own_collectives_are_a_note_when_they_cost_time():
    profile = _profile()
    profile["distributed"]["collectives"] = {"all_reduce": {"calls_per_step": 1.0, "seconds_per_step": 0.02}}
    notes: list[str] = []
    candidates(profile, "cpu", {}, notes=notes)
    assert any("own collectives (all_reduce 1 a step) took 20.0 ms of the 100.0 ms step (20%)" in n for n in notes)
    # Calls a step over few steps print as a count, not as 18.3333 (a review under torchrun).
    profile["distributed"]["collectives"] = {"all_reduce": {"calls_per_step": 55 / 3, "seconds_per_step": 0.02}}
    notes = []
    candidates(profile, "cpu", {}, notes=notes)
    assert any("own collectives (all_reduce 18.3 a step)" in n for n in notes), notes
    quiet: list[str] = []
    candidates(_profile(), "cpu", {}, notes=quiet)
    assert not any("own collectives" in n for n in quiet)


@pytest.mark.parametrize("target", ["cpu", "cuda", "npu"])
def test_advise_collects_them_after_the_other_run_axes_and_before_memory(target):
    from torchaxe.bind import candidates as bind
    from torchaxe.data import candidates as data
    from torchaxe.distributed import candidates as distributed
    from torchaxe.memory import candidates as memory
    from torchaxe.precision import candidates as precision
    from torchaxe.shapes import candidates as shapes

    profile = _profile()
    settings = {"allowed_cpus": 8, "num_threads": 2}
    expected = [c.key for axis in (shapes, precision, bind, data, distributed, memory)
                for c in axis.candidates(profile, target, settings)]
    notes: list[str] = []
    assert [c.key for c in knob_candidates(target, profile, settings, notes=notes)] == expected
    assert "knob:ddp-static-graph" in expected


def test_gradients_exchanged_on_every_micro_batch_are_a_note():
    notes: list[str] = []
    candidates(_profile(), "cpu", {}, notes=notes)
    assert any("accumulates gradients over 4 backward passes" in n and "exchanged them on 4" in n
               and "7.5 ms a step to save" in n and "no_sync()" in n for n in notes), notes
    # Exchanged once a step (the script uses no_sync): no note, and the all-reduce
    # counts once in its share of the step (2.5 ms of 100 ms: too small to try compression).
    once = _profile()
    once["distributed"]["synced_backwards_per_step"] = 1.0
    quiet: list[str] = []
    keys = _keys(once, notes=quiet)
    assert not any("no_sync" in n for n in quiet if not n.startswith("DDP static_graph=True was not tried"))
    assert "knob:ddp-comm-fp16" not in keys and any("(2.5%)" in n for n in quiet)
