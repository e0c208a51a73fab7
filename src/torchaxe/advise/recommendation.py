"""What ``torchaxe advise`` hands back: measured recommendations, ranked, and the
evidence they rest on. Plain data with a stable JSON form (schema
``torchaxe.advice/1``); rendering lives in ``torchaxe.report``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

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
class Accuracy:
    """The accuracy cost of a change, as far as it was measured.

    ``kind``: ``exact`` (same numerics by construction), ``data_order`` (the same
    computation on each batch, but the batches' order or random augmentation may
    differ: worker processes seed their own random state), ``max_error`` (a replacement
    checked on probes: its largest absolute difference), ``loss`` (the training loss
    over the first steps from the same seed, before and after, with the run-to-run
    noise of the unchanged script beside it), ``unknown`` (not measured)."""

    kind: str = "unknown"
    max_error: float | None = None
    loss_delta: float | None = None
    loss_noise: float | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "max_error": self.max_error, "loss_delta": self.loss_delta,
                "loss_noise": self.loss_noise, "detail": self.detail}

    @property
    def text(self) -> str:
        if self.kind == "exact":
            return "exact (same numerics)"
        if self.kind == "data_order":
            return "same math; data order may differ"
        parts = []
        if self.max_error is not None:
            parts.append(f"max error {self.max_error:.1e}")
        if self.loss_delta is not None:
            noise = f" (noise {self.loss_noise:.2%})" if self.loss_noise is not None else ""
            parts.append(f"loss {self.loss_delta:+.2%}{noise}")
        if parts:
            return ", ".join(parts)
        return "not measured (--check-accuracy)"


@dataclass
class Recommendation:
    """One change, measured on the user's run.

    ``applies``: ``code`` (an edit of the user's files, by ``torchaxe apply``) or
    ``knob`` (a runtime setting ``torchaxe run`` applies with no code change).
    ``status``: ``measured``, ``failed`` (the run broke under it: never recommended),
    ``not_measured`` (out of budget or interrupted) or ``advice`` (no automatic change
    exists; the user edits by hand)."""

    key: str
    axis: str
    title: str
    applies: str
    location: str | None = None
    status: str = "not_measured"
    measured_seconds_saved_per_step: float | None = None
    speedup: float | None = None
    #: Per-round ratios of step time (changed / original): below 1 is faster.
    ratios: list[float] = field(default_factory=list)
    accuracy: Accuracy = field(default_factory=Accuracy)
    #: What the static scan and the profile saw (counts per step, shapes, time).
    evidence: list[str] = field(default_factory=list)
    detail: str = ""
    #: For knobs: the knob-set fragment; for code: the rule codes and files.
    knobs: dict[str, Any] = field(default_factory=dict)
    rules: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    unsafe: bool = False
    error: str | None = None
    #: Chosen for the combined run (and for ``torchaxe apply``).
    selected: bool = False

    @property
    def distinguishable(self) -> bool:
        """Every round faster: not noise."""
        return bool(self.ratios) and max(self.ratios) < 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "axis": self.axis, "title": self.title, "applies": self.applies,
            "location": self.location, "status": self.status,
            "measured_seconds_saved_per_step": self.measured_seconds_saved_per_step,
            "speedup": self.speedup, "ratios": self.ratios, "accuracy": self.accuracy.to_dict(),
            "evidence": self.evidence, "detail": self.detail, "knobs": self.knobs, "rules": self.rules,
            "files": self.files, "unsafe": self.unsafe, "error": self.error, "selected": self.selected,
        }


@dataclass
class EnvironmentCheck:
    """A setting that silently slows training, found in the run's environment or code."""

    name: str
    message: str
    location: str | None = None
    #: The key of the recommendation that measures switching it off, if any.
    recommendation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "message": self.message, "location": self.location,
                "recommendation": self.recommendation}


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
