"""Run the user's script with some of its files replaced, without touching the files.

``advise`` measures a code fix before the user accepts it: the fixed source is
written to a temporary file and the trial run reads it in place of the original.
Inside the run, modules keep their real names and ``__file__`` (paths relative to
the script, tracebacks and imports behave as in the user's own run); only the source
text differs. Nothing is compiled to ``__pycache__`` for an overlaid file, so the
user's bytecode cache is never written with code that is not theirs.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from torchaxe.errors import TorchaxeError

_active: dict[str, str] = {}


def _key(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(path))


class OverlayLoader(importlib.machinery.SourceFileLoader):
    """A source loader for ``path`` that reads its text from ``replacement``."""

    def __init__(self, fullname: str, path: str, replacement: str) -> None:
        super().__init__(fullname, path)
        self.replacement = replacement

    def get_data(self, path: str) -> bytes:
        if _key(path) == _key(self.path):
            with open(self.replacement, "rb") as handle:
                return handle.read()
        return super().get_data(path)

    def path_stats(self, path: str):
        # No mtime: the bytecode cache is neither read (it holds the original) nor written.
        raise OSError("overlaid source: no bytecode cache")

    def set_data(self, path: str, data: bytes, *, _mode: int = 0o666) -> None:
        return None


class OverlayFinder(importlib.abc.MetaPathFinder):
    """Finds modules as usual, then swaps in an :class:`OverlayLoader` for overlaid files."""

    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = dict(mapping)

    def find_spec(self, fullname, path, target=None):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin or not spec.has_location:
            return None
        replacement = self.mapping.get(_key(spec.origin))
        if replacement is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, loader=OverlayLoader(fullname, spec.origin, replacement),
            submodule_search_locations=spec.submodule_search_locations)


def check_overlay(mapping: Mapping[str, str]) -> dict[str, str]:
    """Absolute, existing paths on both sides, or one line saying which is not."""
    out: dict[str, str] = {}
    for original, replacement in mapping.items():
        for role, path in (("original", original), ("replacement", replacement)):
            if not Path(path).is_file():
                raise TorchaxeError(f"sources: {role} file not found: {path}")
        out[_key(original)] = os.path.abspath(replacement)
    return out


@contextmanager
def source_overlay(mapping: Mapping[str, str]) -> Iterator[None]:
    """While active, imports of the mapped files and :func:`run_main` read the replacements."""
    global _active
    if not mapping:
        yield
        return
    checked = check_overlay(mapping)
    finder = OverlayFinder(checked)
    saved = _active
    _active = {**saved, **checked}
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        _active = saved


def run_main(path: str) -> None:
    """``runpy.run_path(path, run_name="__main__")``, reading an overlaid script's
    replacement text while ``__file__`` and tracebacks keep the real path."""
    replacement = _active.get(_key(path))
    if replacement is None:
        # Absolute, as `python train.py` makes ``__file__`` and the code's file names
        # since Python 3.9: what ran is then known by path whatever the working folder.
        runpy.run_path(os.path.abspath(path), run_name="__main__")
        return
    loader = OverlayLoader("__main__", os.path.abspath(path), replacement)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=os.path.abspath(path), __loader__=loader, __spec__=None,
                           __package__=None, __builtins__=builtins, __cached__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        loader.exec_module(module)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
