"""Compare the profiles of the ranks of one distributed run.

In data-parallel training every step ends with a gradient exchange, so the whole job
runs at the pace of its slowest rank, and every rank's step time comes out nearly the
same: the others wait, inside ``backward()``, for the slowest one's gradients. The
rank they wait for is the one that spends the longest *outside* backward (data,
forward, optimizer, host work), less its time in the script's own collectives (a
per-step ``barrier()`` or loss ``all_reduce``), where it too waits for the others.
``merge_profiles`` puts the ranks side by side and
names the slowest rank by that time when every rank measured it (by step time
otherwise), with its distance from the median rank, and, step by step, which rank
was slowest.

On GPUs the gradient exchange is waited for on the device, not the host, so this
finds ranks whose host side is slow (data loading, Python work, host syncs); a slow
device shows in the step time instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.profile import Profile
from torchaxe.runtime.stats import Samples, quantile

MERGE_SCHEMA = "torchaxe.profile-merge/1"


@dataclass(frozen=True)
class RankSummary:
    rank: int
    path: str
    status: str
    steps_measured: int
    step_seconds_median: float | None
    step_seconds_p90: float | None
    outside_backward_seconds_median: float | None
    data_wait_fraction: float | None
    host_syncs_per_step: float | None
    peak_device_memory_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


    def measure(self, by: str) -> float | None:
        return self.outside_backward_seconds_median if by == OUTSIDE_BACKWARD else self.step_seconds_median


#: The two ways of ranking ranks: by time outside backward, or by step time.
OUTSIDE_BACKWARD = "outside_backward_seconds"
STEP_TIME = "step_seconds"


@dataclass(frozen=True)
class StepAcrossRanks:
    """One measured step on every rank that measured it: its time, and its time
    outside backward where measured."""

    index: int
    seconds: dict[int, float]
    outside_backward: dict[int, float] = field(default_factory=dict)

    def slowest_rank(self, by: str) -> int:
        values = self.outside_backward if by == OUTSIDE_BACKWARD and self.outside_backward else self.seconds
        return max(values, key=lambda r: (values[r], -r))

    def to_dict(self, by: str) -> dict[str, Any]:
        return {
            "index": self.index,
            "seconds": {str(r): s for r, s in sorted(self.seconds.items())},
            "outside_backward_seconds": {str(r): s for r, s in sorted(self.outside_backward.items())},
            "slowest_rank": self.slowest_rank(by),
            "spread_seconds": max(self.seconds.values()) - min(self.seconds.values()),
        }


@dataclass
class MergeReport:
    world_size: int
    ranks: list[RankSummary]
    steps: list[StepAcrossRanks] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def slowest_by(self) -> str:
        """``outside_backward_seconds`` when every rank measured it, else ``step_seconds``."""
        if self.ranks and all(r.outside_backward_seconds_median is not None for r in self.ranks):
            return OUTSIDE_BACKWARD
        return STEP_TIME

    @property
    def median_step_seconds(self) -> float | None:
        """The median over ranks of each rank's median step time."""
        medians = [r.step_seconds_median for r in self.ranks if r.step_seconds_median is not None]
        return quantile(medians, 0.5) if medians else None

    @property
    def median_rank_measure(self) -> float | None:
        """The median over ranks of the measure the slowest rank is chosen by."""
        values = [r.measure(self.slowest_by) for r in self.ranks if r.measure(self.slowest_by) is not None]
        return quantile(values, 0.5) if values else None

    @property
    def slowest(self) -> RankSummary | None:
        by = self.slowest_by
        timed = [r for r in self.ranks if r.measure(by) is not None]
        return max(timed, key=lambda r: (r.measure(by), -r.rank)) if timed else None

    @property
    def slowest_vs_median(self) -> float | None:
        """How far the slowest rank is above the median rank, on the measure it was
        chosen by (0.1 = 10%)."""
        slowest, median = self.slowest, self.median_rank_measure
        if slowest is None or not median:
            return None
        return slowest.measure(self.slowest_by) / median - 1.0

    def slowest_counts(self) -> dict[int, int]:
        """How many steps each rank was the slowest on."""
        by = self.slowest_by
        counts = {r.rank: 0 for r in self.ranks}
        for step in self.steps:
            rank = step.slowest_rank(by)
            counts[rank] = counts.get(rank, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        slowest = self.slowest
        by = self.slowest_by
        return {
            "schema": MERGE_SCHEMA,
            "world_size": self.world_size,
            "ranks": [r.to_dict() for r in self.ranks],
            "step_seconds_median_across_ranks": self.median_step_seconds,
            "slowest_by": by,
            "slowest_rank": slowest.rank if slowest else None,
            "slowest_seconds": slowest.measure(by) if slowest else None,
            "median_rank_seconds": self.median_rank_measure,
            "slowest_vs_median": self.slowest_vs_median,
            "slowest_counts": {str(k): v for k, v in self.slowest_counts().items()},
            "steps": [s.to_dict(by) for s in self.steps],
            "warnings": list(self.warnings),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def merge_profiles(profiles: list[tuple[str | Path, Profile]]) -> MergeReport:
    """Merge the per-rank profiles of one run; one-line TorchaxeError when the files
    do not belong together."""
    if not profiles:
        raise TorchaxeError("nothing to merge: give the per-rank profile files")
    by_rank: dict[int, tuple[str, Profile]] = {}
    world_sizes = set()
    for path, profile in profiles:
        run = profile.run
        if run.rank is None or run.world_size is None:
            raise TorchaxeError(f"{path}: not from a distributed run (no rank); merge combines the per-rank files of one run")
        if run.rank in by_rank:
            raise TorchaxeError(f"{path}: rank {run.rank} again (also in {by_rank[run.rank][0]})")
        by_rank[run.rank] = (str(path), profile)
        world_sizes.add(run.world_size)
    if len(world_sizes) > 1:
        raise TorchaxeError(f"the files come from runs of different sizes (world sizes {sorted(world_sizes)})")
    world_size = world_sizes.pop()
    warnings = []
    missing = sorted(set(range(world_size)) - set(by_rank))
    if missing:
        warnings.append(f"{len(by_rank)} of {world_size} ranks: no profile for rank{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))}")
    commands = {tuple(p.run.command) for _, p in by_rank.values()}
    if len(commands) > 1:
        warnings.append("the ranks ran different commands")
    ranks = []
    per_step: dict[int, dict[int, float]] = {}
    per_step_outside: dict[int, dict[int, float]] = {}
    for rank in sorted(by_rank):
        path, profile = by_rank[rank]
        summary = profile.summary
        ranks.append(RankSummary(
            rank=rank,
            path=path,
            status=profile.status,
            steps_measured=summary.steps_measured,
            step_seconds_median=summary.step_seconds_median,
            step_seconds_p90=summary.step_seconds_p90,
            outside_backward_seconds_median=_own_work_median(profile),
            data_wait_fraction=summary.data_wait_fraction,
            host_syncs_per_step=summary.host_syncs_per_step,
            peak_device_memory_bytes=summary.peak_device_memory_bytes,
        ))
        for step in profile.measured_steps:
            per_step.setdefault(step.index, {})[rank] = step.seconds
            own = step.own_work_seconds()
            if own is not None:
                per_step_outside.setdefault(step.index, {})[rank] = own
        if profile.status not in ("completed", "stopped"):
            warnings.append(f"rank {rank} ended with status {profile.status}: {profile.detail}")
    steps = []
    for index, seconds in sorted(per_step.items()):
        if len(seconds) < 2:
            continue
        outside = per_step_outside.get(index, {})
        steps.append(StepAcrossRanks(index, seconds, outside if set(outside) == set(seconds) else {}))
    report = MergeReport(world_size=world_size, ranks=ranks, steps=steps, warnings=warnings)
    medians = Samples.of(r.step_seconds_median for r in ranks)
    if len(medians) > 1 and medians.max and medians.min and medians.max / medians.min > 1.5:
        warnings.append("the ranks' median step times differ by more than 50%: look at the slowest rank's data "
                        "loading, host syncs and core binding")
    return report


def _own_work_median(profile: Profile) -> float | None:
    """The median over the measured steps of the time outside backward and the script's
    own collectives (where a rank waits for the others); None unless every step has it."""
    own = [step.own_work_seconds() for step in profile.measured_steps]
    return quantile([v for v in own if v is not None], 0.5) if own and None not in own else None
