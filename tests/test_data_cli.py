"""`torchaxe data` end to end, in subprocesses: a data-bound script, a __getitem__ that
raises, a loader that hangs, tuning stored in the knowledge base, usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "data_train.py"

pytestmark = pytest.mark.slow


def _line_of(text: str) -> int:
    return next(n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line)


def _run(args, tmp_path, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHAXE_HOME=str(tmp_path / "home"))
    return subprocess.run([sys.executable, "-m", "torchaxe", "data", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=timeout)


def test_a_data_bound_script_gets_a_verdict_and_the_static_finding_joined(tmp_path):
    proc = _run(["--steps", "4", "--warmup", "1", "--samples", "4", "--format", "json", "--out", "r.json", "--",
                 "python", str(SCRIPT), "--sample-ms", "8", "--compute-ms", "1"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)  # stdout is the report only: the script's prints went to stderr
    assert report == json.loads((tmp_path / "r.json").read_text())
    assert report["schema"] == "torchaxe.data/1" and report["status"] == "stopped"
    assert report["verdict"]["level"] == "data-bound" and report["summary"]["data_wait_fraction"] > 0.1
    assert any("num_workers=0" in r for r in report["verdict"]["reasons"])
    assert report["summary"]["steps_measured"] == 4 and len(report["steps"]) == 4
    for step in report["steps"]:
        assert step["compute_seconds"] == pytest.approx(step["seconds"] - step["data_wait_seconds"])
    [loader] = report["loaders"]
    line = _line_of("loader = DataLoader(")
    assert loader["site"].endswith(f"data_train.py:{line}") and loader["settings"]["num_workers"] == 0
    assert loader["stages"]["samples"] == 4 and loader["stages"]["per_sample_seconds"] >= 0.008
    [finding] = [f for f in report["findings"] if f["code"] == "AX401"]
    assert finding["loader"] == 0
    assert finding["message"].startswith("DataLoader at ")
    assert f"data_train.py:{line} has num_workers=0; measured data wait " in finding["message"]
    assert report["estimate"]["workers"] >= 1 and report["copies"]["applicable"] is False


def test_text_report_and_a_getitem_that_raises(tmp_path):
    proc = _run(["--steps", "3", "--warmup", "0", "--samples", "8", "--no-scan", "--",
                 "python", str(SCRIPT), "--samples", "8", "--batch-size", "2", "--bad-index", "5"], tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "ValueError: sample 5 is corrupt" in proc.stderr  # the user's traceback, briefly
    assert "torchaxe: error" not in proc.stderr and "Traceback" in proc.stderr
    out = proc.stdout
    assert "run         error: the script raised ValueError" in out
    raise_line = _line_of("raise ValueError")
    assert "error: dataset[5] raised ValueError at " in out and f"data_train.py:{raise_line}: sample 5 is corrupt" in out
    assert "loader 0 (SlowSamples): 7 samples" in out  # the other samples were still timed


def test_a_hung_loader_is_stopped_by_the_timeout(tmp_path):
    # The timeout leaves a busy machine time to start the script (torch's import alone
    # can take seconds there) before the loader hangs.
    proc = _run(["--steps", "50", "--timeout", "12", "--samples", "8", "--sample-timeout", "1", "--no-scan",
                 "--format", "json", "--", "python", str(SCRIPT), "--samples", "8", "--batch-size", "2",
                 "--hang-index", "6"], tmp_path)
    assert proc.returncode == 5, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "timeout" and "--timeout 12" in report["error"]
    stages = report["loaders"][0]["stages"]
    assert "did not return within 1 s" in stages["hung"]


def test_tuning_searches_and_stores_the_best_setting(tmp_path):
    command = ["python", str(SCRIPT), "--sample-ms", "6", "--compute-ms", "4"]
    proc = _run(["--steps", "3", "--warmup", "1", "--samples", "2", "--no-decoders", "--tune", "--max-trials", "3",
                 "--trial-steps", "3", "--trial-warmup", "1", "--format", "json", "--", *command], tmp_path, timeout=400)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    tuning = report["tuning"]
    assert tuning["mode"] == "search" and tuning["trials"] == 3
    assert tuning["results"][0]["label"] == "as written" and tuning["results"][0]["ok"]
    assert tuning["results"][1]["point"]["num_workers"] >= 1 and tuning["results"][1]["point"]["persistent_workers"]
    assert "torchaxe data: trial 1: as written" in proc.stderr
    stored = report["stored"]
    assert stored["kind"] == "dataloader" and stored["setting"] == tuning["best"]["point"]
    from torchaxe.data.tuning import stored_loader_knobs

    found = stored_loader_knobs(command, kb_path=str(tmp_path / "home" / "kb.sqlite"), cwd=str(tmp_path))
    assert (found or {}).get("dataloader", {}) == stored["setting"]
    if stored["setting"]:
        [finding] = [f for f in report["findings"] if f["code"] == "AX401"]
        assert f"; with {tuning['best']['label']} measured " in finding["message"]


@pytest.mark.parametrize("args, message", [
    (["--grid", "--", "python", str(SCRIPT)], "--grid needs --tune"),
    (["--", "python", "no_such_script.py"], "script not found: no_such_script.py"),
    (["--images", "nowhere", "--", "python", str(SCRIPT)], "--images nowhere: no such file or folder"),
])
def test_usage_errors_are_one_line(tmp_path, args, message):
    proc = _run(args, tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"torchaxe: error: {message}"
