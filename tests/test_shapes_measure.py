"""--try bookkeeping with an injected runner (no subprocess), the candidates per
target, and the npu compile-mode setter and reader against the torch_npu stand-in."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from torchaxe.runtime.trials import TrialRun
from torchaxe.shapes.measure import candidates, run_compile_trial
from torchaxe.shapes.report import build_report, render_text
from torchaxe.shapes.verdict import Verdict

FAKE_NPU = Path(__file__).parent / "scripts" / "fake_npu"

#: Per candidate: the warm-up steps (compile) and the steady step time, in seconds.
TIMES = {"eager": ([0.10, 0.10], 0.100), "compile-static": ([2.0, 0.5], 0.080),
         "compile-dynamic": ([1.5, 0.4], 0.090), "compile-static+bucketing": ([1.0, 0.3], 0.078)}


def fake_runner(knobs, command, options, repeat):
    warm, steady = TIMES[knobs.name]
    jitter = 1.0 + 0.01 * repeat
    steps = [w * jitter for w in warm] + [steady * jitter] * (options.steps - len(warm))
    assert options.warmup == 0  # the split into warm-up and steady state is made by the caller
    return TrialRun(knobs=knobs.name, repeat=repeat, ok=True, step_seconds=steps)


def verdict(pick="compile-static+bucketing"):
    return Verdict(verdict="dynamic", reasons=[], picks={"cpu": pick})


def test_candidates_per_target():
    assert [k.name for k in candidates("cpu")] == ["eager", "compile-static", "compile-dynamic"]
    cuda = candidates("cuda", {"boundaries": [8], "dim": 1, "pad_value": 0}, backend="aot_eager")
    assert [k.name for k in cuda][-1] == "compile-static+bucketing"
    assert cuda[1].torch.cudnn_benchmark is True and cuda[1].compile.backend == "aot_eager"
    assert cuda[1].compile.dynamic is False and cuda[2].compile.dynamic is True
    assert cuda[3].bucketing.boundaries == (8,)
    npu = candidates("npu", {"boundaries": [8], "dim": 1})
    assert [(k.name, k.npu.jit_compile) for k in npu] == [
        ("jit-compile-off", False), ("jit-compile-on", True), ("jit-compile-on+bucketing", True)]


def test_warmup_and_steady_state_are_split_and_the_winner_found():
    sets = candidates("cpu", {"boundaries": [8], "dim": 1, "pad_value": 0})
    trial = run_compile_trial(["python", "t.py"], verdict(), "cpu", steps=6, warmup=2, repeats=2,
                              runner=fake_runner, knob_sets=sets)
    by = {r.name: r for r in trial.results}
    assert by["compile-static"].warmup_median == pytest.approx(2.5 * 1.015)
    assert by["compile-static"].steady_median == pytest.approx(0.080 * 1.015)
    assert by["compile-static"].ratios == pytest.approx([0.8, 0.8])
    assert trial.winner.name == "compile-static+bucketing"
    assert trial.pick_ok is True and trial.pick_within == pytest.approx(0.0)
    assert trial.margin() == pytest.approx(0.078 / 0.080)
    # extra compile cost over eager: (1.3 - 2 * 0.078) - (0.2 - 2 * 0.1), paid by 0.022 s a step
    assert trial.payback_steps() == pytest.approx(((1.3 - 0.156) - 0.0) / 0.022, rel=1e-6)
    data = trial.to_dict()
    assert data["winner"] == "compile-static+bucketing" and data["baseline"] == "eager"
    assert data["candidates"][1]["warmup"]["overhead_seconds"] == pytest.approx((2.5 - 0.16) * 1.015)


def test_a_wrong_pick_is_reported_and_text_renders():
    trial = run_compile_trial(["python", "t.py"], verdict("compile-dynamic"), "cpu", steps=4, warmup=2, repeats=1,
                              runner=fake_runner, knob_sets=candidates("cpu"))
    assert trial.winner.name == "compile-static" and trial.pick_ok is False
    assert trial.pick_within == pytest.approx(0.090 / 0.080 - 1)
    import io

    report = build_report(command=["python", "t.py"], target="cpu", verdict=verdict("compile-dynamic"),
                          analysis=None, trial=trial.to_dict())
    buffer = io.StringIO()
    render_text(report, buffer)
    text = buffer.getvalue()
    assert "winner (steady state): compile-static" in text and "12.5% slower than the winner" in text
    assert json.loads(json.dumps(report))["trial"]["pick_ok"] is False


def test_the_winner_and_the_pick_are_judged_round_by_round():
    # Round 2 ran on a machine twice as slow for everyone. Per round, static takes
    # 0.8 of eager's step and dynamic 0.9 and 0.85: the pick (dynamic) is the median
    # of 1.125 and 1.0625 above the winner, 9.4%, whatever the pooled steps say.
    steady = {("eager", 1): 0.10, ("eager", 2): 0.20, ("compile-static", 1): 0.08, ("compile-static", 2): 0.16,
              ("compile-dynamic", 1): 0.09, ("compile-dynamic", 2): 0.17}

    def runner(knobs, command, options, repeat):
        return TrialRun(knobs=knobs.name, repeat=repeat, ok=True, step_seconds=[steady[knobs.name, repeat]] * 6)

    trial = run_compile_trial(["python", "t.py"], verdict("compile-dynamic"), "cpu", steps=4, warmup=2, repeats=2,
                              runner=runner, knob_sets=candidates("cpu"))
    assert trial.winner.name == "compile-static"
    assert trial.pick_within == pytest.approx((1.125 + 0.17 / 0.16) / 2 - 1)
    assert trial.pick_ok is False
    assert trial.margin() == pytest.approx((0.8 / 0.9 + 0.8 / 0.85) / 2)


def test_a_failed_candidate_is_kept_apart():
    def runner(knobs, command, options, repeat):
        if knobs.name == "compile-dynamic":
            return TrialRun(knobs=knobs.name, repeat=repeat, ok=False, error="error: the script raised")
        return fake_runner(knobs, command, options, repeat)

    trial = run_compile_trial(["python", "t.py"], verdict(), "cpu", steps=4, warmup=2, repeats=2, runner=runner,
                              knob_sets=candidates("cpu"))
    failed = next(r for r in trial.results if r.name == "compile-dynamic")
    assert not failed.ok and "raised" in failed.error
    assert trial.winner.name == "compile-static" and trial.pick is None  # no bucketing candidate to pick


@pytest.fixture
def fake_torch_npu(monkeypatch, tmp_path):
    log = tmp_path / "npu.log"
    monkeypatch.setenv("FAKE_TORCH_NPU_LOG", str(log))
    monkeypatch.syspath_prepend(str(FAKE_NPU))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    module = importlib.import_module("torch_npu")
    yield log
    sys.modules.pop("torch_npu", None)
    del module


def test_npu_compile_mode_set_and_read_back(fake_torch_npu):
    from torchaxe.backends import npu

    npu.set_compile_mode(False)
    assert npu.is_jit_compile_false() is True and npu.jit_compile_enabled() is False
    npu.set_compile_mode(True)
    assert npu.is_jit_compile_false() is False and npu.jit_compile_enabled() is True
    calls = [json.loads(line) for line in fake_torch_npu.read_text().splitlines()]
    assert calls[0] == {"call": "set_compile_mode", "kwargs": {"jit_compile": False}}
    assert [c["call"] for c in calls] == ["set_compile_mode", "is_jit_compile_false", "is_jit_compile_false",
                                          "set_compile_mode", "is_jit_compile_false", "is_jit_compile_false"]


def test_npu_compile_mode_unknown_without_torch_npu(monkeypatch):
    from torchaxe.backends import npu

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    assert npu.jit_compile_enabled() is None


NPU_SCRIPT = """\
import torch
import torch_npu
torch_npu.npu.set_compile_mode(jit_compile=False)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
"""


def test_shapes_reports_the_compile_mode_a_run_used(fake_torch_npu, tmp_path, capsys):
    from torchaxe.cli import main

    script = tmp_path / "npu_train.py"
    script.write_text(NPU_SCRIPT)
    assert main(["shapes", "--steps", "3", "--target", "npu", "--format", "json", "--", "python", str(script)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["npu_compile_mode"] == {"jit_compile_in_effect": False}
    assert report["verdict"] == "static" and report["pick"] == "jit-compile-on"
    assert main(["shapes", "--try", "--target", "npu", "--", "python", str(script)]) == 2
    assert "--try measures on this machine, which has cpu, not npu" in capsys.readouterr().err
