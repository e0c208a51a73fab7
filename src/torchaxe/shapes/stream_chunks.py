"""Streams cut into chunks by the script's own code, read from its source.

A loop without a DataLoader that walks a tensor in chunks of one length ends each
epoch on a shorter chunk unless the length divides: a language model's BPTT chunks
(``seq_len = min(bptt, len(source) - 1 - i)`` then ``source[i:i + seq_len]``) or a
hand-made batching loop (``for i in range(0, n, batch): x[i:i + batch]``). The steps
``shapes`` records are the first few of the epoch, so that chunk is rarely among them;
its code says it will come. Only the script's own file is read; nothing is run."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from torchaxe.scan.context import walk_scope

#: Calls and attributes that give a length (``len(x)``, ``x.size(0)``, ``x.shape[0]``).
_LENGTHS = frozenset({"len", "size", "shape", "numel"})


@dataclass(frozen=True)
class ChunkSite:
    """Where the script cuts a stream into chunks whose last one may be shorter."""

    path: str
    line: int
    text: str

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "line": self.line, "text": self.text}


def chunk_sites(path: str | Path, limit: int = 2) -> list[ChunkSite]:
    """The first ``limit`` places in the file at ``path`` that cut a stream into
    chunks of one length with a shorter last one; none when the file cannot be read
    or parsed (a module run with ``-m``, a script that is no Python file)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    found: list[ast.stmt] = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        nodes = list(walk_scope(scope))
        slices = [n.slice for n in nodes if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Slice)]
        for node in nodes:
            if isinstance(node, ast.Assign) and _clipped_length(node, slices):
                found.append(node)
            elif isinstance(node, ast.For) and _strided_range_sliced(node):
                found.append(node)
    found.sort(key=lambda n: n.lineno)
    lines = source.splitlines()
    return [ChunkSite(str(path), n.lineno, lines[n.lineno - 1].strip() if n.lineno <= len(lines) else "")
            for n in found[:limit]]


def _reads_a_length(node: ast.AST) -> bool:
    for inner in ast.walk(node):
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "len":
            return True
        if isinstance(inner, ast.Attribute) and inner.attr in _LENGTHS:
            return True
    return False


def _clipped_length(assign: ast.Assign, slices: list[ast.Slice]) -> bool:
    """``seq_len = min(bptt, len(source) - 1 - i)`` whose name bounds a slice
    ``[i:i + seq_len]`` of the same function."""
    value = assign.value
    if len(assign.targets) != 1 or not isinstance(assign.targets[0], ast.Name):
        return False
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "min"
            and len(value.args) == 2 and not value.keywords):
        return False
    if not any(isinstance(a, ast.BinOp) and isinstance(a.op, ast.Sub) and _reads_a_length(a) for a in value.args):
        return False
    name = assign.targets[0].id
    return any(_added_to_lower(s, lambda n: isinstance(n, ast.Name) and n.id == name) for s in slices)


def _added_to_lower(s: ast.Slice, is_length) -> bool:
    """``[i:i + L]`` (``[i + 1:i + 1 + L]``): the upper bound adds a length to what
    the lower bound holds."""
    if s.lower is None or s.upper is None or not isinstance(s.upper, ast.BinOp) or not isinstance(s.upper.op, ast.Add):
        return False
    lower = {n.id for n in ast.walk(s.lower) if isinstance(n, ast.Name)}
    upper_names = {n.id for n in ast.walk(s.upper) if isinstance(n, ast.Name)}
    return bool(lower) and lower <= upper_names and any(is_length(n) for n in ast.walk(s.upper))


def _strided_range_sliced(loop: ast.For) -> bool:
    """``for i in range(0, n, step)`` whose body takes ``x[i:i + step]`` (Python
    slicing cuts the last one short) and runs a backward pass, the end not made a
    multiple of the step (``n - n % step``)."""
    it = loop.iter
    if not (isinstance(loop.target, ast.Name) and isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
            and it.func.id == "range" and len(it.args) == 3 and not it.keywords):
        return False
    end, step = it.args[1], it.args[2]
    if isinstance(step, ast.Constant) or any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mod, ast.FloorDiv))
                                             for n in ast.walk(end)):
        return False
    if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
               for stmt in loop.body for n in ast.walk(stmt)):
        return False  # not a training loop: chunks of documents, of an evaluation
    index, wanted = loop.target.id, ast.dump(step)
    for node in (n for stmt in loop.body for n in ast.walk(stmt)):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            s = node.slice
            if isinstance(s.lower, ast.Name) and s.lower.id == index and \
                    _added_to_lower(s, lambda n: ast.dump(n) == wanted):
                return True
    return False
