"""Where steps come from (runtime/steps.py): the optimizer, the backward pass of loops
that update their parameters by hand, a --step-marker function; and the first-step
timeout that stops a run in which no step comes."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from profile_support import run_command, run_script
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.harness import EXIT_NO_STEPS, EXIT_OK, HarnessOptions, exit_code_for

LOOPS = Path(__file__).resolve().parent / "scripts" / "step_loops.py"


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def loop(mode: str, *args: str, **options):
    options.setdefault("steps", None)
    options.setdefault("warmup", 0)
    return run_command(["python", str(LOOPS), mode, *args], **options)


# ------------------------------------------------------------------ backward steps


@pytest.mark.parametrize("mode", ["sgd", "nograd"])
def test_a_loop_without_an_optimizer_steps_at_each_update(mode, capsys):
    profile = loop(mode, "6")
    assert "updates 6" in capsys.readouterr().out
    # A step ends where the next one's backward pass finds the gradients cleared:
    # the last update is not followed by one.
    assert profile.status == "completed" and len(profile.steps) == 5
    assert profile.step_source == "backward"
    assert exit_code_for(profile) == EXIT_OK and not any("no step" in w for w in profile.warnings)


def test_backward_steps_stop_the_script_after_the_steps_asked_for(capsys):
    profile = loop("sgd", "50", steps=3, warmup=1)
    assert profile.status == "stopped" and exit_code_for(profile) == EXIT_OK
    assert [s.phase for s in profile.steps] == ["warmup", "measured", "measured", "measured"]
    assert "updates" not in capsys.readouterr().out
    assert all(s.backward_seconds > 0 for s in profile.steps)


def test_accumulated_micro_batches_are_one_step():
    profile = loop("accumulate", "6")
    assert len(profile.steps) == 5 and profile.step_source == "backward"
    # Step 1 starts at the first batch and ends at the fifth batch's backward pass.
    assert [s.batches for s in profile.steps] == [5, 4, 4, 4, 4]


def test_a_gan_with_two_optimizers_is_one_step_an_iteration():
    profile = loop("gan", "6")
    assert len(profile.steps) == 6 and profile.step_source == "optimizer"


def test_an_optimizer_whose_step_calls_its_parents_is_one_step_a_call():
    # torch hooks both classes' step(): the nested call is not a second step.
    profile = loop("subclass", "6")
    assert len(profile.steps) == 6 and profile.step_source == "optimizer"
    assert all(s.optimizer_seconds > 0 for s in profile.steps)


def test_a_gan_updated_by_hand_is_one_step_an_iteration():
    profile = loop("gan-by-hand", "6")
    assert len(profile.steps) == 5 and profile.step_source == "backward"


def test_lbfgs_closure_evaluations_are_inside_one_step(capsys):
    profile = loop("lbfgs", "6")
    out = capsys.readouterr().out
    evaluations = int(out.split("closure evaluations ")[1].split()[0])
    assert evaluations > 6  # several backward passes a step, none of them a boundary
    assert len(profile.steps) == 6 and profile.step_source == "optimizer"


class _Recorder:
    def __init__(self):
        self.optimizer: list[float] = []
        self.ends = 0

    def add_optimizer(self, seconds):
        self.optimizer.append(seconds)

    def step_end(self, source):
        self.ends += 1


@pytest.mark.parametrize("kind", ["sgd-positional", "sgd-keyword", "lbfgs"])
def test_a_closure_handed_to_the_optimizer_is_not_its_update_time(kind):
    # Seen in a review: a Lightning job (automatic optimisation hands step() a closure
    # that runs the forward and backward) was "97.4% of step time in optimizer.step()".
    import torch

    from torchaxe.runtime.steps import OptimizerStepProbe

    now = [0.0]
    recorder = _Recorder()
    probe = OptimizerStepProbe(recorder, clock=lambda: now[0])
    w = torch.zeros(3, requires_grad=True)
    if kind == "lbfgs":
        opt = torch.optim.LBFGS([w], max_iter=4)
    else:
        opt = torch.optim.SGD([w], lr=0.1)
    calls = []

    def closure():
        now[0] += 5.0  # the forward and backward take 5 s
        calls.append(1)
        opt.zero_grad()
        loss = (w - 1).pow(2).sum()
        loss.backward()
        return loss

    probe.install()
    try:
        if kind == "sgd-keyword":
            opt.step(closure=closure)
        else:
            opt.step(closure)
    finally:
        probe.uninstall()
    assert calls and recorder.optimizer[0] == pytest.approx(0.0)
    assert now[0] == pytest.approx(5.0 * len(calls))


def test_gradients_never_cleared_are_no_step_and_the_warning_says_what_to_do(tmp_path):
    source = """
import torch
w = torch.zeros(3, requires_grad=True)
for _ in range(5):
    (w - 1).pow(2).sum().backward()
"""
    profile = run_script(tmp_path, source, steps=2, warmup=0)
    assert profile.status == "completed" and not profile.steps and profile.step_source is None
    assert exit_code_for(profile) == EXIT_NO_STEPS
    warning = next(w for w in profile.warnings if w.startswith("no step was seen"))
    assert "5 backward passes were never cleared" in warning and "--step-marker" in warning
    assert "train_step" not in warning


def test_the_step_source_is_kept_in_the_profile_file(tmp_path):
    from torchaxe.runtime.profile import load_profile, save_profile

    profile = loop("nograd", "4")
    save_profile(profile, tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["step_source"] == "backward"
    assert load_profile(tmp_path / "p.json").step_source == "backward"


# ------------------------------------------------------------------ first-step timeout


def test_a_run_without_steps_is_stopped_after_the_first_step_timeout(capsys):
    started = time.monotonic()
    profile = loop("never", first_step_timeout=1.0)
    assert time.monotonic() - started < 20  # the loop itself would run for a quarter of an hour
    assert profile.status == "stopped" and not profile.steps
    assert exit_code_for(profile) == EXIT_NO_STEPS
    assert profile.detail == "stopped: no step within 1 s of the start of training (--first-step-timeout)"
    assert any("never cleared" in w for w in profile.warnings)
    assert any("give a larger --first-step-timeout" in w for w in profile.warnings)
    # The stop is not a KeyboardInterrupt, which the script catches to go on.
    assert "exiting from training early" not in capsys.readouterr().out


def test_a_first_step_still_under_way_at_the_timeout_is_not_called_a_run_without_backward(tmp_path):
    # An LBFGS step whose closures take minutes: the model was called, no step has ended yet.
    source = ("import time, torch\nmodel = torch.nn.Linear(4, 1)\nmodel(torch.randn(2, 4))\n"
              "for _ in range(200):\n    time.sleep(0.05)\n")
    profile = run_script(tmp_path, source, steps=None, warmup=0, first_step_timeout=1.0)
    assert not profile.steps
    assert not any("no backward pass ran" in w for w in profile.warnings)
    assert any("give a larger --first-step-timeout" in w for w in profile.warnings)


def test_the_first_step_timeout_stops_a_harness_off_the_main_thread():
    result = {}
    thread = threading.Thread(target=lambda: result.update(profile=loop("never", first_step_timeout=0.5)))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert result["profile"].status == "stopped" and not result["profile"].steps


def test_the_first_step_timeout_does_not_stop_slow_steps(capsys):
    # Each iteration sleeps 0.4 s: the run outlasts the timeout, its steps do not.
    profile = loop("sgd", "5", "0.4", first_step_timeout=1.0)
    assert profile.status == "completed" and len(profile.steps) == 4
    assert "updates 5" in capsys.readouterr().out


def test_first_step_timeout_must_be_positive():
    with pytest.raises(TorchaxeError, match="--first-step-timeout"):
        HarnessOptions(first_step_timeout=0)


def test_profile_cli_stops_without_steps_with_exit_6_in_one_line(tmp_path, capsys):
    from torchaxe.cli import main

    code = main(["profile", "--first-step-timeout", "1", "-o", str(tmp_path / "p.json"), "--target", "cpu", "--",
                 "python", str(LOOPS), "never"])
    assert code == EXIT_NO_STEPS
    err = capsys.readouterr().err
    assert "stopped: no step within 1 s of the start of training (--first-step-timeout)" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------ step markers


def test_a_marked_function_that_calls_itself_is_one_step_a_call():
    profile = loop("recursive", "6", step_marker="__main__:repackage")
    assert len(profile.steps) == 6 and profile.step_source == "marker"
    assert sys.gettrace() is None


def test_an_imported_marked_function_that_calls_itself_is_one_step_a_call(tmp_path):
    (tmp_path / "recursive_marker_mod.py").write_text(
        "import torch\n"
        "def repackage(h):\n"
        "    if isinstance(h, torch.Tensor):\n"
        "        return h.detach()\n"
        "    return tuple(repackage(v) for v in h)\n")
    source = """
import torch
import recursive_marker_mod
hidden = ((torch.zeros(2), torch.zeros(2)), (torch.zeros(2), torch.zeros(2)))
for _ in range(5):
    hidden = recursive_marker_mod.repackage(hidden)
"""
    profile = run_script(tmp_path, source, steps=None, warmup=0, step_marker="recursive_marker_mod:repackage")
    assert len(profile.steps) == 5 and profile.step_source == "marker"
    assert "recursive_marker_mod" not in sys.modules


def test_a_marker_replaces_the_backward_source(tmp_path):
    source = """
import torch
w = torch.zeros(3, requires_grad=True)
def log(i):
    pass
for i in range(8):
    (w - i).pow(2).sum().backward()
    with torch.no_grad():
        w -= 0.1 * w.grad
        w.grad = None
    if i % 2:
        log(i)
"""
    assert len(run_script(tmp_path, source, steps=None, warmup=0).steps) == 7
    profile = run_script(tmp_path, source, steps=None, warmup=0, step_marker="__main__:log")
    assert profile.step_source == "marker" and len(profile.steps) == 4


# ------------------------------------------------------------------ advise's message


def test_advise_says_why_no_step_was_seen_and_the_first_step_timeout():
    from torchaxe.advise.baseline import check_profile
    from torchaxe.advise.options import AdviseOptions

    profile = {"status": "stopped", "summary": {"steps_measured": 0}, "steps": [],
               "warnings": ["no step was seen: no torch.optim optimizer stepped and no backward pass ran; if one "
                            "call of a function of yours is one training step, pass --step-marker MODULE:FUNCTION "
                            "naming it"]}
    with pytest.raises(TorchaxeError) as caught:
        check_profile(profile, AdviseOptions(target="cpu"))
    message = caught.value.message
    assert message.startswith("no training step was detected within 120 s of the start of training")
    assert "no backward pass ran" in message and "--step-marker" in message and "train_step" not in message


def test_advise_says_when_the_script_stopped_in_the_step_whose_flops_it_counts():
    from torchaxe.advise.baseline import check_profile
    from torchaxe.advise.options import AdviseOptions

    def stopped_after(steps: int) -> dict:
        return {"status": "error", "summary": {"steps_measured": 0},
                "steps": [{"phase": "warmup", "seconds": 0.1}] * steps,
                "error": {"type": "RuntimeError", "file": "train.py", "line": 37, "message": "boom"}}

    with pytest.raises(TorchaxeError) as caught:
        check_profile(stopped_after(9), AdviseOptions(target="cpu", warmup=10))
    assert caught.value.message == ("the script raised RuntimeError at train.py:37: boom; it stopped in the step "
                                    "whose FLOPs torchaxe counts (the last warm-up step): if the script runs on its "
                                    "own, --no-flops leaves the counter out")
    for steps, options in ((3, AdviseOptions(target="cpu", warmup=10)),
                           (9, AdviseOptions(target="cpu", warmup=10, flops=False))):
        with pytest.raises(TorchaxeError) as caught:
            check_profile(stopped_after(steps), options)
        assert caught.value.message == "the script raised RuntimeError at train.py:37: boom"


def test_advise_takes_no_flops(monkeypatch):
    from torchaxe.advise import pipeline
    from torchaxe.cli import main

    seen = {}

    def fake(command, options=None, **kwargs):
        seen["flops"] = options.flops
        raise TorchaxeError("stop here")

    monkeypatch.setattr(pipeline, "advise", fake)
    assert main(["advise", "--no-flops", "--", "python", str(LOOPS), "sgd", "2"]) == 2
    assert seen == {"flops": False}


def test_advise_tells_a_script_with_slow_steps_to_measure_fewer():
    """Steps of seconds (an LBFGS closure): a larger budget cannot help a script whose
    run ends before the warm-up does; the error names the warm-up and step counts, and
    quotes a multi-line error's first line only."""
    from torchaxe.advise.baseline import check_profile
    from torchaxe.advise.options import AdviseOptions

    profile = {"status": "timeout", "summary": {"steps_measured": 0},
               "steps": [{"phase": "warmup", "seconds": s} for s in (4.1, 3.9, 4.0)]}
    with pytest.raises(TorchaxeError) as caught:
        check_profile(profile, AdviseOptions(target="cpu", budget=180.0))
    message = caught.value.message
    assert "give a larger --budget; its steps took 4.0 s each" in message and "--warmup 2 --steps 3" in message
    raised = {"status": "error", "error": {"type": "UnpicklingError", "file": "train.py", "line": 47,
                                           "message": "Weights only load failed.\nIn PyTorch 2.6 ...\nmore"}}
    with pytest.raises(TorchaxeError) as caught:
        check_profile(raised, AdviseOptions(target="cpu"))
    assert caught.value.message == ("the script raised UnpicklingError at train.py:47: Weights only load failed. ...")


def test_a_single_boundary_is_no_step_and_says_so(tmp_path):
    source = "import torch\nw = torch.zeros(2, requires_grad=True)\ntorch.optim.SGD([w], lr=0.1).step()\n"
    profile = run_script(tmp_path, source, steps=2, warmup=0)
    assert not profile.steps and exit_code_for(profile) == EXIT_NO_STEPS
    assert profile.warnings[0].startswith("no step was seen: the script ended at its first step boundary (optimizer)")
