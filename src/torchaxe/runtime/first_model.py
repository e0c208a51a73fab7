"""Finding the model inside an unmodified training script.

"The model" is the first ``nn.Module`` with parameters that the script calls from
outside any other module's forward (a loss function without parameters called first
does not count). A temporary patch of ``nn.Module.__call__`` spots it at its first
call and hands it to a callback *before* that call runs (so that what the callback
installs -- compilation, autocast, tuned subgraphs -- sees that very call). torch is
imported only at ``install``.

A script may train several models in one iteration: a GAN calls its discriminator and
its generator, each from the loop. With ``every_model=True`` a finder hands over each
top-level module with parameters that the script calls before it calls the first one
again (one iteration's models, at most :data:`MOST_MODELS`).

Several finders may be active at once (compile, autocast, the run's own probe); one
patch serves them all, the finder installed last told first, and it is removed when
the last finder is done. While a top-level module runs, ``nn.Module.__call__`` is
torch's own: its submodules' calls are not watched (they are not top-level), and what
torch.compile traces and guards on in that first call is torch's call, so that the
compiled code is not compiled again once the patch is gone.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torchaxe.runtime.dynamo import compiling

#: The most models ``every_model`` hands over: a script that calls its layers one by
#: one from the loop (no model class) is not compiled layer by layer beyond these.
MOST_MODELS = 4

#: The finders the patch serves, in the order they were installed.
_ACTIVE: list["FirstModel"] = []
#: torch's own ``nn.Module.__call__`` while the patch is in place.
_TORCH_CALL: list[Any] = []
_LOCK = threading.RLock()


def has_parameters(module: Any) -> bool:
    return next(module.parameters(), None) is not None


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread."""
    import torch

    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _watched_call(module, *args, **kwargs):
    """``nn.Module.__call__`` while finders are active: a top-level call."""
    from torch import nn

    original = _TORCH_CALL[0] if _TORCH_CALL else nn.Module.__call__
    if compiling():  # inside the script's own compiled graph: not ours to watch
        return original(module, *args, **kwargs)
    if not has_parameters(module) or _in_backward():
        # No model in it or below it: called as it is, without swapping the class's
        # __call__ back and forth (a script that calls its layers' forward directly
        # runs only such calls through the patch until the finders give up). Nor is a
        # module the backward pass calls (activation checkpointing recomputes a block
        # there, outside its model's forward): the loop did not call it.
        return original(module, *args, **kwargs)
    with _LOCK:
        if _ACTIVE:
            for finder in reversed(list(_ACTIVE)):
                if finder._take(module):
                    finder.on_model(module)
        watching = bool(_ACTIVE)
        if watching:
            nn.Module.__call__ = original  # torch's own while the module runs
    try:
        return original(module, *args, **kwargs)
    finally:
        if watching:
            with _LOCK:
                if _ACTIVE:
                    nn.Module.__call__ = _watched_call


class FirstModel:
    """Calls ``on_model(model)`` at the model's first call (see the module docstring)."""

    def __init__(self, on_model: Callable[[Any], None], every_model: bool = False) -> None:
        self.on_model = on_model
        self.every_model = every_model
        self.model: Any = None
        #: Every model handed over, the first one first.
        self.models: list[Any] = []

    def install(self) -> "FirstModel":
        from torch import nn

        with _LOCK:
            if not _ACTIVE:
                _TORCH_CALL[:] = [nn.Module.__call__]
                nn.Module.__call__ = _watched_call
            if self not in _ACTIVE:
                _ACTIVE.append(self)
        return self

    def _take(self, module: Any) -> bool:
        """Whether ``module`` is a model to hand over; stops watching when no more are
        to be found."""
        if any(module is seen for seen in self.models):
            self.uninstall()  # the first model again (or a model called twice): one iteration has passed
            return False
        self.models.append(module)
        if self.model is None:
            self.model = module
        if not self.every_model or len(self.models) >= MOST_MODELS:
            self.uninstall()
        return True

    def uninstall(self) -> None:
        from torch import nn

        with _LOCK:
            if self not in _ACTIVE:
                return
            _ACTIVE.remove(self)
            if not _ACTIVE and _TORCH_CALL:
                if nn.Module.__call__ is _watched_call:
                    nn.Module.__call__ = _TORCH_CALL[0]
                _TORCH_CALL.clear()


def patched() -> bool:
    """Whether ``nn.Module.__call__`` is this module's patch now (a finder is watching)."""
    return bool(_ACTIVE)


def release_all() -> None:
    """Stop every finder that has not found its model yet. Called when the first step
    has ended: a model not called from the loop by then never will be (a script that
    calls its layers' ``forward`` directly), and the patch of ``nn.Module.__call__``
    must not meet torch.profiler's Python tracer (CPython 3.11 crashed there)."""
    for finder in list(_ACTIVE):
        finder.uninstall()
