"""Auto-tuning of fixed-shape subgraphs; the winners are kept in the knowledge base.

``torchaxe.tune(model, example_inputs)`` (also ``torchaxe.tune.tune``) captures the
model on its real shapes, cuts it into subgraphs, measures every strategy on each
distinct subgraph, records the results in the knowledge base (:mod:`torchaxe.kb`)
and applies the winners; ``torchaxe.tune.apply(model)`` applies what the knowledge
base already holds, without tuning. See docs/tune.md and docs/kb.md.

Importing this package is light (no torch): the tuner is loaded on first use.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from torchaxe.lazy import lazy_attributes

__all__ = ["tune", "apply", "TuneOptions", "TuneReport"]

__getattr__ = lazy_attributes(__name__, dict.fromkeys(__all__, "torchaxe.tune.tuner"))


class _CallablePackage(types.ModuleType):
    """Lets ``torchaxe.tune(model, example_inputs)`` call :func:`tune` directly."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return importlib.import_module("torchaxe.tune.tuner").tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
