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
AXES = ("fused_ops", "compile", "tune", "binding", "data", "precision", "environment")
AXIS_TITLES = {
    "fused_ops": "fused operators and optimizers",
    "compile": "compile mode and shapes",
    "tune": "tuned subgraphs",
    "binding": "core binding",
    "data": "data pipeline",
    "precision": "mixed precision",
    "environment": "environment",
}


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
    repeats: int = 0
    #: The working folder advise ran in: the command's relative paths are relative to it.
    cwd: str = field(default_factory=os.getcwd)

    def ranked(self) -> list[Recommendation]:
        order = {"measured": 0, "advice": 1, "not_measured": 2, "failed": 3}
        return sorted(self.recommendations,
                      key=lambda r: (order.get(r.status, 9), -(r.measured_seconds_saved_per_step or 0.0), r.key))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "command": self.command, "cwd": self.cwd, "target": self.target,
            "budget_seconds": self.budget_seconds, "elapsed_seconds": self.elapsed_seconds,
            "repeats": self.repeats, "partial": self.partial, "baseline": self.baseline,
            "recommendations": [r.to_dict() for r in self.ranked()],
            "combined": self.combined, "achieved": self.achieved,
            "environment": [c.to_dict() for c in self.environment],
            "findings": self.findings, "scanned": self.scanned, "profile": self.profile, "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"
