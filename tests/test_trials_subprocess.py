"""Trials end to end: real subprocesses through the bootstrap on tests/scripts/trial_train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchaxe.runtime.knobs import knob_set_from_dict
from torchaxe.runtime.trials import TrialOptions, run_in_subprocess

HERE = Path(__file__).parent
SCRIPT = HERE / "scripts" / "trial_train.py"
FAKE_NPU = HERE / "scripts" / "fake_npu"


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.slow
def test_cli_interleaves_measures_ratio_and_reports_a_failing_set(tmp_path):
    base = write(tmp_path, "base.json", {})
    # 120 ms a step against a few ms: a margin that a loaded machine does not close.
    slow = write(tmp_path, "slow.json", {"env": {"SLOW_MS": "120"}})
    broken = write(tmp_path, "broken.json", {"env": {"FAIL_AT": "2"}})
    proc = subprocess.run(
        [sys.executable, "-m", "torchaxe", "trial", "--knobs", base, "--knobs", slow, "--knobs", broken,
         "--repeats", "2", "--steps", "4", "--warmup", "1", "--json", "--", "python", str(SCRIPT)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    base_r, slow_r, broken_r = report["knob_sets"]
    assert [k["name"] for k in report["knob_sets"]] == ["base", "slow", "broken"]
    assert base_r["status"] == slow_r["status"] == "ok"
    assert slow_r["ratio"]["median"] > 1.5 and len(slow_r["ratio"]["per_repeat"]) == 2
    assert slow_r["step_seconds"]["median"] >= 0.120
    assert slow_r["step_seconds"]["samples"] == 8 and len(slow_r["runs"][0]["step_seconds"]) == 4
    assert broken_r["status"] == "failed" and len(broken_r["runs"]) == 1
    assert "RuntimeError" in broken_r["error"] and "FAIL_AT reached" in broken_r["stderr_tail"]
    # progress on stderr, in interleaved order
    lines = [l for l in proc.stderr.splitlines() if l.endswith("...")]
    assert [l.split(": ")[2].split()[0] for l in lines] == ["base", "slow", "broken", "base", "slow"]


@pytest.mark.slow
def test_bootstrap_applies_every_knob(tmp_path):
    knobs = write(tmp_path, "all.json", {
        "name": "all",
        "env": {"SLOW_MS": "1"},
        "torch": {"num_threads": 1, "matmul_precision": "medium"},
        "compile": {"backend": "eager"},
        "dataloader": {"num_workers": 1, "persistent_workers": True, "prefetch_factor": 3},
        "cpu_affinity": sorted(os.sched_getaffinity(0))[:1],
        "npu": {"jit_compile": False},
    })
    out = tmp_path / "profile.json"
    log = tmp_path / "npu.log"
    env = dict(os.environ, FAKE_TORCH_NPU_LOG=str(log),
               PYTHONPATH=os.pathsep.join(filter(None, [str(FAKE_NPU), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "torchaxe.runtime.bootstrap", knobs, "--out", str(out), "--steps", "3",
         "--warmup", "1", "--target", "cpu", "--", "python", str(SCRIPT)],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "loader num_workers=1 pin_memory=False persistent_workers=True prefetch_factor=3" in proc.stdout
    assert "torch num_threads=1 matmul_precision=medium" in proc.stdout
    assert "compiled=True" in proc.stdout
    assert [json.loads(l) for l in log.read_text().splitlines()] == [
        {"call": "set_compile_mode", "kwargs": {"jit_compile": False}}]
    profile = json.loads(out.read_text())
    applied = profile["run"]["options"]["knobs"]
    # torch's own nn.Sequential: its forward is compiled (module.compile() would leave it eager).
    assert applied["compile"] == {"module": "Sequential", "modules": ["Sequential"],
                                  "kwargs": {"backend": "eager", "fullgraph": False, "dynamic": None},
                                  "compiled": "forward", "how": ["forward"]}
    assert applied["torch"] == {"matmul_precision": "medium", "num_threads": 1}
    assert applied["cpu_affinity"] == sorted(os.sched_getaffinity(0))[:1]
    assert applied["npu"] == {"jit_compile": False}
    assert profile["status"] == "stopped" and len([s for s in profile["steps"] if s["phase"] == "measured"]) == 3


@pytest.mark.slow
def test_a_run_past_its_timeout_fails(tmp_path):
    knobs = knob_set_from_dict({"name": "hang", "env": {"SLOW_MS": "3000"}}, "hang.json")
    run = run_in_subprocess(knobs, ["python", str(SCRIPT)], TrialOptions(steps=3, warmup=0, timeout=1.5), 1)
    assert not run.ok
    assert run.error.startswith("timeout")
    assert run.status == "timeout"


def test_bootstrap_refuses_bad_knobs_in_one_line(tmp_path):
    bad = write(tmp_path, "bad.json", {"cpu_affinity": "0"})
    proc = subprocess.run([sys.executable, "-m", "torchaxe.runtime.bootstrap", bad, "--", "python", str(SCRIPT)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"torchaxe bootstrap: error: {bad}: cpu_affinity: expected a non-empty list of "
                                   "CPU numbers, got string \"0\"")


def trial_run_in(folder, script):
    """One trial run of ``script`` with ``folder`` as the working folder."""
    from torchaxe.runtime.knobs import knob_set_from_dict
    from torchaxe.runtime.trials import TrialOptions, run_in_subprocess

    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return run_in_subprocess(knob_set_from_dict({"name": "a"}, "k"), ["python", str(script)],
                                 TrialOptions(steps=3, warmup=1, timeout=120), 1)
    finally:
        os.chdir(cwd)


def test_a_trial_run_leaves_the_files_the_script_writes_as_they_were(tmp_path):
    """A script that truncates its log and writes a checkpoint: after the trial run
    the log holds what it held before and the new checkpoint is gone."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "os.makedirs('runs', exist_ok=True)\n"
        "log = open('runs/log.csv', 'w')\n"
        "for step in range(20):\n"
        "    loss = model(torch.ones(4, 2)).sum()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    log.write(f'{step},{loss.item()}\\n'); log.flush()\n"
        "    if step == 1:\n"
        "        torch.save(model.state_dict(), 'runs/ckpt.pt')\n"
    )
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "log.csv").write_text("the user's real log\n" * 100)
    before = (tmp_path / "runs" / "log.csv").read_bytes()
    run = trial_run_in(tmp_path, script)
    assert run.ok, run.error
    assert (tmp_path / "runs" / "log.csv").read_bytes() == before
    assert not (tmp_path / "runs" / "ckpt.pt").exists()


def test_folders_a_trial_run_creates_are_removed_and_the_users_are_kept(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import os, pathlib, torch\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "os.makedirs('checkpoints/run1', exist_ok=True)\n"
        "os.makedirs('kept', exist_ok=True)\n"
        "pathlib.Path('logs').mkdir()\n"
        "for step in range(20):\n"
        "    loss = model(torch.ones(4, 2)).sum()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    torch.save(model.state_dict(), f'checkpoints/run1/{step}.pt')\n"
        "    open('kept/new.txt', 'w').write('x')\n"
    )
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "old.txt").write_text("the user's")
    run = trial_run_in(tmp_path, script)
    assert run.ok, run.error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "train.py"]
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["old.txt"]
