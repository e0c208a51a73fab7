"""Memory as an axis of ``torchaxe advise``: every measured change carries its peak
memory against the original's, ``--memory-limit`` holds back what does not fit (and a
combination that does not), checkpointing, expandable allocator segments and a larger
micro-batch are proposed when they apply -- with injected runs (no subprocess), and
one real advise on a tiny script."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchaxe.advise.cli import parse_size
from torchaxe.advise.measure import ArmResult
from torchaxe.errors import TorchaxeError
from torchaxe.memory.candidates import candidates as memory_candidates
from torchaxe.report.advice_html import render_advice_html
from torchaxe.report.advice_text import render_advice_text
from torchaxe.runtime.knobs import knob_set_from_dict
from torchaxe.runtime.trials import TrialRun

from test_advise import FakeRuns, advise_options_seen, run_advice, script  # noqa: F401  (fixture)

GIB = 1 << 30


def text_of(advice) -> str:
    out = io.StringIO()
    render_advice_text(advice, out, width=200)
    return out.getvalue()


def rec_of(advice, key: str):
    return next(r for r in advice.recommendations if r.key == key)


def test_every_measured_change_reports_its_peak_memory_against_the_original(script: Path) -> None:  # noqa: F811
    runs = FakeRuns(memory={"knob:compile": int(0.65 * GIB), "code:AX110": int(1.1 * GIB)})
    advice = run_advice(script, runs)
    data = json.loads(advice.to_json())
    compile_rec = next(r for r in data["recommendations"] if r["key"] == "knob:compile")
    assert compile_rec["memory"]["kind"] == "host_rss"
    assert compile_rec["memory"]["peak_bytes"] == int(0.65 * GIB)
    assert compile_rec["memory"]["original_peak_bytes"] == GIB
    assert compile_rec["memory"]["change"] == pytest.approx(-0.35, abs=1e-6)
    assert data["baseline"]["peak_memory_bytes"] == GIB and data["baseline"]["memory_kind"] == "host_rss"
    assert data["memory_limit_bytes"] is None
    assert data["combined"]["peak_memory_bytes"] == GIB and data["combined"]["memory_kind"] == "host_rss"
    text = text_of(advice)
    assert "memory" in text and "-35%" in text and "+10%" in text
    assert "original peak memory 1.0 GiB" in text
    html = render_advice_html(advice)
    assert "-35% memory" in html and 'id="peak-memory"' in html
    # No limit: nothing held back for memory, and no checkpointing tried.
    assert not any("--memory-limit" in (r.held_back or "") for r in advice.recommendations)
    assert "knob:checkpoint" not in runs.order


def test_arm_peak_is_the_highest_of_its_runs_that_went_through() -> None:
    knobs = knob_set_from_dict({"name": "x"}, "test")
    arm = ArmResult("x", knobs, runs=[
        TrialRun("x", 1, True, [0.1], peak_memory_bytes=500, memory_kind="device"),
        TrialRun("x", 2, True, [0.1], peak_memory_bytes=700, memory_kind="device"),
        TrialRun("x", 3, False, [], peak_memory_bytes=9000, memory_kind="device"),
    ])
    assert arm.peak_memory == (700, "device")
    assert ArmResult("y", knobs, runs=[TrialRun("y", 1, True, [0.1])]).peak_memory is None


def test_a_host_peak_is_the_median_of_its_runs() -> None:
    # Seen in a review: a DCGAN's original peaked at 409 MiB in most runs and 483 in one;
    # the highest made every code change look 15% lighter, which no real run showed.
    knobs = knob_set_from_dict({"name": "x"}, "test")
    mib = 1 << 20
    original = ArmResult("original", knobs, runs=[
        TrialRun("original", i, True, [0.1], peak_memory_bytes=peak * mib, memory_kind="host_rss")
        for i, peak in enumerate((409, 483, 410, 411, 408))])
    assert original.peak_memory == (410 * mib, "host_rss")


def test_a_change_within_the_runs_own_spread_of_peaks_is_marked(script: Path) -> None:  # noqa: F811
    # A process's resident set strays from run to run (a review's DCGAN: 409 to 483 MiB
    # for the same run): a change that moves the peak less than that is not told apart.
    mib = 1 << 20
    runs = FakeRuns(memory={"original": [1000 * mib, 1150 * mib, 1010 * mib],
                            "code:AX110": 960 * mib, "knob:compile": 650 * mib})
    advice = run_advice(script, runs)
    code, compiled = rec_of(advice, "code:AX110").memory, rec_of(advice, "knob:compile").memory
    assert code.noise == pytest.approx(0.15, abs=0.01) and code.within_noise and code.text.startswith("~-")
    assert not compiled.within_noise and compiled.text.startswith("-3")
    data = json.loads(advice.to_json())
    memory = next(r for r in data["recommendations"] if r["key"] == "code:AX110")["memory"]
    assert memory["within_noise"] is True and memory["noise"] == pytest.approx(code.noise)
    assert "~: no more than the runs' own peaks differ" in text_of(advice)
    # Peaks that do not stray leave every change told apart.
    steady = run_advice(script, FakeRuns(memory={"code:AX110": int(0.99 * GIB)}))
    assert not rec_of(steady, "code:AX110").memory.within_noise
    assert "~:" not in text_of(steady)


def test_a_change_above_the_memory_limit_is_held_back(script: Path) -> None:  # noqa: F811
    runs = FakeRuns(memory={"knob:compile": int(1.5 * GIB)})
    advice = run_advice(script, runs, memory_limit=int(1.2 * GIB))
    compile_rec = rec_of(advice, "knob:compile")
    assert compile_rec.status == "measured" and compile_rec.speedup == pytest.approx(2.0)
    assert not compile_rec.selected
    assert "--memory-limit" in compile_rec.held_back and "apply --only knob:compile" in compile_rec.held_back
    assert rec_of(advice, "code:AX110").selected
    assert any(n.startswith("knob:compile (2.00x) is held back") for n in advice.notes)
    # With a limit, what fits ranks before what does not, however fast.
    measured = [r.key for r in advice.ranked() if r.status == "measured"]
    assert measured.index("code:AX110") < measured.index("knob:compile")
    assert json.loads(advice.to_json())["memory_limit_bytes"] == int(1.2 * GIB)


def test_a_combination_above_the_memory_limit_is_not_chosen(script: Path) -> None:  # noqa: F811
    runs = FakeRuns(memory={"combined": int(1.4 * GIB)})
    advice = run_advice(script, runs, memory_limit=int(1.2 * GIB))
    assert "combined" in runs.order  # each fits alone, so they were measured together
    assert advice.combined["keys"] == ["knob:compile"]
    assert rec_of(advice, "knob:compile").selected and not rec_of(advice, "code:AX110").selected
    assert any("together peaked at 1.4 GiB, above --memory-limit (1.2 GiB)" in n for n in advice.notes)


def test_when_the_original_exceeds_the_limit_it_is_said_first_and_what_fits_is_ranked(script: Path) -> None:  # noqa: F811
    runs = FakeRuns(times={"knob:checkpoint": 0.13}, memory={"original": 2 * GIB, "knob:checkpoint": int(1.3 * GIB)})
    advice = run_advice(script, runs, memory_limit=int(1.5 * GIB))
    assert advice.notes[0].startswith("the original itself exceeds --memory-limit")
    assert advice.baseline["over_memory_limit"] is True
    checkpoint = rec_of(advice, "knob:checkpoint")
    assert checkpoint.status == "measured" and checkpoint.speedup < 1.0  # it costs time ...
    assert checkpoint.memory.change == pytest.approx(-0.35)  # ... for the memory it saves
    assert checkpoint.accuracy.kind == "exact"
    assert checkpoint.selected and advice.combined["keys"] == ["knob:checkpoint"]
    assert rec_of(advice, "knob:compile").held_back and not rec_of(advice, "knob:compile").selected
    assert [r.key for r in advice.ranked()][0] == "knob:checkpoint"
    lines = text_of(advice).splitlines()
    assert "the original exceeds --memory-limit" in lines[1]
    assert 'id="over-memory-limit"' in render_advice_html(advice)


def test_checkpointing_is_offered_only_with_a_memory_limit() -> None:
    profile = {"summary": {"host_rss_peak_bytes": GIB}, "steps": []}
    assert [c.key for c in memory_candidates(profile, "cpu", {})] == []
    (c,) = memory_candidates(profile, "cpu", {}, memory_limit=2 * GIB)
    assert c.key == "knob:checkpoint" and c.knobs == {"checkpoint": {"blocks": "auto"}}
    assert c.rec.accuracy.kind == "exact" and c.rec.axis == "memory"


def test_expandable_segments_only_on_cuda_and_npu_unless_already_set() -> None:
    profile = {"summary": {}, "steps": []}
    assert memory_candidates(profile, "cpu", {"env": {}}) == []
    (cuda,) = memory_candidates(profile, "cuda", {"env": {}})
    assert cuda.key == "knob:expandable-segments"
    assert cuda.knobs == {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    assert cuda.rec.accuracy.kind == "exact"
    (npu,) = memory_candidates(profile, "npu", {})
    assert npu.knobs == {"env": {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}}
    # Other allocator settings of the run are kept; one that already expands is left alone.
    (kept,) = memory_candidates(profile, "cuda", {"env": {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}})
    assert kept.knobs["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    assert memory_candidates(profile, "cuda", {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}) == []


def test_a_larger_batch_only_when_allowed_and_when_memory_allows() -> None:
    loads = {"summary": {"host_rss_peak_bytes": GIB}, "steps": [{"batches": 1}]}
    assert memory_candidates(loads, "cpu", {}) == []
    (batch,) = memory_candidates(loads, "cpu", {}, allow_batch_change=True)
    assert batch.knobs == {"dataloader": {"batch_scale": 2}} and batch.rec.changes_optimisation
    assert batch.rec.accuracy.changes_numerics  # so its training loss is compared
    notes: list[str] = []
    # The original's peak times two would not fit: not tried, and said why.
    tight = memory_candidates(loads, "cpu", {}, memory_limit=int(1.5 * GIB), allow_batch_change=True, notes=notes)
    assert [c.key for c in tight] == ["knob:checkpoint"]
    assert "times 2 is above --memory-limit" in notes[0]
    roomy = memory_candidates(loads, "cpu", {}, memory_limit=3 * GIB, allow_batch_change=True)
    assert "knob:batch-x2" in [c.key for c in roomy]
    # No DataLoader batches in the run: nothing to enlarge.
    notes.clear()
    assert memory_candidates({"summary": {}, "steps": [{"batches": 0}]}, "cpu", {}, allow_batch_change=True,
                             notes=notes) == []
    assert "DataLoader" in notes[0]


def test_a_larger_batch_is_ranked_by_samples_per_second_and_marked(script: Path) -> None:  # noqa: F811
    # Twice the samples in 1.6x the step time: 1.25x the samples per second.
    runs = FakeRuns(times={"knob:batch-x2": 0.16}, memory={"knob:batch-x2": int(1.8 * GIB)})
    advice = run_advice(script, runs, allow_batch_change=True, batches=1)
    batch = rec_of(advice, "knob:batch-x2")
    assert batch.status == "measured"
    assert batch.ratios == [pytest.approx(0.8)] * len(batch.ratios)
    assert batch.speedup == pytest.approx(1.25)
    assert batch.memory.change == pytest.approx(0.8)
    assert batch.accuracy.kind == "loss"  # the loss check applied
    data = json.loads(advice.to_json())
    entry = next(r for r in data["recommendations"] if r["key"] == "knob:batch-x2")
    assert entry["changes_optimisation"] is True
    text = text_of(advice)
    assert "changes the optimisation" in text
    assert "changes the optimisation" in render_advice_html(advice)
    if batch.selected:
        assert any("knob:batch-x2 is chosen and changes the optimisation" in n for n in advice.notes)
    # Not allowed: never tried.
    runs = FakeRuns(times={"knob:batch-x2": 0.16})
    run_advice(script, runs, batches=1)
    assert "knob:batch-x2" not in runs.order


def test_the_dataloader_knob_scales_the_batch_and_notes_it() -> None:
    import torch
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

    from torchaxe.data.knob import SPEC
    from torchaxe.runtime.knobs import AppliedKnobs

    knobs = knob_set_from_dict({"name": "b", "dataloader": {"batch_scale": 2}}, "test")
    assert knobs.to_dict()["dataloader"] == {"batch_scale": 2}
    applied = AppliedKnobs(knobs)
    data = TensorDataset(torch.arange(32.0))
    with SPEC.patch(knobs.dataloader, applied):
        assert next(iter(DataLoader(data, batch_size=4)))[0].shape == (8,)
        assert next(iter(DataLoader(data)))[0].shape == (2,)  # the default batch size, 1, doubled
        own = BatchSampler(SequentialSampler(data), batch_size=4, drop_last=False)
        assert next(iter(DataLoader(data, batch_sampler=own)))[0].shape == (4,)  # its own sampler: left alone
    assert applied.record["samples_scale"] == 2
    assert next(iter(DataLoader(data, batch_size=4)))[0].shape == (4,)  # uninstalled
    with pytest.raises(TorchaxeError, match="batch_scale"):
        knob_set_from_dict({"name": "b", "dataloader": {"batch_scale": 0}}, "test")


@pytest.mark.parametrize("text, size", [("20GiB", 20 * GIB), ("512MiB", 512 << 20), ("2e9", 2_000_000_000),
                                        ("1073741824", GIB), ("16GB", 16 * 10 ** 9), ("1.5 GiB", int(1.5 * GIB))])
def test_memory_limit_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_memory_limit_on_the_command_line(script: Path, tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: F811
    from torchaxe.cli import main

    seen = advise_options_seen(monkeypatch)
    save = ["--save", str(tmp_path / "a.json"), "-q"]
    assert main(["advise", "--memory-limit", "512MiB", "--allow-batch-change", *save, "--", "python",
                 str(script)]) == 0
    assert seen[-1].memory_limit == 512 << 20 and seen[-1].allow_batch_change
    assert main(["advise", *save, "--", "python", str(script)]) == 0
    assert seen[-1].memory_limit is None and not seen[-1].allow_batch_change
    capsys.readouterr()
    for bad in ("lots", "0", "-1GiB", "12XB"):
        assert main(["advise", "--memory-limit", bad, *save, "--", "python", str(script)]) == 2
        err = capsys.readouterr().err
        assert "--memory-limit" in err and err.count("\n") == 1 and "Traceback" not in err


TINY = '''
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range(4)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 64)
for step in range(40):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.slow
def test_real_advise_measures_checkpointing_with_its_memory(tmp_path: Path) -> None:
    """Real subprocess runs on a CPU: with --memory-limit the checkpoint knob is measured,
    its peak (host RSS) beside the original's."""
    train = tmp_path / "train.py"
    train.write_text(TINY)
    skips = [arg for key in ("code:", "env:", "installed", "knob:compile", "knob:autocast", "knob:tf32",
                             "knob:threads", "knob:bind", "knob:dataloader", "knob:cudnn", "knob:npu")
             for arg in ("--skip", key)]
    result = subprocess.run(
        [sys.executable, "-m", "torchaxe", "advise", "--budget", "2m", "--repeats", "1", "--steps", "4",
         "--warmup", "1", "--memory-limit", "64GiB", "--no-installed", *skips, "--format", "json",
         "--save", str(tmp_path / "a.json"), "-q", "--", "python", str(train)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    checkpoint = next(r for r in data["recommendations"] if r["key"] == "knob:checkpoint")
    assert checkpoint["status"] == "measured", checkpoint
    memory = checkpoint["memory"]
    assert memory["kind"] == "host_rss" and memory["peak_bytes"] > 0 and memory["original_peak_bytes"] > 0
    assert data["baseline"]["peak_memory_bytes"] == memory["original_peak_bytes"]
    assert data["memory_limit_bytes"] == 64 * GIB and not data["baseline"]["over_memory_limit"]


def test_apply_warns_that_a_larger_batch_changes_the_optimisation(script: Path, tmp_path: Path) -> None:  # noqa: F811
    from torchaxe.advise.apply import apply_advice

    advice = run_advice(script, FakeRuns(times={"knob:batch-x2": 0.16}), allow_batch_change=True, batches=1)
    result = apply_advice(json.loads(advice.to_json()), keys=["knob:batch-x2"], write=False)
    assert result.changes_optimisation == ["knob:batch-x2"]
    assert result.knobs == {"dataloader": {"batch_scale": 2}}
