"""Keeping torchaxe's probes out of the user's compiled graphs.

A script that calls ``torch.compile`` itself has dynamo trace every global module hook
and every patch of ``nn.Module.__call__`` into its graphs. torchaxe's probes keep
Python state (dicts of the modules seen, thread-locals) that dynamo cannot or should
not trace, so each returns at once while dynamo traces: :func:`compiling` is True
then (dynamo treats it as a constant) and False in eager code.
"""

from __future__ import annotations

from typing import Callable


def _is_compiling() -> Callable[[], bool]:
    import torch

    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):  # torch >= 2.3
        return compiler.is_compiling
    return torch._dynamo.is_compiling  # pragma: no cover - older torch


_check: Callable[[], bool] | None = None


def compiling() -> bool:
    """Whether dynamo is tracing the code that calls this (torch imported already)."""
    global _check
    if _check is None:
        _check = _is_compiling()
    return _check()


def quiet_global_hook_warning() -> None:
    """torch warns, at the script's own ``torch.compile(module)`` call, that global
    module hooks fire an extra time for the compiled wrapper. Those hooks are
    torchaxe's probes, which count that call once (see :func:`compiling`), so the
    warning would only point the user at their own line for nothing."""
    import warnings

    warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
