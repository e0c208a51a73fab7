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
from torchaxe.units import duration

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


def load_ranks(out: str | Path) -> dict[int, Profile]:
    """The profiles a run wrote for ``out`` (see :func:`rank_files`), by rank; a file
    that cannot be read (a rank killed while writing) is left out."""
    from torchaxe.errors import TorchaxeError
    from torchaxe.runtime.profile import ProfileFormatError, load_profile

    profiles = {}
    for rank, path in rank_files(out).items():
        try:
            profiles[rank] = load_profile(path)
        except (ProfileFormatError, TorchaxeError):
            continue
    return profiles


@dataclass(frozen=True)
class JobSteps:
    """The job's measured steps: per step, the slowest rank's time and that rank's data wait."""

    seconds: list[float]
    data_wait_seconds: list[float]
    #: Per step, the rank that was slowest.
    slowest: list[int]
    #: Per step, that rank's time in optimizers' ``step()`` (None: no optimizer stepped).
    optimizer_seconds: list[float | None]


def job_steps(profiles: dict[int, Profile]) -> JobSteps:
    """Step ``i`` of the job is the slowest rank's step ``i`` (over the steps every rank measured)."""
    measured = {rank: p.measured_steps for rank, p in profiles.items()}
    count = min((len(steps) for steps in measured.values()), default=0)
    seconds, waits, slowest, optimizer = [], [], [], []
    for i in range(count):
        rank = max(measured, key=lambda r: (measured[r][i].seconds, -r))
        step = measured[rank][i]
        seconds.append(step.seconds)
        waits.append(step.data_wait_seconds or 0.0)
        slowest.append(rank)
        optimizer.append(step.optimizer_seconds)
    return JobSteps(seconds, waits, slowest, optimizer)


def _fraction(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def rank_row(rank: int, profile: Profile) -> dict[str, Any]:
    """One rank's line: who it is and where its step went."""
    summary = profile.summary
    dist = profile.distributed
    steps = profile.measured_steps
    comm = Samples.of(s.comm_seconds for s in steps if s.comm_seconds is not None).median
    own = [s.own_work_seconds() for s in steps]
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
        "own_work_seconds_median": Samples.of(own).median if own and None not in own else None,
        "comm_seconds_per_step": dist.comm_seconds_per_step if dist is not None else comm,
        "comm_exposed_seconds_per_step": dist.comm_exposed_seconds_per_step if dist is not None else None,
        "cpus": dist.cpus if dist is not None else None,
        "input_signatures": dist.input_signatures if dist is not None else None,
        "compute_seconds_per_step": dist.compute_seconds_per_step if dist is not None else None,
        "synced_backwards_per_step": dist.synced_backwards_per_step if dist is not None else None,
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


def missing_local_ranks(profiles: dict[int, Profile]) -> list[int]:
    """The local ranks of this node (``0..LOCAL_WORLD_SIZE-1``) that wrote no profile."""
    sizes = [p.distributed.local_world_size for p in profiles.values()
             if p.distributed is not None and p.distributed.local_world_size]
    if not sizes:
        return []
    seen = {p.run.local_rank for p in profiles.values()}
    return [r for r in range(max(sizes)) if r not in seen]


def world_of(profiles: Sequence[Profile]) -> int | None:
    sizes = [p.run.world_size for p in profiles if p.run.world_size]
    return max(sizes) if sizes else None


def _median(values: Sequence[float | None]) -> float | None:
    return Samples.of(v for v in values if v is not None).median


def _input_signatures(profile: Profile) -> int | None:
    shapes = profile.shapes
    if shapes is None or not shapes.modules:
        return None
    return max(len(m.signatures) for m in shapes.modules)


def _own_work(row: dict[str, Any]) -> float | None:
    """A row's time outside backward and the script's collectives (a row from before
    that figure: its time outside backward)."""
    own = row.get("own_work_seconds_median")
    return own if own is not None else row.get("outside_backward_seconds_median")


def slowest_reason(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Why one rank is behind the others, from what the ranks measured: data wait,
    fewer CPUs, more input shapes (recompiles, cold caches), or slower compute."""
    others = [r for r in rows if r["rank"] != row["rank"]]
    if not others:
        return "the only rank"
    reasons = []
    step = row.get("step_seconds_median") or 0.0
    wait = (row.get("data_wait_fraction") or 0.0) * step
    other_wait = _median([(r.get("data_wait_fraction") or 0.0) * (r.get("step_seconds_median") or 0.0)
                          for r in others]) or 0.0
    if wait - other_wait > 0.02 * step and wait > 1.5 * other_wait:
        reasons.append(f"it waits for data ({duration(wait)} a step against {duration(other_wait)} on "
                       "the others)")
    cpus, other_cpus = row.get("cpus"), _median([r.get("cpus") for r in others])
    if cpus and other_cpus and cpus < other_cpus:
        reasons.append(f"it may run on fewer CPUs ({cpus} against {other_cpus:g}): check its core binding")
    sigs, other_sigs = row.get("input_signatures"), _median([r.get("input_signatures") for r in others])
    if sigs and other_sigs and sigs > other_sigs:
        reasons.append(f"its model saw more input shapes ({sigs} against {other_sigs:g}): dynamic shapes cost it "
                       "compiles and cold caches")
    compute, other_compute = row.get("compute_seconds_per_step"), _median(
        [r.get("compute_seconds_per_step") for r in others])
    if compute and other_compute and compute > 1.1 * other_compute:
        reasons.append(f"its forward and backward compute is slower ({duration(compute)} against "
                       f"{duration(other_compute)}): a slower or busier device")
    outside, other_outside = _own_work(row), _median([_own_work(r) for r in others])
    if not reasons and outside and other_outside and outside > 1.1 * other_outside:
        reasons.append(f"it spends longer outside backward and collectives ({duration(outside)} against "
                       f"{duration(other_outside)}): its host work (Python, data, optimizer) is slower")
    if reasons:
        return "; ".join(reasons)
    if outside is not None and other_outside is not None:
        return (f"only just: {duration(outside - other_outside)} a step longer outside backward and "
                "collectives than the others, too little to name a cause; no rank stands out")
    return "only just: no rank stands out, the ranks' step times are close"


def distributed_view(profiles: dict[int, Profile]) -> dict[str, Any] | None:
    """The job across its ranks: who they are, where each rank's step went, the rank
    the others wait for and why. None for a one-process run."""
    infos = {r: p.distributed for r, p in profiles.items() if p.distributed is not None}
    world = world_of(list(profiles.values()))
    if not infos and not (world and world > 1):
        return None
    rows = rank_rows(profiles)
    for row in rows:
        row["input_signatures"] = row.get("input_signatures") or _input_signatures(profiles[row["rank"]])
    first = next(iter(infos.values()), None)
    return with_slowest({
        "world_size": world or len(profiles),
        "nnodes": first.nnodes if first is not None else None,
        "backend": first.backend if first is not None else None,
        "ranks_measured": len(profiles),
        "ranks": rows,
        "ddp": first.ddp if first is not None else None,
        # Ranks a launcher started without a process group train alone: none waits for another.
        "process_group": bool(infos),
    })


def with_slowest(view: dict[str, Any]) -> dict[str, Any]:
    """``view`` with the rank the others wait for (``slowest_rank``, ``slowest_reason``)
    and each rank's wait for it, from its rows."""
    rows = view["ranks"]
    if view.get("process_group") is False:
        for row in rows:
            row["wait_for_slowest_seconds_per_step"] = None
        view["slowest_rank"] = view["slowest_reason"] = None
        return view
    # The others wait, in their gradient exchange or a collective of the script, for the
    # rank that spends longest outside both (waiting in a collective is not work).
    outside = {row["rank"]: _own_work(row) for row in rows}
    by = outside if all(v is not None for v in outside.values()) else \
        {row["rank"]: row.get("step_seconds_median") for row in rows}
    known = {r: v for r, v in by.items() if v is not None}
    slowest = max(known, key=lambda r: (known[r], -r)) if known else None
    for row in rows:
        mine = known.get(row["rank"])
        row["wait_for_slowest_seconds_per_step"] = (known[slowest] - mine) if slowest is not None and mine is not None \
            else None
    view["slowest_rank"] = slowest
    view["slowest_reason"] = slowest_reason(next(r for r in rows if r["rank"] == slowest), rows) \
        if slowest is not None else None
    return view


def with_measured_rows(view: dict[str, Any], runs: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """``view`` (made from the profiling run) with each rank's figures replaced by their
    medians over ``runs`` (the rank rows of the original's measured runs), so that they
    agree with the step time measured in those runs; ``ranks_source`` says so."""
    merged = median_rows(runs)
    if not merged:
        return view
    before = {row["rank"]: row for row in view.get("ranks") or []}
    rows = [{**before.get(row["rank"], {"rank": row["rank"]}), **{key: row[key] for key in (*ROW_FIGURES, "runs")}}
            for row in merged]
    return with_slowest({**view, "ranks": rows, "ranks_source": "measured runs of the original"})


#: The per-rank figures a measured change is compared by.
ROW_FIGURES = ("step_seconds_median", "data_wait_fraction", "comm_seconds_per_step", "comm_exposed_seconds_per_step",
               "outside_backward_seconds_median", "own_work_seconds_median", "compute_seconds_per_step",
               "synced_backwards_per_step")


def median_rows(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]] | None:
    """Several runs' rank rows as one row per rank: the median of each figure."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            by_rank.setdefault(row["rank"], []).append(row)
    if not by_rank:
        return None
    out = []
    for rank, rows in sorted(by_rank.items()):
        merged: dict[str, Any] = {"rank": rank, "local_rank": rows[0].get("local_rank"), "host": rows[0].get("host"),
                                  "runs": len(rows)}
        for key in ROW_FIGURES:
            merged[key] = _median([r.get(key) for r in rows])
        out.append(merged)
    return out


def root_cause_rank(failure: str | None) -> int | None:
    """The rank a torchrun failure line (``runtime/torchrun.py`` ``torchrun_failure``) names."""
    match = re.match(r"rank (\d+)", failure or "")
    return int(match.group(1)) if match else None
