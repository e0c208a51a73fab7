"""A change to measure: the knob-set fragment or code fix, and the recommendation it
becomes once measured.

Plain data, low in the layers so that every axis package can propose candidates
without importing ``advise``, which only collects and measures them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchaxe.findings import Finding


#: The kinds of accuracy of a change that keeps the computation: its loss is not compared.
SAME_COMPUTATION = ("exact", "data_order")


@dataclass
class Accuracy:
    """The accuracy cost of a change, as far as it was measured.

    ``kind``: ``exact`` (same numerics by construction), ``data_order`` (the same
    computation on each batch, but the batches' order or random augmentation may
    differ: worker processes seed their own random state), ``max_error`` (a replacement
    checked on probes: its largest absolute difference), ``loss`` (the mean training
    loss of the change's runs against the original's, same seed, with the run-to-run
    noise of the unchanged script beside it), ``unknown`` (not measured).

    ``loss_tolerance``: how far beyond that noise the loss may land for the change to
    be chosen (``beyond_tolerance``)."""

    kind: str = "unknown"
    max_error: float | None = None
    loss_delta: float | None = None
    loss_noise: float | None = None
    detail: str = ""
    loss_tolerance: float | None = None

    @property
    def changes_numerics(self) -> bool:
        """Whether the change may compute other numbers (its loss is compared)."""
        return self.kind not in SAME_COMPUTATION

    @property
    def beyond_tolerance(self) -> bool:
        """The loss differs from the original's by more than the run-to-run noise
        plus the tolerance: never chosen, shown with its cost for the user to decide."""
        if self.loss_delta is None or self.loss_tolerance is None:
            return False
        return abs(self.loss_delta) > (self.loss_noise or 0.0) + self.loss_tolerance

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "max_error": self.max_error, "loss_delta": self.loss_delta,
                "loss_noise": self.loss_noise, "loss_tolerance": self.loss_tolerance,
                "beyond_tolerance": self.beyond_tolerance, "detail": self.detail}

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
            if self.beyond_tolerance:
                parts.append("beyond tolerance")
        if parts:
            return ", ".join(parts)
        return "not measured"


#: What each kind of peak memory measures, for reports.
MEMORY_KINDS = {"device": "device allocator", "host_rss": "host resident set"}


@dataclass
class Memory:
    """The peak memory of a change's runs against the original's, measured in the same
    rounds: ``kind`` ``device`` (the allocator's peak, cuda/npu) or ``host_rss`` (the
    process's peak resident set, where the run had no device)."""

    kind: str
    peak_bytes: int
    original_peak_bytes: int | None = None
    #: How far the peaks of one side's own runs strayed from one another (a fraction
    #: of their median, the larger side's): a change within it is not told apart.
    noise: float | None = None

    @property
    def change(self) -> float | None:
        """The change of the peak as a fraction of the original's (-0.35: 35% less)."""
        if not self.original_peak_bytes:
            return None
        return self.peak_bytes / self.original_peak_bytes - 1.0

    @property
    def within_noise(self) -> bool:
        """Whether the change is no larger than the runs' own spread of their peaks."""
        change = self.change
        return change is not None and bool(self.noise) and abs(change) <= self.noise  # type: ignore[operator]

    @property
    def text(self) -> str:
        """``-35% memory``, ``+4% memory``; ``~+4% memory`` within the noise."""
        change = self.change
        if change is None:
            return "memory n/a"
        return f"{'~' if self.within_noise else ''}{100 * change:+.0f}% memory"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "peak_bytes": self.peak_bytes, "original_peak_bytes": self.original_peak_bytes,
                "change": self.change, "noise": self.noise, "within_noise": self.within_noise}


def loss_checked(rec: dict[str, Any]) -> bool:
    """Whether advise measured the change (a recommendation's JSON), chose it, and its
    training loss landed within the original's run-to-run noise plus the tolerance:
    an unsafe fix (one that may change numerics) checked on the user's own run, which
    ``apply`` applies without ``--unsafe-fixes``."""
    accuracy = rec.get("accuracy") or {}
    return (rec.get("status") == "measured" and bool(rec.get("selected")) and accuracy.get("kind") == "loss"
            and accuracy.get("loss_delta") is not None and not accuracy.get("beyond_tolerance"))


def exact() -> Accuracy:
    """A fresh ``exact`` accuracy (each recommendation gets its own, it is filled in later)."""
    return Accuracy(kind="exact", detail="same computation")


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
    #: Why a change is not chosen for all that it may be faster (its loss beyond the
    #: tolerance, or its peak memory above ``--memory-limit``): the user decides,
    #: ``torchaxe apply --only KEY`` applies it.
    held_back: str | None = None
    #: Why a change has no measurement (status ``not_measured``): ``"budget"`` when
    #: the --budget had no room for its runs; None otherwise.
    not_measured_reason: str | None = None
    #: Its peak memory against the original's (measured changes).
    memory: Memory | None = None
    #: It changes what training computes beyond numerics (a larger micro-batch: fewer
    #: optimizer steps per epoch, another gradient noise): never applied unmarked.
    changes_optimisation: bool = False
    #: Under torchrun: each rank's figures under this change (medians over its runs).
    ranks: list[dict[str, Any]] | None = None
    #: What it costs once before its first fast step (compiling, mostly): the extra
    #: wall time of its warm-up steps over the original's; None when about none.
    one_time_seconds: float | None = None
    #: The steps after which the time it saves has paid ``one_time_seconds`` back.
    break_even_steps: int | None = None
    #: What its first run paid once, filling torch's compile caches, where that was
    #: more than ``one_time_seconds`` (its later runs, and a job run here next, read
    #: them): the cost on another machine.
    one_time_seconds_first: float | None = None
    #: ``one_time_seconds`` comes from its first run alone, which filled the caches: a
    #: later run on this machine may pay much less.
    one_time_cold_only: bool = False
    #: Which module a model-wrapping knob took as the model in its runs ("compile
    #: applied to Discriminator"): a script that trains two models learns which.
    applied_to: str = ""

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
            "evidence": self.evidence, "detail": self.detail, "applied_to": self.applied_to,
            "knobs": self.knobs, "rules": self.rules,
            "files": self.files, "unsafe": self.unsafe, "error": self.error, "selected": self.selected,
            "held_back": self.held_back, "not_measured_reason": self.not_measured_reason,
            "memory": self.memory.to_dict() if self.memory else None,
            "changes_optimisation": self.changes_optimisation, "ranks": self.ranks,
            "one_time_seconds": self.one_time_seconds, "break_even_steps": self.break_even_steps,
            "one_time_seconds_first": self.one_time_seconds_first, "one_time_cold_only": self.one_time_cold_only,
        }


@dataclass
class Candidate:
    """A change to measure, and the recommendation it will become."""

    rec: Recommendation
    #: Knob-set fragment (without ``name``); code candidates get ``sources`` at run time.
    knobs: dict[str, Any] = field(default_factory=dict)
    #: Only one candidate of a group goes into the combined run (the fastest).
    group: str | None = None
    #: Code candidates: the findings whose fixes it applies.
    findings: list[Finding] = field(default_factory=list)
    #: Higher is measured first when the budget is short.
    priority: float = 0.0
    #: Input shapes the code ran on in the profile (code candidates).
    shapes: list[list[int]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.rec.key


def knob_candidate(key: str, axis: str, title: str, knobs: dict[str, Any], *, group: str | None = None,
                   accuracy: Accuracy | None = None, detail: str = "", priority: float = 0.5,
                   changes_optimisation: bool = False) -> Candidate:
    """A runtime-setting candidate: the knob-set fragment, and its recommendation
    (same computation unless ``accuracy`` says otherwise)."""
    rec = Recommendation(key=key, axis=axis, title=title, applies="knob", knobs=knobs, detail=detail,
                         accuracy=accuracy or exact(), changes_optimisation=changes_optimisation)
    return Candidate(rec=rec, knobs=knobs, group=group, priority=priority)
