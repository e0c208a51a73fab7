"""The ``replace`` knob: swap recognised hand-written formulas in code the user does
not edit (an installed package) for the fused operator, at run time.

In a knob-set file (docs/trial.md) or the ``run`` table of torchaxe.toml::

    {"replace": {"transformers.activations:NewGELUActivation.forward": "gelu_tanh"}}

Each key names a function by import path, ``module:function`` or
``module:Class.method``; each value names the formula it computes and is replaced by
(``gelu_tanh`` -> ``F.gelu(x, approximate="tanh")``, ``gelu_erf``, ``silu``,
``rms_norm``, ``layer_norm``). When the module is imported (or at once, if it already
is), its file is read again and the formula rules must still find that very formula as
the function's whole body (``swaps.py``): a package upgraded since ``advise`` is left
alone and the run notes why. A method is replaced on its class, a function in its
module, for the whole run; both are restored when the run ends. The package's files
are never written. What was replaced is noted under ``replace`` in the run's record.
Validation here imports nothing heavy.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import re
import sys
import types
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed, kind
from torchaxe.tune.swaps import SUPPORTED, file_swaps

_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")


@dataclass(frozen=True)
class Replacement:
    """One function to replace: ``module:scope`` computing ``formula``."""

    module: str
    scope: str
    formula: str

    @property
    def target(self) -> str:
        return f"{self.module}:{self.scope}"


def parse_replace(raw: Any, check: KnobCheck) -> tuple[Replacement, ...]:
    """The validated ``replace`` table: import path -> formula."""
    if not isinstance(raw, dict):
        check.fail("replace", f"expected an object such as {{\"pkg.mod:Class.forward\": \"gelu_tanh\"}}, "
                              f"got {kind(raw)}")
    out = []
    for target, formula in raw.items():
        if not isinstance(target, str) or not _TARGET.match(target):
            check.fail(f"replace.{target}", "expected module:function or module:Class.method "
                                            "(e.g. \"transformers.activations:NewGELUActivation.forward\")")
        if formula not in SUPPORTED:
            check.fail(f"replace.{target}", f"{kind(formula)} is not one of {', '.join(SUPPORTED)}")
        module, _, scope = target.partition(":")
        out.append(Replacement(module, scope, formula))
    return tuple(sorted(out, key=lambda r: r.target))


class _Loaded(importlib.abc.Loader):
    """Runs the real loader, then ``then(module)``; the module keeps the real loader."""

    def __init__(self, inner: Any, then: Callable[[types.ModuleType], None]) -> None:
        self.inner = inner
        self.then = then

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self.inner.exec_module(module)
        finally:
            module.__loader__ = self.inner
            if module.__spec__ is not None:
                module.__spec__.loader = self.inner
        self.then(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the named modules as the other finders would, and calls ``then(module)``
    once each has run."""

    def __init__(self, names: set[str], then: Callable[[types.ModuleType], None]) -> None:
        self.names = names
        self.then = then
        self.busy: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names or fullname in self.busy:
            return None
        self.busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            self.busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loaded(spec.loader, self.then)
        return spec


class ReplacePatch:
    """Installs the replacements of one ``replace`` value (see the module docstring)."""

    def __init__(self, replacements: tuple[Replacement, ...], applied: AppliedKnobs) -> None:
        self.replacements = replacements
        self.applied = applied
        self.replaced: list[str] = []
        self.not_replaced: list[str] = []
        self._undo: list[tuple[Any, str, Any]] = []
        self._hook: _AfterImport | None = None

    def install(self) -> None:
        names = {r.module for r in self.replacements}
        self._note()
        for name in sorted(names):
            module = sys.modules.get(name)
            if module is not None:
                self._on_import(module)
        self._hook = _AfterImport(names - set(sys.modules), self._on_import)
        sys.meta_path.insert(0, self._hook)

    def uninstall(self) -> None:
        if self._hook is not None and self._hook in sys.meta_path:
            sys.meta_path.remove(self._hook)
        self._hook = None
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def _on_import(self, module: types.ModuleType) -> None:
        for r in self.replacements:
            if r.module == module.__name__:
                try:
                    why = self._replace(module, r)
                except Exception as exc:  # noqa: BLE001 - the user's import must not fail because of a knob
                    why = f"{type(exc).__name__}: {exc}"
                if why is None:
                    self.replaced.append(f"{r.target} ({r.formula})")
                else:
                    self.not_replaced.append(f"{r.target}: {why}")
        self._note()

    def _replace(self, module: types.ModuleType, r: Replacement) -> str | None:
        """Swap one function; None when done, else why not."""
        from torchaxe.tune.replacements import fused_function

        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            return "the module has no Python source"
        swap = next((s for s in file_swaps(path).swaps if s.scope == r.scope and s.category == r.formula), None)
        if swap is None:
            return f"{r.scope} in {path} does not return the {r.formula} formula (changed since advise?)"
        owner: Any = module
        if swap.owner is not None:
            owner = module.__dict__.get(swap.owner)
            if not isinstance(owner, type):
                return f"{swap.owner} is not a class of {module.__name__}"
        original = vars(owner).get(swap.name)
        if not isinstance(original, types.FunctionType):
            return f"{r.scope} is not a plain function"
        setattr(owner, swap.name, fused_function(swap, original))
        self._undo.append((owner, swap.name, original))
        return None

    def _note(self) -> None:
        self.applied.note("replace", {"requested": [r.target for r in self.replacements],
                                      "replaced": list(self.replaced), "not_replaced": list(self.not_replaced)})


class ReplaceKnob(Knob):
    """``replace``: swap recognised formulas in installed packages for fused operators
    (import path -> formula)."""

    key = "replace"
    example = {"transformers.activations:NewGELUActivation.forward": "gelu_tanh"}

    def parse(self, raw: Any, check: KnobCheck) -> tuple[Replacement, ...] | None:
        return None if raw is None else parse_replace(raw, check)

    def to_json(self, value: tuple[Replacement, ...] | None) -> dict[str, str] | None:
        return None if value is None else {r.target: r.formula for r in value}

    def patch(self, value: tuple[Replacement, ...] | None, applied: AppliedKnobs):
        return installed(ReplacePatch(value, applied)) if value else nullcontext()


SPEC = ReplaceKnob()
