"""Rewriting a formula that is spread over several statements.

The engine reads ``scores = q @ k^T * s; scores = scores.masked_fill(...); w =
softmax(scores); out = w @ v`` as one expression, reported at its last part
(``w @ v``). Replacing that part with the fused call is only half a fix: the
statements before it would still build the score matrix. ``plan`` finds them and
says whether deleting them is sound, from the syntax alone:

* walking back from the reported expression through its block, each local it reads
  that is not an input of the replacement must be bound by a plain ``name = value``
  statement of the same block (nothing conditional, in a loop or unpacked); those
  statements are the *chain*, and the engine has already matched every operation in
  them as part of the formula;
* no chain name is read anywhere else in the function (not later, not by a closure,
  not by an in-place call between the statements);
* every input's text still means the same value where the replacement goes: none of
  the names it reads is bound again between where the text was taken and there;
* each chain statement has its lines to itself, so deleting the lines deletes it.

When any of that fails there is no plan, and the finding stays advice.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterator

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
#: Statement fields that hold statement lists.
_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers")
_DROPOUT_FUNCTIONS = {"torch.nn.functional.dropout": (1, 2, 0.5, True), "torch.dropout": (1, 2, None, None)}


@dataclass(frozen=True)
class Plan:
    """The line ranges (first, last, 1-based, inclusive) of the chain statements to
    delete, and the replacement's dropout probability text when the chain drops out."""

    delete: tuple[tuple[int, int], ...]
    dropout_p: str | None = None

    def to_data(self) -> list:
        return [[list(r) for r in self.delete], self.dropout_p]

    @classmethod
    def from_data(cls, data: list | None) -> Plan | None:
        if data is None:
            return None
        ranges, dropout_p = data
        return cls(tuple((int(a), int(b)) for a, b in ranges), dropout_p)


# ---------------------------------------------------------------- syntax helpers
def _pos(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset  # type: ignore[attr-defined]


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]


def _inside(inner: ast.AST, outer: ast.AST) -> bool:
    return _pos(outer) <= _pos(inner) and _end(inner) <= _end(outer)


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _binding_names(target: ast.AST) -> Iterator[str]:
    for n in ast.walk(target):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            yield n.id


def _bindings(scope: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Every (name, node) that binds a local of ``scope``, nested scopes' own locals
    excepted (their names, a ``def``'s or a ``class``'s, are bindings here)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node
            stack.extend(node.decorator_list)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            yield node.id, node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield (alias.asname or alias.name).split(".", 1)[0], node
        elif isinstance(node, ast.ExceptHandler) and node.name:
            yield node.name, node
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                yield name, node
        stack.extend(ast.iter_child_nodes(node))


def _parameters(scope: ast.AST) -> list[str]:
    args = getattr(scope, "args", None)
    if args is None:
        return []
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    every += [a for a in (args.vararg, args.kwarg) if a is not None]
    return [a.arg for a in every]


def _block_of(scope: ast.AST, expr: ast.AST) -> tuple[list[ast.stmt], int] | None:
    """The innermost statement list of ``scope`` holding a statement that contains
    ``expr``, and that statement's index in it."""
    block: list[ast.stmt] = getattr(scope, "body", [])
    found: tuple[list[ast.stmt], int] | None = None
    while True:
        for index, stmt in enumerate(block):
            if _inside(expr, stmt):
                found = (block, index)
                break
        else:
            return found
        stmt = block[index]
        if isinstance(stmt, _SCOPES):
            return found
        inner = None
        for name in _BLOCK_FIELDS:
            for child in getattr(stmt, name, None) or []:
                if isinstance(child, ast.ExceptHandler):
                    if _inside(expr, child):
                        inner = child.body
                elif _inside(expr, child):
                    inner = getattr(stmt, name)
                if inner is not None:
                    break
            if inner is not None:
                break
        if inner is None:
            return found
        block = inner


def _alone_on_its_lines(stmt: ast.stmt, lines: list[str]) -> bool:
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    if first - 1 >= len(lines) or last - 1 >= len(lines):
        return False
    before = lines[first - 1].encode("utf-8")[: stmt.col_offset].decode("utf-8", errors="replace")
    after = lines[last - 1].encode("utf-8")[stmt.end_col_offset or 0 :].decode("utf-8", errors="replace").strip()
    return not before.strip() and (not after or after.startswith("#"))


# ---------------------------------------------------------------- the plan
def plan(scope: ast.AST, expr: ast.AST, sources: dict[str, ast.AST], lines: list[str],
         resolve, cls: ast.ClassDef | None = None) -> Plan | None:
    """The chain statements to delete when ``expr`` is replaced by a call on the
    texts of ``sources`` (the inputs, by role), or None when that is not sound.
    ``resolve`` gives an expression's qualified name (``F.dropout`` ->
    ``torch.nn.functional.dropout``)."""
    if isinstance(scope, ast.Lambda):
        return None
    place = _block_of(scope, expr)
    if place is None:
        return None
    block, index = place
    inputs = set()
    for source in sources.values():
        inputs |= _loads(source)
    params = _parameters(scope)
    receiver = params[0] if params and cls is not None else None
    need = _loads(expr) - inputs
    chain: list[ast.stmt] = []
    for stmt in reversed(block[:index]):
        bound = {name for name, _ in _bindings_of_statement(stmt)}
        hit = bound & need
        if not hit:
            continue
        target = _simple_target(stmt)
        if target is None or hit != {target}:
            return None
        chain.append(stmt)
        need.discard(target)
        need |= _loads(stmt.value) - inputs  # type: ignore[attr-defined]
    chain.reverse()
    if not chain:
        return None
    bound_anywhere = {name for name, _ in _bindings(scope)}
    left = need - {receiver}
    if left & (bound_anywhere | set(params)):
        return None  # the chain goes on outside this block, or through a parameter
    if not _chain_is_private(scope, chain, expr):
        return None
    if not _inputs_still_valid(scope, sources, expr):
        return None
    if not all(_alone_on_its_lines(s, lines) for s in chain):
        return None
    taken = {(s.lineno, s.end_lineno or s.lineno) for s in chain}
    for stmt in block:
        if stmt in chain:
            continue
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        if any(first <= b and a <= last for a, b in taken):
            return None  # shares a line with a chain statement (``a = 1; b = 2``)
    dropout = _dropout_p(chain, expr, resolve, cls, receiver)
    if dropout is False:
        return None
    return Plan(tuple(sorted(taken)), dropout or None)


def _bindings_of_statement(stmt: ast.stmt) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield stmt.name, stmt
        return
    wrapper = ast.Module(body=[stmt], type_ignores=[])
    yield from _bindings(wrapper)


def _simple_target(stmt: ast.stmt) -> str | None:
    """The name a plain ``name = value`` (or ``name: T = value``) binds."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
        return stmt.target.id
    return None


def _chain_is_private(scope: ast.AST, chain: list[ast.stmt], expr: ast.AST) -> bool:
    """No chain name is read, written or declared outside the chain and ``expr``."""
    names = {_simple_target(s) for s in chain}
    places = [*chain, expr]
    for node in ast.walk(scope):
        if isinstance(node, ast.Name) and node.id in names:
            if not any(_inside(node, p) for p in places):
                return False
        elif isinstance(node, (ast.Global, ast.Nonlocal)) and names & set(node.names):
            return False
    return True


def _inputs_still_valid(scope: ast.AST, sources: dict[str, ast.AST], expr: ast.AST) -> bool:
    """No name an input's text reads is bound between that text and ``expr``."""
    bindings = list(_bindings(scope))
    for source in sources.values():
        if _inside(source, expr):
            continue
        lo, hi = sorted((_end(source), _pos(expr)))
        names = _loads(source)
        for name, node in bindings:
            if name in names and hasattr(node, "lineno") and lo <= _pos(node) < hi:
                return False
    return True


def _dropout_p(chain: list[ast.stmt], expr: ast.AST, resolve, cls: ast.ClassDef | None,
               receiver: str | None) -> str | bool:
    """SDPA's ``dropout_p`` for the dropout the chain applies: "" when there is none,
    False when there is one it cannot express."""
    calls = []
    for place in (*chain, expr):
        for node in ast.walk(place):
            if isinstance(node, ast.Call) and _is_dropout_call(node, resolve):
                calls.append(node)
    if not calls:
        return ""
    if len(calls) > 1:
        return False
    call = calls[0]
    func = call.func
    qualified = resolve(func)
    if qualified in _DROPOUT_FUNCTIONS:
        p_index, training_index, p_default, training_default = _DROPOUT_FUNCTIONS[qualified]
        p = _argument(call, "p", p_index, p_default)
        training = _argument(call, "train" if qualified == "torch.dropout" else "training", training_index,
                             training_default)
        if p is None or training is None:
            return False
        return p if training == "True" else f"({p} if {training} else 0.0)"
    # self.attn_dropout(x): an nn.Dropout set in __init__.
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == receiver
            and _is_dropout_module(cls, func.attr, resolve)):
        return f"({receiver}.{func.attr}.p if {receiver}.training else 0.0)"
    return False


def _is_dropout_call(call: ast.Call, resolve) -> bool:
    if resolve(call.func) in _DROPOUT_FUNCTIONS:
        return True
    func = call.func
    return isinstance(func, ast.Attribute) and ("dropout" in func.attr.lower() or "drop" in func.attr.lower())


def _argument(call: ast.Call, name: str, index: int, default) -> str | None:
    for keyword in call.keywords:
        if keyword.arg == name:
            return ast.unparse(keyword.value)
    if len(call.args) > index:
        return ast.unparse(call.args[index])
    return None if default is None else repr(default)


def _is_dropout_module(cls: ast.ClassDef | None, attr: str, resolve) -> bool:
    """``self.<attr> = nn.Dropout(...)`` somewhere in the class's methods."""
    if cls is None:
        return False
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == attr:
                    return resolve(node.value.func) == "torch.nn.Dropout"
    return False
