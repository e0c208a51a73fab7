"""Each axis proposes its own candidates; advise collects them in a fixed order."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torchaxe
from torchaxe.advise.candidates import knob_candidates
from torchaxe.bind import candidates as bind
from torchaxe.data import candidates as data
from torchaxe.data.tuning import estimate_workers
from torchaxe.memory import candidates as memory
from torchaxe.precision import candidates as precision
from torchaxe.shapes import candidates as shapes

PACKAGE = Path(torchaxe.__file__).parent
WAITING = {"shapes": {"static": True}, "summary": {"data_wait_fraction": 0.3}}


@pytest.mark.parametrize("target", ["cpu", "cuda", "npu"])
def test_advise_lists_what_each_axis_proposes_in_a_fixed_order(target: str) -> None:
    settings = {"allowed_cpus": 8, "num_threads": 2}
    expected = [c.key for axis in (shapes, precision, bind, data, memory)
                for c in axis.candidates(WAITING, target, settings)]
    assert [c.key for c in knob_candidates(target, WAITING, settings)] == expected
    # The memory axis comes last: allocator settings on a device, nothing on the cpu
    # without a memory limit.
    axes = expected[:-1] if target in ("cuda", "npu") else expected
    assert axes[-1] == "knob:dataloader" and axes[-2] == "knob:bind"
    assert (expected[-1] == "knob:expandable-segments") == (target in ("cuda", "npu"))


@pytest.mark.parametrize("cores", [1, 2, 6, 16])
def test_the_loader_candidate_uses_the_data_axis_worker_estimate(cores: int) -> None:
    (loader,) = data.candidates(WAITING, "cpu", {"allowed_cpus": cores})
    assert loader.knobs["dataloader"]["num_workers"] == estimate_workers(None, None, cores)


def test_the_loader_candidate_never_asks_for_more_workers_than_usable_cpus(monkeypatch) -> None:
    import os

    # Loading a batch takes 40x the compute: the estimate alone would ask for 40 workers.
    slow = {"summary": {"data_wait_fraction": 0.9, "data_wait_seconds_median": 0.41, "step_seconds_median": 0.42}}
    (loader,) = data.candidates(slow, "cuda", {"allowed_cpus": 2})
    assert loader.knobs["dataloader"]["num_workers"] == 2
    # Without the run's figure: this process's affinity, not the machine's count.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    (loader,) = data.candidates(slow, "cuda", {})
    assert loader.knobs["dataloader"]["num_workers"] == 2 and "num_workers=2" in loader.rec.title


def test_shapes_try_and_advise_share_the_npu_compile_mode() -> None:
    static = {c.key: c.knobs for c in shapes.candidates({"shapes": {"static": True}}, "npu", {})}
    tried = {s["name"]: s for s in shapes.trial_settings("npu")}
    assert static["knob:npu-jit-on"] == {"npu": tried["jit-compile-on"]["npu"]}


def test_no_axis_package_imports_advise() -> None:
    for folder in ("shapes", "data", "bind", "tune", "precision", "environment", "runtime"):
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    assert not node.module.startswith("torchaxe.advise"), f"{path} imports {node.module}"


def _batches(*sizes: int) -> dict:
    return {"static": True, "batches": {"signatures": [{"shapes": [[n, 8], [n]], "dtypes": ["float32", "int64"],
                                                        "count": 3} for n in sizes]}}


def test_compile_is_static_when_the_epochs_smaller_last_batch_came_after_the_steps_watched() -> None:
    from torchaxe.kernels import candidates as kernels

    epoch = {"site": "train.py:9", "batch_size": 64, "samples": 1000, "drop_last": False, "last_batch_samples": 40}
    profile = {**WAITING, "shapes": _batches(64), "ops": [{"name": "aten::bernoulli_", "self_seconds": 1.0}]}
    (compiled,) = [c for c in shapes.candidates(profile, "cpu", {"loader_epochs": [epoch]}) if c.key == "knob:compile"]
    assert compiled.knobs == {"compile": {"mode": "default", "dynamic": False}}
    assert "last batch of 40" in compiled.rec.title and "drop_last=True" in compiled.rec.detail
    # The last batch was among the steps watched (the shapes then vary), or the loader
    # drops it, or no loader was noted: the compile candidate is the plain one.
    for seen, epochs in ((_batches(64, 40), [epoch]), (_batches(64), [{**epoch, "last_batch_samples": None}]),
                         (_batches(64), [])):
        (plain,) = [c for c in shapes.candidates({**WAITING, "shapes": seen}, "cpu", {"loader_epochs": epochs})
                    if c.key == "knob:compile"]
        assert plain.knobs == {"compile": {"mode": "default"}}
    # The last batch among the steps watched, and all that varied (a review's 13-batch
    # epoch got dynamic=True where a 63-batch epoch got dynamic=False): the same choice.
    varied = {**_batches(64, 40), "static": False, "modules": [{"name": "Net", "dynamic": True, "step_sets": 2}]}
    found = {c.key: c for c in shapes.candidates({**WAITING, "shapes": varied}, "cpu", {"loader_epochs": [epoch]})}
    assert "knob:compile-dynamic" not in found
    assert found["knob:compile"].knobs == {"compile": {"mode": "default", "dynamic": False}}
    assert "reached within the steps profiled" in found["knob:compile"].rec.detail
    # Shapes that vary otherwise too (a module with more sets of shapes): dynamic.
    busy = {**varied, "modules": [{"name": "Net", "dynamic": True, "step_sets": 5}]}
    assert "knob:compile-dynamic" in {c.key for c in shapes.candidates({**WAITING, "shapes": busy}, "cpu",
                                                                        {"loader_epochs": [epoch]})}
    # Another loader's batch size (an evaluation loader): not the training batches.
    assert shapes.unseen_last_batch({"shapes": _batches(64)}, {"loader_epochs": [{**epoch, "batch_size": 32}]}) is None
    # A validation loader of the training batch size whose smaller epoch ends short,
    # beside a training loader of full batches (ImageNet's example): nothing to say.
    train = {"batch_size": 64, "samples": 6400, "drop_last": False, "last_batch_samples": None}
    val = {"batch_size": 64, "samples": 200, "drop_last": False, "last_batch_samples": 8}
    assert shapes.unseen_last_batch({"shapes": _batches(64)}, {"loader_epochs": [train, val]}) is None
    assert shapes.unseen_last_batch({"shapes": _batches(64)}, {"loader_epochs": [val]}) == val
    # The compile of the dropout axis follows the same rule.
    packed = [c for c in kernels.candidates(profile, "cpu", {"loader_epochs": [epoch]})
              if c.key == "knob:compile-dropout-packed"]
    assert packed and packed[0].knobs["compile"] == {"mode": "default", "dynamic": False}


def test_compiling_a_recurrent_model_with_varying_shapes_is_measured_last() -> None:
    """The shapes verdict says keep eager there: advise still measures the compile
    modes, after every other change (the budget's order), and says why."""
    def profile(static: bool, layer: str) -> dict:
        return {"shapes": {"static": static, "modules": [
            {"name": "Classifier", "type": "Classifier", "signatures": []},
            {"name": "Classifier.rnn", "type": layer, "signatures": []}]}}

    varying = shapes.candidates(profile(False, "GRU"), "cpu", {})
    assert {c.key for c in varying} == {"knob:compile-dynamic"}
    assert all(c.priority < 1.0 for c in varying)
    assert all("recurrent layers (GRU)" in c.rec.detail for c in varying)
    # Static shapes, or no recurrent layer: compile comes first as before.
    assert all(c.priority >= 2.0 for c in shapes.candidates(profile(True, "LSTM"), "cpu", {}))
    assert all(c.priority >= 1.9 for c in shapes.candidates(profile(False, "Linear"), "cpu", {}))
