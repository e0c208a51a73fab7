"""Interleaved measurement of several changes against the unchanged run, bounded by
a deadline.

Each round runs the baseline once, then every arm once (A B C A B C ...; the loop is
``trials.interleave``), each in a fresh subprocess through the trial bootstrap. The
ratio of an arm is taken per round against that round's baseline, so slow drifts of a
shared machine fall on both. When the deadline comes, no new run starts: what was
measured so far is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from torchaxe.runtime.harness import GRACE_MAX_SECONDS
from torchaxe.runtime.knobs import KnobSet, pays_once
from torchaxe.runtime.stats import Samples
from torchaxe.runtime.other_load import OtherLoad
from torchaxe.runtime.trials import Runner, TrialOptions, TrialRun, interleave, run_in_subprocess


def measured_losses(applied: dict[str, Any]) -> list[float]:
    """The losses a run recorded in its measured steps; all of them when it did not
    record the steps' phases (or recorded none in a measured step)."""
    losses = list(applied.get("loss") or [])
    phases = applied.get("loss_phases")
    if not isinstance(phases, list) or len(phases) != len(losses):
        return losses
    measured = [loss for loss, phase in zip(losses, phases) if phase == "measured"]
    return measured or losses


#: The knob set of the original run again (the A/A arm: how far apart two runs of the
#: unchanged script land).
AGAIN = "original-again"


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
    def warmup_seconds(self) -> float | None:
        """The wall time of its warm-up steps as a run after advise pays it: the median
        over its runs after the first, else its one run's. A first compile fills torch's
        compile caches on this machine (a GPT block's compile took 21 s cold, 2 s from the
        cache), which its later runs read, and so does the user's job run here next."""
        seconds = self._warmups()
        return Samples.of(seconds[1:] if len(seconds) > 1 else seconds).median

    @property
    def first_warmup_seconds(self) -> float | None:
        """The wall time of its first run's warm-up steps: on a machine whose caches did
        not yet hold its compiled kernels."""
        seconds = self._warmups()
        return seconds[0] if seconds else None

    @property
    def warm_runs(self) -> int:
        """How many of its runs came after its first: their warm-up read what the
        first one left in the caches."""
        return max(0, len(self._warmups()) - 1)

    def _warmups(self) -> list[float]:
        return [r.warmup_seconds for r in self.runs if r.ok and r.warmup_seconds is not None]

    @property
    def losses(self) -> list[list[float]]:
        """Each run's training losses over its measured steps: the warm-up's (a compiled
        first step, an optimizer's first large updates) are left out where the run
        recorded which steps they came from."""
        return [measured_losses(r.applied or {}) for r in self.runs if r.ok]

    @property
    def peak_memory(self) -> tuple[int, str] | None:
        """The peak memory of its runs that went through, and its kind (``device`` or
        ``host_rss``): the highest device peak; the median host peak, as a process's
        resident set varies from run to run (one script's original peaked at 409 and at
        483 MiB) and the original runs more often than any change, so that its highest
        would be its worst outlier. None when no run recorded one."""
        peaks = [(r.peak_memory_bytes, r.memory_kind or "") for r in self.runs
                 if r.ok and r.peak_memory_bytes is not None]
        if not peaks:
            return None
        if any(kind == "device" for _, kind in peaks):
            return max(p for p in peaks if p[1] == "device")
        ordered = sorted(peaks)
        return ordered[(len(ordered) - 1) // 2]

    @property
    def memory_spread(self) -> float | None:
        """How far its runs' peaks of the kind ``peak_memory`` reports strayed from one
        another, as a fraction of their median ((highest - lowest) / median); None
        with fewer than two such runs."""
        peak = self.peak_memory
        if peak is None:
            return None
        peaks = sorted(r.peak_memory_bytes for r in self.runs
                       if r.ok and r.peak_memory_bytes is not None and (r.memory_kind or "") == peak[1])
        if len(peaks) < 2 or not peaks[(len(peaks) - 1) // 2]:
            return None
        return (peaks[-1] - peaks[0]) / peaks[(len(peaks) - 1) // 2]

    @property
    def rank_figures(self) -> list[dict[str, Any]] | None:
        """Under torchrun: each rank's figures, medians over the arm's runs that went through."""
        from torchaxe.runtime.ranks import median_rows

        return median_rows([r.ranks for r in self.runs if r.ok and r.ranks])

    @property
    def data_wait_fraction(self) -> float | None:
        waits = [w for r in self.runs if r.ok for w in r.data_wait_seconds]
        steps = [s for r in self.runs if r.ok for s in r.step_seconds]
        return sum(waits) / sum(steps) if steps and sum(steps) > 0 else None

    @property
    def data_wait_seconds_median(self) -> float | None:
        """The median time a step waited for data, over the runs that went through."""
        return Samples.of(w for r in self.runs if r.ok for w in r.data_wait_seconds).median

    @property
    def optimizer_seconds_median(self) -> float | None:
        """The median time a step spent in optimizers' ``step()``; None unless an
        optimizer stepped in every measured step of every run that went through."""
        times = [t for r in self.runs if r.ok for t in r.optimizer_seconds]
        if not times or None in times or len(times) != sum(len(r.step_seconds) for r in self.runs if r.ok):
            return None
        return Samples.of(times).median


#: ``(knob_sets, repeat, options)``: one run of each at once, side by side taking
#: turns (``runtime/turns.py``), in the order given, each under ``options``.
TogetherRunner = Callable[[Sequence[KnobSet], int, TrialOptions], list[TrialRun]]

#: How many times the original's run a change's first compiled run is guessed to
#: take before any compiled run was timed (its own or another change's).
FIRST_COMPILE_GUESS = 3.0
#: The least a first compile is guessed to add to a run, in seconds: it does not
#: shrink with the step (30-40 s for a small BERT on 2 cores beside an 8-second run,
#: more than a minute for minGPT's nano model beside a 9-second one).
FIRST_COMPILE_SECONDS = 30.0


def first_compile_runs(run_seconds: float) -> float:
    """A change's first compiled run, guessed in runs of ``run_seconds`` (the
    original's) when the budget is first shared out: ``FIRST_COMPILE_GUESS`` of them,
    and ``FIRST_COMPILE_SECONDS`` more than one at the least. (Once runs are timed,
    later rounds guess from those: :meth:`Measurer.expected_seconds_of`.)"""
    if run_seconds <= 0:
        return FIRST_COMPILE_GUESS
    return max(FIRST_COMPILE_GUESS, 1.0 + FIRST_COMPILE_SECONDS / run_seconds)

#: The least --timeout a run is given when the deadline bounds it.
MIN_BOUNDED_TIMEOUT = 1.0


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
    #: Wall seconds of every run so far, to estimate whether the next one fits (of a
    #: round run together: its share of the round's).
    run_seconds: list[float] = field(default_factory=list)
    #: The same by change: a change's own runs say how long its next one takes (a
    #: compiled run can take several times the original's).
    seconds_of: dict[str, list[float]] = field(default_factory=dict)
    _compiling: set[str] = field(default_factory=set)
    #: When set, each round's runs are made at once, taking turns (else one by one).
    together: TogetherRunner | None = None
    #: The most runs memory allows side by side; a round of more runs goes one by one.
    together_limit: int | None = None
    #: A round of runs side by side left changes out to fit the deadline (since the
    #: comparison began).
    shortened: bool = False
    #: The knob sets of the runs the deadline stopped before a measured step.
    stopped: list[str] = field(default_factory=list)
    #: When the budget ended a comparison's rounds before the next one: the rounds
    #: made, the seconds left, and the seconds the next round with the runs kept in
    #: reserve would have taken at the run times seen.
    ended_early: tuple[int, float, float] | None = None
    #: How busy other processes kept the cores, run by run (None: a run not watched).
    other_loads: list[OtherLoad | None] = field(default_factory=list)

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.clock()

    def expected_run_seconds(self) -> float:
        return Samples.of(self.run_seconds).median or 0.0

    def expected_seconds_of(self, knobs: KnobSet) -> float:
        """How long a run of ``knobs`` should take: the median of its own runs so far,
        else, for a change that compiles, of the runs of the others that compile (each
        pays for its compile), else of every run."""
        own = Samples.of(self.seconds_of.get(knobs.name, [])).median
        if own is not None:
            return own
        if pays_once(knobs.values):
            alike = Samples.of([t for name, times in self.seconds_of.items() if name in self._compiling
                                for t in times]).median
            if alike is not None:
                return max(alike, self.expected_run_seconds())
            # No compiled run yet: its compile comes on top (30-40 s for a small BERT
            # on 2 cores, beside an 8-second run; 40 s for nanoGPT beside 20).
            return FIRST_COMPILE_GUESS * self.expected_run_seconds()
        return self.expected_run_seconds()

    def fits(self, runs: int) -> bool:
        """Whether ``runs`` more runs end before the deadline, at the run times so far."""
        left = self.remaining()
        return left is None or left >= runs * self.expected_run_seconds()

    def _out_of_rounds(self, repeat: int, runs: int, arms: Sequence[ArmResult]) -> bool:
        """The budget's hook of :func:`interleave`: a round after the first is not
        started when its runs (each arm that has not failed, at its own run times so
        far: a change that compiles took longer) and the rest of ``runs`` (those kept
        in reserve, at the median run's time) would end past the deadline; noted in
        ``ended_early``."""
        left = self.remaining()
        if repeat <= 1 or left is None:
            return False
        live = [a for a in arms if not _failed(a)]
        need = (sum(self.expected_seconds_of(a.knobs) for a in live)
                + max(runs - len(live), 0) * self.expected_run_seconds())
        if left >= need:
            return False
        self.ended_early = (repeat - 1, max(left, 0.0), need)
        return True

    def bounded(self, runs: int = 1) -> tuple[TrialOptions, bool]:
        """The trial options for ``runs`` runs made now (side by side, each given the
        others' share of the time too), their --timeout cut to end by the deadline: a
        run longer than the runs before it said (a first compile) stops there instead
        of overrunning the --budget. And whether the deadline cut it."""
        left = self.remaining()
        timeout = self.options.timeout
        if left is None:
            return self.options, False
        share = max(before_grace(left), MIN_BOUNDED_TIMEOUT) / max(runs, 1)
        if timeout is not None and timeout <= share:
            return self.options, False
        return replace(self.options, timeout=share), True

    def _run(self, knobs: KnobSet, repeat: int, label: str) -> TrialRun:
        left = self.remaining()
        # A run is not started when the runs so far say it would end past the deadline:
        # its own runs when it had some, else all of them.
        if left is not None and (left <= 0 or left < self.expected_seconds_of(knobs)):
            raise OutOfTime(label)
        self.progress(label)
        start = self.clock()
        options, bounded = self.bounded()
        run = self.runner(knobs, self.command, options, repeat)
        self._took(knobs, run.seconds if run.seconds is not None else self.clock() - start)
        self.other_loads.append(run.other_load)
        run.knobs = knobs.name
        if bounded and cut_short(run):
            self.stopped.append(knobs.name)
            raise OutOfTime(label)
        return run

    def _took(self, knobs: KnobSet, seconds: float) -> None:
        self.run_seconds.append(seconds)
        self.seconds_of.setdefault(knobs.name, []).append(seconds)
        if pays_once(knobs.values):
            self._compiling.add(knobs.name)

    def compare(self, baseline: KnobSet, arms: Sequence[KnobSet], repeats: int,
                what: str = "measuring", warm: bool = False, reserve: int = 0,
                settled: Callable[[ArmResult, ArmResult, Sequence[ArmResult]], bool] | None = None,
                ) -> tuple[ArmResult, list[ArmResult], bool]:
        """Run ``repeats`` interleaved rounds. Returns the baseline, the arms and
        whether every planned run happened (False: the deadline cut it short).
        ``warm``: one unmeasured run of the baseline first, so that the first round
        does not pay for cold file and compiler caches on one side only.
        ``reserve``: runs that must still fit after this comparison; a round after
        the first is not started when, at the run times seen so far, it would eat
        into them. ``settled(arm, baseline, arms)``: after the first round, whether an
        arm's verdict can no longer change (it then sits out the later rounds)."""
        base = ArmResult(baseline.name, baseline)
        results = [ArmResult(k.name, k) for k in arms]
        self.shortened = False

        def planned(repeat: int) -> list[ArmResult]:
            if settled is None or repeat <= 1:
                return [base, *results]
            return [base, *(a for a in results if not settled(a, base, results))]

        try:
            if warm:
                self._run(baseline, 0, f"{what}: warming the caches (not measured)")
            # Without a baseline nothing can be compared: its failure ends the rounds.
            label = (lambda repeat: f"{what}: round {repeat}/{repeats}")
            complete = interleave(planned, self._recorder(base, label), _failed, rounds=repeats,
                                  required=[base], reserve=reserve,
                                  stop=lambda repeat, runs: self._out_of_rounds(repeat, runs, planned(repeat)),
                                  together=self._together(base, label))
        except OutOfTime:
            return base, results, False
        return base, results, complete and not self.shortened

    def more_rounds(self, base: ArmResult, plan: Callable[[], Sequence[ArmResult]], what: str) -> bool:
        """Further interleaved rounds after a comparison, one at a time, while ``plan``
        names the arms for the next (none: no more): the baseline, then each of them
        that has not failed, each ratio taken against this round's baseline. Ends when
        the baseline fails; False when the deadline cut a round short."""
        extra = 0

        def arms(repeat: int) -> list[ArmResult]:
            nonlocal extra
            chosen = list(plan())
            if not chosen:
                return []
            extra += 1
            return [base, *chosen]

        def label(repeat: int) -> str:
            return f"{what}: extra round {extra}"

        try:
            interleave(arms, self._recorder(base, label), _failed, first=len(base.runs) + 1, required=[base],
                       together=self._together(base, label))
        except OutOfTime:
            return False
        return True

    def _recorder(self, base: ArmResult, label: Callable[[int], str]) -> Callable[[ArmResult, int], None]:
        """One run of an arm in a round, kept with the arm; an arm's ratio is taken
        against the baseline's run of the same round, which comes first. Runs that
        process more samples a step (a larger batch) are compared per sample: the
        ratio is of the step times per original batch."""
        def run(arm: ArmResult, repeat: int) -> None:
            latest = self._run(arm.knobs, repeat, f"{label(repeat)}: {'original' if arm is base else arm.name}")
            arm.runs.append(latest)
            against = base.runs[-1].typical_per_sample_unit
            mine = latest.typical_per_sample_unit
            if arm is not base and latest.ok and mine and against:
                arm.ratios.append(mine / against)

        return run


    def _together(self, base: ArmResult,
                  label: Callable[[int], str]) -> Callable[[list[ArmResult], int], None] | None:
        """A round's runs made at once (``together``), kept with their arms; each
        ratio against the baseline's run of the round. None when runs go one by one."""
        together = self.together
        if together is None:
            return None

        one_by_one = self._recorder(base, label)

        def run(arms: list[ArmResult], repeat: int) -> None:
            if self.together_limit is not None and len(arms) > self.together_limit:
                for arm in arms:  # the baseline first, as the rounds list it
                    one_by_one(arm, repeat)
                    if arm is base and _failed(base):
                        return
                return
            left = self.remaining()
            # Runs side by side share the machine's idle moments: 0.8 of a run each.
            cost = {id(a): 0.8 * self.expected_seconds_of(a.knobs) for a in arms}
            if left is not None and (left <= 0 or left < sum(cost.values())):
                # Not all of them fit: the original and, in order (the most promising
                # first), the changes that still fit, rather than none; a change whose
                # first compile does not fit leaves room for cheaper ones after it.
                if base not in arms or left <= cost[id(base)]:
                    raise OutOfTime(label(repeat))
                others = [a for a in arms if a is not base]
                again = [a for a in others if a.knobs.name == AGAIN]
                changes = [a for a in others if a.knobs.name != AGAIN]
                room = left - cost[id(base)]
                # The original against itself (the noise every change is judged by)
                # first, when a change still fits beside it: it only matters beside one.
                kept = [a for a in again[:1] if changes and cost[id(a)] + min(cost[id(c)] for c in changes) <= room]
                room -= sum(cost[id(a)] for a in kept)
                for arm in changes:
                    if cost[id(arm)] <= room:
                        kept.append(arm)
                        room -= cost[id(arm)]
                if not any(a.knobs.name != AGAIN for a in kept):
                    raise OutOfTime(label(repeat))
                taken = sum(1 for a in kept if a.knobs.name != AGAIN)
                self.progress(f"{label(repeat)}: {taken} of the {len(changes)} changes fit the --budget left")
                arms = [base, *kept]
                self.shortened = True
            self.progress(f"{label(repeat)}: {len(arms)} runs side by side, taking turns")
            # Who goes first rotates with the rounds.
            shift = repeat % len(arms)
            order = arms[shift:] + arms[:shift]
            options, bounded = self.bounded(len(order))
            runs = together([a.knobs for a in order], repeat, options)
            for arm, latest in zip(order, runs):
                if latest.seconds is not None:  # None: not started, for the round's time
                    self._took(arm.knobs, latest.seconds)
                    self.other_loads.append(latest.other_load)
            # Runs the deadline stopped before a measured step are no failures of their
            # change: left out of the round (without the original's, nothing is kept).
            cut = {id(arm) for arm, latest in zip(order, runs) if bounded and cut_short(latest)}
            self.stopped.extend(arm.knobs.name for arm in order if id(arm) in cut)
            if id(base) in cut:
                raise OutOfTime(label(repeat))
            if cut:
                self.shortened = True
            for arm, latest in zip(order, runs):
                if id(arm) not in cut:
                    latest.knobs = arm.knobs.name
                    arm.runs.append(latest)
            against = base.runs[-1].typical_per_sample_unit if base in arms else None
            for arm in arms:
                if id(arm) in cut or not arm.runs:
                    continue
                mine = arm.runs[-1].typical_per_sample_unit
                if arm is not base and arm.runs[-1].ok and mine and against:
                    arm.ratios.append(mine / against)

        return run


def before_grace(left: float) -> float:
    """The longest --timeout whose run still ends within ``left`` seconds when it
    takes all the grace the harness allows it to stop after its timeout (half the
    timeout, between 1 and 10 s: ``HarnessOptions.grace_seconds``). A run stopped in
    a first compile, or waiting for its turn, may need it; the --budget is kept."""
    if left >= 3 * GRACE_MAX_SECONDS:
        return left - GRACE_MAX_SECONDS  # a grace of the most
    if left >= 3:
        return left / 1.5  # a grace of half the timeout
    return left - 1  # a grace of the least


def cut_short(run: TrialRun) -> bool:
    """Whether ``run`` failed for its --timeout (stopped by the harness, or killed)."""
    return not run.ok and (run.status == "timeout" or (run.error or "").startswith("timeout"))


def _failed(arm: ArmResult) -> bool:
    return arm.error is not None
