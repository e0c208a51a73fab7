"""Rewriting a formula that is spread over several statements.

The engine reads ``scores = q @ k^T * s; scores = scores.masked_fill(...); w =
softmax(scores); out = w @ v`` as one expression, reported at its last part
(``w @ v``). Replacing that part with the fused call is only half a fix: the
statements before it would still build the score matrix. ``plan`` finds them and
says whether deleting them is sound, from the syntax alone:

* walking back from the reported expression through its block, each local it reads
  that is not an input of the replacement must be bound by a plain ``name = value``
  statement of the same block, or an unpacking into plain names all of which the
  formula reads (``a, b = x.chunk(2, -1)``; nothing in a loop, and nothing conditional
  but one ``if NAME is not None:`` around a single assignment, where NAME is read by an
  input: an optional mask, which the rule must then pass only when it is not None);
  those statements are the *chain*, and the engine has already matched every
  operation in them as part of the formula;
* no chain name is read anywhere else in the function (not later, not by a closure,
  not by an in-place call between the statements);
* every input's text still means the same value where the replacement goes: none of
  the names it reads is bound again between where the text was taken and there;
* no intermediate result is reshaped on the way (a mask would broadcast otherwise);
* each chain statement has its lines to itself, so deleting the lines deletes it.

When any of that fails there is no plan, and the finding stays advice.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterator

from torchaxe.scan.context import child_nodes, fast_walk

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
#: Statement fields that hold statement lists.
_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers")
#: Calls that change a tensor's shape or the order of its dimensions.
_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "permute", "transpose", "unsqueeze", "squeeze",
                       "view_as", "reshape_as", "movedim", "swapaxes", "swapdims", "expand", "expand_as"})
_DROPOUT_FUNCTIONS = {"torch.nn.functional.dropout": (1, 2, 0.5, True), "torch.dropout": (1, 2, None, None)}


@dataclass(frozen=True)
class Plan:
    """The line ranges (first, last, 1-based, inclusive) of the chain statements to
    delete, the replacement's dropout probability text when the chain drops out, and
    the name whose ``is not None`` guards one chain statement (an optional mask): the
    replacement must then do without that part when the name is None."""

    delete: tuple[tuple[int, int], ...]
    dropout_p: str | None = None
    guard: str | None = None

    def to_data(self) -> list:
        return [[list(r) for r in self.delete], self.dropout_p, self.guard]

    @classmethod
    def from_data(cls, data: list | None) -> Plan | None:
        if data is None:
            return None
        ranges, dropout_p, guard = data
        return cls(tuple((int(a), int(b)) for a, b in ranges), dropout_p, guard)


# ---------------------------------------------------------------- syntax helpers
def _pos(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset  # type: ignore[attr-defined]


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]


def _inside(inner: ast.AST, outer: ast.AST) -> bool:
    return _pos(outer) <= _pos(inner) and _end(inner) <= _end(outer)


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in fast_walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _bindings(scope: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Every (name, node) that binds a local of ``scope``, nested scopes' own locals
    excepted (their names, a ``def``'s or a ``class``'s, are bindings here)."""
    stack = list(child_nodes(scope))
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
        stack.extend(child_nodes(node))


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
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None  # a lambda has no statements; module-level names may be imported elsewhere
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
    guard: str | None = None
    for stmt in reversed(block[:index]):
        bound = {name for name, _ in _bindings_of_statement(stmt)}
        hit = bound & need
        if not hit:
            continue
        assign = stmt
        if _targets(stmt) is None:
            # ``if mask is not None: scores = scores.masked_fill(...)``: an optional mask.
            guarded = _guarded(stmt)
            if guarded is None or guard is not None or guarded[0] not in inputs:
                return None
            guard, assign = guarded
        targets = _targets(assign)
        if targets is None or hit != targets:
            return None  # it also binds a name the formula does not read
        chain.append(stmt)
        need -= targets
        need |= _loads(assign.value) - inputs  # type: ignore[attr-defined]
    chain.reverse()
    if not chain:
        return None
    bindings = list(_bindings(scope))
    bound_anywhere = {name for name, _ in bindings}
    left = need - {receiver}
    if left & (bound_anywhere | set(params)):
        return None  # the chain goes on outside this block, or through a parameter
    if not _chain_is_private(scope, chain, expr):
        return None
    if _reshapes_the_chain(chain, expr):
        return None
    if not _inputs_still_valid(scope, sources, expr, bindings):
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
    return Plan(_with_blank_lines(sorted(taken), block[index].lineno, lines), dropout or None, guard)


def _with_blank_lines(ranges: list[tuple[int, int]], final: int, lines: list[str]) -> tuple[tuple[int, int], ...]:
    """The ranges, each extended over the blank lines after it when the next line with
    text is deleted too or is the rewritten statement's: the chain's blank lines go with
    it, and the blank line before it stays."""
    starts = {a for a, _ in ranges} | {final}
    out = []
    for first, last in ranges:
        end = last
        while end < len(lines) and not lines[end].strip():
            end += 1
        out.append((first, end if end + 1 in starts and end > last else last))
    return tuple(out)


def _bindings_of_statement(stmt: ast.stmt) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield stmt.name, stmt
        return
    wrapper = ast.Module(body=[stmt], type_ignores=[])
    yield from _bindings(wrapper)


def _guarded(stmt: ast.stmt) -> tuple[str, ast.stmt] | None:
    """``if NAME is not None: <one plain assignment>`` (no else): NAME and the assignment."""
    if not isinstance(stmt, ast.If) or stmt.orelse or len(stmt.body) != 1 or _simple_target(stmt.body[0]) is None:
        return None
    test = stmt.test
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        return test.left.id, stmt.body[0]
    return None


def _chain_targets(stmt: ast.stmt) -> set[str]:
    guarded = _guarded(stmt)
    return _targets(guarded[1] if guarded else stmt) or set()


def _targets(stmt: ast.stmt) -> set[str] | None:
    """The names a plain ``name = value`` binds, or an unpacking into plain names
    (``a, b = x.chunk(2, -1)``); None for any other statement."""
    single = _simple_target(stmt)
    if single is not None:
        return {single}
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], (ast.Tuple, ast.List)):
        elts = stmt.targets[0].elts
        if elts and all(isinstance(e, ast.Name) for e in elts):
            names = {e.id for e in elts}  # type: ignore[attr-defined]
            return names if len(names) == len(elts) else None
    return None


def _simple_target(stmt: ast.stmt) -> str | None:
    """The name a plain ``name = value`` (or ``name: T = value``) binds."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
        return stmt.target.id
    return None


def _chain_is_private(scope: ast.AST, chain: list[ast.stmt], expr: ast.AST) -> bool:
    """No chain name is read, written or declared outside the chain and ``expr``."""
    names = set().union(*(_chain_targets(s) for s in chain))
    places = [*chain, expr]
    for node in fast_walk(scope):
        if isinstance(node, ast.Name) and node.id in names:
            if not any(_inside(node, p) for p in places):
                return False
        elif isinstance(node, (ast.Global, ast.Nonlocal)) and names & set(node.names):
            return False
    return True


def _reshapes_the_chain(chain: list[ast.stmt], expr: ast.AST) -> bool:
    """Whether an intermediate result is reshaped on the way (``scores.view(b, h, l,
    s)`` between two ``bmm``): the engine reads through it, but a mask or a fused call
    would then broadcast over other dimensions than the hand-written code did."""
    names = set().union(*(_chain_targets(s) for s in chain))
    for place in (*chain, expr):
        for node in fast_walk(place):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _RESHAPES:
                if _loads(func.value) & names:
                    return True
                if node.args and isinstance(func.value, ast.Name) and func.value.id == "torch" and (
                        _loads(node.args[0]) & names):
                    return True
    return False


def _inputs_still_valid(scope: ast.AST, sources: dict[str, ast.AST], expr: ast.AST,
                        bindings: list[tuple[str, ast.AST]]) -> bool:
    """An input's text means the same value where ``expr`` is as where it was taken:
    between the two, no name it reads is bound again, and nothing it reads is
    written (``self.k_cache = ...``, ``k[0] = 0``) or changed in place (``k.mul_(2)``)."""
    writes = list(_writes(scope))
    for source in sources.values():
        if _inside(source, expr):
            continue
        lo, hi = sorted((_end(source), _pos(expr)))
        names = _loads(source)
        for name, node in bindings:
            if name in names and hasattr(node, "lineno") and lo <= _pos(node) < hi:
                return False
        paths = {p for p in (_path(n) for n in fast_walk(source)) if p}
        for path, node in writes:
            if lo <= _pos(node) < hi and any(_overlap(path, p) for p in paths):
                return False
    return True


def _path(node: ast.AST) -> str | None:
    """``self.k_cache`` for an attribute chain on a name, ``k`` for a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _writes(scope: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """What the scope writes other than by binding a name: attribute and subscript
    stores (the object written to) and in-place calls (``k.mul_(2)``, ``torch.nn.init.zeros_(w)``)."""
    for node in fast_walk(scope):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            path = _path(node) if isinstance(node, ast.Attribute) else _path(node.value)
            if path:
                yield path, node
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name.endswith("_") and not name.endswith("__"):
                if isinstance(node.func, ast.Attribute) and (path := _path(node.func.value)):
                    yield path, node
                for arg in node.args[:1]:
                    if path := _path(arg):
                        yield path, node


def _dropout_p(chain: list[ast.stmt], expr: ast.AST, resolve, cls: ast.ClassDef | None,
               receiver: str | None) -> str | bool:
    """SDPA's ``dropout_p`` for the dropout the chain applies: "" when there is none,
    False when there is one it cannot express."""
    calls = []
    for place in (*chain, expr):
        for node in fast_walk(place):
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
    """Every ``self.<attr> = ...`` in the class's methods sets an ``nn.Dropout`` (one
    that may be ``nn.Identity`` has no ``.p``)."""
    if cls is None:
        return False
    values = []
    for node in fast_walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == attr:
                values.append(getattr(node, "value", None))
            elif isinstance(target, (ast.Tuple, ast.List)) and any(
                    isinstance(e, ast.Attribute) and e.attr == attr for e in target.elts):
                return False
    return bool(values) and all(isinstance(v, ast.Call) and resolve(v.func) == "torch.nn.Dropout" for v in values)
