"""Keeping torchaxe's probes out of the user's compiled graphs.

A script that calls ``torch.compile`` itself has dynamo trace every global module hook
and every patch of ``nn.Module.__call__`` into its graphs. torchaxe's probes keep
Python state (dicts of the modules seen, thread-locals) that dynamo cannot or should
not trace, so each returns at once while dynamo traces: :func:`compiling` is True
then (dynamo treats it as a constant) and False in eager code.
"""

from __future__ import annotations

from typing import Callable


def compiling_check() -> Callable[[], bool]:
    """torch's own "is dynamo tracing now?" function (``torch.compiler.is_compiling``
    from torch 2.3, ``torch._dynamo``'s before), or one that always says no. A probe
    that patches tensor methods calls it directly: dynamo knows it as a constant."""
    import torch

    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if check is None:
        check = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return check or (lambda: False)


_check: Callable[[], bool] | None = None


def compiling() -> bool:
    """Whether dynamo is tracing the code that calls this (torch imported already)."""
    global _check
    if _check is None:
        _check = compiling_check()
    return _check()


def quiet_global_hook_warning() -> None:
    """torch warns, at the script's own ``torch.compile(module)`` call, that global
    module hooks fire an extra time for the compiled wrapper. Those hooks are
    torchaxe's probes, which count that call once (see :func:`compiling`), so the
    warning would only point the user at their own line for nothing."""
    import warnings

    warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
