"""Facts about the installed torch that rules depend on, read from its real
signatures once per scan (in the parent process) and passed to rules as plain data."""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

#: The torch.optim device name per target (torch_npu registers as privateuseone).
_OPTIM_DEVICE = {"cpu": "cpu", "cuda": "cuda", "npu": "privateuseone"}

#: Used only when torch cannot be imported: the optimizers with ``fused=`` in 2.13.
FALLBACK_FUSED = ("Adagrad", "Adam", "AdamW", "SGD")


@lru_cache(maxsize=None)
def _introspect(target: str) -> tuple[tuple[str, ...], str | None]:
    try:
        import torch
        import torch.optim as optim
    except Exception:
        return FALLBACK_FUSED, None
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except Exception:  # private helper moved: trust the signatures alone
        devices = set(_OPTIM_DEVICE.values())
    fused = []
    if _OPTIM_DEVICE.get(target, target) in devices:
        for name in dir(optim):
            cls = getattr(optim, name)
            if isinstance(cls, type) and issubclass(cls, optim.Optimizer) and cls is not optim.Optimizer:
                try:
                    params = inspect.signature(cls).parameters
                except (TypeError, ValueError):
                    continue
                if "fused" in params:
                    fused.append(name)
    return tuple(sorted(fused)), str(torch.__version__)


def torch_capabilities(target: str) -> dict[str, Any]:
    """``{"torch_version", "fused_optimizers"}`` for the given target."""
    fused, version = _introspect(target)
    return {"torch_version": version, "fused_optimizers": list(fused)}
