"""The statistics advise decides with: the rank test against the A/A arm, whether a
gain is clear, whether an undecided change is worth more rounds, and the figures of
an arm measured against the original. Pure functions of per-round ratios."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from torchaxe.advise.measure import ArmResult

#: A change must save at least this fraction of the step (median over rounds), and
#: beat the run-to-run noise (see clear_gain), to be chosen for the combined run.
MIN_GAIN = 0.03
#: Rounds of one change further apart than twice this (and twice the noise) disagree.
SPLIT_GAP = 0.05
#: Rounds a promising change may get when the budget leaves time for more.
MAX_ROUNDS = 5
#: A change is judged on at least this many rounds when the budget allows.
DECIDE_ROUNDS = 3
#: The share of rounds a change must be faster in (every round, up to four rounds).
FASTER_SHARE = 0.8
#: On fewer than DECIDE_ROUNDS rounds, the least a change must save in its worst
#: round: one or two A/A pairs measure the noise poorly (a Lightning GAN's bf16 autocast
#: at 1.06x on one round, beside an A/A pair 0.4% apart, was 0.92x over four).
FEW_ROUNDS_GAIN = 0.10
#: A change whose rounds rank below the A/A arm's with at most this chance under no
#: effect (one-sided Mann-Whitney, exact) beats the noise even when a single A/A
#: round strayed further than its gain.
SIGNIFICANCE = 0.05
#: A change that may alter the numerics is not chosen when its mean training loss
#: differs from the original's by more than the run-to-run loss noise plus this
#: fraction of the loss (``advise --loss-tolerance``). Mixed precision with the loss
#: in float32 lands well within it; a loss computed in bfloat16 (5% off on a
#: word-level language model) does not.
LOSS_TOLERANCE = 0.02


def rank_p_value(changed: Sequence[float], same: Sequence[float]) -> float:
    """One-sided exact Mann-Whitney p-value that ``changed`` (per-round ratios of a
    change) tend lower than ``same`` (ratios of the original against itself): the
    chance, if the change did nothing, of ranking at least this far below. Ties count
    one half. 1.0 when either side is empty."""
    n, m = len(changed), len(same)
    if not n or not m:
        return 1.0

    def u_of(xs: Sequence[float], ys: Sequence[float]) -> float:
        return sum(1.0 if x < y else 0.5 if x == y else 0.0 for x in xs for y in ys)

    observed = u_of(changed, same)
    pooled = list(changed) + list(same)
    at_least = total = 0
    for picked in itertools.combinations(range(n + m), n):
        chosen = set(picked)
        xs = [pooled[i] for i in picked]
        ys = [pooled[i] for i in range(n + m) if i not in chosen]
        total += 1
        if u_of(xs, ys) >= observed - 1e-12:
            at_least += 1
    return at_least / total


def clear_gain(ratios: Sequence[float], noise: float, same: Sequence[float] = ()) -> bool:
    """Whether per-round ratios (change / original) show a gain to act on: at least
    ``MIN_GAIN`` of the step by median, and beyond the run-to-run noise, one of two
    ways: ranked below the A/A arm's ratios (``same``, the original against itself in
    the same rounds) beyond chance (``SIGNIFICANCE``); or faster in every round (one
    slow round in five is let through once the budget has paid for five) by more than
    the furthest the original strayed from itself (``noise``), and on fewer than
    ``DECIDE_ROUNDS`` rounds by at least ``FEW_ROUNDS_GAIN`` too."""
    if not ratios:
        return False
    # On fewer than DECIDE_ROUNDS rounds a median is one outlier away from anything:
    # the gain is then the worst round's.
    gain = 1.0 - (statistics.median(ratios) if len(ratios) >= DECIDE_ROUNDS else max(ratios))
    if gain < MIN_GAIN:
        return False
    if len(ratios) >= DECIDE_ROUNDS and rank_p_value(ratios, same) <= SIGNIFICANCE:
        # The A/A arm is the control: rounds in which the original ran slow pull its
        # ratios down too, so a change that ranks below them gained on its own.
        return True
    faster = sum(r <= 1.0 - MIN_GAIN / 3 for r in ratios)
    floor = noise if len(ratios) >= DECIDE_ROUNDS else max(noise, FEW_ROUNDS_GAIN)
    return faster >= FASTER_SHARE * len(ratios) and gain >= floor


def promising(ratios: Sequence[float]) -> bool:
    """A median gain of at least ``MIN_GAIN``: worth more rounds when undecided."""
    return bool(ratios) and 1.0 - statistics.median(ratios) >= MIN_GAIN


@dataclass
class Noise:
    """How far runs of the unchanged script land from each other on this machine:
    the A/A arm's per-round ratios, the furthest of them from 1 (``spread``), and how
    far apart their training losses landed (``loss``, see :func:`loss_noise`; None
    when not recorded)."""

    spread: float = 0.0
    same: list[float] = field(default_factory=list)
    loss: float | None = None

    def beaten_by(self, ratios: Sequence[float]) -> bool:
        """Whether per-round ratios show a clear gain over this noise (clear_gain)."""
        return clear_gain(ratios, self.spread, self.same)

    def split(self, ratios: Sequence[float]) -> bool:
        """Whether a change's rounds disagree about it far beyond this noise: one round
        clearly faster, another not (a SimCLR's compile at 0.81 and 1.20 beside the
        original against itself within 4%). Its median says little: more rounds
        decide it."""
        if len(ratios) < 2 or min(ratios) > 1.0 - MIN_GAIN:
            return False
        return max(ratios) - min(ratios) > max(2 * self.spread, 2 * SPLIT_GAP)


#: The A/A arm (the original under another seed, the same other seed every round) this
#: far from the original, on the same side in every round, ...
SEED_DEPENDENT_SHIFT = 0.30
#: ... while its rounds agree with each other, and the original's own runs (its seed)
#: with each other, this many times more closely: the work of a step depends on the
#: random draws (an episode's length in reinforcement learning, a sampled sequence
#: length), not on the machine, whose noise scatters the A/A rounds both ways.
SEED_DEPENDENT_FACTOR = 3.0


def own_runs_noise(run_medians: Sequence[float]) -> Noise | None:
    """The run-to-run noise of the original's own runs (each run's median step), as a
    :class:`Noise` whose control ratios are each run over their median; None with
    fewer than two runs."""
    runs = [m for m in run_medians if m and m > 0]
    if len(runs) < 2:
        return None
    middle = statistics.median(runs)
    ratios = [m / middle for m in runs]
    return Noise(max(abs(1.0 - r) for r in ratios), ratios)


def seed_dependent(aa: Sequence[float], own: Noise | None) -> bool:
    """Whether the A/A arm's per-round ratios ``aa`` strayed because its other seed
    changed the work of a step (see ``SEED_DEPENDENT_SHIFT``): they sit on one side
    of 1, far from it, and agree with each other as the original's own runs (``own``)
    do. Two rounds at least."""
    if own is None or len(aa) < 2:
        return False
    middle = statistics.median(aa)
    shift = abs(middle - 1.0)
    if shift < SEED_DEPENDENT_SHIFT or not (all(r > 1.0 for r in aa) or all(r < 1.0 for r in aa)):
        return False
    scatter = max(abs(r / middle - 1.0) for r in aa)
    return shift >= SEED_DEPENDENT_FACTOR * max(scatter, own.spread, MIN_GAIN)


def paired_ratios(arm: ArmResult, against: Sequence[float]) -> list[float]:
    """An arm's per-round ratios over another's in the same rounds."""
    return [a / b for a, b in zip(arm.ratios, against)]


def _common_steps(runs: Sequence[Sequence[float]]) -> int:
    return min((len(r) for r in runs), default=0)


def _mean_losses(runs: Sequence[Sequence[float]], n: int) -> list[float]:
    return [statistics.fmean(r[:n]) for r in runs]


def _loss_scale(runs: Sequence[Sequence[float]], n: int) -> float:
    """The size of a loss: the mean of its steps' absolute values. For a loss that is
    never negative (cross-entropy, a squared error) that is its mean; a signed loss
    that averages near zero (REINFORCE's log-probability times a normalised return)
    keeps the size of its steps, not of their near-zero sum."""
    return max(statistics.fmean(abs(v) for r in runs for v in r[:n]), 1e-12)


def loss_noise(*originals: ArmResult) -> float | None:
    """How far apart the runs of the unchanged script landed in training loss: the
    largest difference between two runs' mean loss (over the steps every run
    recorded), relative to the loss's size (:func:`_loss_scale`). Runs of the same
    seed land 0.0 apart for a deterministic script; advise adds a run under another
    seed (the A/A arm), which is what a change of random draws alone does. None with
    fewer than two runs that recorded a loss."""
    runs = [losses for arm in originals for losses in arm.losses if losses]
    n = _common_steps(runs)
    if len(runs) < 2 or not n:
        return None
    means = _mean_losses(runs, n)
    return (max(means) - min(means)) / _loss_scale(runs, n)


def loss_delta(arm: ArmResult, *originals: ArmResult) -> float | None:
    """The relative difference of a change's mean training loss from the original's,
    signed (above 0: higher loss): the loss of every run averaged over the steps that
    all of them recorded (same seed, so the same batches), then over the runs of each
    side, relative to the original's loss size (:func:`_loss_scale`). None when either
    side recorded no loss."""
    changed = [losses for losses in arm.losses if losses]
    same = [losses for o in originals for losses in o.losses if losses]
    n = _common_steps(changed + same)
    if not changed or not same or not n:
        return None
    reference = statistics.fmean(_mean_losses(same, n))
    return (statistics.fmean(_mean_losses(changed, n)) - reference) / _loss_scale(same, n)


#: A change's warm-up steps must take this much longer than the original's (seconds,
#: and steps of the original) before its one-time cost is reported.
ONE_TIME_MIN_SECONDS = 1.0
ONE_TIME_MIN_STEPS = 5


def one_time_cost(arm: ArmResult, base: ArmResult, saved_per_step: float,
                  same: ArmResult | None = None) -> dict[str, Any]:
    """What a change costs once, before its first fast step -- compiling, mostly --
    as the extra wall time of its warm-up steps over the original's, and the steps
    after which the time it saves per step has paid that back (a short job may end
    first). Empty when the warm-up took about as long as the original's, or than
    twice as far as the original's own second run (``same``, the A/A arm) strayed from
    it: a busy machine slows one warm-up more than another.

    The cost is the one a run after advise pays on this machine, its warm-up once
    torch's compile caches hold the change's kernels (its runs after the first, see
    ``ArmResult.warmup_seconds``); ``one_time_seconds_first`` is what its first run
    paid, filling them, where that was more; ``one_time_cold_only`` marks a cost
    known from that first run alone, which a later run may pay much less of."""
    mine, original = arm.warmup_seconds, base.warmup_seconds
    if mine is None or original is None:
        return {}
    strayed = abs(same.warmup_seconds - original) if same is not None and same.warmup_seconds is not None else 0.0
    least = max(ONE_TIME_MIN_SECONDS, ONE_TIME_MIN_STEPS * (base.median or 0.0), 2 * strayed)
    extra, first = mine - original, (arm.first_warmup_seconds or mine) - original
    if extra < least:
        if not arm.warm_runs or first < least:
            return {}
        # Paid only where torch's compile caches do not yet hold its kernels: another
        # machine, or this one after its caches are cleared.
        return {"one_time_seconds_first": first}
    out = with_one_time({}, extra, saved_per_step)
    if not arm.warm_runs:
        out["one_time_cold_only"] = True  # its only run filled the caches: a later run pays less
    elif first - extra >= least:
        out["one_time_seconds_first"] = first
    return out


def with_one_time(figures: dict[str, Any], once: float, saved_per_step: float) -> dict[str, Any]:
    """``figures`` with a one-time cost of ``once`` seconds and, when a step saves
    time, the steps after which that saving has paid it back."""
    out: dict[str, Any] = {**figures, "one_time_seconds": once}
    if saved_per_step > 0:
        out["break_even_steps"] = math.ceil(once / saved_per_step)
    return out


def measured_figures(arm: ArmResult, base: ArmResult, original_median: float | None = None) -> dict[str, Any]:
    """The figures of an arm measured against the original in the same rounds (its
    ratio is known): speed-up, per-round ratios, time saved, both step medians, and
    the difference of its training loss when it was recorded, both peak memories.
    ``original_median``: the original's step time the report quotes (from all its
    rounds), which the time saved is a share of; else the median of ``base``'s runs."""
    ratio = arm.ratio or 1.0
    peak, original = arm.peak_memory, base.peak_memory
    reference = original_median if original_median is not None else base.median
    out = {"status": "measured", "speedup": 1.0 / ratio, "ratios": [round(r, 4) for r in arm.ratios],
           "measured_seconds_saved_per_step": (reference or 0.0) * (1.0 - ratio),
           "step_seconds_median": arm.median, "original_step_seconds_median": base.median,
           "peak_memory_bytes": peak[0] if peak else None, "memory_kind": peak[1] if peak else None,
           "original_peak_memory_bytes": original[0] if original else None}
    delta = loss_delta(arm, base)
    if delta is not None:
        out["loss_delta"] = delta
    out.update(one_time_cost(arm, base, out["measured_seconds_saved_per_step"]))
    if arm.rank_figures:
        out["ranks"] = arm.rank_figures
        out["original_ranks"] = base.rank_figures
    return out
