"""The expression trees formulas are recognised in.

A :class:`Node` is a free variable (a parameter, ``self.eps``, an opaque call), a
constant, or a whitelisted operation on other nodes. Nodes are interned by a
:class:`Builder`, so the same subexpression written twice is one object: a value
computed once, and "x is used three times" visible as sharing. Constant arithmetic is
folded as the tree is built, which makes ``math.sqrt(2 / math.pi)`` and
``0.7978845608`` the same kind of leaf.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

#: Larger trees are cut into an opaque variable: matching them would cost more than
#: it can find (real formulas are a few dozen nodes).
MAX_SIZE = 400
MAX_KEY = 6000

VAR = "$var"
CONST = "$const"


class Node:
    """One interned expression node; treat as immutable."""

    __slots__ = ("op", "args", "kwargs", "value", "key", "vars", "ops", "size", "__weakref__")

    def __init__(self, op: str, args: tuple[Node, ...], kwargs: tuple[tuple[str, Node], ...], value: Any, key: str):
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.value = value
        self.key = key
        if op == VAR:
            self.vars: frozenset[str] = frozenset((value,))
            self.ops: frozenset[str] = frozenset()
            self.size = 1
        elif op == CONST:
            self.vars = frozenset()
            self.ops = frozenset()
            self.size = 1
        else:
            children = self.children()
            self.vars = frozenset().union(*(c.vars for c in children)) if children else frozenset()
            self.ops = frozenset((op,)).union(*(c.ops for c in children))
            self.size = 1 + sum(c.size for c in children)

    def children(self) -> tuple[Node, ...]:
        if not self.kwargs:
            return self.args
        return self.args + tuple(v for _, v in self.kwargs)

    def kwarg(self, name: str) -> Node | None:
        for k, v in self.kwargs:
            if k == name:
                return v
        return None

    @property
    def is_var(self) -> bool:
        return self.op == VAR

    @property
    def is_const(self) -> bool:
        return self.op == CONST

    def __repr__(self) -> str:
        return f"Node({self.key[:80]})"


def _const_key(value: Any) -> str:
    return "#" + repr(value)


class Builder:
    """Creates interned nodes, folding constant arithmetic."""

    def __init__(self) -> None:
        self._table: dict[str, Node] = {}
        self._big = 0

    def _intern(self, op: str, args: tuple[Node, ...], kwargs: tuple[tuple[str, Node], ...], value: Any, key: str) -> Node:
        node = self._table.get(key)
        if node is None:
            node = Node(op, args, kwargs, value, key)
            self._table[key] = node
        return node

    def var(self, name: str) -> Node:
        return self._intern(VAR, (), (), name, "$" + name)

    def const(self, value: Any) -> Node:
        # repr keeps 2 and 2.0 apart: ints index and count, floats scale.
        return self._intern(CONST, (), (), value, _const_key(value))

    def op(self, name: str, args: tuple[Node, ...] | list[Node], kwargs: dict[str, Node] | None = None) -> Node:
        args = tuple(args)
        kw = tuple(sorted(kwargs.items())) if kwargs else ()
        folded = _fold(name, args, kw)
        if folded is not _NO_FOLD:
            return self.const(folded)
        parts = [a.key for a in args]
        if kw:
            parts.extend(f"{k}={v.key}" for k, v in kw)
        key = f"{name}({','.join(parts)})"
        size = 1 + sum(a.size for a in args) + sum(v.size for _, v in kw)
        if size > MAX_SIZE or len(key) > MAX_KEY:
            # Too big to be worth matching: an opaque variable stands for it.
            return self.var(f"<large expression {hash(key) & 0xFFFFFFFF:08x}>")
        return self._intern(name, args, kw, None, key)


_NO_FOLD = object()

_BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
}
_UNARY = {
    "neg": lambda a: -a,
    "pos": lambda a: +a,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "tanh": math.tanh,
    "erf": math.erf,
    "abs": abs,
    "reciprocal": lambda a: 1.0 / a,
    "rsqrt": lambda a: 1.0 / math.sqrt(a),
    "float": float,
    "int": int,
}


def _is_number(node: Node) -> bool:
    return node.op == CONST and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def _fold(name: str, args: tuple[Node, ...], kwargs: tuple) -> Any:
    """The value of an operation on numeric constants, or ``_NO_FOLD``."""
    if (name == "add" and len(args) == 2 and not kwargs and all(a.op == CONST and isinstance(a.value, str)
                                                                for a in args)):
        return args[0].value + args[1].value  # an einsum equation put together from pieces
    if kwargs or not args or not all(_is_number(a) for a in args):
        return _NO_FOLD
    values = [a.value for a in args]
    try:
        if len(values) == 2 and name in _BINARY:
            return _BINARY[name](*values)
        if len(values) == 2 and name == "pow":
            base, exponent = values
            if abs(exponent) > 64 or (isinstance(base, int) and abs(base) > 2**32):
                return _NO_FOLD
            result = base**exponent
            return _NO_FOLD if isinstance(result, complex) else result
        if len(values) == 1 and name in _UNARY:
            return _UNARY[name](values[0])
    except (ArithmeticError, ValueError, TypeError):
        return _NO_FOLD
    return _NO_FOLD


# ---------------------------------------------------------------- traversal
def walk(root: Node) -> Iterator[Node]:
    """Every distinct node under ``root`` (itself included), children before parents,
    in a fixed order: two trees with the same normalised text list their nodes in
    corresponding order."""
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            yield node
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for child in reversed(node.children()):
            if id(child) not in seen:
                stack.append((child, False))


def contains(root: Node, target: Node) -> bool:
    if root is target:
        return True
    return any(n is target for n in walk(root))


def normalised(root: Node) -> tuple[str, tuple[str, ...]]:
    """The tree's text with its free variables renamed ``v0, v1, ...`` in order of
    first appearance, and the original names in that order. Two formulas that differ
    only in what their variables are called share this text (and a cache entry)."""
    names: dict[str, str] = {}
    memo: dict[int, str] = {}
    for node in walk(root):
        if node.op == VAR:
            alias = names.get(node.value)
            if alias is None:
                alias = names[node.value] = f"v{len(names)}"
            memo[id(node)] = alias
        elif node.op == CONST:
            memo[id(node)] = node.key
        else:
            parts = [memo[id(a)] for a in node.args]
            parts.extend(f"{k}={memo[id(v)]}" for k, v in node.kwargs)
            memo[id(node)] = f"{node.op}({','.join(parts)})"
    return memo[id(root)], tuple(names)
