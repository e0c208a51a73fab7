"""What ``torchaxe advise`` hands back: measured recommendations, ranked, and the
evidence they rest on. Plain data with a stable JSON form (schema
``torchaxe.advice/1``); rendering lives in ``torchaxe.report``. A recommendation and
its accuracy are defined beside the candidates (runtime/candidate.py), where the
axis packages that propose them can reach them; they are re-exported here."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from torchaxe.environment.checks import EnvironmentCheck
from torchaxe.runtime.candidate import Accuracy, Recommendation

__all__ = ["AXES", "AXIS_TITLES", "SCHEMA", "Accuracy", "Advice", "EnvironmentCheck", "Recommendation"]

SCHEMA = "torchaxe.advice/1"

#: The axes, in the order of the seed document, plus the environment checks.
AXES = ("fused_ops", "compile", "tune", "binding", "data", "precision", "memory", "distributed", "environment")
AXIS_TITLES = {
    "fused_ops": "fused operators and optimizers",
    "compile": "compile mode and shapes",
    "tune": "tuned subgraphs",
    "binding": "core binding",
    "data": "data pipeline",
    "precision": "mixed precision",
    "memory": "memory",
    "distributed": "distributed training",
    "environment": "environment",
}


def _utilisation(flops: int, seconds: float | None, table: float | None, measured: float | None) -> dict[str, Any]:
    achieved = flops / seconds if seconds else None
    return {"step_seconds": seconds, "achieved_flops_per_second": achieved,
            "mfu_table": achieved / table if achieved and table else None,
            "mfu_measured": achieved / measured if achieved and measured else None}


def mfu_figures(flops: dict[str, Any] | None, before: float | None, after: float | None,
                chosen_knobs: list[dict[str, Any]] = ()) -> dict[str, Any] | None:
    """MFU of the original and of the chosen changes together. A chosen mixed
    precision changes the dtype the peak is for: the table's peak for that dtype
    applies after, and the measured peak (probed in the original's dtype) does not."""
    from torchaxe.backends.peaks import table_peak

    if not flops or not flops.get("flops_per_step"):
        return None
    count = flops["flops_per_step"]
    table, measured = flops.get("peak_flops_per_second_table"), flops.get("peak_flops_per_second_measured")
    out = {key: flops.get(key) for key in ("flops_per_step", "dtype", "device_name", "peak_flops_per_second_table",
                                            "peak_table_source", "peak_flops_per_second_measured")}
    out["before"] = _utilisation(count, before, table, measured)
    out["after"] = None
    out["note"] = None
    if after is not None:
        dtype = next((k["autocast"].get("dtype") for k in chosen_knobs if isinstance(k.get("autocast"), dict)), None)
        if dtype and dtype != flops.get("dtype"):
            peak = table_peak(flops.get("device_name"), dtype)
            out["after"] = _utilisation(count, after, peak.flops_per_second if peak else None, None)
            out["after"]["dtype"] = dtype
            out["note"] = (f"after: the chosen mixed precision computes in {dtype}, so the {dtype} peak applies; "
                           f"the measured peak was probed in {flops.get('dtype')}")
        else:
            out["after"] = _utilisation(count, after, table, measured)
    return out


@dataclass
class Advice:
    """The whole result of one ``torchaxe advise``."""

    command: list[str]
    target: str
    budget_seconds: float
    baseline: dict[str, Any] = field(default_factory=dict)
    recommendations: list[Recommendation] = field(default_factory=list)
    #: The selected recommendations measured together against the original.
    combined: dict[str, Any] | None = None
    #: When the script was changed by an earlier ``torchaxe apply``: now vs then.
    achieved: dict[str, Any] | None = None
    environment: list[EnvironmentCheck] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    scanned: dict[str, Any] = field(default_factory=dict)
    #: Step-time breakdown, data wait per step and top ops, for the plots.
    profile: dict[str, Any] = field(default_factory=dict)
    partial: bool = False
    notes: list[str] = field(default_factory=list)
    elapsed_seconds: float = 0.0
    #: Where the elapsed time went: seconds by phase (profile, scan, micro-benchmarks, measuring).
    phases: dict[str, float] = field(default_factory=dict)
    repeats: int = 0
    #: The working folder advise ran in: the command's relative paths are relative to it.
    cwd: str = field(default_factory=os.getcwd)
    #: The profiled run's FLOP count and peaks (``flops`` of its profile), for MFU.
    flops: dict[str, Any] | None = None
    #: ``--memory-limit`` in bytes (None: none given).
    memory_limit: int | None = None
    #: Under torchrun: the job across its ranks, as profiled (runtime/ranks.py
    #: ``distributed_view``); None for a one-process run.
    distributed: dict[str, Any] | None = None
    #: The job's length when known: ``{"steps": N, "source": "read from the command: --steps N"}``.
    job: dict[str, Any] | None = None

    @property
    def mfu(self) -> dict[str, Any] | None:
        """Model FLOPs utilisation before (the original's step time) and after (the
        chosen changes together), against the profiled run's peaks."""
        before = self.baseline.get("step_seconds_median")
        combined = self.combined or {}
        after = None
        if combined.get("status") == "measured":
            # A single chosen change carries its speed-up only: the original's step over it.
            after = combined.get("step_seconds_median") or (
                before / combined["speedup"] if before and combined.get("speedup") else None)
        return mfu_figures(self.flops, before, after, [r.knobs for r in self.recommendations if r.selected])

    def over_memory_limit(self, rec: Recommendation) -> bool:
        """Whether a change's measured peak memory exceeds ``--memory-limit``."""
        return self.memory_limit is not None and rec.memory is not None and rec.memory.peak_bytes > self.memory_limit

    def ranked(self) -> list[Recommendation]:
        """Measured changes first, those that fit the memory limit before those that do
        not, each by time saved per step; then advice, unmeasured and failed ones."""
        order = {"measured": 0, "advice": 1, "not_measured": 2, "failed": 3}
        return sorted(self.recommendations,
                      key=lambda r: (order.get(r.status, 9), self.over_memory_limit(r),
                                     -(r.measured_seconds_saved_per_step or 0.0), r.key))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "command": self.command, "cwd": self.cwd, "target": self.target,
            "budget_seconds": self.budget_seconds, "elapsed_seconds": self.elapsed_seconds,
            "phases": {name: round(seconds, 2) for name, seconds in self.phases.items()},
            "repeats": self.repeats, "partial": self.partial, "baseline": self.baseline,
            "recommendations": [r.to_dict() for r in self.ranked()],
            "combined": self.combined, "achieved": self.achieved,
            "environment": [c.to_dict() for c in self.environment],
            "findings": self.findings, "scanned": self.scanned, "profile": self.profile, "notes": self.notes,
            "mfu": self.mfu, "memory_limit_bytes": self.memory_limit, "distributed": self.distributed,
            "job": self.job,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"
