"""The ``tune`` knob: apply the knowledge base's winners to the script's model.

In a knob-set file (docs/trial.md)::

    {"tune": {"kb": "team-kb.sqlite", "depth": 1, "whole_model": true, "min_gain": 0.05,
              "compile_backend": "inductor"}}

Every key is optional (``{"tune": {}}`` uses the default knowledge base). The trial
bootstrap finds the model at its first call (as for the ``compile`` knob) and swaps
the winners into its subgraphs after that first forward, without tuning anything and
without touching the script. Validation here imports nothing heavy.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed

KEYS = ("kb", "depth", "whole_model", "min_gain", "compile_backend")


def parse_tune_knob(value: Any, fail: Callable[[str, str], Any]) -> dict[str, Any]:
    """Validate the ``tune`` object of a knob set; ``fail(key, message)`` raises the knob error."""
    if value is True:
        value = {}
    if not isinstance(value, dict):
        fail("tune", "expected an object such as {\"kb\": \"kb.sqlite\"}")
    for key in value:
        if key not in KEYS:
            fail(f"tune.{key}", f"unknown key (expected one of {', '.join(KEYS)})")
    kb = value.get("kb")
    if kb is not None and (not isinstance(kb, str) or not kb):
        fail("tune.kb", "expected a file path")
    depth = value.get("depth", 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        fail("tune.depth", "expected an integer of at least 1")
    whole = value.get("whole_model", True)
    if not isinstance(whole, bool):
        fail("tune.whole_model", "expected true or false")
    gain = value.get("min_gain", 0.05)
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 <= gain < 1:
        fail("tune.min_gain", "expected a number in [0, 1)")
    backend = value.get("compile_backend", "inductor")
    if not isinstance(backend, str) or not backend:
        fail("tune.compile_backend", "expected a backend name such as \"inductor\"")
    return {"kb": kb, "depth": depth, "whole_model": whole, "min_gain": float(gain), "compile_backend": backend}


class TunedModel:
    """Installs the lazy apply on the script's model (see the module docstring);
    ``note(key, value)`` records what was applied (the bootstrap's ``applied.note``)."""

    def __init__(self, settings: dict[str, Any], note: Callable[[str, Any], None]) -> None:
        self.settings = settings
        self.note = note
        self._finder: Any = None
        self._module = ""
        self.lazy: Any = None

    def install(self) -> None:
        from torchaxe.runtime.first_model import FirstModel

        self._finder = FirstModel(self._on_model).install()

    def _on_model(self, model: Any) -> None:
        from torchaxe.tune.tuner import LazyApply, TuneOptions

        options = TuneOptions(kb=self.settings.get("kb"), depth=self.settings.get("depth", 1),
                              whole_model=self.settings.get("whole_model", True),
                              min_gain=self.settings.get("min_gain", 0.05),
                              compile_backend=self.settings.get("compile_backend", "inductor"), strategies=())
        self._module = type(model).__qualname__
        self.lazy = LazyApply(model, options, on_report=self._report)
        self.lazy.install()
        self.note("tune", {"module": self._module, "kb": str(options.kb or "default"), "applied": []})

    def _report(self, report: Any) -> None:
        # ``unknown``: signatures the knowledge base holds nothing for (tune never measured
        # them at these shapes); ``eager``: those whose stored winner is the model as it is.
        self.note("tune", {"module": self._module, "kb": report.kb, "seconds": report.seconds,
                           "apply_seconds": report.apply_seconds, "subgraphs": len(report.subgraphs),
                           "unknown": sum(1 for s in report.subgraphs if s.winner is None and s.eager_median is None),
                           "eager": sum(1 for s in report.subgraphs if s.winner == "eager"),
                           "applied": [{"name": n, "strategy": s} for n, s in report.applied]})

    def uninstall(self) -> None:
        if self._finder is not None:
            self._finder.uninstall()
            self._finder = None


class TuneKnob(Knob):
    """``tune``: apply the knowledge base's tuned winners to the model (``true`` for the defaults)."""

    key = "tune"
    example = {"kb": "kb.sqlite", "depth": 1, "whole_model": True, "min_gain": 0.05, "compile_backend": "inductor"}

    def parse(self, raw: Any, check: KnobCheck) -> dict[str, Any] | None:
        return None if raw is None else parse_tune_knob(raw, check.fail)

    def to_json(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else dict(value)

    def patch(self, value: dict[str, Any] | None, applied: AppliedKnobs):
        return installed(TunedModel(value, applied.note)) if value is not None else nullcontext()


SPEC = TuneKnob()
