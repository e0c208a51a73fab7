"""Fused optimizers for the run, without editing the code that builds them.

A framework or a model library often builds the optimizer itself (timm's
``create_optimizer_v2``, a ``Trainer``): the scan cannot fix that call, yet the
optimizer that steps is torch's ``AdamW`` with one small kernel per parameter and
operation. While installed, :class:`FusedOptimizers` makes each ``torch.optim``
optimizer that has a fused implementation (``Adam``, ``AdamW``, ``SGD``,
``Adagrad``; those whose ``__init__`` takes ``fused``) pass ``fused=True`` when its
caller chose no implementation (no ``fused``, ``foreach`` or ``differentiable``)
and every parameter is a floating-point tensor on a device torch has fused kernels
for. Anything else is built as the caller asked. Subclasses defined elsewhere are
left alone. torch is imported at ``install``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

#: The torch.optim classes that may have a fused implementation.
FUSED_CLASSES = ("Adam", "AdamW", "SGD", "Adagrad")


def fused_devices() -> tuple[str, ...]:
    """The device types torch has fused optimizer kernels for."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except (ImportError, AttributeError):  # pragma: no cover - another torch
        return ("cuda", "cpu")


def _tensors(params: list) -> list:
    """The parameter tensors of a list of tensors or of parameter groups."""
    out = []
    for item in params:
        if isinstance(item, dict):
            group = item.get("params")
            out.extend([group] if hasattr(group, "device") else list(group or ()))
        else:
            out.append(item)
    return out


def can_fuse(params: list, devices: tuple[str, ...]) -> bool:
    import torch

    tensors = _tensors(params)
    return bool(tensors) and all(isinstance(t, torch.Tensor) and torch.is_floating_point(t)
                                 and t.device.type in devices for t in tensors)


class FusedOptimizers:
    """Patches the fused-capable optimizers' ``__init__`` (see the module docstring);
    ``fused`` counts the optimizers built fused, by class name."""

    def __init__(self) -> None:
        self.fused: dict[str, int] = {}
        self._saved: list[tuple[type, Any]] = []

    def install(self) -> "FusedOptimizers":
        import torch

        devices = fused_devices()
        for name in FUSED_CLASSES:
            cls = getattr(torch.optim, name, None)
            if cls is None or "fused" not in inspect.signature(cls.__init__).parameters:
                continue
            self._saved.append((cls, cls.__init__))
            cls.__init__ = self._wrap(cls, cls.__init__, devices)
        return self

    def _wrap(self, cls: type, original: Callable, devices: tuple[str, ...]) -> Callable:
        fused = self.fused

        def __init__(optimizer, params, *args, **kwargs):
            chosen = {"fused", "foreach"} & set(kwargs) or kwargs.get("differentiable")
            if type(optimizer) is cls and not chosen:
                params = list(params)  # read once: a generator is consumed by the check
                if can_fuse(params, devices):
                    kwargs["fused"] = True
                    fused[cls.__name__] = fused.get(cls.__name__, 0) + 1
            return original(optimizer, params, *args, **kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        return __init__

    def uninstall(self) -> None:
        while self._saved:
            cls, original = self._saved.pop()
            cls.__init__ = original
