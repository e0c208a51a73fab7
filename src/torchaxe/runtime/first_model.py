"""Finding the model inside an unmodified training script.

"The model" is the first ``nn.Module`` with parameters that the script calls from
outside any other module's forward (a loss function without parameters called first
does not count). A temporary patch of ``nn.Module.__call__`` spots it at its first
call, hands it to a callback *before* that call runs (so that what the callback
installs -- compilation, autocast, tuned subgraphs -- sees that very call), and
removes itself at once, so that later calls run torch's own ``__call__`` untouched.
Several patches may be installed; each finds the model once. torch is imported only
at ``install``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torchaxe.runtime.dynamo import compiling


def has_parameters(module: Any) -> bool:
    return next(module.parameters(), None) is not None


class FirstModel:
    """Calls ``on_model(model)`` at the model's first call (see the module docstring)."""

    def __init__(self, on_model: Callable[[Any], None]) -> None:
        self.on_model = on_model
        self.model: Any = None
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
            if depth == 0 and finder._original is not None and has_parameters(module):
                finder.uninstall()
                finder.model = module
                finder.on_model(module)
                return original(module, *args, **kwargs)
            finder._local.depth = depth + 1
            try:
                return original(module, *args, **kwargs)
            finally:
                finder._local.depth = depth

        nn.Module.__call__ = __call__
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            from torch import nn

            nn.Module.__call__ = self._original
            self._original = None
