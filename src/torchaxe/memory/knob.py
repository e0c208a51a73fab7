"""The ``checkpoint`` knob: activation checkpointing of the model's repeated blocks,
without editing the script.

    {"checkpoint": {"blocks": "auto"}}
    {"checkpoint": {"blocks": ["Block"]}}

At the model's first call (runtime/first_model.py) the blocks are found: with
``"auto"``, the largest group of same-class modules with parameters that sit side by
side in one ``nn.ModuleList`` or ``nn.Sequential`` (a transformer's layers, a ResNet's
stage); with a list of class names, every module of those classes that is not inside
another one. Each block's ``forward`` is then run through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` while gradients are
recorded and the block is in training mode: its activations are not kept for
backward but computed again there. That trades time (one more forward of the blocks)
for memory; the random state is replayed, so dropout draws the same masks and the
numbers are those of the original. Validation here is stdlib-only.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from torchaxe.runtime.instance_forward import set_forward
from torchaxe.runtime.first_model import FirstModel, has_parameters
from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed


@dataclass(frozen=True)
class CheckpointKnobs:
    #: "auto", or the class names of the blocks to checkpoint.
    blocks: str | tuple[str, ...] = "auto"

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks if isinstance(self.blocks, str) else list(self.blocks)}


def repeated_blocks(model: Any) -> list[tuple[str, Any]]:
    """(path, module) of the largest run of same-class modules with parameters held
    by one ModuleList or Sequential of ``model``; [] when there is none of two or more."""
    from torch import nn

    best: list[tuple[str, Any]] = []
    best_size = 0
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[type, list[tuple[str, Any]]] = {}
        for name, child in container.named_children():
            if has_parameters(child):
                groups.setdefault(type(child), []).append((f"{path}.{name}" if path else name, child))
        for members in groups.values():
            size = sum(p.numel() for _, m in members for p in m.parameters())
            if len(members) >= 2 and size > best_size:
                best, best_size = members, size
    return best


def blocks_of_classes(model: Any, names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(path, module) of the outermost modules whose class name is in ``names``."""
    found: list[tuple[str, Any]] = []
    for path, module in model.named_modules():
        if type(module).__name__ in names and not any(path.startswith(f"{p}.") for p, _ in found):
            found.append((path, module))
    return found


class BlockCheckpointing(FirstModel):
    """Wraps each block's ``forward`` (on the instance) in non-reentrant checkpointing."""

    def __init__(self, knobs: CheckpointKnobs, applied: AppliedKnobs) -> None:
        super().__init__(self.wrap)
        self.knobs = knobs
        self.applied = applied

    def wrap(self, model: Any) -> None:
        import functools

        import torch
        from torch.utils.checkpoint import checkpoint

        blocks = (repeated_blocks(model) if self.knobs.blocks == "auto"
                  else blocks_of_classes(model, tuple(self.knobs.blocks)))
        for _, block in blocks:
            forward = block.forward

            @functools.wraps(forward)
            def checkpointed(*args, _forward=forward, _block=block, **kwargs):
                if torch.is_grad_enabled() and _block.training:
                    return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
                return _forward(*args, **kwargs)

            set_forward(block, checkpointed)
        self.applied.note("checkpoint", {**self.knobs.to_dict(), "wrapped": [path for path, _ in blocks],
                                         "class": type(blocks[0][1]).__qualname__ if blocks else None})


class CheckpointKnob(Knob):
    """``checkpoint``: recompute the repeated blocks' activations in backward instead of keeping them."""

    key = "checkpoint"
    example = {"blocks": "auto"}

    def parse(self, raw: Any, check: KnobCheck) -> CheckpointKnobs | None:
        if raw is None:
            return None
        c = check.obj(raw, "checkpoint", ("blocks",))
        blocks = c.get("blocks", "auto")
        if blocks == "auto":
            return CheckpointKnobs()
        if not isinstance(blocks, list) or not blocks or not all(
                isinstance(b, str) and b.isidentifier() for b in blocks):
            check.fail("checkpoint.blocks", 'expected "auto" or a non-empty list of module class names')
        return CheckpointKnobs(blocks=tuple(blocks))

    def patch(self, value: CheckpointKnobs | None, applied: AppliedKnobs):
        return installed(BlockCheckpointing(value, applied)) if value is not None else nullcontext()


SPEC = CheckpointKnob()
