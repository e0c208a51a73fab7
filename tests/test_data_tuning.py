"""The loader search and grid against a model of a training script (no subprocess), the
knob it produces, and storing the result in the knowledge base."""

from __future__ import annotations

import random

import pytest

from torchaxe.data import tuning
from torchaxe.data.tuning import LoaderPoint, LoaderTuner, TuneOptions, estimate_workers, store_best, stored_loader_knobs
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.knobs import knob_set_from_dict
from torchaxe.runtime.trials import TrialRun


class ModelScript:
    """A script whose steps compute ``compute`` seconds and whose loader needs ``load``
    seconds per batch per worker; workers restart every ``epoch`` steps unless
    persistent (``startup`` seconds); workers beyond the spare cores slow compute."""

    def __init__(self, load=0.040, compute=0.020, cores=4, startup=0.05, epoch=4, as_written=None, noise=0.02,
                 seed=0, broken=()):
        self.load, self.compute, self.cores, self.startup, self.epoch = load, compute, cores, startup, epoch
        self.as_written = as_written or LoaderPoint(0, None, None, False, None)
        self.noise = noise
        self.rng = random.Random(seed)
        self.calls: list[LoaderPoint] = []
        self.broken = broken

    def effective(self, point: LoaderPoint) -> LoaderPoint:
        base = self.as_written
        return LoaderPoint(*(getattr(point, f) if getattr(point, f) is not None else getattr(base, f)
                             for f in ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory",
                                       "start_method")))

    def step(self, point: LoaderPoint) -> tuple[float, float]:
        p = self.effective(point)
        w = p.num_workers or 0
        compute = self.compute * max(1.0, (w + 1) / self.cores)
        if w == 0:
            wait = self.load
        else:
            wait = max(0.0, self.load / w - compute * (1.0 + 0.1 * ((p.prefetch_factor or 2) - 2)))
            if not p.persistent_workers:
                wait += (self.startup * (3 if p.start_method == "spawn" else 1)) / self.epoch
        return compute + wait, wait

    def __call__(self, point: LoaderPoint, repeats: int) -> list[TrialRun]:
        self.calls.append(point)
        runs = []
        for r in range(repeats):
            if self.effective(point).start_method in self.broken:
                runs.append(TrialRun("x", r + 1, ok=False, error="error: the script raised PicklingError"))
                continue
            seconds, wait = self.step(point)
            jitter = [1.0 + self.rng.uniform(-self.noise, self.noise) for _ in range(8)]
            runs.append(TrialRun("x", r + 1, ok=True, step_seconds=[seconds * j for j in jitter],
                                 data_wait_seconds=[wait * j for j in jitter]))
        return runs


def _tuner(model, **kwargs):
    options = kwargs.pop("options", TuneOptions(max_trials=12))
    return LoaderTuner(["python", "train.py"], options, cores=model.cores, batch_size=16, measure=model, **kwargs)


def test_estimate_workers():
    assert estimate_workers(0.040, 0.020, 8) == 2
    assert estimate_workers(0.5, 0.020, 8) == 8  # bounded by the cores
    assert estimate_workers(0.001, 0.020, 8) == 1
    assert estimate_workers(None, 0.02, 6) == 3


def test_points_canonical_overrides_and_knobs():
    assert LoaderPoint(0, 4, True, False, "spawn").canonical() == LoaderPoint(0, None, None, False, None)
    point = LoaderPoint(2, 4, True, None, "forkserver")
    assert point.overrides() == {"num_workers": 2, "prefetch_factor": 4, "persistent_workers": True,
                                 "multiprocessing_context": "forkserver"}
    assert point.label == "num_workers=2, prefetch_factor=4, persistent_workers=True, start=forkserver"
    assert LoaderPoint().label == "as written" and LoaderPoint().overrides() == {}
    knobs = point.knob_set("p1")
    assert knobs.dataloader.multiprocessing_context == "forkserver" and knobs.dataloader.prefetch_factor == 4


def test_search_reaches_the_grid_best_with_a_third_of_its_trials():
    grid_model = ModelScript(seed=1)
    grid = _tuner(grid_model).grid({"workers": 2})
    search_model = ModelScript(seed=2)
    est = {"workers": estimate_workers(0.040, 0.020, 4)}
    search = _tuner(search_model).search(est)
    assert search.best is not None and grid.best is not None
    # judged on the model's true (noise-free) throughput
    true = {m: 16 / ModelScript().step(r.point)[0] for m, r in (("search", search.best), ("grid", grid.best))}
    assert true["search"] >= 0.9 * true["grid"]
    assert search.trials <= grid.trials / 3
    assert (search.best.wait_fraction or 0) < 0.02
    assert search.stopped_because.startswith("data wait")
    assert search.baseline.point == LoaderPoint() and search.speedup() > 1.5
    assert grid.mode == "grid" and grid.trials == len(_tuner(ModelScript()).space()) + 1


def test_search_adds_workers_while_the_step_waits():
    model = ModelScript(load=0.120, compute=0.020, cores=8)
    report = _tuner(model).search({"workers": 2})
    assert report.best.point.num_workers >= 6
    workers_tried = [r.point.num_workers for r in report.results if r.point.num_workers]
    assert workers_tried == sorted(workers_tried) and len(workers_tried) >= 3
    # every move was measured against the best of the time, interleaved: the best ran again after it
    assert len(model.calls) == report.trials and model.calls[2] == LoaderPoint()


def test_search_stops_when_throughput_stops_improving():
    # the loader can never keep up: load is far beyond what the cores give
    model = ModelScript(load=1.0, compute=0.010, cores=2)
    report = _tuner(model, options=TuneOptions(max_trials=12, min_gain=0.03)).search({"workers": 2})
    assert report.best.point.num_workers == 2
    assert "stopped improving" in report.stopped_because or "budget" in report.stopped_because
    assert report.trials <= 12


def test_failing_points_are_reported_and_skipped():
    model = ModelScript(load=1.0, compute=0.010, cores=2, broken=("spawn",))
    report = _tuner(model).search({"workers": 2})
    failed = [r for r in report.results if not r.ok]
    assert report.best.ok
    for r in failed:
        assert "PicklingError" in r.error
        assert r.to_dict()["ok"] is False


def test_a_broken_script_ends_the_search_with_its_error():
    model = ModelScript(broken=("fork", "spawn", "forkserver", None))
    model.as_written = LoaderPoint(0, None, None, False, "fork")
    report = _tuner(model).search({"workers": 2})
    assert report.best is None and "failed" in report.stopped_because


def test_tune_options_are_checked():
    with pytest.raises(TorchaxeError, match="max-trials"):
        TuneOptions(max_trials=1)
    with pytest.raises(TorchaxeError, match="wait target"):
        TuneOptions(wait_target=2)


def test_report_to_dict_keeps_every_point():
    report = _tuner(ModelScript()).search({"workers": 2})
    data = report.to_dict()
    assert data["mode"] == "search" and data["trials"] == report.trials
    assert data["best"]["label"] == report.best.point.label
    assert len(data["results"]) == len(report.results) and all("step_seconds" in r for r in data["results"])


def test_the_best_setting_is_stored_and_read_back_as_a_knob(tmp_path):
    report = _tuner(ModelScript()).search({"workers": 2})
    kb = str(tmp_path / "kb.sqlite")
    command = ["python", str(tmp_path / "train.py"), "--lr", "0.1"]
    (tmp_path / "train.py").write_text("pass\n")
    stored = store_best(report, command, kb_path=kb, env={"cores": 4})
    assert stored["setting"] == report.best.point.overrides() and stored["kind"] == "dataloader"
    knobs = stored_loader_knobs(command, kb_path=kb)
    assert knobs == {"name": "tuned-dataloader", "dataloader": report.best.point.overrides()}
    assert knob_set_from_dict(knobs, "kb").dataloader.overrides() == report.best.point.overrides()
    assert stored_loader_knobs(["python", str(tmp_path / "train.py")], kb_path=kb) is None  # other arguments


def test_cores_for_this_rank_shares_the_cpus_among_local_ranks():
    total = tuning.cores_for_this_rank({})
    assert total >= 1
    assert tuning.cores_for_this_rank({"LOCAL_WORLD_SIZE": str(total * 4)}) == 1
    assert tuning.cores_for_this_rank({"LOCAL_WORLD_SIZE": "x"}) == total


def test_throughput_counts_the_epoch_start_stall():
    from torchaxe.data.tuning import PointResult

    run = TrialRun("x", 1, ok=True, step_seconds=[0.1] * 7 + [0.9], data_wait_seconds=[0.0] * 7 + [0.8])
    result = PointResult(LoaderPoint(2), 1, [run], batch_size=16)
    assert result.median_step_seconds == pytest.approx(0.1)
    assert result.throughput == pytest.approx(16 / 0.2)  # the mean step, not the median
    assert result.wait_fraction == pytest.approx(0.8 / 1.6)
