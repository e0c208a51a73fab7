"""The trials' ``bucketing`` knob: pad the batches of every DataLoader the script
builds to a few bucket sizes, without editing the script.

    {"bucketing": {"boundaries": [24, 40, 64], "dim": 1, "pad_value": "auto"}}

``boundaries`` may be one list per dimension with ``dim`` a list (image height and
width). The bootstrap patches ``DataLoader.__init__`` so that the loader's collate
function (torch's ``default_collate`` when the script gives none) is wrapped in
:class:`~torchaxe.shapes.BucketingCollate`, which pads the tensors of each batch
that have the dimension along it. The script's own batch structure is kept (no mask
is added): a script that masks its padding by the padding value (as most do) sees the
same numbers. Validation here is stdlib-only; torch is imported when installing.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed
from torchaxe.runtime.loader_patch import LoaderPatch


@dataclass(frozen=True)
class BucketingKnobs:
    boundaries: tuple  # of ints, or of tuples of ints (one per dim)
    dim: Any = 1  # int, or tuple of ints
    #: A number, or "auto": the value the script's own collate function pads with.
    pad_value: float | str = "auto"

    def to_dict(self) -> dict[str, Any]:
        multi = not isinstance(self.dim, int)
        return {"boundaries": [list(b) for b in self.boundaries] if multi else list(self.boundaries),
                "dim": list(self.dim) if multi else self.dim, "pad_value": self.pad_value}


def _sizes(value: Any, key: str, fail: Callable[[str, str], Any]) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
        fail(key, "expected a non-empty list of positive integers (the sizes to pad to)")
    return tuple(sorted(set(value)))


def bucketing_from_dict(raw: Any, fail: Callable[[str, str], Any]) -> BucketingKnobs:
    """Validate the ``bucketing`` object; ``fail(key, message)`` raises the one-line error."""
    if not isinstance(raw, dict):
        fail("bucketing", "expected an object with boundaries, dim and pad_value")
    for key in raw:
        if key not in ("boundaries", "dim", "pad_value"):
            fail(f"bucketing.{key}", "unknown key (expected one of boundaries, dim, pad_value)")
    dim = raw.get("dim", 1)
    pad = raw.get("pad_value", "auto")
    if pad != "auto" and (isinstance(pad, bool) or not isinstance(pad, (int, float))):
        fail("bucketing.pad_value", "expected a number, or \"auto\" (the value the script's collate function pads with)")
    boundaries = raw.get("boundaries")
    if isinstance(dim, int) and not isinstance(dim, bool):
        return BucketingKnobs(boundaries=_sizes(boundaries, "bucketing.boundaries", fail), dim=dim, pad_value=pad)
    if not isinstance(dim, list) or not dim or not all(isinstance(d, int) and not isinstance(d, bool) for d in dim):
        fail("bucketing.dim", "expected an integer, or a list of integers with one list of boundaries each")
    if not isinstance(boundaries, list) or len(boundaries) != len(dim):
        fail("bucketing.boundaries", f"with dim {dim}: expected {len(dim)} lists of sizes, one per dimension")
    return BucketingKnobs(boundaries=tuple(_sizes(b, f"bucketing.boundaries[{i}]", fail)
                                           for i, b in enumerate(boundaries)),
                          dim=tuple(dim), pad_value=pad)


class CollateBucketing:
    """Patches ``DataLoader.__init__`` to wrap each loader's collate function in a
    :class:`BucketingCollate`. Loaders without automatic batching (``batch_size=None``)
    are left alone. ``note(key, value)`` records what was applied (the bootstrap's
    AppliedKnobs.note)."""

    def __init__(self, knobs: BucketingKnobs, note: Callable[[str, Any], None]) -> None:
        self.knobs = knobs
        self.note = note
        self.wrapped: list[str] = []
        self._patch = LoaderPatch(self._edit)

    def install(self) -> None:
        self._patch.install()

    def uninstall(self) -> None:
        self._patch.uninstall()

    def _edit(self, arguments: dict[str, Any], signature: inspect.Signature) -> None:
        from torch.utils.data import default_collate

        from torchaxe.shapes.bucketing import BucketingCollate

        knobs = self.knobs
        batch_size = arguments.get("batch_size", signature.parameters["batch_size"].default)
        if batch_size is None and arguments.get("batch_sampler") is None:
            return
        dim = knobs.dim if isinstance(knobs.dim, int) else list(knobs.dim)
        boundaries = list(knobs.boundaries) if isinstance(knobs.dim, int) else [list(b) for b in knobs.boundaries]
        inner = arguments.get("collate_fn") or default_collate
        arguments["collate_fn"] = BucketingCollate(boundaries, dim=dim, pad_value=knobs.pad_value,
                                                   collate_fn=inner, return_mask=False, oversize="keep")
        self.wrapped.append(getattr(inner, "__qualname__", type(inner).__name__))
        self.note("bucketing", {**knobs.to_dict(), "collate_fns": list(self.wrapped)})


class BucketingKnob(Knob):
    """``bucketing``: pad every DataLoader's batches to a few sizes."""

    key = "bucketing"
    example = {"boundaries": [16, 32], "dim": 1, "pad_value": 0}

    def parse(self, raw: Any, check: KnobCheck) -> BucketingKnobs | None:
        return None if raw is None else bucketing_from_dict(raw, check.fail)

    def patch(self, value: BucketingKnobs | None, applied: AppliedKnobs):
        return installed(CollateBucketing(value, applied.note)) if value is not None else nullcontext()


SPEC = BucketingKnob()
