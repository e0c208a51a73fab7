"""Loader tuning: a search over DataLoader settings with trials on the real script.

Each point is a set of DataLoader keywords (``num_workers``, ``prefetch_factor``,
``persistent_workers``, ``pin_memory``, the workers' start method) forced on every
loader the script builds through the trial bootstrap's ``dataloader`` knob, measured
by running the unmodified script in a subprocess (``torchaxe.runtime.trials``) for a
few steps. A point's throughput is samples per second over the total time of its
measured steps (so the stall of restarting workers at an epoch start counts) and its
data wait the fraction of the measured step time spent blocked in the DataLoader.

The **search** starts from the script as written and from an estimate — workers ≈
the time to load one batch in one process over the step's compute time, bounded by
the cores this rank has — with persistent workers (and pinned memory on a device).
It then moves one setting at a time: more workers while that pays, fewer when the
estimate already meets the target, a deeper prefetch, pinning, another start method;
a move is kept when throughput improves by at least ``min_gain``. It stops as soon as
the data wait is under ``wait_target`` (2%) of the step, when no move pays, or at
``max_trials``. The **grid** measures every distinct point of the same space; the
benchmark compares the two.
"""

from __future__ import annotations

import math
import multiprocessing
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from torchaxe.cpulist import cores_per_rank, usable_cpus
from torchaxe.errors import TorchaxeError
from torchaxe.units import duration

#: The data-wait fraction at which the search stops: the device hardly waits.
WAIT_TARGET = 0.02
#: A move must raise throughput by this much to be kept (below it is noise here).
MIN_GAIN = 0.03
KB_KIND = "dataloader"


def cores_for_this_rank(environ: Any = None) -> int:
    """CPUs this process may use, shared among the ranks on this node (``LOCAL_WORLD_SIZE``)."""
    return cores_per_rank(usable_cpus(), environ)


def estimate_workers(load_seconds_per_batch: float | None, compute_seconds_per_step: float | None,
                     cores: int) -> int:
    """Workers needed so that batches arrive as fast as steps use them: one worker
    delivers a batch every ``load`` seconds, a step uses one every ``compute``;
    bounded to 1..cores. Without the two figures: half the cores, at least 1."""
    if not load_seconds_per_batch or not compute_seconds_per_step or compute_seconds_per_step <= 0:
        return max(1, cores // 2)
    return max(1, min(cores, math.ceil(load_seconds_per_batch / compute_seconds_per_step)))


def start_methods() -> tuple[str, ...]:
    """The start methods this platform has, its default first."""
    available = multiprocessing.get_all_start_methods()
    default = multiprocessing.get_start_method(allow_none=True) or available[0]
    return tuple([default] + [m for m in available if m != default])


@dataclass(frozen=True)
class LoaderPoint:
    """DataLoader keywords to force; ``None`` leaves the script's own value."""

    num_workers: int | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    pin_memory: bool | None = None
    start_method: str | None = None

    def canonical(self) -> "LoaderPoint":
        """Settings that only act with workers are dropped at ``num_workers=0``, so
        equal runs compare equal."""
        if self.num_workers == 0:
            return LoaderPoint(0, None, None, self.pin_memory, None)
        return self

    def overrides(self) -> dict[str, Any]:
        """The ``dataloader`` knob (docs/trial.md) and the setting stored in the KB."""
        point = self.canonical()
        out: dict[str, Any] = {}
        for key, value in (("num_workers", point.num_workers), ("prefetch_factor", point.prefetch_factor),
                           ("persistent_workers", point.persistent_workers), ("pin_memory", point.pin_memory),
                           ("multiprocessing_context", point.start_method)):
            if value is not None:
                out[key] = value
        return out

    @property
    def label(self) -> str:
        settings = self.overrides()
        if not settings:
            return "as written"
        return ", ".join(f"{'start' if k == 'multiprocessing_context' else k}={v}" for k, v in settings.items())

    def knob_set(self, name: str):
        from torchaxe.runtime.knobs import knob_set_from_dict

        return knob_set_from_dict({"name": name, "dataloader": self.overrides()}, f"loader point {name}")


@dataclass
class PointResult:
    """The runs of one point."""

    point: LoaderPoint
    order: int
    runs: list[Any] = field(default_factory=list)  # TrialRun
    batch_size: int | None = None

    @property
    def ok(self) -> bool:
        return bool(self.runs) and all(r.ok for r in self.runs)

    @property
    def error(self) -> str | None:
        failed = next((r for r in self.runs if not r.ok), None)
        return failed.error if failed is not None else None

    @property
    def step_seconds(self) -> list[float]:
        return [s for r in self.runs if r.ok for s in r.step_seconds]

    @property
    def median_step_seconds(self) -> float | None:
        from torchaxe.runtime.stats import Samples

        return Samples.of(self.step_seconds).median

    @property
    def wait_fraction(self) -> float | None:
        steps = sum(self.step_seconds)
        waits = sum(w for r in self.runs if r.ok for w in getattr(r, "data_wait_seconds", []))
        return min(1.0, waits / steps) if steps > 0 else None

    @property
    def mean_step_seconds(self) -> float | None:
        steps = self.step_seconds
        return sum(steps) / len(steps) if steps else None

    @property
    def throughput(self) -> float | None:
        """Samples per second (steps per second when the batch size is unknown) over the
        total time of the measured steps: a loader that stalls at every epoch start
        pays for it here, where a median step would hide it."""
        mean = self.mean_step_seconds
        if not self.ok or not mean:
            return None
        return (self.batch_size or 1) / mean

    def to_dict(self) -> dict[str, Any]:
        from torchaxe.runtime.stats import Samples

        s = Samples.of(self.step_seconds)
        return {"order": self.order, "point": self.point.overrides(), "label": self.point.label, "ok": self.ok,
                "error": self.error, "runs": len(self.runs), "median_step_seconds": s.median,
                "mean_step_seconds": self.mean_step_seconds,
                "step_spread": s.relative_spread, "noisy": s.is_noisy(), "wait_fraction": self.wait_fraction,
                "throughput": self.throughput, "throughput_unit": "samples/s" if self.batch_size else "steps/s",
                "step_seconds": list(self.step_seconds)}


@dataclass
class TuneReport:
    mode: str
    results: list[PointResult]
    baseline: PointResult | None
    estimate: dict[str, Any]
    stopped_because: str
    options: dict[str, Any]
    #: The search's pick (compared head to head); the grid picks the highest median.
    chosen: PointResult | None = None

    @property
    def trials(self) -> int:
        """Runs of the script made (a point measured with R repeats is R runs)."""
        return sum(len(r.runs) for r in self.results)

    @property
    def best(self) -> PointResult | None:
        if self.chosen is not None:
            return self.chosen
        ok = [r for r in self.results if r.ok and r.throughput]
        return max(ok, key=lambda r: r.throughput) if ok else None

    def speedup(self) -> float | None:
        best, base = self.best, self.baseline
        if best is None or base is None or not base.throughput or not best.throughput:
            return None
        return best.throughput / base.throughput

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"mode": self.mode, "trials": self.trials, "points": len(self.results),
                "stopped_because": self.stopped_because, "estimate": dict(self.estimate),
                "options": dict(self.options),
                "baseline": self.baseline.to_dict() if self.baseline else None,
                "best": best.to_dict() if best else None, "speedup_vs_baseline": self.speedup(),
                "results": [r.to_dict() for r in self.results]}


@dataclass(frozen=True)
class TuneOptions:
    steps: int = 10
    warmup: int = 3
    repeats: int = 1
    timeout: float | None = 180.0
    target: str = "auto"
    wait_target: float = WAIT_TARGET
    min_gain: float = MIN_GAIN
    max_trials: int = 12

    def __post_init__(self) -> None:
        if self.steps < 1 or self.repeats < 1 or self.warmup < 0:
            raise TorchaxeError("tuning: --trial-steps and --repeats must be at least 1, --trial-warmup 0 or more")
        if self.max_trials < 2:
            raise TorchaxeError(f"--max-trials {self.max_trials}: must be at least 2 (the script as written and the estimate)")
        if not 0 < self.wait_target < 1:
            raise TorchaxeError(f"wait target {self.wait_target}: must be between 0 and 1")

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


Measure = Callable[[LoaderPoint, int], list]


class LoaderTuner:
    """Measures loader points on the real script; ``search`` or ``grid``.

    ``measure(point, repeats)`` returns the TrialRuns of one point (default: the trial
    bootstrap in subprocesses); tests pass a model of the script."""

    def __init__(self, command: Sequence[str], options: TuneOptions | None = None, *, cores: int | None = None,
                 batch_size: int | None = None, accelerator: bool = False, measure: Measure | None = None,
                 progress: Callable[[str], None] = lambda line: None) -> None:
        self.command = list(command)
        self.options = options or TuneOptions()
        self.cores = cores or cores_for_this_rank()
        self.batch_size = batch_size
        self.accelerator = accelerator
        self.measure = measure or self._measure_in_subprocess
        self.progress = progress
        self._results: list[PointResult] = []
        self._cache: dict[LoaderPoint, PointResult] = {}

    # -- measuring

    def _measure_in_subprocess(self, point: LoaderPoint, repeats: int) -> list:
        from torchaxe.runtime.trials import TrialOptions, run_in_subprocess

        o = self.options
        trial = TrialOptions(repeats=1, steps=o.steps, warmup=o.warmup, timeout=o.timeout, target=o.target)
        knobs = point.knob_set(f"point{len(self._results) + 1}")
        return [run_in_subprocess(knobs, self.command, trial, r) for r in range(1, repeats + 1)]

    @property
    def trials(self) -> int:
        return sum(len(r.runs) for r in self._results)

    def run_point(self, point: LoaderPoint, runs: int | None = None) -> PointResult:
        """Measure a point (``runs`` more runs of it when it was measured before)."""
        point = point.canonical()
        result = self._cache.get(point)
        if result is not None and runs is None:
            return result
        self.progress(f"trial {self.trials + 1}: {point.label} ...")
        measured = list(self.measure(point, runs or self.options.repeats))
        if result is None:
            result = PointResult(point, len(self._results) + 1, measured, self.batch_size)
            self._cache[point] = result
            self._results.append(result)
        else:
            result.runs.extend(measured)
        if all(r.ok for r in measured):
            self.progress(f"trial {self.trials}: {point.label}: {_rate(result)}, data wait {_pct(result.wait_fraction)}")
        else:
            self.progress(f"trial {self.trials}: {point.label}: FAILED: {result.error}")
        return result

    def _budget_left(self, runs: int = 1) -> bool:
        return self.trials + runs <= self.options.max_trials

    def compare(self, point: LoaderPoint, reference: PointResult) -> tuple[PointResult, float]:
        """Measure ``point`` interleaved with ``reference`` (one run of each, ``repeats``
        times: B A B A ...), and return it with its throughput gain over the reference:
        the median of the per-pair ratios, so that a machine that is slower for a while
        slows both sides of a pair alike. A failing ``point`` ends the comparison (no
        gain); a failing reference ends it after the point's next run."""
        from torchaxe.runtime.stats import Samples
        from torchaxe.runtime.trials import interleave

        point = point.canonical()
        ratios: list[float] = []
        broke = None if reference.ok else 0  # the round the reference failed in

        def run(p: LoaderPoint, repeat: int) -> None:
            nonlocal broke
            result = self.run_point(p, runs=1)
            if p is point:
                return
            if not result.ok and broke is None:
                broke = repeat
            mine, theirs = _mean(self._cache[point].runs[-1].step_seconds), _mean(result.runs[-1].step_seconds)
            if mine and theirs:
                ratios.append(theirs / mine)

        def failed(p: LoaderPoint) -> bool:
            result = self._cache.get(p)
            return result is not None and not result.ok

        interleave([point, reference.point], run, failed, rounds=self.options.repeats, required=[point],
                   stop=lambda repeat, runs: broke is not None and repeat > broke + 1)
        candidate = self._cache[point]
        if not candidate.ok:
            return candidate, -1.0
        median = Samples.of(ratios).median
        return candidate, (median - 1.0) if median is not None else -1.0

    # -- the search

    def search(self, estimate: dict[str, Any]) -> TuneReport:
        """Start from the script as written and the estimate; move one setting at a time,
        each move measured against the current best, interleaved."""
        o = self.options
        self._results, self._cache = [], {}
        baseline = self.run_point(LoaderPoint(), runs=1)
        if not baseline.ok:
            return self._report("search", baseline, estimate, f"the script as written failed: {baseline.error}")
        w0 = int(estimate.get("workers") or estimate_workers(None, None, self.cores))
        start = LoaderPoint(num_workers=w0, prefetch_factor=2, persistent_workers=True,
                            pin_memory=True if self.accelerator else None)
        first, gain = self.compare(start, baseline)
        best = baseline
        if first.ok and (gain >= o.min_gain or (gain > -o.min_gain and (first.wait_fraction or 0.0)
                                                 < (baseline.wait_fraction or 0.0))):
            best = first  # faster, or as fast within noise and waiting less
        steps_needed = 2 * o.repeats  # a move costs a run of it and one of the best, per repeat

        def met() -> bool:
            return (best.wait_fraction or 0.0) < o.wait_target

        def attempt(point: LoaderPoint) -> bool:
            nonlocal best
            if point.canonical() in self._cache or not self._budget_left(steps_needed):
                return False
            candidate, gained = self.compare(point, best)
            if candidate.ok and gained >= o.min_gain:
                best = candidate
                return True
            return False

        # More workers while the loader still keeps the step waiting.
        while not met() and self._budget_left(steps_needed):
            w = best.point.num_workers if best.point.num_workers is not None else w0
            if w >= self.cores:
                break
            nxt = min(self.cores, max(w + 1, math.ceil(w * 1.5)))
            if not attempt(LoaderPoint(nxt, 2, True, best.point.pin_memory if best is not baseline else start.pin_memory,
                                       best.point.start_method)):
                break
        # Fewer workers when the estimate already meets the target: the same speed on fewer cores.
        if met() and best is first and (best.point.num_workers or 0) > 1 and self._budget_left(steps_needed):
            fewer = replace(best.point, num_workers=best.point.num_workers - 1)
            candidate, gained = self.compare(fewer, best)
            if candidate.ok and (candidate.wait_fraction or 0.0) < o.wait_target and gained > -o.min_gain:
                best = candidate
        if not met() and best.point.num_workers:
            attempt(replace(best.point, prefetch_factor=4))
        if not met() and self.accelerator and best.point.num_workers is not None:
            attempt(replace(best.point, pin_memory=not bool(best.point.pin_memory)))
        if not met() and best.point.num_workers:
            current = best.point.start_method or start_methods()[0]
            for method in start_methods():
                if method != current and not met():
                    attempt(replace(best.point, start_method=method))
        if met():
            reason = f"data wait {_pct(best.wait_fraction)} of the step, under the {_pct(o.wait_target)} target"
        elif not self._budget_left(steps_needed):
            reason = f"the trial budget ran out (--max-trials {o.max_trials})"
        else:
            reason = f"throughput stopped improving (no move gained {100 * o.min_gain:.0f}% or more)"
        return self._report("search", baseline, estimate, reason, chosen=best)

    # -- the grid

    def space(self, workers: Sequence[int] | None = None) -> list[LoaderPoint]:
        """Every distinct point of the space the search moves in."""
        workers = list(workers) if workers is not None else list(range(0, self.cores + 1))
        pins: tuple[bool | None, ...] = (False, True) if self.accelerator else (None,)
        points: dict[LoaderPoint, None] = {}
        for w in workers:
            for pf in (2, 4):
                for persistent in (False, True):
                    for pin in pins:
                        for method in start_methods():
                            points.setdefault(LoaderPoint(w, pf, persistent, pin, method).canonical(), None)
        return list(points)

    def grid(self, estimate: dict[str, Any], workers: Sequence[int] | None = None) -> TuneReport:
        """Every point once (``repeats`` runs), in order; the best is the highest median."""
        self._results, self._cache = [], {}
        baseline = self.run_point(LoaderPoint())
        for point in self.space(workers):
            self.run_point(point)
        return self._report("grid", baseline, estimate, "every point of the grid measured")

    def _report(self, mode: str, baseline: PointResult, estimate: dict[str, Any], reason: str,
                chosen: PointResult | None = None) -> TuneReport:
        return TuneReport(mode, list(self._results), baseline, dict(estimate), reason, self.options.to_dict(), chosen)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _rate(result: PointResult) -> str:
    if result.throughput is None:
        return "n/a"
    unit = "samples/s" if result.batch_size else "steps/s"
    return (f"{result.throughput:.1f} {unit} (mean step {duration(result.mean_step_seconds or 0, 1)}, "
            f"median {duration(result.median_step_seconds or 0, 1)})")


# ------------------------------------------------------------------ knowledge base


def store_best(report: TuneReport, command: Sequence[str], *, kb_path: str | None = None, cwd: str | None = None,
               env: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Store the best point as the ``dataloader`` setting of this workload, for
    ``torchaxe run`` to apply (the setting is the trial knob's ``dataloader`` object;
    :func:`stored_loader_knobs` reads it back as a knob set). Returns what was stored,
    or None when no point ran."""
    from torchaxe.kb import KnowledgeBase, workload_key

    best = report.best
    if best is None:
        return None
    stats = {"throughput": best.throughput, "throughput_unit": "samples/s" if best.batch_size else "steps/s",
             "median_step_seconds": best.median_step_seconds, "mean_step_seconds": best.mean_step_seconds, "wait_fraction": best.wait_fraction,
             "baseline_throughput": report.baseline.throughput if report.baseline else None,
             "baseline_wait_fraction": report.baseline.wait_fraction if report.baseline else None,
             "speedup": report.speedup(), "trials": report.trials, "mode": report.mode,
             "label": best.point.label}
    setting = best.point.overrides()
    workload = workload_key(list(command), cwd)
    with KnowledgeBase.open(kb_path) as kb:
        kb.put_setting(KB_KIND, workload, setting, stats, env or {})
    return {"kind": KB_KIND, "workload": workload, "setting": setting, "stats": stats}


def stored_loader_knobs(command: Sequence[str], *, kb_path: str | None = None, cwd: str | None = None) -> dict | None:
    """The knob-set object (``{"name": ..., "dataloader": {...}}``) of the tuned loader
    setting stored for this command, or None: what ``torchaxe run`` hands the bootstrap."""
    from torchaxe.kb import KnowledgeBase, workload_key

    with KnowledgeBase.open(kb_path) as kb:
        found = kb.best_setting(KB_KIND, workload_key(list(command), cwd))
    if not found or not found.get("setting"):
        return None
    return {"name": "tuned-dataloader", "dataloader": dict(found["setting"])}
