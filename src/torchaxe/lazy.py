"""Package names loaded on first use: a package that exposes names from modules that
import torch (or cost start-up time) maps each name to its module here, so that
importing the package stays cheap."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_attributes(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``names[name]`` (a module
    path) the first time ``name`` is asked for, and refuses any other name."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
