"""The profiles of one run's ranks, read together: the job's steps and each rank's part.

Under torchrun every rank writes ``OUT.rankN.json``; a one-process run writes ``OUT``.
:func:`rank_files` finds them. In data-parallel training the job moves at the pace of
its slowest rank, so the job's step ``i`` takes the longest of the ranks' step ``i``
(:func:`job_steps`), and its data wait is the data wait of the rank that was slowest
in that step. :func:`rank_rows` gives each rank's own figures, the per-rank lines of
the advice's ``distributed`` object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from torchaxe.runtime.profile import Profile
from torchaxe.runtime.stats import Samples

_RANK = re.compile(r"\.rank(\d+)$")


def rank_files(out: str | Path) -> dict[int, Path]:
    """The profile files a run wrote for ``out``: rank -> path (rank 0 for a one-process
    run's ``out`` itself); empty when nothing was written."""
    out = Path(out)
    found: dict[int, Path] = {}
    if out.exists() and out.stat().st_size:
        found[0] = out
    suffix = out.suffix or ".json"
    stem = out.name[: -len(out.suffix)] if out.suffix else out.name
    for path in out.parent.glob(f"{stem}.rank*{suffix}"):
        match = _RANK.search(path.name[: -len(suffix)])
        if match and path.stat().st_size:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class JobSteps:
    """The job's measured steps: per step, the slowest rank's time and that rank's data wait."""

    seconds: list[float]
    data_wait_seconds: list[float]
    #: Per step, the rank that was slowest.
    slowest: list[int]


def job_steps(profiles: dict[int, Profile]) -> JobSteps:
    """Step ``i`` of the job is the slowest rank's step ``i`` (over the steps every rank measured)."""
    measured = {rank: p.measured_steps for rank, p in profiles.items()}
    count = min((len(steps) for steps in measured.values()), default=0)
    seconds, waits, slowest = [], [], []
    for i in range(count):
        rank = max(measured, key=lambda r: (measured[r][i].seconds, -r))
        step = measured[rank][i]
        seconds.append(step.seconds)
        waits.append(step.data_wait_seconds or 0.0)
        slowest.append(rank)
    return JobSteps(seconds, waits, slowest)


def _fraction(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def rank_row(rank: int, profile: Profile) -> dict[str, Any]:
    """One rank's line: who it is and where its step went."""
    summary = profile.summary
    dist = profile.distributed
    steps = profile.measured_steps
    comm = Samples.of(s.comm_seconds for s in steps if s.comm_seconds is not None).median
    return {
        "rank": rank,
        "local_rank": profile.run.local_rank,
        "host": dist.host if dist is not None else None,
        "status": profile.status,
        "steps_measured": len(steps),
        "step_seconds_median": summary.step_seconds_median,
        "data_wait_fraction": summary.data_wait_fraction,
        "host_syncs_per_step": summary.host_syncs_per_step,
        "outside_backward_seconds_median": summary.outside_backward_seconds_median,
        "comm_seconds_per_step": dist.comm_seconds_per_step if dist is not None else comm,
        "comm_exposed_seconds_per_step": dist.comm_exposed_seconds_per_step if dist is not None else None,
        "cpus": dist.cpus if dist is not None else None,
        "input_signatures": dist.input_signatures if dist is not None else None,
        "compute_seconds_per_step": dist.compute_seconds_per_step if dist is not None else None,
    }


def rank_rows(profiles: dict[int, Profile]) -> list[dict[str, Any]]:
    return [rank_row(rank, p) for rank, p in sorted(profiles.items())]


def failed_rank(profiles: dict[int, Profile]) -> tuple[int, Profile] | None:
    """The first rank whose run did not end as measured (raised, exited, timed out)."""
    for rank, p in sorted(profiles.items()):
        if p.status in ("error", "timeout", "interrupted") or (p.status == "exited" and p.exit_code):
            return rank, p
    return None


def first_rank(profiles: dict[int, Profile]) -> Profile | None:
    return profiles[min(profiles)] if profiles else None


def missing_ranks(profiles: dict[int, Profile], world: int | None) -> list[int]:
    """The local ranks expected (``0..world-1`` where all ranks are local) that wrote nothing."""
    if not world or world <= 1:
        return []
    return [r for r in range(world) if r not in profiles]


def world_of(profiles: Sequence[Profile]) -> int | None:
    sizes = [p.run.world_size for p in profiles if p.run.world_size]
    return max(sizes) if sizes else None
