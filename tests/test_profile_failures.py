"""However the user's script ends, the harness returns a Profile of what was measured
with a status saying how it ended, and leaves the interpreter as it found it."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from profile_support import PRELUDE, line_of, run_script, write_script
from torchaxe.runtime.harness import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SCRIPT_ERROR,
    EXIT_SCRIPT_EXIT,
    EXIT_TIMEOUT,
    Harness,
    HarnessOptions,
    exit_code_for,
)
from torchaxe.runtime.command import parse_command


def test_script_raising_is_an_error_with_the_users_traceback(tmp_path):
    source = PRELUDE + """
def check(i):
    if i == 3:
        raise ValueError(f"bad batch {i}")   # RAISE
for i in range(10):
    step()
    check(i)
"""
    path = write_script(tmp_path, source)
    profile = Harness(HarnessOptions(steps=10, warmup=1, target="cpu")).run(parse_command(["python", str(path)]))
    assert profile.status == "error" and exit_code_for(profile) == EXIT_SCRIPT_ERROR
    assert len(profile.steps) == 4  # what was measured before the error is kept
    error = profile.error
    assert error.type == "ValueError" and error.message == "bad batch 3"
    assert error.file == str(path) and error.line == line_of(path, "RAISE")
    assert error.traceback.startswith("Traceback (most recent call last):")
    assert str(path) in error.traceback and "ValueError: bad batch 3" in error.traceback
    assert "torchaxe" not in error.traceback and "runpy" not in error.traceback
    assert "raised ValueError at" in profile.detail


def test_error_from_torch_points_at_the_users_line(tmp_path):
    source = PRELUDE + """
step()
model(torch.ones(2, 5))                      # SHAPES
"""
    path = write_script(tmp_path, source)
    profile = run_script(tmp_path, source, steps=3)
    assert profile.status == "error" and profile.error.type == "RuntimeError"
    assert profile.error.line == line_of(path, "SHAPES")
    assert "torch/nn" in profile.error.traceback  # torch's frames stay: they are part of the story


def test_an_error_raised_through_a_change_under_trial_shows_its_frame(tmp_path):
    # The float32-attention knob wraps torch's fused attention: a failure inside names
    # that wrapper, so that the user can tell the change's failure from their own.
    from torchaxe.runtime import bootstrap, knob_specs
    from torchaxe.runtime.knobs import knob_set_from_dict

    source = PRELUDE + """
import torch.nn.functional as F
step()
with torch.autocast("cpu", dtype=torch.bfloat16):
    q = torch.randn(1, 2, 4, 8)
    F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(3, 3))   # ATTN
"""
    knobs = knob_set_from_dict({"name": "k", "autocast": {"dtype": "bfloat16", "attention": "float32"}}, "test")
    patch = knob_specs.AttentionInFloat32(bootstrap.AppliedKnobs(knobs)).install()
    try:
        profile = run_script(tmp_path, source, steps=3)
    finally:
        patch.uninstall()
    path = tmp_path / "train.py"
    assert profile.status == "error" and profile.error.line == line_of(path, "ATTN")
    assert "knob_specs.py" in profile.error.traceback and "harness.py" not in profile.error.traceback
    assert profile.error.through.startswith("attention (torchaxe/runtime/knob_specs.py:")
    assert "through torchaxe's attention (torchaxe/runtime/knob_specs.py:" in profile.detail
    assert type(profile.error).from_dict(profile.error.to_dict()) == profile.error
    # Without the change, no torchaxe frame and nothing said of one.
    profile = run_script(tmp_path, source, steps=3)
    assert profile.error.through is None and "torchaxe" not in profile.error.traceback


def test_an_error_in_a_backward_pass_is_not_blamed_on_the_loss_recorder(tmp_path):
    # Seen in a review: a compile failure in the backward pass was said to come "through
    # torchaxe's backward (a change under trial)": the loss recorder only observes.
    from torchaxe.runtime import bootstrap, knob_specs
    from torchaxe.runtime.knobs import knob_set_from_dict

    source = PRELUDE + """
import operator
step()
w = torch.ones(1, requires_grad=True)
w.register_hook(operator.methodcaller("no_such_method"))  # raises inside torch's backward, not in this file
(w * 2).sum().backward()   # BACKWARD
"""
    recorder = knob_specs.LossRecorder(bootstrap.AppliedKnobs(knob_set_from_dict({"name": "k"}, "test")))
    recorder.install()
    try:
        profile = run_script(tmp_path, source, steps=3)
    finally:
        recorder.uninstall()
    assert profile.status == "error" and profile.error.line == line_of(tmp_path / "train.py", "BACKWARD")
    assert profile.error.through is None and "through torchaxe" not in profile.detail
    assert "knob_specs" not in profile.error.traceback


@pytest.mark.parametrize("call, code, exit_code, message", [
    ("sys.exit(3)", 3, EXIT_SCRIPT_EXIT, None),
    ("sys.exit(0)", 0, EXIT_OK, None),
    ("sys.exit()", 0, EXIT_OK, None),
    ("sys.exit('out of data')", 1, EXIT_SCRIPT_EXIT, "out of data"),
])
def test_sys_exit_is_exited_with_its_code(tmp_path, call, code, exit_code, message):
    source = PRELUDE + f"for _ in range(3):\n    step()\n{call}\n"
    profile = run_script(tmp_path, source, steps=10, warmup=0)
    assert profile.status == "exited" and profile.exit_code == code
    assert exit_code_for(profile) == exit_code
    assert len(profile.steps) == 3
    assert f"sys.exit({code})" in profile.detail
    if message:
        assert message in profile.detail


def test_argparse_error_in_the_script_is_an_exit(tmp_path, capsys):
    source = "import argparse\nargparse.ArgumentParser().parse_args()\n"
    profile = run_script(tmp_path, source, "--no-such-flag")
    assert profile.status == "exited" and profile.exit_code == 2
    assert exit_code_for(profile) == EXIT_SCRIPT_EXIT
    assert "unrecognized arguments" in capsys.readouterr().err
    # It stopped before training: no step marker would have helped, so none is suggested.
    assert profile.warnings == ["no step was seen: the script exited before any backward pass (see above)"]


def test_a_script_failing_at_import_is_not_told_to_pass_a_step_marker(tmp_path):
    profile = run_script(tmp_path, "import torch\nimport no_such_module_here\n")
    assert profile.status == "error"
    assert profile.warnings == ["no step was seen: the script raised before any backward pass (see above)"]


def test_timeout_stops_a_hanging_script(tmp_path):
    source = PRELUDE + "import time\nfor _ in range(3):\n    step()\ntime.sleep(60)\n"
    started = time.monotonic()
    profile = run_script(tmp_path, source, steps=10, warmup=0, timeout=1.0)
    assert time.monotonic() - started < 20
    assert profile.status == "timeout" and exit_code_for(profile) == EXIT_TIMEOUT
    assert len(profile.steps) == 3
    assert "--timeout 1 s" in profile.detail
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_timeout_stops_a_busy_loop(tmp_path):
    source = PRELUDE + "step()\nstep()\nwhile True:\n    pass\n"
    profile = run_script(tmp_path, source, steps=10, warmup=0, timeout=0.5)
    assert profile.status == "timeout" and len(profile.steps) == 2


def test_a_timeout_that_does_not_fire_changes_nothing(tmp_path):
    profile = run_script(tmp_path, PRELUDE + "for _ in range(3):\n    step()\n", steps=2, warmup=0, timeout=30)
    assert profile.status == "stopped"
    assert not [t for t in threading.enumerate() if t.name == "torchaxe-watchdog" and t.is_alive()]


def test_a_script_that_ignores_the_timeout_is_abandoned_with_a_profile(tmp_path, monkeypatch):
    leave = threading.Event()
    monkeypatch.setitem(sys.modules, "torchaxe_test_leave", leave)
    source = PRELUDE + """
import time
import torchaxe_test_leave as leave
step(); step()
while not leave.is_set():
    try:
        time.sleep(0.05)
    except KeyboardInterrupt:
        pass                      # a script that will not stop
"""
    abandoned = []

    def abandon(profile):
        # The CLI writes this profile and exits the process; here the test records
        # it and lets the script go.
        abandoned.append(profile)
        leave.set()

    path = write_script(tmp_path, source)
    harness = Harness(HarnessOptions(steps=10, warmup=0, timeout=0.5, grace=0.5, target="cpu"), abandon=abandon)
    profile = harness.run(parse_command(["python", str(path)]))
    [taken] = abandoned
    assert taken.status == "timeout" and len(taken.steps) == 2
    assert "did not stop within 0.5 s of the timeout" in taken.detail
    assert exit_code_for(taken) == EXIT_TIMEOUT
    assert profile.status == "timeout"


def test_ctrl_c_is_interrupted(tmp_path):
    source = PRELUDE + """
import os, signal
for i in range(10):
    step()
    if i == 2:
        os.kill(os.getpid(), signal.SIGINT)   # as if the user pressed Ctrl-C
"""
    profile = run_script(tmp_path, source, steps=10, warmup=0)
    assert profile.status == "interrupted" and exit_code_for(profile) == EXIT_INTERRUPTED
    assert len(profile.steps) == 3
    assert profile.detail.startswith("interrupted")


def test_a_swallowed_stop_is_raised_again(tmp_path):
    source = PRELUDE + """
done = 0
for _ in range(10):
    try:
        step()
    except BaseException:
        pass                                   # swallows everything, even the stop
    done += 1
with open(sys.argv[1], "w") as fh:
    fh.write(str(done))
"""
    out = tmp_path / "done.txt"
    profile = run_script(tmp_path, source, str(out), steps=2, warmup=1)
    assert out.read_text() == "10"
    assert profile.status == "stopped" and len(profile.steps) == 3
    assert "caught the stop and went on" in profile.detail
    assert exit_code_for(profile) == EXIT_OK


def test_except_exception_does_not_swallow_the_stop(tmp_path):
    source = PRELUDE + """
reached = []
for _ in range(10):
    try:
        step()
    except Exception:
        reached.append("caught")
assert False, "not reached"
"""
    profile = run_script(tmp_path, source, steps=2, warmup=0)
    assert profile.status == "stopped" and len(profile.steps) == 2


def test_stop_closes_dataloader_workers(tmp_path):
    import multiprocessing

    source = PRELUDE + """
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.ones(64, 4)), batch_size=2, num_workers=2)
for (batch,) in loader:
    loss = model(batch).sum()
    opt.zero_grad(); loss.backward(); opt.step()
"""
    before = set(multiprocessing.active_children())
    profile = run_script(tmp_path, source, steps=2, warmup=1)
    assert profile.status == "stopped"
    deadline = time.monotonic() + 10
    while set(multiprocessing.active_children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(multiprocessing.active_children()) - before


def test_stopped_workers_of_a_loader_kept_by_an_object_end_at_once(tmp_path):
    """An iterator kept in an object (an infinite loader, as makemore's) is collected
    once the run stops: its workers end then, not after torch's 5 s join timeout per
    worker, and torch's child-signal check does not take that for a crash."""
    import multiprocessing

    source = PRELUDE + """
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
class Infinite:
    def __init__(self, ds):
        sampler = RandomSampler(ds, replacement=True, num_samples=10 ** 9)
        self.it = iter(DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2))
batches = Infinite(TensorDataset(torch.ones(64, 4)))
while True:
    (batch,) = next(batches.it)
    loss = model(batch).sum()
    opt.zero_grad(); loss.backward(); opt.step()
"""
    before = set(multiprocessing.active_children())
    started = time.monotonic()
    profile = run_script(tmp_path, source, steps=2, warmup=1)
    assert profile.status == "stopped" and profile.error is None
    assert not set(multiprocessing.active_children()) - before
    assert time.monotonic() - started < 8.0  # two workers joined with a timeout would take 10 s more


def test_training_in_child_processes_is_said_to_be_unwatched(tmp_path):
    """Hogwild: the script trains in processes it starts; no step in the watched
    process, and the warning says why instead of suggesting a step marker."""
    source = """
import multiprocessing

def train(rank):
    pass  # (the training, out of the harness's sight)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=train, args=(r,)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
"""
    profile = run_script(tmp_path, source, steps=2, warmup=0)
    assert not profile.steps
    warning = next(w for w in profile.warnings if w.startswith("no step was seen"))
    assert "started 2 process(es) (train)" in warning and "--step-marker" not in warning


def test_interpreter_state_is_restored_after_every_ending(tmp_path):
    import torch

    argv, path = sys.argv[:], sys.path[:]
    for body in ("raise KeyError('k')", "sys.exit(5)", "import os, signal; os.kill(os.getpid(), signal.SIGINT)"):
        run_script(tmp_path, PRELUDE + f"step()\n{body}\n", steps=5)
        assert sys.argv == argv and sys.path == path
        assert "item" not in torch.Tensor.__dict__
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
