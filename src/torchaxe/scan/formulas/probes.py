"""Probe values for the free variables of a tree, by the role each plays.

A variable's role is read from how the tree uses it: reduced over or multiplied as a
matrix (a full tensor), added to a reduction (a positive scalar such as ``eps``),
scaling a norm's output (a last-dimension vector such as ``weight``), used as a mask,
multiplied with a complex view (rotary frequencies), or used as a dimension or a size.
Probes are hypercubes (every dimension the same size), so transposes and views keep
shapes compatible and only the arithmetic decides a match.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from torchaxe.scan.formulas import vocabulary as V
from torchaxe.scan.formulas.ir import CONST, VAR, Node, walk

FULL, VECTOR, SCALAR, BOOL, COMPLEX, INT, SIZE, HALF, CUBE, BOUND, COUNT, MATRIX, SHAPE, BOOL_CUBE = (
    "full", "vector", "scalar", "bool", "complex", "int", "size", "half", "cube", "bound", "count", "matrix",
    "shape", "bool3")
#: The real and imaginary parts given to ``torch.complex(re, im)``: the cosine and sine
#: of one angle, as a complex rotation is built from them (``COMPLEX`` is the whole
#: unit number).
COMPLEX_RE, COMPLEX_IM = "complex_re", "complex_im"
#: Unit complex numbers of two and three dimensions: ``freqs_cis[None, :T, None, :]``
#: indexes a matrix of them (the frequencies of each position).
COMPLEX_MATRIX, COMPLEX_CUBE = "complex2", "complex3"
#: A mask of zeros and ones in floating point, kept where it is one: the scores of
#: GPT-2's first code, ``w * b + -1e9 * (1 - b)``, with ``b`` a lower triangle of ones.
MASK01 = "mask01"
#: A number a mask writes into scores where they are masked (``masked_fill``'s value).
FILL = "fill"
#: The value a FILL variable takes: a score no softmax keeps.
FILL_VALUE = -1e9
#: A constant at least this large stands for minus infinity beside ``1 - mask``.
_MASK_FILL = 1e3
#: Operations whose extra arguments are sizes (a whole shape may stand in one of them).
_SIZE_ARGS = frozenset({"view", "reshape", "expand", "repeat", "unflatten", "rearrange", "einops_repeat"})
#: einops calls: their keyword arguments are axis lengths (``h=self.heads``).
_EINOPS = frozenset({"rearrange", "einops_repeat"})

#: The value a scalar variable takes: not 1 or 0 (they hide mistakes) and large enough
#: that where an ``eps`` sits in a formula changes the result.
SCALAR_VALUE = 0.37

#: ``self.sqrt_dim`` (Conformer's score divisor), ``sqrt_dk``: the square root of a size.
_SCALAR_NAMES = re.compile(r"(eps|epsilon|scale|scaling|temperature|norm_factor|inv_freq_scale)$|^sqrt_d\w*$",
                           re.IGNORECASE)
_SIZE_NAMES = re.compile(
    r"(^|_)(d_model|d_k|d_head|head_dim|hidden_size|hidden_dim|embed_dim|n_embd|model_dim|dim_head|"
    r"head_size|kv_dim|qk_dim)$",
    re.IGNORECASE,
)
_DATA_FIRST = V.REDUCTIONS | {"softmax", "log_softmax", "shape", "size", "dim", "ndim", "numel", "view_as_complex",
                              "chunk", "split", "unbind", "getitem", "linear", "layer_norm", "expand_as",
                              "view_as", "reshape_as", "rearrange", "einops_repeat"}
_INT_ARGS = V.REDUCTIONS | {"softmax", "log_softmax", "transpose", "swapaxes", "permute", "view", "reshape",
                            "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "repeat", "narrow", "chunk",
                            "split", "unbind", "size", "getitem", "tril", "triu", "flip", "repeat_interleave",
                            "cat", "stack", "rearrange", "einops_repeat"}


#: Names of a size raised to a half power (``dim ** -0.5``), where no size name matches.
_DIMENSION_NAMES = re.compile(r"(^|_)(dim|dims|d|size|features|channels|width)$|^(dim|d)_", re.IGNORECASE)


@dataclass(frozen=True)
class Probe:
    """One draw of probe values: hypercube side ``n``, dtype, spread, seed."""

    n: int
    dtype: str
    sigma: float
    seed: int


#: Recognition runs on the first probe; a match must hold on the others too (another
#: shape, large values, float32).
PRIMARY = Probe(4, "float64", 1.0, 11)
#: Sides are multiples of 4, so that halves (rotary, SwiGLU) and their halves are whole.
CONFIRMATIONS = (Probe(8, "float64", 6.0, 23), Probe(4, "float32", 1.0, 37))
#: Two sides at which a fitted role's sizes are read (see ``fitted_roles``).
FIT_PROBES = (PRIMARY, CONFIRMATIONS[0])


def is_size_name(name: str) -> bool:
    """Whether a name reads as a size (``dim``, ``head_dim``, ``hidden_size``): raised
    to a half power, such a variable is probed as the probes' side."""
    return bool(_SIZE_NAMES.search(name) or _DIMENSION_NAMES.search(name))


def _leaf_name(name: str) -> str:
    return name.rsplit(".", 1)[-1].split("@", 1)[0]


def _strip(node: Node) -> Node:
    """Below casts and constant scalings: ``(x.pow(2).mean(-1) * 1.0).float()``."""
    while True:
        if node.op in ("cast", "dropout", "contiguous") and node.args:
            node = node.args[0]
        elif node.op in ("mul", "div") and len(node.args) == 2 and node.args[1].op == CONST:
            node = node.args[0]
        elif node.op == "mul" and len(node.args) == 2 and node.args[0].op == CONST:
            node = node.args[1]
        else:
            return node


def data_children(node: Node) -> tuple[Node, ...]:
    """The arguments that flow into ``node``'s value as data (not a dimension, a size
    or an index)."""
    if node.op in _INT_ARGS and node.op not in ("cat", "stack"):
        return node.args[:1]
    return node.children()


def _data_vars(node: Node, memo: dict[int, frozenset[str]]) -> frozenset[str]:
    """The variables that reach ``node``'s value as data (not as a dimension, a size
    or an index)."""
    found = memo.get(id(node))
    if found is not None:
        return found
    if node.op == VAR:
        found = frozenset((node.value,))
    elif node.op == CONST:
        found = frozenset()
    else:
        args = data_children(node)
        found = frozenset().union(*(_data_vars(a, memo) for a in args)) if args else frozenset()
    memo[id(node)] = found
    return found


def _leading_part(node: Node) -> bool:
    """``x[..., :self.d]``: the leading part of the last dimension of a variable, cut
    at a bound that is a variable (the rotated share of a partial rotary)."""
    if node.op != "getitem" or len(node.args) != 2 or node.args[0].op != VAR:
        return False
    index = node.args[1]
    parts = index.args if index.op == "tuple" else ()
    if len(parts) < 2 or parts[-1].op != "slice" or len(parts[-1].args) != 3:
        return False  # x[:T] cuts the first dimension, not the last
    start, stop, step = parts[-1].args
    leading = all(p.op == CONST and p.value in (None, Ellipsis) for p in parts[:-1]) or \
        all(p.op == "slice" and all(a.op == CONST and a.value is None for a in p.args) for p in parts[:-1])
    return leading and start.op == CONST and start.value is None and step.op == CONST and step.value is None \
        and stop.op == VAR


def _through_layout(node: Node) -> set[str]:
    """The variables ``node`` is (a slice, view or cast of)."""
    while node.op in V.LAYOUT and node.args:
        node = node.args[0]
    return {node.value} if node.op == VAR else set()


def _complex_data(node: Node) -> bool:
    """Whether ``node``'s values (under slices, views and casts; not the sizes a view
    is given, ``f.view(1, x.size(1), 1, x.size(-1))`` of a complex ``x``) come from a
    ``view_as_complex``."""
    while node.op in V.LAYOUT and node.args:
        node = node.args[0]
    return "view_as_complex" in node.ops


#: Operations a boolean mask keeps its values through: a causal mask is often the
#: triangle of a boolean tensor made with ``torch.ones(T, T, dtype=torch.bool)``.
_MASK_SHAPING = frozenset({"tril", "triu"})


#: Comparisons that turn a 0/1 tensor into a boolean mask (``tril(ones(T, T)) == 0``).
_MASK_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})


def _through_mask(node: Node) -> set[str]:
    """The variables a mask ``node`` is (a slice, view, cast, triangle, negation of,
    or a comparison of with a constant)."""
    while node.args:
        if node.op in V.LAYOUT or node.op in _MASK_SHAPING or node.op == "invert":
            node = node.args[0]
        elif node.op in _MASK_COMPARISONS and len(node.args) == 2 and node.args[1].op == CONST:
            node = node.args[0]
        else:
            break
    return {node.value} if node.op == VAR else set()


def data_vars(node: Node) -> frozenset[str]:
    return _data_vars(node, {})


def data_vars_of_data_ops(root: Node) -> set[str]:
    """Variables reduced, sliced, split or multiplied as matrices somewhere in ``root``."""
    return _collect(root)[0]


def infer_roles(root: Node) -> dict[str, str]:
    """The role of each free variable of ``root``."""
    data, ints, scalars, bools, complexes, dims, sizes = _collect(root)
    # bmm takes batches of matrices: what flows into its operands is three-dimensional.
    cubes: set[str] = set()
    bounds: set[str] = set()
    mask_bounds: set[str] = set()
    arithmetic: set[str] = set()
    ranks: dict[str, set[int]] = {}
    masked: list[Node] = []
    zero_one: set[str] = set()
    #: Variables passed as one of several sizes to a view (``q.reshape(b * h, -1,
    #: self.head_width)``): a single size each, not a whole shape.
    single_sizes: set[str] = set()
    counts: set[str] = set()
    halves: set[str] = set()
    for node in walk(root):
        if node.op in ("reshape", "view") and len(node.args) >= 3:
            single_sizes.update(a.value for a in node.args[1:] if a.op == VAR)
        if node.op in ("add", "sub", "mul", "div", "floordiv", "mod", "pow"):
            arithmetic.update(a.value for a in node.args if a.op == VAR)
            if node.op == "floordiv" and any(a.op != VAR and scalarish(a) for a in node.args):
                # dim // self.n_heads, of dim = x.size(2): a count of heads or groups.
                counts.update(a.value for a in node.args if a.op == VAR)
        elif node.op in _EINOPS:
            # An axis length is a count (of heads, of groups), as ``C // self.n_head`` is.
            arithmetic.update(a.value for _, a in node.kwargs if a.op == VAR)
            rank = _einops_rank(node)
            source = _unbound_source(node.args[0], rank) if rank is not None else None
            if source is not None:
                # repeat(t, 'd -> b 1 d') of t = null_kv.unbind(dim=-2)[0]: null_kv is a matrix.
                ranks.setdefault(source[0], set()).add(source[1])
            elif rank is not None and 2 <= rank <= 3:
                # 'b n (h d) -> b h n d' takes a three-dimensional tensor.
                for name in _strict_data(node.args[0], {}, stop=_EINOPS):
                    ranks.setdefault(name, set()).add(rank)
        if node.op == "getitem" and len(node.args) == 2 and node.args[0].op == VAR:
            # x[:n, :n] indexes a matrix: as many dimensions as indices (no ..., no None).
            index = node.args[1]
            parts = index.args if index.op == "tuple" else (index,)
            if index.op == "tuple" and all(p.op == "slice" or (p.op == CONST and isinstance(p.value, int))
                                           for p in parts):
                ranks.setdefault(node.args[0].value, set()).add(len(parts))
            elif _channel_index(parts):
                # w[:, None, None]: a per-channel vector broadcast over the trailing dimensions.
                ranks.setdefault(node.args[0].value, set()).add(1)
            elif index.op == "tuple" and all(p.op == "slice" or (p.op == CONST and (
                    p.value is None or (isinstance(p.value, int) and not isinstance(p.value, bool)))) for p in parts):
                # f[None, :T, None, :]: new axes around a matrix, as many dimensions as
                # the parts that are not None.
                kept = sum(1 for p in parts if not (p.op == CONST and p.value is None))
                if 1 <= kept <= 3:
                    ranks.setdefault(node.args[0].value, set()).add(kept)
        if node.op == "flatten" and len(node.args) >= 2 and node.args[1].op == CONST and isinstance(
                node.args[1].value, int) and not isinstance(node.args[1].value, bool) and 1 <= node.args[1].value <= 2:
            # view_as_real(view_as_complex(x.reshape(..., -1, 2)) * f).flatten(2): the
            # pairs are merged back from dimension 2, so x has three dimensions.
            for name in _complex_sources(node.args[0]):
                ranks.setdefault(name, set()).add(node.args[1].value + 1)
        if node.op == "masked_fill" and len(node.args) >= 2:
            masked.append(node)
        if node.op == "mul" and len(node.args) == 2:
            # x[..., :self.d] * self.cos_cached[:T]: a table as wide as the slice of x
            # (a partial rotary), half of the probe's last dimension as the bound is.
            for sliced, other in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
                if any(_leading_part(n) for n in walk(sliced)) and not any(_leading_part(n) for n in walk(other)):
                    halves |= _through_layout(other)
        if node.op == "mul" and len(node.args) == 2:
            # -1e9 * (1 - b): b is kept where it is one and filled with a very negative
            # number elsewhere, a mask of zeros and ones.
            zero_one |= _one_minus_filled(node, -1.0)
        if node.op == "sub" and len(node.args) == 2 and node.args[1].op == "mul" and len(node.args[1].args) == 2:
            # w * b - 1e10 * (1 - b): the same, subtracted.
            zero_one |= _one_minus_filled(node.args[1], 1.0)
        mask = node.args[1] if node.op == "masked_fill" and len(node.args) >= 2 else \
            node.args[0] if node.op == "where" and node.args else None
        if mask is not None:
            # bias[:, :, :T, :T]: a mask cut to the scores' size, whatever T is.
            for part in walk(mask):
                if part.op == "slice":
                    for arg in part.args:
                        mask_bounds |= arg.vars
        if node.op in ("bmm", "baddbmm"):
            memo: dict[int, frozenset[str]] = {}
            for arg in node.args:
                # Not through a view: q.view(B * H, T, D) takes a 4-D q to bmm (GPT-NeoX).
                cubes |= _strict_data(arg, memo, stop=RESHAPES)
        elif node.op == "einsum" and node.args and node.args[0].op == CONST and isinstance(node.args[0].value, str):
            # 'b i d, b j d -> b i j': each operand has as many dimensions as letters.
            inputs = node.args[0].value.split("->")[0].split(",")
            memo = {}
            for spec, arg in zip(inputs, node.args[1:]):
                letters = [c for c in spec if c.isalpha()]
                if "." not in spec and 2 <= len(letters) <= 3:
                    # Not through einops, which changes the rank by design.
                    for name in _strict_data(arg, memo, stop=_EINOPS):
                        ranks.setdefault(name, set()).add(len(letters))
        elif node.op == "slice":
            for arg in node.args:
                bounds |= arg.vars
    reduces = bool(root.ops & (V.REDUCTIONS | V.MATMULS))
    # A mask has the rank of what it masks: bmm scores are three-dimensional.
    cube_masks: set[str] = set()
    if cubes:
        memo = {}
        for node in masked:
            source = _strict_data(node.args[0], memo, stop=RESHAPES)
            if source and source <= cubes:
                cube_masks |= node.args[1].vars
    parts = _complex_parts(root)
    roles: dict[str, str] = {}
    # The value a masked_fill writes (self.mask_fill = float('-inf')): a very negative number.
    fills = {node.args[2].value for node in masked if len(node.args) >= 3 and node.args[2].op == VAR}
    for name in root.vars:
        leaf = _leaf_name(name)
        if name in parts and name not in data:
            role = parts[name]
        elif name in fills and name not in data:
            role = FILL
        elif _SIZE_NAMES.search(leaf) or (name in (sizes | mask_bounds) and name not in data):
            role = SIZE
        elif _SCALAR_NAMES.search(leaf):
            role = SCALAR
        elif name in halves and name not in bounds and not ranks.get(name):
            role = HALF
        elif name in complexes:
            role = {frozenset({2}): COMPLEX_MATRIX, frozenset({3}): COMPLEX_CUBE}.get(
                frozenset(ranks.get(name, ())), COMPLEX)
        elif name in bools:
            role = BOOL_CUBE if name in cube_masks else BOOL
        elif name in zero_one:
            role = MASK01
        elif name in scalars and name not in data:
            role = SCALAR
        elif name in cubes:
            role = CUBE
        elif ranks.get(name) == {1}:
            role = VECTOR
        elif ranks.get(name) in ({2}, {3}) and name not in complexes:
            role = MATRIX if ranks[name] == {2} else CUBE
        elif name in data:
            role = FULL
        elif name in bounds and name not in data:
            role = BOUND
        elif (name in ints and name in arithmetic) or (name in counts and name not in data):
            role = COUNT  # a size that is also computed with (C // self.n_head)
        elif name in ints and name not in dims and name not in single_sizes:
            role = SHAPE  # x.view(self.shape): a whole shape
        elif name in single_sizes and name not in dims:
            role = SIZE
        elif name in ints:
            role = INT
        else:
            role = VECTOR if reduces else FULL
        roles[name] = role
    return roles


def _unbound_source(node: Node, rank: int) -> tuple[str, int] | None:
    """The variable an item of ``x.unbind(...)`` comes from, and its rank (one more
    than the item's), when ``node`` is such an item (through casts)."""
    added = 0
    while True:
        if node.op in ("cast", "contiguous", "clone", "detach") and node.args:
            node = node.args[0]
        elif (node.op == "getitem" and len(node.args) == 2 and node.args[0].op == "unbind" and node.args[0].args
              and node.args[1].op == CONST and isinstance(node.args[1].value, int)):
            node = node.args[0].args[0]
            added += 1
        else:
            break
    if not added or node.op != VAR or not 1 <= rank + added <= 3:
        return None
    return node.value, rank + added


def _einops_rank(node: Node) -> int | None:
    """The rank an einops call's pattern gives its input, when it has no ``...``."""
    from torchaxe.scan.formulas.einops_patterns import PatternError, parse_side

    pattern = node.args[1] if len(node.args) > 1 else None
    if pattern is None or pattern.op != CONST or not isinstance(pattern.value, str) or "->" not in pattern.value:
        return None
    left = pattern.value.split("->")[0]
    if "..." in left:
        return None
    try:
        return len(parse_side(left))
    except PatternError:
        return None


def _channel_index(parts: tuple[Node, ...]) -> bool:
    """``[:, None]``, ``[:, None, None]``: one whole slice, first, then only new axes."""
    if len(parts) < 2 or parts[0].op != "slice" or any(a.op != CONST or a.value is not None for a in parts[0].args):
        return False
    return all(p.op == CONST and p.value is None for p in parts[1:])


_BINARY = frozenset({"add", "sub", "mul", "div", "maximum", "minimum", "where", "and_", "or_", "pow"})
_SHAPE_OPS = frozenset({"size", "shape", "dim", "ndim", "numel"})


def scalarish(node: Node) -> bool:
    """A number rather than a tensor: a constant, a shape, a variable named like a
    scale or a size, or arithmetic on those."""
    if node.op == CONST:
        return True
    if node.op == VAR:
        leaf = _leaf_name(node.value)
        return bool(_SCALAR_NAMES.search(leaf) or _SIZE_NAMES.search(leaf))
    if node.op in _SHAPE_OPS or (node.op == "getitem" and node.args and node.args[0].op in _SHAPE_OPS):
        return True
    if node.op in ("attr_min", "attr_max", "attr_eps", "attr_tiny") or node.op.startswith("math_"):
        return True
    if node.op in ("add", "sub", "mul", "div", "floordiv", "pow", "sqrt", "rsqrt", "neg", "reciprocal", "float",
                   "int", "exp", "log", "cast"):
        return all(scalarish(a) for a in node.args)
    return False


#: Operations that regroup dimensions (a tensor's rank or last dimension may change).
RESHAPES = frozenset({"reshape", "view", "flatten", "unflatten", "rearrange", "einops_repeat"})


def _strict_data(node: Node, memo: dict[int, frozenset[str]], stop: frozenset[str] = frozenset()) -> frozenset[str]:
    """The variables that *are* ``node``'s data: reached through layout operations,
    elementwise functions and products with numbers, but not through a sum or a
    product of two tensors (``scores + mask``: neither is the other's data)."""
    found = memo.get(id(node))
    if found is not None:
        return found
    if node.op == VAR:
        found = frozenset((node.value,))
    elif node.op == CONST or node.op in stop:
        found = frozenset()
    else:
        args = data_children(node)
        if node.op == "masked_fill":
            args = args[:1]
        elif node.op in _BINARY:
            tensors = [a for a in args if not scalarish(a)]
            args = tensors if len(tensors) == 1 else ()
        found = frozenset().union(*(_strict_data(a, memo, stop) for a in args)) if args else frozenset()
    memo[id(node)] = found
    return found


def _collect(root: Node) -> tuple[set[str], ...]:
    """Evidence for the roles: (data, ints, scalars, bools, complexes, dims, sizes)."""
    memo: dict[int, frozenset[str]] = {}
    dims: set[str] = set()
    sizes: set[str] = set()
    data: set[str] = set()
    ints: set[str] = set()
    scalars: set[str] = set()
    bools: set[str] = set()
    complexes: set[str] = set()
    nodes = list(walk(root))
    for node in nodes:
        op, args = node.op, node.args
        if op in (VAR, CONST):
            continue
        if op in _DATA_FIRST and args:
            data |= _strict_data(args[0], memo)
        elif op in ("matmul", "bmm", "mm", "outer"):
            for a in args[:2]:
                data |= _strict_data(a, memo)
        elif op == "einsum":
            for a in args[1:]:
                data |= _strict_data(a, memo)
        elif op == "baddbmm":
            for a in args[1:3]:
                data |= _strict_data(a, memo)
        if op in _INT_ARGS:
            for extra in (*args[1:], *(v for _, v in node.kwargs)):
                ints |= extra.vars
                if op not in _SIZE_ARGS:
                    dims |= extra.vars
        if op in ("add", "sub") and len(args) == 2:
            for mine, other in ((args[0], args[1]), (args[1], args[0])):
                if mine.op == VAR and _strip(other).op in V.REDUCTIONS:
                    scalars.add(mine.value)
        if op.startswith("math_"):
            sizes |= {a.value for a in args if a.op == VAR}
        if (op == "pow" and len(args) == 2 and args[0].op == VAR and args[1].op == CONST
                and args[1].value in (0.5, -0.5) and _DIMENSION_NAMES.search(_leaf_name(args[0].value))):
            sizes.add(args[0].value)  # dim ** -0.5: the square root of a size, as math.sqrt(dim) is
        if op in ("mul", "div") and len(args) == 2:
            for mine, other in ((args[0], args[1]), (args[1], args[0])):
                if _strip(other).op in V.MATMULS and not mine.ops & V.MATMULS and mine.vars:
                    scalars |= mine.vars
                if "view_as_complex" in other.ops and not _complex_data(mine):
                    complexes |= _through_layout(mine)
        if op == "masked_fill" and len(args) >= 2:
            bools |= _through_mask(args[1])
        if op == "where" and args:
            bools |= _through_mask(args[0])
        if op in ("invert", "and_", "or_"):
            for a in args:
                bools |= _through_layout(a)
    return data, ints, scalars | sizes, bools, complexes, dims, sizes


def _complex_sources(node: Node) -> set[str]:
    """The variables viewed as complex numbers in a ``view_as_real`` that ``node`` is
    (through casts): ``view_as_real(view_as_complex(x.float().reshape(...)) * f)``."""
    while node.op in ("cast", "contiguous") and node.args:
        node = node.args[0]
    if node.op != "view_as_real":
        return set()
    names: set[str] = set()
    for inner in walk(node):
        if inner.op == "view_as_complex" and inner.args:
            source = inner.args[0]
            while source.op in ("reshape", "view", "cast", "contiguous", "unflatten") and source.args:
                source = source.args[0]
            if source.op == VAR:
                names.add(source.value)
    return names


_COSINE_NAMES = re.compile(r"cos", re.IGNORECASE)
_SINE_NAMES = re.compile(r"sin", re.IGNORECASE)


def _complex_parts(root: Node) -> dict[str, str]:
    """The variables given (maybe cast or viewed) to ``torch.complex(re, im)`` where
    the number meets a complex view of data: the real part's names to ``COMPLEX_RE``,
    the imaginary part's to ``COMPLEX_IM``, when they are named as a cosine and a sine
    are. Other parts (a learned gain's ``self.re``, ``self.im``) keep the values any
    tensor gets, so that a complex product that scales is not read as a rotation."""
    parts: dict[str, str] = {}
    for node in walk(root):
        if node.op not in ("mul", "div") or len(node.args) != 2:
            continue
        for mine, other in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if "view_as_complex" not in other.ops or _complex_data(mine):
                continue
            while mine.op in V.LAYOUT and mine.args:
                mine = mine.args[0]
            if mine.op == "complex" and len(mine.args) == 2:
                re_names, im_names = _through_layout(mine.args[0]), _through_layout(mine.args[1])
                if (re_names and im_names and not re_names & im_names
                        and all(_COSINE_NAMES.search(_leaf_name(n)) for n in re_names)
                        and all(_SINE_NAMES.search(_leaf_name(n)) for n in im_names)):
                    parts.update(dict.fromkeys(re_names, COMPLEX_RE))
                    parts.update(dict.fromkeys(im_names, COMPLEX_IM))
    return parts


def half_width_roles(root: Node, roles: dict[str, str]) -> dict[str, str] | None:
    """Second guess when the tree does not evaluate: full tensors that are never
    reduced, sliced or multiplied as matrices may be half as wide as the data they
    meet (the cos and sin of a split-halves rotary embedding)."""
    data = data_vars_of_data_ops(root)
    changed = {name: HALF for name, role in roles.items() if role == FULL and name not in data}
    return {**roles, **changed} if changed else None


def widened_roles(root: Node, roles: dict[str, str]) -> dict[str, str] | None:
    """Another guess when the tree does not evaluate: a full tensor (or cube) split
    into k equal pieces along its last dimension (``k, v = self.to_kv(x).chunk(2,
    dim=-1)``) is k times as wide as the tensors its pieces meet."""
    changed: dict[str, str] = {}
    halves: dict[str, set[tuple[str, str]]] = {}
    for node in walk(root):
        cut = _last_dim_cut(node)
        if cut is not None:
            # cos, sin = cache[..., :d], cache[..., d:]: cos and sin side by side.
            halves.setdefault(cut[0], set()).add((cut[1], cut[2]))
        if node.op != "chunk" or len(node.args) < 2:
            continue
        source = node.args[0]
        added = False
        while source.op in _WIDTH_KEEPING and source.args:
            added = added or source.op == "unsqueeze"
            source = source.args[0]  # freqs.unsqueeze(-2).chunk(2, dim=-1)
        if source.op != VAR:
            continue
        count = node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwarg("dim")
        if count.op != CONST or count.value not in (2, 3) or dim is None or dim.op != CONST:
            continue
        name = source.value
        if roles.get(name) not in (FULL, CUBE):
            continue
        if dim.value == -1:
            # Unsqueezed before it meets the data: one dimension fewer than the data.
            base = CUBE if added and roles[name] == FULL else roles[name]
            changed[name] = f"{base}{WIDE}{count.value}"
        elif dim.value in _LAST_OF_RANK and not added:
            # Split along a dimension counted from the front: taken for the last one of
            # a tensor of that rank (MPT's ``self.Wqkv(x).chunk(3, dim=2)`` of a
            # (batch, sequence, 3 * width) projection).
            changed[name] = f"{_LAST_OF_RANK[dim.value]}{WIDE}{count.value}"
        elif dim.value == 1 and roles[name] == FULL and not added and _images_split(root, node):
            # The channels of an image's projection (Restormer's ``qkv.chunk(3, dim=1)``
            # of a (batch, 3 * channels, height, width) convolution, each piece
            # rearranged from four axes).
            changed[name] = f"{FULL}{WIDE}{count.value}{AT}1"
    for name, cuts in halves.items():
        bounds = {b for side, b in cuts if side == "below"} & {b for side, b in cuts if side == "above"}
        if bounds and roles.get(name) in (FULL, CUBE) and name not in changed:
            changed[name] = f"{roles[name]}{WIDE}2"
    return {**roles, **changed} if changed else None


def _one_minus_filled(product: Node, sign: float) -> set[str]:
    """The mask variables of ``fill * (1 - mask)`` (either order) whose constant fill is
    at least :data:`_MASK_FILL` in size, with the sign ``sign`` (-1: added, as in
    ``-1e9 * (1 - b)``; 1: subtracted)."""
    for fill, kept in (product.args, product.args[::-1]):
        if (fill.op == CONST and isinstance(fill.value, (int, float)) and not isinstance(fill.value, bool)
                and sign * fill.value >= _MASK_FILL and kept.op == "sub" and len(kept.args) == 2
                and kept.args[0].op == CONST and kept.args[0].value == 1):
            return _through_mask(kept.args[1])
    return set()


def _images_split(root: Node, chunk: Node) -> bool:
    """Whether a piece of ``chunk`` is rearranged by an einops pattern of four axes
    (``'b (head c) h w -> b head c (h w)'``): the split tensor is an image batch."""
    for node in walk(root):
        if node.op in _EINOPS and node.args and _einops_rank(node) == 4:
            source = node.args[0]
            while source.op == "getitem" and source.args:
                source = source.args[0]
            if source is chunk:
                return True
    return False


def _last_dim_cut(node: Node) -> tuple[str, str, str] | None:
    """(variable, "below" or "above", the bound's key) for ``v[..., :b]`` and
    ``v[..., b:]`` with a bound that is not a number."""
    if node.op != "getitem" or len(node.args) != 2 or node.args[0].op != VAR:
        return None
    index = node.args[1]
    if index.op != "tuple" or len(index.args) != 2:
        return None
    first, part = index.args
    if first.op != CONST or first.value is not Ellipsis or part.op != "slice" or len(part.args) != 3:
        return None
    start, stop, step = part.args
    if step.op != CONST or step.value is not None:
        return None
    if start.op == CONST and start.value is None and stop.op != CONST:
        return node.args[0].value, "below", stop.key
    if stop.op == CONST and stop.value is None and start.op != CONST:
        return node.args[0].value, "above", start.key
    return None


def single_count_roles(roles: dict[str, str]) -> dict[str, str] | None:
    """A last guess when the tree does not evaluate: counts (a number of heads) of
    one, so that sizes computed from them (``width // (3 * self.n_heads)``) are not
    zero on the probes' small sides."""
    changed = {name: ONE for name, role in roles.items() if role == COUNT}
    return {**roles, **changed} if changed else None


def sized_count_roles(roles: dict[str, str]) -> dict[str, str] | None:
    """Another guess when the tree does not evaluate: counts (a number of heads) as
    large as the probes' side, for a tree whose inputs already hold the heads as a
    dimension and are folded with the count into the batch (Bloom's
    ``q.reshape(batch * self.num_heads, -1, self.head_dim)`` of a (batch, heads,
    sequence, width) tensor)."""
    changed = {name: SIZE for name, role in roles.items() if role == COUNT}
    return {**roles, **changed} if changed else None


#: Marks a fitted role: ``"fit:1,n/1,1,n/2,2"`` is a tensor of that shape, each side
#: a number, a fraction or a multiple (``n*2``) of the probe's side ``n`` (see
#: ``fitted_roles``).
FIT = "fit:"
#: The operations a fitted variable may go through before it is viewed.
_FIT_THROUGH = frozenset({"getitem", "cast", "contiguous", "detach", "clone"})


def fitted_roles(root: Node, roles: dict[str, str],
                 sizes: Callable[[tuple[Node, ...], dict[str, str], Probe], tuple[int, ...] | None],
                 ) -> dict[str, str] | None:
    """Another guess when the tree does not evaluate: a variable viewed to sizes
    computed from the data (``rope_cache.view(1, xs.size(1), 1, xs.size(3), 2)``, a
    cache laid out for broadcasting) takes the shape it is viewed to, a side of -1 taken
    as 1. ``sizes`` gives
    the values of the size arguments on a probe; a side that doubles with the probe's
    side is a fraction of it, one that does not is a number."""
    changed: dict[str, str] = {}
    for node in walk(root):
        if node.op not in ("view", "reshape") or len(node.args) < 3:
            continue
        source = node.args[0]
        while source.op in _FIT_THROUGH and source.args:
            source = source.args[0]
        if source.op != VAR or roles.get(source.value) not in (FULL, VECTOR, MATRIX, CUBE) or source.value in changed:
            continue
        small, large = (sizes(node.args[1:], roles, probe) for probe in (FIT_PROBES[0], FIT_PROBES[1]))
        if small is None or large is None or len(small) != len(large):
            continue
        if small.count(-1) > 1 or large.count(-1) != small.count(-1):
            continue
        sides = []
        for a, b in zip(small, large):
            if a == -1 and b == -1:
                sides.append("1")  # view(-1, T, 1, D): the leading side is whatever is left
                continue
            if a < 1 or b < 1:
                break
            if a == b:
                sides.append(str(a))
            elif b == 2 * a and a % FIT_PROBES[0].n == 0:
                sides.append(f"n*{a // FIT_PROBES[0].n}")
            elif b == 2 * a and FIT_PROBES[0].n % a == 0:
                sides.append(f"n/{FIT_PROBES[0].n // a}")
            else:
                break
        else:
            changed[source.value] = FIT + ",".join(sides)
    return {**roles, **changed} if changed else None


def _fitted_shape(role: str, n: int) -> tuple[int, ...]:
    return tuple(n // int(side[2:]) if side.startswith("n/") else n * int(side[2:]) if side.startswith("n*")
                 else int(side) for side in role[len(FIT):].split(","))


#: A count of one (see ``single_count_roles``).
ONE = "one"
#: Operations that keep the last dimension of their input.
_WIDTH_KEEPING = frozenset({"unsqueeze", "cast", "contiguous", "detach", "clone"})
#: The widened role of a tensor split along dimension ``d`` counted from the front,
#: taken for its last: a cube for 2, a full tensor for 3.
_LAST_OF_RANK = {2: CUBE, 3: FULL}
#: Marks a widened role: ``"full*2"`` is a full tensor twice as wide in its last dimension,
#: ``"full*3@1"`` three times as wide in its dimension 1.
WIDE = "*"
AT = "@"


def _generator(torch: Any, probe: Probe, name: str) -> Any:
    return torch.Generator().manual_seed((probe.seed * 1_000_003) ^ zlib.crc32(name.encode()))


def scalar_value(name: str) -> float:
    """A scalar variable's probe value: near ``SCALAR_VALUE`` and different per name,
    so that two stored numbers (``self.eps`` inside the square root, ``self.scale``
    outside) are told apart by their values."""
    return SCALAR_VALUE + (zlib.crc32(name.encode()) % 997) / 10_000


def make_env(roles: dict[str, str], probe: Probe) -> dict[str, Any]:
    """Probe values for every variable, deterministic per (probe, name)."""
    import torch

    dtype = getattr(torch, probe.dtype)
    n = probe.n
    shape = (n, n, n, n)
    env: dict[str, Any] = {}
    for name, role in roles.items():
        g = _generator(torch, probe, name)
        if role.startswith(FIT):
            env[name] = torch.randn(_fitted_shape(role, n), generator=g, dtype=dtype) * probe.sigma
        elif WIDE in role:
            base, factor = role.split(WIDE)
            factor, _, at = factor.partition(AT)
            size = [n, n, n, n] if base == FULL else [n, n, n]
            size[int(at) if at else -1] *= int(factor)
            env[name] = torch.randn(size, generator=g, dtype=dtype) * probe.sigma
        elif role == FULL:
            env[name] = torch.randn(shape, generator=g, dtype=dtype) * probe.sigma
        elif role == VECTOR:
            env[name] = torch.rand((n,), generator=g, dtype=dtype) + 0.5
        elif role == SCALAR:
            env[name] = scalar_value(name)
        elif role == FILL:
            env[name] = FILL_VALUE
        elif role == INT:
            env[name] = -1
        elif role == SHAPE:
            env[name] = shape
        elif role == COUNT:
            env[name] = 2
        elif role == ONE:
            env[name] = 1
        elif role == BOUND:
            env[name] = n // 2  # a slice bound: half the width, like a half-width tensor
        elif role == SIZE:
            env[name] = n
        elif role in (BOOL, BOOL_CUBE, MASK01):
            # Every row keeps a True and a False, so that a softmax masked with it
            # or with its inverse never masks a whole row.
            mask = torch.rand(shape if role != BOOL_CUBE else (n, n, n), generator=g) < 0.5
            eye = torch.eye(n, dtype=torch.bool)
            mask = (mask | eye) & ~torch.roll(eye, 1, dims=-1)
            env[name] = mask.to(dtype) if role == MASK01 else mask
        elif role == MATRIX:
            env[name] = torch.randn((n, n), generator=g, dtype=dtype) * probe.sigma
        elif role == CUBE:
            env[name] = torch.randn((n, n, n), generator=g, dtype=dtype) * probe.sigma
        elif role == HALF:
            env[name] = torch.randn((n, n, n, n // 2), generator=g, dtype=dtype) * probe.sigma
        elif role in (COMPLEX, COMPLEX_MATRIX, COMPLEX_CUBE):
            sides = {COMPLEX: 3, COMPLEX_CUBE: 2, COMPLEX_MATRIX: 1}[role]
            angle = torch.rand((n,) * sides + (n // 2,), generator=g, dtype=dtype) * 6.2831853
            env[name] = torch.polar(torch.ones_like(angle), angle)
        elif role in (COMPLEX_RE, COMPLEX_IM):
            # One angle for every real and imaginary part, so that each pair of them is
            # the cosine and sine of it.
            shared = _generator(torch, probe, "complex parts")
            angle = torch.rand((n, n, n, n // 2), generator=shared, dtype=dtype) * 6.2831853
            env[name] = angle.cos() if role == COMPLEX_RE else angle.sin()
    return env


def fresh_full(probe: Probe, salt: str) -> Any:
    """Another full probe tensor, for re-evaluating a tree with a new input."""
    import torch

    g = _generator(torch, probe, "fresh:" + salt)
    n = probe.n
    return torch.randn((n, n, n, n), generator=g, dtype=getattr(torch, probe.dtype)) * probe.sigma
