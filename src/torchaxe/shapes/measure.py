"""``torchaxe shapes --try``: measure the compile-mode candidates on the real run.

Each candidate is a knob set (runtime/knobs.py) run through the trials
(runtime/trials.py): fresh subprocesses, interleaved A B C A B C over ``repeats``
rounds. Every run records ``warmup + steps`` steps with nothing discarded, and the
split is made here: the first ``warmup`` steps carry the compile and warm-up cost
(reported as their total time and as the overhead over the same number of
steady-state steps), the rest give the steady-state step time. Ratios to the baseline
(the first candidate: eager, or ``jit_compile=False`` on the NPU) are per round, from
the steady-state medians of the two runs of that round, and quoted as their median
(min..max). The winner is the candidate with the lowest median ratio (a whole round
run slow on a busy machine then weighs on every candidate alike); the pick is judged
against it round by round. The winner's compile overhead is paid back after
``overhead / gain per step`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torchaxe.runtime.knobs import KnobSet, knob_set_from_dict
from torchaxe.runtime.stats import Samples
from torchaxe.runtime.trials import KnobResult, Runner, TrialOptions, run_trials
from torchaxe.shapes.candidates import trial_settings
from torchaxe.shapes.verdict import Verdict

#: A pick within this fraction of the winner's steady-state median counts as right.
PICK_TOLERANCE = 0.05


def candidates(target: str, bucketing: dict[str, Any] | None = None, backend: str = "inductor") -> list[KnobSet]:
    """The settings worth comparing on ``target``, baseline first, as knob sets
    (the list is the shapes axis's, shapes/candidates.py)."""
    return [knob_set_from_dict(s, f"candidate {s['name']}") for s in trial_settings(target, bucketing, backend)]


@dataclass
class CandidateResult:
    """One candidate over every round: its warm-up and steady-state figures."""

    name: str
    knobs: dict[str, Any]
    ok: bool
    error: str | None = None
    #: Per round: total seconds of the first ``warmup`` steps, and the steady-state steps.
    warmup_seconds: list[float] = field(default_factory=list)
    steady: list[list[float]] = field(default_factory=list)
    #: Per round, steady-state median over the baseline's of the same round.
    ratios: list[float] = field(default_factory=list)

    @property
    def steady_samples(self) -> Samples:
        return Samples.of(v for run in self.steady for v in run)

    @property
    def steady_median(self) -> float | None:
        return self.steady_samples.median

    @property
    def warmup_median(self) -> float | None:
        return Samples.of(self.warmup_seconds).median

    def overhead(self, warmup: int) -> float | None:
        """Warm-up time beyond what the same number of steady steps take: the compile cost."""
        if self.warmup_median is None or self.steady_median is None:
            return None
        return self.warmup_median - warmup * self.steady_median

    def to_dict(self, warmup: int) -> dict[str, Any]:
        s = self.steady_samples
        r = Samples.of(self.ratios)
        return {"name": self.name, "knobs": self.knobs, "ok": self.ok, "error": self.error,
                "warmup": {"steps": warmup, "seconds_median": self.warmup_median,
                           "overhead_seconds": self.overhead(warmup), "per_repeat": list(self.warmup_seconds)},
                "steady": {"median": s.median, "p90": s.p90, "spread": s.relative_spread, "noisy": s.is_noisy(),
                           "samples": len(s)},
                "ratio": {"median": r.median, "min": r.min, "max": r.max, "per_repeat": list(self.ratios)}
                if self.ratios else None}


@dataclass
class CompileTrial:
    target: str
    warmup: int
    steps: int
    repeats: int
    results: list[CandidateResult]
    #: The candidate the verdict picked before measuring (None: "measure").
    pick: str | None

    @property
    def ok_results(self) -> list[CandidateResult]:
        return [r for r in self.results if r.ok and r.steady_median is not None]

    def _paired(self) -> bool:
        """Whether every candidate has a ratio to the baseline in each of the same rounds."""
        ok = self.ok_results
        return bool(ok) and all(r.ratios and len(r.ratios) == len(ok[0].ratios) for r in ok)

    def _score(self, r: CandidateResult) -> float:
        # Per-round ratios to the baseline, paired within a round, decide: a round that
        # ran slow for every candidate (a busy machine) moves them all alike, where
        # pooled step times would let it decide. Without rounds: the pooled median.
        return Samples.of(r.ratios).median if self._paired() else r.steady_median

    @property
    def winner(self) -> CandidateResult | None:
        """The fastest candidate: lowest median per-round ratio to the baseline."""
        ok = self.ok_results
        return min(ok, key=self._score) if ok else None

    def result(self, name: str | None) -> CandidateResult | None:
        return next((r for r in self.results if r.name == name), None)

    @property
    def pick_within(self) -> float | None:
        """How far the pick is above the winner (0 = the winner): the median over rounds
        of the pick's steady-state median over the winner's in the same round."""
        winner, picked = self.winner, self.result(self.pick)
        if winner is None or picked is None or not picked.ok or picked.steady_median is None:
            return None
        if picked is winner:
            return 0.0
        if self._paired():
            return Samples.of(p / w for p, w in zip(picked.ratios, winner.ratios)).median - 1.0
        return picked.steady_median / winner.steady_median - 1.0

    @property
    def pick_ok(self) -> bool | None:
        within = self.pick_within
        return None if within is None else within <= PICK_TOLERANCE

    def margin(self) -> float | None:
        """The winner over the runner-up (below 1: faster), per round when paired."""
        ordered = sorted(self.ok_results, key=self._score)
        if len(ordered) < 2:
            return None
        if self._paired():
            return Samples.of(a / b for a, b in zip(ordered[0].ratios, ordered[1].ratios)).median
        return ordered[0].steady_median / ordered[1].steady_median

    def payback_steps(self) -> float | None:
        """Steps after which the winner's extra compile cost over the baseline is paid back."""
        winner, base = self.winner, self.results[0] if self.results else None
        if winner is None or base is None or winner is base or not base.ok:
            return None
        extra = (winner.overhead(self.warmup) or 0.0) - (base.overhead(self.warmup) or 0.0)
        gain = (base.steady_median or 0.0) - (winner.steady_median or 0.0)
        if gain <= 0:
            return None
        return max(0.0, extra) / gain

    def to_dict(self) -> dict[str, Any]:
        winner = self.winner
        return {"target": self.target, "warmup_steps": self.warmup, "steps": self.steps, "repeats": self.repeats,
                "baseline": self.results[0].name if self.results else None,
                "candidates": [r.to_dict(self.warmup) for r in self.results],
                "winner": winner.name if winner else None, "winner_over_runner_up": self.margin(),
                "payback_steps": self.payback_steps(), "pick": self.pick, "pick_within": self.pick_within,
                "pick_ok": self.pick_ok}


def _result(knob_result: KnobResult, warmup: int) -> CandidateResult:
    failed = knob_result.failed_run
    out = CandidateResult(name=knob_result.name, knobs=knob_result.knobs.to_dict(), ok=knob_result.ok,
                          error=failed.error if failed else None)
    for run in knob_result.runs:
        if run.ok and len(run.step_seconds) > warmup:
            out.warmup_seconds.append(sum(run.step_seconds[:warmup]))
            out.steady.append(list(run.step_seconds[warmup:]))
        elif run.ok:
            out.ok = False
            out.error = f"only {len(run.step_seconds)} steps recorded: the script ended before warm-up + steps"
    return out


def run_compile_trial(command: Sequence[str], verdict: Verdict, target: str, *, steps: int = 10, warmup: int = 3,
                      repeats: int = 2, timeout: float | None = None, backend: str = "inductor",
                      runner: Runner | None = None, progress: Callable[[str], None] = lambda line: None,
                      knob_sets: list[KnobSet] | None = None) -> CompileTrial:
    """Measure every candidate for ``target`` on the script, interleaved."""
    bucketing = verdict.buckets[0].knob() if verdict.buckets else None
    sets = knob_sets if knob_sets is not None else candidates(target, bucketing, backend)
    options = TrialOptions(repeats=repeats, steps=warmup + steps, warmup=0, timeout=timeout, target=target)
    report = run_trials(sets, list(command), options, runner=runner, progress=progress)
    results = [_result(r, warmup) for r in report.results]
    base = results[0]
    base_by_round = {i: Samples.of(run).median for i, run in enumerate(base.steady)} if base.ok else {}
    for r in results:
        if not r.ok:
            continue
        r.ratios = [Samples.of(run).median / base_by_round[i] for i, run in enumerate(r.steady)
                    if base_by_round.get(i)]
    pick = verdict.picks.get(target)
    if pick is not None and all(r.name != pick for r in results):
        pick = None
    return CompileTrial(target=target, warmup=warmup, steps=steps, repeats=repeats, results=results, pick=pick)
