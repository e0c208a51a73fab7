"""The ``kernels`` knob: faster kernels for torch operators, swapped in for the run.

    {"kernels": {"dropout": "packed", "optimizer": "fused"}}

``optimizer``: ``"fused"`` builds torch's optimizers that have a fused implementation
with ``fused=True`` where the caller chose none (kernels/optimizer.py): the ones a
framework or library builds, which no code fix reaches; ``"torch"`` builds them as
asked. ``dropout``: ``"packed"`` replaces ``torch.nn.functional.dropout`` (which
``nn.Dropout`` calls) by ``kernels/dropout.py``'s for the calls it takes (training,
out of place, a CPU floating-point tensor; inside torch.compile too, where the draw
is one operator, ``torchaxe::packed_lanes``), the original for
the rest; ``"torch"`` leaves torch's. The function is restored when the run ends.
The run's record notes the kernels installed and how many calls took them.
Validation here is stdlib-only.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed

DROPOUT_KERNELS = ("packed", "torch")
OPTIMIZER_KERNELS = ("fused", "torch")


@dataclass(frozen=True)
class KernelKnobs:
    dropout: str = "torch"
    optimizer: str = "torch"

    def to_dict(self) -> dict[str, Any]:
        return {"dropout": self.dropout, **({"optimizer": self.optimizer} if self.optimizer != "torch" else {})}


class KernelSwap:
    """Installs the chosen kernels into torch's namespaces; uninstall puts torch's back."""

    def __init__(self, knobs: KernelKnobs, applied: AppliedKnobs) -> None:
        self.knobs = knobs
        self.applied = applied
        self.calls = [0]
        self._original: Any = None
        self._optimizers: Any = None
        #: Optimizers built fused, by class (kept after the patch is removed: the
        #: record is taken once the run has stopped).
        self.fused: dict[str, int] = {}

    def install(self) -> None:
        if self.knobs.optimizer == "fused":
            from torchaxe.kernels.optimizer import FusedOptimizers

            self._optimizers = FusedOptimizers().install()
            self.fused = self._optimizers.fused
            self.applied.note_later("kernels", self._record)
        if self.knobs.dropout != "packed":
            return
        import torch.nn.functional as F

        from torchaxe.kernels.dropout import dropout_with

        self._original = F.dropout
        F.dropout = dropout_with(self._original, self.calls)
        self.applied.note_later("kernels", self._record)

    def _record(self) -> dict[str, Any]:
        record: dict[str, Any] = self.knobs.to_dict()
        if self.knobs.dropout == "packed":
            record["dropout_calls"] = self.calls[0]
        if self.knobs.optimizer == "fused":
            record["fused_optimizers"] = dict(self.fused)
        return record

    def uninstall(self) -> None:
        if self._optimizers is not None:
            self._optimizers.uninstall()
            self._optimizers = None
        if self._original is not None:
            import torch.nn.functional as F

            F.dropout = self._original
            self._original = None


class KernelsKnob(Knob):
    """``kernels``: faster kernels for torch operators (dropout's mask from packed random
    bits, fused optimizers built by code no fix reaches)."""

    key = "kernels"
    example = {"dropout": "packed", "optimizer": "fused"}

    def parse(self, raw: Any, check: KnobCheck) -> KernelKnobs | None:
        if raw is None:
            return None
        c = check.obj(raw, "kernels", ("dropout", "optimizer"))
        return KernelKnobs(
            dropout=check.choice(c.get("dropout", "torch"), "kernels.dropout", DROPOUT_KERNELS),
            optimizer=check.choice(c.get("optimizer", "torch"), "kernels.optimizer", OPTIMIZER_KERNELS))

    def patch(self, value: KernelKnobs | None, applied: AppliedKnobs):
        return installed(KernelSwap(value, applied)) if value is not None else nullcontext()


SPEC = KernelsKnob()
