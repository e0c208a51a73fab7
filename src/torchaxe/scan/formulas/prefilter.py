"""Structural tests: whether a subtree can be one of the formulas at all, read from
its operations and how its inputs flow, without evaluating anything.

Each matcher of ``fingerprints`` starts with one of these tests, and ``analysis``
asks them before it evaluates a tree: a tree no test accepts has no match, so a file
whose trees all fail them never imports torch. They must never reject a formula a
matcher would accept; they only spare the evaluations that cannot succeed.

Nothing here imports torch.
"""

from __future__ import annotations

from typing import Callable, Iterator

from torchaxe.scan.formulas import vocabulary as V
from torchaxe.scan.formulas.ir import CONST, VAR, Node, walk
from torchaxe.scan.formulas.probes import data_children, data_vars

#: Operations an elementwise activation is written with (outside its input).
ACTIVATION_ANCHORS = frozenset({"tanh", "erf", "erfc", "ndtr", "sigmoid", "exp"})
#: Reductions a norm takes its statistics with.
NORM_REDUCE = frozenset({"mean", "sum", "norm", "vector_norm", "var", "std", "var_mean"})
#: Operations that divide by the statistics.
NORM_ROOT = frozenset({"rsqrt", "sqrt", "pow", "norm", "vector_norm", "std", "div", "reciprocal"})
#: A norm divides by a square root of a second moment: one of these, or a power
#: with a fractional (or unknown) exponent.
_SQUARE_ROOTS = frozenset({"rsqrt", "sqrt", "norm", "vector_norm", "std"})
TRANSPOSES = frozenset({"transpose", "swapaxes", "mT", "T", "permute", "t"})


# ------------------------------------------------------------------ tree helpers
def reaches_var_avoiding(root: Node, avoid: Node) -> tuple[bool, set[str]]:
    """Whether a variable is reachable from ``root`` without passing ``avoid``, and
    the operations met on the way."""
    ops: set[str] = set()
    stack, seen = [root], set()
    reached = False
    while stack:
        node = stack.pop()
        if node is avoid or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == VAR:
            reached = True
            continue
        ops.add(node.op)
        stack.extend(c for c in data_children(node) if c.vars)
    return reached, ops


def ops_outside(node: Node, inner: Node) -> set[str]:
    return reaches_var_avoiding(node, inner)[1]


def dominators(node: Node) -> Iterator[Node]:
    """The proper subtrees every path from ``node`` to a variable goes through, largest
    first: the candidate inputs of an elementwise function written out by hand."""
    needed = data_vars(node)
    candidates = [x for x in walk(node) if x is not node and x.op != CONST and needed <= x.vars]
    candidates.sort(key=lambda x: -x.size)
    for x in candidates:
        reached, _ = reaches_var_avoiding(node, x)
        if not reached:
            yield x


def dominator(node: Node) -> Node | None:
    return next(dominators(node), None)


def uncast(node: Node) -> Node:
    while node.op == "cast" and node.args:
        node = node.args[0]
    return node


def _direct(node: Node, stop: frozenset[str]) -> set[int]:
    """Ids of the nodes whose value flows into ``node`` as data without passing an
    operation of ``stop``."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op in stop and n is not node:
            continue
        stack.extend(data_children(n))
    return seen


# ------------------------------------------------------------------ per matcher
def activation_input(node: Node) -> Node | None:
    """The input of an elementwise activation written out in ``node``: the largest
    subtree all of ``node``'s data goes through, with a tanh, erf, sigmoid or exp
    applied outside it."""
    if node.op not in ("mul", "div") or not node.ops & ACTIVATION_ANCHORS:
        return None
    return next((d for d in dominators(node) if ops_outside(node, d) & ACTIVATION_ANCHORS), None)


def activation(node: Node) -> bool:
    return activation_input(node) is not None


def softmax(node: Node) -> bool:
    return node.op in ("div", "mul", "exp") and "exp" in node.ops and bool(node.ops & {"sum", "logsumexp"})


def _has_square_root(node: Node) -> bool:
    if node.ops & _SQUARE_ROOTS:
        return True
    if "pow" not in node.ops:
        return False
    for n in walk(node):
        if n.op == "pow" and len(n.args) == 2:
            value = n.args[1].value if n.args[1].op == CONST else None
            whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            if not whole:
                return True  # a fractional or unknown exponent
    return False


def norm_inputs(node: Node) -> list[Node]:
    """The candidate inputs ``x`` of a norm written out in ``node``, uncast first:
    subtrees a reduction takes that also reach ``node`` directly (a norm's output is
    its input scaled, so ``x`` must be used outside the statistics too). Empty when
    ``node`` cannot be a norm: it has no reduction, or never divides by a square root."""
    if node.op not in ("mul", "div", "add", "sub", "cast") or not node.ops & NORM_REDUCE or not node.ops & NORM_ROOT:
        return []
    if not _has_square_root(node):
        return []
    direct = _direct(node, NORM_REDUCE)
    found: list[Node] = []
    for reduction in walk(node):
        if reduction.op in NORM_REDUCE and reduction.args:
            inner = sorted((n for n in walk(reduction.args[0]) if n.vars and n.op != CONST and id(n) in direct),
                           key=lambda n: -n.size)
            for x in inner[:6]:
                # The uncast input first: it is what a replacement takes.
                for candidate in (uncast(x), x):
                    if all(candidate is not f for f in found):
                        found.append(candidate)
    return found


def norm(node: Node) -> bool:
    return bool(norm_inputs(node))


def attention(node: Node) -> bool:
    """A product of weights made with a softmax (or exp) from a second product: the
    key transposed somewhere, an einsum, (a key that arrives transposed) a product
    inside the weights, or scores summed from an elementwise product (one query
    against every key: ``(q[:, :, 0:1] * k).sum(-1)``)."""
    if node.op not in ("matmul", "bmm", "einsum") or not node.ops & {"softmax", "exp"}:
        return False
    return bool(node.ops & (TRANSPOSES | {"einsum"})) or any(
        a.ops & V.MATMULS or ({"mul", "sum"} <= a.ops and any(product_sum(n) for n in walk(a))) for a in node.args)


def product_sum(node: Node) -> bool:
    """``(a * b).sum(-1)``: a sum over the last dimension of a product of two tensors."""
    if node.op != "sum" or not node.args or node.args[0].op != "mul" or len(node.args[0].args) != 2:
        return False
    kwargs = dict(node.kwargs)
    dim = node.args[1] if len(node.args) == 2 and not kwargs else kwargs.get("dim") if len(node.args) == 1 else None
    if dim is None or set(kwargs) - {"dim"}:
        return False
    return dim.op == CONST and dim.value == -1 and all(a.vars for a in node.args[0].args)


def rotary(node: Node) -> bool:
    return node.op in ("add", "sub", "cat", "flatten", "reshape", "view", "cast", "view_as_real", "setitem") and bool(
        node.ops & {"cat", "stack", "view_as_complex", "setitem", "flip"}) and "mul" in node.ops


def swiglu(node: Node) -> bool:
    return node.op == "mul" and len(node.args) == 2 and bool(node.ops & {"silu", "sigmoid", "exp"})


def glu(node: Node) -> bool:
    return node.op == "mul" and len(node.args) == 2 and any(a.op == "sigmoid" for a in node.args)


#: The test of each category.
TESTS: dict[str, Callable[[Node], bool]] = {
    "attention": attention, "rotary": rotary, "swiglu": swiglu, "glu": glu, "layer_norm": norm, "rms_norm": norm,
    "softmax": softmax, "gelu_tanh": activation, "gelu_erf": activation, "quick_gelu": activation,
    "silu": activation, "mish": activation,
}


def anchored(node: Node) -> bool:
    """Whether ``node`` holds an operation a formula is built around: one of the
    anchors, or a sum beside a square root written as a power (LayerNorm as
    ``x.sum(-1) / C`` and ``(var + eps) ** -0.5``)."""
    return bool(node.ops & V.ANCHORS) or ({"pow", "sum"} <= node.ops and _has_square_root(node))


def candidates(order: list[Node]) -> list[Node]:
    """The subtrees worth a look, largest first."""
    found = [n for n in order if n.op not in (VAR, CONST) and n.size >= 3 and anchored(n)]
    found.sort(key=lambda n: -n.size)
    return found


def worth_evaluating(root: Node, categories: frozenset[str]) -> bool:
    """Whether some subtree of ``root`` passes the test of one of ``categories``."""
    tests = list(dict.fromkeys(TESTS[c] for c in categories if c in TESTS))
    return any(test(node) for node in candidates(list(walk(root))) for test in tests)
