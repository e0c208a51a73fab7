"""torchaxe on training scripts written with the frameworks people train with: the
Hugging Face ``Trainer``, a plain loop over a ``transformers`` model, the Lightning
``Trainer``, ``accelerate`` with gradient accumulation, a loop with SGD written by hand
(no ``torch.optim``) and a model that trains with dropout.

The scripts are in tests/scripts/frameworks/ (random weights from configs, synthetic
data, nothing downloaded). Each prints ``step N: loss X, time Y ms`` per optimizer
step, which the checks compare with what torchaxe measured. The framework packages
come with the ``frameworks`` extra (``pip install -e .[test,frameworks]``); without
them these tests skip.

Every test starts real processes, and the framework imports alone take seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts" / "frameworks"
STEP_LINE = re.compile(r"^step (\d+): loss (\S+), time ([0-9.]+) ms$", re.MULTILINE)

#: script -> the packages it imports
SCRIPT_NEEDS = {
    "hf_trainer": ("transformers", "accelerate"),
    "hf_custom_loop": ("transformers",),
    "lightning_trainer": ("lightning",),
    "accelerate_accumulation": ("accelerate",),
    "manual_sgd": (),
    "dropout_gpt": (),
}
#: micro-batches per optimizer step (accelerate_accumulation.py's --accumulate)
ACCUMULATE = 4


def needs(name: str) -> None:
    for package in SCRIPT_NEEDS[name]:
        pytest.importorskip(package, reason=f"{package} is not installed (pip install -e .[frameworks])")


def torchaxe(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHAXE_HOME": str(cwd / "home"),
           # One intra-op thread: the suite runs several processes on a few cores.
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           # No telemetry, hub look-ups or tokenizer thread pools from the frameworks.
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "torchaxe", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def copy_script(name: str, tmp_path: Path) -> Path:
    """The script alone in a folder of its own (advise scans the script's folder)."""
    folder = tmp_path / "project"
    folder.mkdir()
    return Path(shutil.copy(SCRIPTS / f"{name}.py", folder / f"{name}.py"))


def logged_steps(stdout: str) -> list[tuple[int, float, float]]:
    """(step, loss, milliseconds) of every step line the script printed."""
    return [(int(n), float(loss), float(ms)) for n, loss, ms in STEP_LINE.findall(stdout)]


@pytest.mark.parametrize("name", list(SCRIPT_NEEDS))
def test_profile_sees_the_scripts_own_steps(name: str, tmp_path: Path) -> None:
    """The steps torchaxe counts are the script's optimizer steps (one per `step N` line,
    an accumulation of micro-batches included), and their times agree with the
    script's own clock."""
    needs(name)
    script = copy_script(name, tmp_path)
    out = tmp_path / "profile.json"
    result = torchaxe("profile", "--steps", "4", "--warmup", "1", "--target", "cpu", "--timeout", "300",
                      "-o", str(out), "--", "python", str(script), "--steps", "60", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    profile = json.loads(out.read_text())
    assert profile["status"] == "stopped", profile["detail"]
    summary = profile["summary"]
    assert summary["steps_measured"] == 4 and summary["steps_total"] == 5, summary
    logged = logged_steps(result.stdout)
    # The run is stopped at the end of its fifth step, before or after the script logs it.
    assert [n for n, _, _ in logged] in (list(range(1, 5)), list(range(1, 6))), result.stdout
    # Same steps, two clocks: the script's own step time and torchaxe's agree within 2x
    # (a step boundary at every micro-batch or every other step would be 4x or 2x off).
    own = statistics.median(ms for n, _, ms in logged if n >= 2) / 1e3
    ratio = summary["step_seconds_median"] / own
    assert 0.5 < ratio < 2.0, (summary["step_seconds_median"], own, result.stdout)
    if name == "accelerate_accumulation":
        assert [s["batches"] for s in profile["steps"][1:]] == [ACCUMULATE] * 4, profile["steps"]


@pytest.mark.parametrize("name", list(SCRIPT_NEEDS))
def test_short_advise_measures_the_changes_it_proposes(name: str, tmp_path: Path) -> None:
    """A short advise ends with advice in which at least one change was measured against
    the original and none failed; either some are chosen or the advice says that
    nothing was faster.

    Kept cheap: one round, two steps a run, no compile, packed dropout or mixed
    precision (each measured in tests of its own; on a CPU with native bfloat16, mixed
    precision would earn extra rounds here), no environment variables (a promising
    change earns extra rounds, at most five). Every run starts the framework afresh, so
    a run takes seconds; on a heavily loaded machine the budget can end before the first
    change is measured, and then this test fails saying so. The formula fixes (AX1xx)
    are left out, the other code fixes kept: they and the run-time formula replacement
    of an installed package (`knob:replace-*`, GPT-2's GELU in the HF Trainer script)
    are these scripts' cheap changes (a fused optimizer, a faster zero_grad). The
    hand-written SGD loop has none, so its thread setting is measured instead."""
    needs(name)
    code = "code:AX1"
    env = "env:NONE" if name == "manual_sgd" else "env:"
    script = copy_script(name, tmp_path)
    saved = tmp_path / "advice.json"
    result = torchaxe("advise", "--budget", "3m", "--repeats", "1", "--steps", "2", "--warmup", "1",
                      "--target", "cpu", "--skip", "knob:compile", "--skip", "knob:dropout", "--skip", "knob:autocast",
                      "--skip", env, "--skip", code,
                      "--format", "json", "--save", str(saved), "--", "python", str(script), "--steps", "100",
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    advice = json.loads(result.stdout)
    assert advice["schema"] == "torchaxe.advice/1"
    recs = advice["recommendations"]
    failed = [(r["key"], r.get("error")) for r in recs if r["status"] == "failed"]
    assert not failed, failed
    measured = [r for r in recs if r["status"] == "measured"]
    assert measured, ("nothing measured" + (" (the budget ran out)" if advice["partial"] else ""),
                      advice["notes"], [(r["key"], r["status"]) for r in recs if r["status"] != "advice"])
    assert all(r["speedup"] and r["ratios"] for r in measured), measured
    if not any(r["selected"] for r in recs):
        assert any(n.startswith("no change saved") for n in advice["notes"]), advice["notes"]
    assert json.loads(saved.read_text())["schema"] == "torchaxe.advice/1"
    assert script.read_text() == (SCRIPTS / script.name).read_text()  # measured, never applied


def test_tune_compiles_a_model_that_trains_with_dropout(tmp_path: Path) -> None:
    """Dropout's random masks are not a numerical difference: torch.compile (inductor)
    passes the check against eager for the whole model and each of its parts, and wins
    wherever it measured faster by --min-gain."""
    script = copy_script("dropout_gpt", tmp_path)
    result = torchaxe("tune", "--strategies", "eager,compile", "--repeats", "3", "--target", "cpu", "--json",
                      "--", "python", str(script), "--steps", "20", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == "torchaxe.tune/1" and report["subgraphs"], report
    for subgraph in report["subgraphs"]:
        by_strategy = {m["strategy"]: m for m in subgraph["measured"]}
        compiled, eager = by_strategy["compile"], by_strategy["eager"]
        assert compiled["status"] == "ok", (subgraph["module"], subgraph["names"], compiled["message"])
        if compiled["median"] < eager["median"] * (1 - 0.05):
            assert subgraph["winner"] == "compile", subgraph
    whole = next(s for s in report["subgraphs"] if s["names"] == ["GPT"])
    assert whole["status"] == "tuned"
