"""Trace import (`torchaxe profile --from-trace`): torch.profiler Chrome traces made
here at test time, and real torch_npu.profiler output under tests/data/ascend
(see tests/data/README.md)."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest

from torchaxe.cli import main
from torchaxe.runtime.profile import Profile, load_profile
from torchaxe.runtime.traces import TraceFormatError, load_trace
from torchaxe.runtime.traces.ascend import parse_shapes

ASCEND = Path(__file__).parent / "data" / "ascend"


def _train(path: Path, batch_sizes: list[int]) -> Path:
    """A tiny model and unfused Adam, profiled with a schedule (wait 1, warmup 1,
    active 3), one `.item()` per step, exported as a Chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 record_shapes=True) as prof:
        for batch in batch_sizes:
            loss = model(torch.randn(batch, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()
            prof.step()
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    fixed = _train(folder / "fixed.json", [4] * 5)
    gz = folder / "fixed.json.gz"
    gz.write_bytes(gzip.compress(fixed.read_bytes()))
    varying = _train(folder / "varying.json", [4, 4, 4, 6, 9])
    return {"json": fixed, "gz": gz, "varying": varying}


def _finding(profile: Profile, kind: str):
    found = [f for f in profile.findings if f.kind == kind]
    assert found, f"no {kind} finding in {[f.kind for f in profile.findings]}"
    return found[0]


# ------------------------------------------------------------------ torch.profiler


def test_chrome_trace_steps_ops_and_shapes(traces):
    profile = load_trace(traces["json"])
    assert profile.run.source == "torch-trace" and profile.run.target == "cpu"
    # ProfilerStep#2..#4 (0-based prof.step() count) are steps 3..5.
    assert [s.index for s in profile.steps] == [3, 4, 5] == profile.ops_steps
    assert all(s.seconds > 0 and s.data_wait_seconds is None for s in profile.steps)
    ops = {o.name: o for o in profile.ops}
    assert ops["aten::addmm"].calls == 6 and ops["aten::addmm"].kind == "op"
    # One shape group per Linear layer, three calls each; groups are ordered by time,
    # which the two layers' tiny matmuls do not settle, so each is looked for by shape.
    groups = ops["aten::addmm"].input_shapes
    first = [g for g in groups if [16, 8] in g.input_shapes or [8, 16] in g.input_shapes]
    second = [g for g in groups if [16, 1] in g.input_shapes or [1, 16] in g.input_shapes]
    assert len(first) == 1 and first[0].calls == 3
    assert len(second) == 1 and second[0].calls == 3
    assert ops["ProfilerStep#2"].kind == "range"
    host = [o for o in profile.ops if o.kind == "op"]
    assert host == sorted(host, key=lambda o: -o.self_seconds)
    assert not [o for o in profile.ops if o.kind == "kernel"]


def test_chrome_trace_host_syncs_optimizer_and_no_copies_on_cpu(traces):
    profile = load_trace(traces["json"])
    # One loss.item() per step, plus CPU Adam reading each of 4 step counters.
    assert [s.host_syncs for s in profile.steps] == [5, 5, 5]
    sync = _finding(profile, "host-sync")
    assert sync.count == 15 and sync.ops == ["aten::item"]
    assert "12 of them inside Adam.step" in sync.message and "3 elsewhere" in sync.message
    optimizer = _finding(profile, "unfused-optimizer")
    assert "about 4 per-parameter updates" in optimizer.message
    assert "torch.optim.Adam(..., fused=True)" in optimizer.suggestion and "NpuFusedAdam" in optimizer.suggestion
    assert not [f for f in profile.findings if f.kind in ("host-to-device-copy", "dynamic-shape")]


def test_gzip_trace_reads_the_same(traces):
    plain, packed = load_trace(traces["json"]), load_trace(traces["gz"])
    assert [s.to_dict() for s in plain.steps] == [s.to_dict() for s in packed.steps]
    assert [o.to_dict() for o in plain.ops] == [o.to_dict() for o in packed.ops]


def test_tensorboard_style_folder_with_one_trace(traces, tmp_path):
    shutil.copy(traces["gz"], tmp_path / "worker0.123.pt.trace.json.gz")
    assert [s.index for s in load_trace(tmp_path).steps] == [3, 4, 5]
    shutil.copy(traces["json"], tmp_path / "worker1.456.pt.trace.json")
    with pytest.raises(TraceFormatError, match="2 trace files in this folder"):
        load_trace(tmp_path)


def test_shapes_that_change_between_steps_are_dynamic(traces):
    dynamic = _finding(load_trace(traces["varying"]), "dynamic-shape")
    assert "aten::addmm" in dynamic.ops and "aten::as_strided" not in dynamic.ops
    assert "aten::addmm (3 shape sets in 3 steps)" in dynamic.message


def test_trace_without_profiler_steps_says_so(traces, tmp_path):
    data = json.loads(traces["json"].read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep#")]
    path = tmp_path / "nosteps.json"
    path.write_text(json.dumps(data))
    profile = load_trace(path)
    assert profile.steps == [] and any("no ProfilerStep#N" in w for w in profile.warnings)
    assert profile.ops


def test_imported_profile_round_trips(traces, tmp_path):
    for source in (traces["json"], ASCEND / "ut_timeline", ASCEND / "ut_compute_v2"):
        profile = load_trace(source)
        assert Profile.from_dict(json.loads(profile.to_json())).to_dict() == profile.to_dict()


@pytest.mark.parametrize("content, message", [
    ("", "empty file, not a profiler trace"),
    ("{not json", "not JSON"),
    ('{"hello": 1}', "not a profiler trace (no list of trace events)"),
    ('[{"ph": "M", "name": "process_name"}]', "without a single complete event"),
])
def test_bad_trace_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "trace.json"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=re.escape(message)) as caught:
        load_trace(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_missing_unknown_and_empty_inputs(tmp_path):
    with pytest.raises(TraceFormatError, match="no such file or folder"):
        load_trace(tmp_path / "absent.json")
    with pytest.raises(TraceFormatError, match="no profiler trace in this folder"):
        load_trace(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(TraceFormatError, match="not a trace this torchaxe reads"):
        load_trace(tmp_path / "notes.txt")
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(TraceFormatError, match="not a gzip file"):
        load_trace(tmp_path / "bad.json.gz")
    (tmp_path / "kernel_details.csv").write_text("a,b\n1,2\n")
    with pytest.raises(TraceFormatError, match="no column Name, Type, Duration"):
        load_trace(tmp_path / "kernel_details.csv")


# ------------------------------------------------------------------ torch_npu


def test_ascend_timeline_step_syncs_copies_and_launches():
    profile = load_trace(ASCEND / "ut_timeline")
    assert profile.run.source == "ascend-trace" and profile.run.target == "npu"
    assert [s.index for s in profile.steps] == [2]  # ProfilerStep#1
    assert profile.steps[0].host_syncs == 45
    sync = _finding(profile, "host-sync")
    assert sync.count == 45 and "40 of them inside Adam.step" in sync.message
    runtime = [f for f in profile.findings if f.kind == "host-sync"][1]
    assert "aclrtSynchronizeStream x4" in runtime.message
    copies = _finding(profile, "host-to-device-copy")
    assert copies.count == 4 and copies.ops == ["aten::to"]
    assert _finding(profile, "launches").count == 274
    assert _finding(profile, "online-compile").count == 11
    assert any("not been verified on Ascend hardware" in w for w in profile.warnings)
    kernels = [o for o in profile.ops if o.kind == "kernel"]
    assert kernels and all(k.device_self_seconds and k.self_seconds == 0 for k in kernels)


def _kernels(profile: Profile, op: str) -> dict[str, int]:
    [row] = [o for o in profile.ops if o.kind == "op" and o.name == op]
    return {k.name: k.calls for k in row.kernels}


def test_ascend_kernels_map_to_the_aten_operator_that_launched_them():
    profile = load_trace(ASCEND / "ut_timeline")
    # torch_npu's async_npu flows: each kernel goes to the innermost aten operator
    # around its launch (aten::addmm, not the aten::linear around it).
    assert _kernels(profile, "aten::mm")["aclnnMm_MatMulCommon_MatMulV2"] == 6
    assert _kernels(profile, "aten::addmm")["aclnnAddmm_MatMulCommon_MatMulV2"] == 3
    assert _kernels(profile, "aten::relu") == {"aclnnRelu_Relu_Relu": 4}
    assert _kernels(profile, "aten::_log_softmax") == {"aclnnLogSoftmax_LogSoftmaxAiCore_LogSoftmaxV2": 1}
    assert _kernels(profile, "aten::linear") == {} and _kernels(profile, "aten::cross_entropy_loss") == {}
    # An operator's device time is its kernels' sum; the op table leads with device time.
    [addmm] = [o for o in profile.ops if o.name == "aten::addmm"]
    assert addmm.device_self_seconds > 0
    assert addmm.device_self_seconds == pytest.approx(sum(k.device_seconds for k in addmm.kernels))
    assert profile.ops[0].name == "aten::convolution_backward"
    # An operator that launched no kernel (a host read) has no device time.
    [read] = [o for o in profile.ops if o.name == "aten::_local_scalar_dense"]
    assert read.device_self_seconds == 0.0 and read.kernels == [] and read.self_seconds > 0
    # The two MEMCPY_ASYNC tasks have no launch flow: linked to no operator, still in the kernel table.
    linked = {k.name for o in profile.ops for k in o.kernels}
    assert "MEMCPY_ASYNC" not in linked
    assert [o.calls for o in profile.ops if o.kind == "kernel" and o.name == "MEMCPY_ASYNC"] == [2]
    # 274 of the 276 device tasks are linked.
    assert sum(k.calls for o in profile.ops for k in o.kernels) == 274
    # The link survives the profile's JSON form.
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert _kernels(again, "aten::addmm") == _kernels(profile, "aten::addmm")


def test_launch_flows_link_the_innermost_aten_operator(tmp_path):
    """A hand-written torch_npu timeline: a launch inside aten::mul_ inside aten::linear,
    a flow whose end lies on no device task, and a task without a flow."""
    def op(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "pid": 10, "tid": tid, "ts": f"{ts:.3f}", "dur": dur, "cat": "cpu_op"}

    def flow(ph, key, pid, tid, ts):
        return {"ph": ph, "bp": "e", "name": "torch_to_npu", "id": key, "pid": pid, "tid": tid, "ts": f"{ts:.3f}",
                "cat": "async_npu"}

    events = [
        {"ph": "M", "name": "process_name", "pid": 10, "args": {"name": "Python"}},
        {"ph": "M", "name": "process_name", "pid": 20, "args": {"name": "Ascend Hardware"}},
        op("aten::linear", 100, 50), op("aten::mul_", 110, 30), op("aclnnMuls", 115, 10),
        op("aten::relu", 200, 20),
        {"ph": "X", "name": "Mul", "pid": 20, "tid": 3, "ts": "300.000", "dur": 4.5},
        {"ph": "X", "name": "Relu", "pid": 20, "tid": 3, "ts": "400.000", "dur": 2.0},
        {"ph": "X", "name": "Copy", "pid": 20, "tid": 3, "ts": "500.000", "dur": 1.0},
        flow("s", 7, 10, 1, 115), flow("f", 7, 20, 3, 300),
        flow("s", 8, 10, 1, 205), flow("f", 8, 20, 3, 450.5),  # ends between two tasks
        flow("s", 9, 10, 1, 600),  # no end
    ]
    path = tmp_path / "trace_view.json"
    path.write_text(json.dumps(events))
    profile = load_trace(path)
    assert _kernels(profile, "aten::mul_") == {"Mul": 1}
    assert _kernels(profile, "aten::linear") == {} and _kernels(profile, "aten::relu") == {}
    [mul] = [o for o in profile.ops if o.name == "aten::mul_"]
    assert mul.device_self_seconds == pytest.approx(4.5e-6)
    assert {o.name for o in profile.ops if o.kind == "kernel"} == {"Mul", "Relu", "Copy"}


def test_ascend_unfused_adam_suggests_npu_fused_adam():
    optimizer = _finding(load_trace(ASCEND / "ut_timeline"), "unfused-optimizer")
    assert "about 10 per-parameter updates" in optimizer.message
    assert "aten::addcdiv_ x10" in optimizer.message and "aten::sqrt x10" in optimizer.message
    assert optimizer.suggestion.startswith("use torch_npu.optim.NpuFusedAdam on Ascend")


def test_ascend_dynamic_shape_operators_from_op_state():
    for path in (ASCEND / "ut_compute_v2", ASCEND / "ut_compute_v2" / "kernel_details.csv"):
        profile = load_trace(path)
        dynamic = _finding(profile, "dynamic-shape")
        assert dynamic.count == 29 and dynamic.ops[:2] == ["MatMulV3", "Add"]
        assert "29 of 29 kernels" in dynamic.message
        top = profile.ops[0]
        assert top.kind == "kernel" and "FlashAttentionScoreGrad" in top.name
        assert top.input_shapes[0].input_shapes[0] == [4096, 2, 512]


def test_kernel_details_without_op_state_claims_no_dynamic_shapes():
    profile = load_trace(ASCEND / "ut_compute")
    assert not [f for f in profile.findings if f.kind == "dynamic-shape"]
    assert profile.ops and all(o.kind == "kernel" for o in profile.ops) and profile.steps == []
    assert any("no timeline" in w for w in profile.warnings)


def test_op_statistic_table(tmp_path):
    folder = tmp_path / "run_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    folder.mkdir(parents=True)
    # Hand-written in the layout of op_statistic.csv (no sample of it in shared/data).
    (folder / "op_statistic.csv").write_text(
        "OP Type,Core Type,Count,Total Time(us),Min Time(us),Avg Time(us),Max Time(us),Ratio(%)\n"
        "MatMulV2,AI_CORE,4,800.5,150,200.1,250,80\nAdd,AI_VECTOR_CORE,10,200,10,20,30,20\n")
    profile = load_trace(tmp_path / "run_ascend_pt")
    assert [(o.name, o.calls, o.device_self_seconds) for o in profile.ops] == [
        ("MatMulV2", 4, 800.5e-6), ("Add", 10, 200e-6)]


def test_parse_shapes():
    assert parse_shapes('"81920,4096;8192,512"') == ((81920, 4096), (8192, 512))
    assert parse_shapes('"4096,2,512;;x"') == ((4096, 2, 512), (), None)
    assert parse_shapes("N/A") is None and parse_shapes("") is None


# ------------------------------------------------------------------ CLI


def test_cli_from_trace_writes_profile_and_summary(tmp_path, capsys):
    out = tmp_path / "npu.json"
    code = main(["profile", "--from-trace", str(ASCEND / "ut_timeline"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert load_profile(out).run.source == "ascend-trace"
    assert "unfused-optimizer: Adam.step ran op by op" in err and "NpuFusedAdam" in err
    assert "host syncs  45.0 per step" in err and "not been verified on Ascend hardware" in err


@pytest.mark.parametrize("argv, message", [
    (["--from-trace", "{missing}"], "no such file or folder"),
    (["--from-trace", "{empty}"], "empty file"),
    (["--from-trace", "{empty}", "--", "python", "train.py"], "give it no training command"),
])
def test_cli_from_trace_errors_exit_2_in_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "empty.json").write_text("")
    names = {"missing": tmp_path / "missing.json", "empty": tmp_path / "empty.json"}
    argv = [a.format(**names) for a in argv]
    code = main(["profile", *argv, "--out", str(tmp_path / "p.json")] if "--" not in argv else
                ["profile", "--out", str(tmp_path / "p.json"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
