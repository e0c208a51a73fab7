"""Finding the model inside an unmodified training script.

"The model" is the first ``nn.Module`` with parameters that the script calls from
outside any other module's forward (a loss function without parameters called first
does not count). A temporary patch of ``nn.Module.__call__`` spots it at its first
call, hands it to a callback *before* that call runs (so that what the callback
installs -- compilation, autocast, tuned subgraphs -- sees that very call), and
removes itself at once, so that later calls run torch's own ``__call__`` untouched.
Several patches may be installed; each finds the model once. torch is imported only
at ``install``.

A script may train several models in one iteration: a GAN calls its discriminator and
its generator, each from the loop. With ``every_model=True`` the patch hands over each
top-level module with parameters that the script calls before it calls the first one
again (one iteration's models, at most :data:`MOST_MODELS`), and removes itself at that
second call.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torchaxe.runtime.dynamo import compiling

#: The most models ``every_model`` hands over: a script that calls its layers one by
#: one from the loop (no model class) is not compiled layer by layer beyond these.
MOST_MODELS = 4


def has_parameters(module: Any) -> bool:
    return next(module.parameters(), None) is not None


class FirstModel:
    """Calls ``on_model(model)`` at the model's first call (see the module docstring)."""

    def __init__(self, on_model: Callable[[Any], None], every_model: bool = False) -> None:
        self.on_model = on_model
        self.every_model = every_model
        self.model: Any = None
        #: Every model handed over, the first one first.
        self.models: list[Any] = []
        self._original: Any = None
        self._local = threading.local()

    def install(self) -> "FirstModel":
        from torch import nn

        original = nn.Module.__call__
        self._original = original
        finder = self

        def __call__(module, *args, **kwargs):
            if compiling():  # inside the script's own compiled graph: not ours to watch
                return original(module, *args, **kwargs)
            depth = getattr(finder._local, "depth", 0)
            if depth == 0 and finder._original is not None and has_parameters(module) and finder._take(module):
                finder.on_model(module)
            finder._local.depth = depth + 1
            try:
                return original(module, *args, **kwargs)
            finally:
                finder._local.depth = depth

        nn.Module.__call__ = __call__
        return self

    def _take(self, module: Any) -> bool:
        """Whether ``module`` is a model to hand over; removes the patch when no more
        are to be found."""
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
        if self._original is not None:
            from torch import nn

            nn.Module.__call__ = self._original
            self._original = None
