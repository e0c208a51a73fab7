"""Interleaved measurement of several changes against the unchanged run, bounded by
a deadline.

Each round runs the baseline once, then every arm once (A B C A B C ...), each in a
fresh subprocess through the trial bootstrap. The ratio of an arm is taken per round
against that round's baseline, so slow drifts of a shared machine fall on both.
When the deadline comes, no new run starts: what was measured so far is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torchaxe.runtime.knobs import KnobSet
from torchaxe.runtime.stats import Samples
from torchaxe.runtime.trials import Runner, TrialOptions, TrialRun, run_in_subprocess


@dataclass
class ArmResult:
    name: str
    knobs: KnobSet
    runs: list[TrialRun] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)

    @property
    def error(self) -> str | None:
        return next((r.error or "failed" for r in self.runs if not r.ok), None)

    @property
    def ok(self) -> bool:
        return bool(self.runs) and self.error is None

    @property
    def median(self) -> float | None:
        return Samples.of(s for r in self.runs if r.ok for s in r.step_seconds).median

    @property
    def ratio(self) -> float | None:
        return Samples.of(self.ratios).median

    @property
    def losses(self) -> list[list[float]]:
        return [list((r.applied or {}).get("loss") or []) for r in self.runs if r.ok]

    @property
    def data_wait_fraction(self) -> float | None:
        waits = [w for r in self.runs if r.ok for w in r.data_wait_seconds]
        steps = [s for r in self.runs if r.ok for s in r.step_seconds]
        return sum(waits) / sum(steps) if steps and sum(steps) > 0 else None


class OutOfTime(Exception):
    """The deadline passed before the next run could start."""


@dataclass
class Measurer:
    command: Sequence[str]
    options: TrialOptions
    deadline: float | None = None
    runner: Runner = run_in_subprocess
    clock: Callable[[], float] = time.monotonic
    progress: Callable[[str], None] = lambda line: None
    #: Wall seconds of every run so far, to estimate whether the next one fits.
    run_seconds: list[float] = field(default_factory=list)

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.clock()

    def expected_run_seconds(self) -> float:
        return Samples.of(self.run_seconds).median or 0.0

    def fits(self, runs: int) -> bool:
        """Whether ``runs`` more runs end before the deadline, at the run times so far."""
        left = self.remaining()
        return left is None or left >= runs * self.expected_run_seconds()

    def _run(self, knobs: KnobSet, repeat: int, label: str) -> TrialRun:
        left = self.remaining()
        # A run is not started when the runs so far say it would end past the deadline.
        if left is not None and (left <= 0 or left < 0.8 * self.expected_run_seconds()):
            raise OutOfTime(label)
        self.progress(label)
        start = self.clock()
        run = self.runner(knobs, self.command, self.options, repeat)
        self.run_seconds.append(run.seconds if run.seconds is not None else self.clock() - start)
        run.knobs = knobs.name
        return run

    def compare(self, baseline: KnobSet, arms: Sequence[KnobSet], repeats: int,
                what: str = "measuring", warm: bool = False,
                reserve: int = 0) -> tuple[ArmResult, list[ArmResult], bool]:
        """Run ``repeats`` interleaved rounds. Returns the baseline, the arms and
        whether every planned run happened (False: the deadline cut it short).
        ``warm``: one unmeasured run of the baseline first, so that the first round
        does not pay for cold file and compiler caches on one side only.
        ``reserve``: runs that must still fit after this comparison; a round after
        the first is not started when, at the run times seen so far, it would eat
        into them."""
        base = ArmResult(baseline.name, baseline)
        results = [ArmResult(k.name, k) for k in arms]
        try:
            if warm:
                self._run(baseline, 0, f"{what}: warming the caches (not measured)")
            for repeat in range(1, repeats + 1):
                if repeat > 1 and not self.fits(1 + sum(a.error is None for a in results) + reserve):
                    return base, results, False
                if not self.round(base, results, f"{what}: round {repeat}/{repeats}"):
                    break  # without a baseline nothing can be compared
        except OutOfTime:
            return base, results, False
        return base, results, True

    def round(self, base: ArmResult, arms: Sequence[ArmResult], label: str) -> bool:
        """One more interleaved round: the baseline, then each arm that has not failed,
        each ratio taken against this round's baseline. False when the baseline failed.
        Raises OutOfTime when the deadline comes first (the runs so far are kept)."""
        repeat = len(base.runs) + 1
        run = self._run(base.knobs, repeat, f"{label}: original")
        base.runs.append(run)
        if not run.ok:
            return False
        for arm in arms:
            if arm.error is not None:
                continue
            latest = self._run(arm.knobs, repeat, f"{label}: {arm.name}")
            arm.runs.append(latest)
            if latest.ok and latest.median and run.median:
                arm.ratios.append(latest.median / run.median)
        return True
