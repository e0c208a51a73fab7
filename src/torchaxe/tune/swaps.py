"""Which recognised formulas of a file can be swapped for a fused operator at run time.

The formula rules (AX110-AX120) recognise hand-written GELUs, norms and attention by
their values. Where a rule found that a *whole* function computes the formula (its
body is one ``return`` of the matched expression, every input a parameter, an
attribute of one, or a constant), that function can be replaced by the fused
operator without touching the file. This module only reads source (no torch): the
tuner (``replacements.py``) and the ``replace`` knob (``replace.py``) apply what it
finds, and ``advise`` proposes it for installed packages (``candidates.py``).
"""

from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

#: Categories with a fused operator that can be called in place of the function.
SUPPORTED = ("gelu_tanh", "gelu_erf", "silu", "mish", "rms_norm", "layer_norm")


@dataclass(frozen=True)
class FunctionSwap:
    """Replace function ``name`` (a method of ``owner`` when ``owner`` is set)."""

    category: str
    file: str
    scope: str
    inputs: tuple[tuple[str, str], ...]
    params: tuple[tuple[str, Any], ...]
    #: Largest difference of the fused operator from the hand-written form on the
    #: scanner's probes (0 when they agree exactly).
    max_error: float = 0.0
    #: The line of the formula, for messages.
    line: int = 0

    @property
    def owner(self) -> str | None:
        return self.scope.split(".")[0] if "." in self.scope else None

    @property
    def name(self) -> str:
        return self.scope.split(".")[-1]

    def label(self) -> str:
        return f"{self.category} in {self.scope}"


@dataclass
class FileSwaps:
    """What the formula rules found in one file, sorted by what can be done at run time."""

    swaps: list[FunctionSwap] = field(default_factory=list)
    #: Recognised attention to rewrite to SDPA in a captured graph ("attention in C.forward").
    rewrites: list[str] = field(default_factory=list)
    #: Recognised formulas that cannot be swapped at run time, with the reason.
    skipped: list[str] = field(default_factory=list)


@functools.lru_cache(maxsize=64)
def file_matches(path: str, target: str) -> tuple[tuple[Any, ...], str]:
    """The formula rules' matches in the file at ``path``, and its text (empty when
    it cannot be read or parsed)."""
    from torchaxe.scan.context import FileContext
    from torchaxe.scan.formulas.analysis import formula_matches

    try:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        tree = ast.parse(source, filename=path)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return (), ""
    ctx = FileContext(path=path, source=source, tree=tree, target=target)
    return tuple(formula_matches(ctx)), source


def file_swaps(path: str, target: str = "cpu", owners: Iterable[str] | None = None) -> FileSwaps:
    """The runtime replacements of the formulas in ``path``; with ``owners``, only
    the module-level functions and the methods of those classes."""
    found = FileSwaps()
    matches, source = file_matches(path, target)
    if not matches:
        return found
    wanted = set(owners) if owners is not None else None
    tree = ast.parse(source, filename=path)
    for m in matches:
        owner = m.scope_name.split(".")[0] if "." in m.scope_name else None
        if owner is not None and wanted is not None and owner not in wanted:
            continue
        where = f"{m.category} in {m.scope_name} ({path}:{m.line})"
        if m.category == "attention" and owner is not None:
            why = _attention_unsupported(m.params)
            if why is None:
                found.rewrites.append(f"attention in {m.scope_name}")
            else:
                found.skipped.append(f"{where}: {why}")
            continue
        if m.category not in SUPPORTED:
            found.skipped.append(f"{where}: no runtime replacement for {m.category}; apply it with `torchaxe fix`")
            continue
        if m.spread or not m.fixable:
            found.skipped.append(f"{where}: spread over several statements; apply it with `torchaxe fix` or by hand")
            continue
        reason = _whole_function(tree, m) or _unsupported_params(m)
        if reason:
            found.skipped.append(f"{where}: {reason}")
            continue
        found.swaps.append(FunctionSwap(m.category, path, m.scope_name, tuple(sorted(m.inputs.items())),
                                        tuple(sorted((k, v) for k, v in m.params.items()
                                                     if isinstance(v, (int, float, str, bool)))),
                                        max_error=float(m.max_abs or 0.0), line=m.line))
    return found


def module_name(path: str) -> str | None:
    """The import name of the module in ``path``, from the packages (folders with an
    ``__init__.py``) around it: ``.../site-packages/transformers/activations.py`` ->
    ``transformers.activations``. None for a package's ``__init__`` outside any package."""
    real = os.path.realpath(path)
    folder, filename = os.path.split(real)
    stem, ext = os.path.splitext(filename)
    if ext != ".py" or not stem.isidentifier():
        return None
    parts = [] if stem == "__init__" else [stem]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, name = os.path.split(folder)
        if not name.isidentifier():
            return None
        parts.insert(0, name)
    return ".".join(parts) or None


def _scope_function(tree: ast.Module, scope: str) -> ast.FunctionDef | None:
    parts = scope.split(".")
    body = tree.body
    node: Any = None
    for i, part in enumerate(parts):
        wanted = ast.ClassDef if i < len(parts) - 1 else (ast.FunctionDef, ast.AsyncFunctionDef)
        node = next((n for n in body if isinstance(n, wanted) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node if isinstance(node, ast.FunctionDef) else None


def _whole_function(tree: ast.Module, match: Any) -> str | None:
    """None when the match is the function's whole body; else why not."""
    fn = _scope_function(tree, match.scope_name)
    if fn is None:
        return f"{match.scope_name} is not a plain function or method"
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return f"{match.scope_name} does more than return the formula"
    value = body[0].value
    span = (value.lineno, value.col_offset, value.end_lineno, value.end_col_offset)
    n = match.node
    if span != (n.lineno, n.col_offset, n.end_lineno, n.end_col_offset):
        return f"{match.scope_name} does more than return the formula"
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    for role, text in match.inputs.items():
        if text is not None and reference(text, params) is None:
            return f"input {role} ({text}) is not a parameter, an attribute of one or a constant"
    return None


def reference(text: str, params: set[str]) -> tuple[str, tuple[str, ...]] | float | None:
    """``x`` -> ("x", ()), ``self.weight`` -> ("self", ("weight",)), ``1e-6`` -> 1e-6."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        node = ast.Constant(-node.operand.value)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in params:
        return node.id, tuple(reversed(chain))
    return None


def _attention_unsupported(params: dict[str, Any]) -> str | None:
    if params.get("dropout"):
        return "attention with dropout (the rewrite keeps no dropout state); apply it with `torchaxe fix`"
    if params.get("layout") not in (None, "BNSD"):
        return f"attention in layout {params.get('layout')} (the rewrite expects heads before the sequence)"
    return None


def _unsupported_params(match: Any) -> str | None:
    p = match.params
    if match.category == "rms_norm":
        if p.get("casts"):
            return "normalises in another dtype and casts back (the fused norm keeps the input dtype)"
        if p.get("eps_placement") == "outside":
            return "adds eps outside the square root (F.rms_norm adds it inside)"
    if match.category == "layer_norm" and p.get("casts"):
        return "normalises in another dtype and casts back"
    return None
