"""Evaluating expression trees with torch on probe values.

The interpreter never calls ``eval`` or ``exec`` and never looks a name up: every
operation maps to one fixed torch function or Python operator in ``_OPS``. Values are
only what the probes and these operations produce (tensors, numbers, tuples,
slices), so nothing the scanned code defines can run. Results are capped in size.

A layout operation that fails (``x.view(B, T, self.n_head, -1)`` with a probe
``n_head``) passes its input through unchanged: probes are hypercubes, so the data
keeps a usable shape and the arithmetic around it can still be checked.
"""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from torchaxe.scan.formulas import einops_patterns
from torchaxe.scan.formulas import vocabulary as V
from torchaxe.scan.formulas.ir import CONST, VAR, Node, walk
from torchaxe.scan.formulas.probes import data_vars

#: No intermediate value may hold more elements than this.
MAX_ELEMENTS = 1 << 16


class EvaluationError(Exception):
    """An operation did not apply to the probe values."""


FAIL = object()

_DTYPES = {
    "torch.float32": torch.float32, "torch.float": torch.float32, "torch.float16": torch.float16,
    "torch.half": torch.float16, "torch.bfloat16": torch.bfloat16, "torch.float64": torch.float64,
    "torch.double": torch.float64, "torch.bool": torch.bool, "torch.int64": torch.int64, "torch.long": torch.int64,
    "torch.int32": torch.int32, "torch.int": torch.int32, "torch.int8": torch.int8, "torch.uint8": torch.uint8,
    "torch.complex64": torch.complex64, "torch.cfloat": torch.complex64, "torch.complex128": torch.complex128,
}


def _tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value, dtype=torch.float64)
    raise EvaluationError("not a tensor")


def _small_int(value: Any) -> bool:
    return isinstance(value, int) and abs(value) <= 64


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``a`` and ``b`` broadcast to; RuntimeError when they do not.

    Written out because ``torch.broadcast_shapes`` imports sympy on its first call
    (half a second, more than all the probe arithmetic of a large scan)."""
    if len(a) < len(b):
        a, b = b, a
    out = list(a)
    offset = len(a) - len(b)
    for i, size in enumerate(b):
        mine = out[offset + i]
        if mine == size or size == 1:
            continue
        if mine == 1:
            out[offset + i] = size
        else:
            raise RuntimeError(f"shapes {tuple(a)} and {tuple(b)} do not broadcast")
    return tuple(out)


def _check_broadcast(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
        shape = broadcast_shape(a.shape, b.shape)
        if math.prod(shape) > MAX_ELEMENTS:
            raise EvaluationError("broadcast too large")


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def apply(a: Any, b: Any) -> Any:
        _check_broadcast(a, b)
        return fn(a, b)

    return apply


def _matmul(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.ndim > 2 and b.ndim > 2:
        if math.prod(broadcast_shape(a.shape[:-2], b.shape[:-2])) * a.shape[-2] * b.shape[-1] > MAX_ELEMENTS:
            raise EvaluationError("product too large")
    return operator.matmul(a, b)


def _power(a: Any, b: Any) -> Any:
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        if not isinstance(b, (int, float)) or abs(b) > 64 or (isinstance(a, int) and abs(a) > 2**32):
            raise EvaluationError("power too large")
    _check_broadcast(a, b)
    return a**b


def _unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    def apply(a: Any, *rest: Any, **kwargs: Any) -> Any:
        return fn(_tensor(a), *rest, **kwargs)

    return apply


def _method(name: str) -> Callable[..., Any]:
    """A fixed tensor method, called on a tensor receiver only."""
    fn = getattr(torch.Tensor, name)

    def apply(receiver: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(receiver, torch.Tensor):
            raise EvaluationError(f"{name} of a non-tensor")
        return fn(receiver, *args, **kwargs)

    return apply


def _sized_method(name: str) -> Callable[..., Any]:
    """A tensor method that allocates in proportion to its integer arguments."""
    inner = _method(name)

    def apply(receiver: Any, *args: Any, **kwargs: Any) -> Any:
        flat = [a for arg in args for a in (arg if isinstance(arg, (tuple, list, torch.Size)) else (arg,))]
        if not all(_small_int(a) for a in flat if not isinstance(a, torch.Tensor)):
            raise EvaluationError(f"{name} with large sizes")
        return inner(receiver, *args, **kwargs)

    return apply


def _first(value: Any, *_: Any, **__: Any) -> Any:
    return value


def _getitem(value: Any, index: Any) -> Any:
    if isinstance(value, (torch.Tensor, tuple, list, torch.Size)):
        return value[index]
    raise EvaluationError("subscript of an unknown value")


def _tuple(*items: Any) -> tuple:
    return tuple(items)


def _is_return_type(value: Any) -> bool:
    """A named result of torch (``x.max(dim)`` gives ``(values, indices)``)."""
    return isinstance(value, tuple) and type(value).__module__ == "torch.return_types"


def _attribute(name: str, kinds: tuple[type, ...]) -> Callable[[Any], Any]:
    def apply(value: Any) -> Any:
        if not isinstance(value, kinds) and not (name in ("values", "indices") and _is_return_type(value)):
            raise EvaluationError(f".{name} of an unexpected value")
        return getattr(value, name)

    return apply


def _reverse_dims(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        raise EvaluationError(".T of a non-tensor")
    return value.permute(*reversed(range(value.ndim)))


def _size(value: Any, *args: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        raise EvaluationError("size of a non-tensor")
    return value.size(*args)


def _finfo(value: Any) -> Any:
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.finfo(value)
    raise EvaluationError("finfo of a non-float dtype")


def _bmm(a: Any, b: Any) -> Any:
    """torch.bmm, or the same batched product over the leading dimensions when a
    probe reached it with more than three."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.ndim < 3 or b.ndim < 3:
        raise EvaluationError("bmm of non-batched operands")
    return torch.bmm(a, b) if a.ndim == b.ndim == 3 else _matmul(a, b)


def _masked_fill(x: Any, mask: Any, *rest: Any, **kwargs: Any) -> Any:
    """Tensor.masked_fill, with a mask that would broadcast ``x`` to more elements cut
    to ``x``'s shape: a probe mask is a hypercube whatever the rank of the scores it
    masks (three-dimensional after bmm, one head after a view); real masks fit."""
    if not isinstance(x, torch.Tensor):
        raise EvaluationError("masked_fill of a non-tensor")
    if isinstance(mask, torch.Tensor) and mask.ndim >= x.ndim and mask.shape != x.shape:
        try:
            grows = broadcast_shape(x.shape, mask.shape) != x.shape
        except RuntimeError:
            grows = True
        if grows:
            mask = mask[(0,) * (mask.ndim - x.ndim)]
            if all(m >= s for m, s in zip(mask.shape, x.shape)):
                mask = mask[tuple(slice(0, s) for s in x.shape)]
    return x.masked_fill(mask, *rest, **kwargs)


def _einsum(equation: Any, *operands: Any) -> Any:
    if not isinstance(equation, str):
        raise EvaluationError("einsum without an equation")
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
        operands = tuple(operands[0])
    return torch.einsum(equation, *operands)


def _setitem(base: Any, index: Any, value: Any) -> Any:
    """``out[index] = value`` as a value: a copy of ``out`` with the part written."""
    if not isinstance(base, torch.Tensor):
        raise EvaluationError("an item written into a non-tensor")
    out = base.clone()
    out[index] = value
    return out


def _einops(repeat: bool) -> Callable[..., Any]:
    def apply(tensor: Any, pattern: Any, **lengths: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):
            raise EvaluationError("einops of a non-tensor")
        return einops_patterns.apply(tensor, pattern, repeat=repeat, **lengths)

    return apply


def _cat(fn: Callable[..., Any]) -> Callable[..., Any]:
    def apply(seq: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(seq, (tuple, list)):
            raise EvaluationError("concatenation of a non-sequence")
        return fn(list(seq), *args, **kwargs)

    return apply


_OPS: dict[str, Callable[..., Any]] = {
    "add": _binary(operator.add), "sub": _binary(operator.sub), "mul": _binary(operator.mul),
    "div": _binary(operator.truediv), "floordiv": _binary(operator.floordiv), "mod": _binary(operator.mod),
    "pow": _power, "matmul": _matmul, "and_": _binary(operator.and_), "or_": _binary(operator.or_),
    "neg": operator.neg, "pos": operator.pos, "invert": operator.invert,
    "eq": _binary(operator.eq), "ne": _binary(operator.ne), "lt": _binary(operator.lt), "le": _binary(operator.le),
    "gt": _binary(operator.gt), "ge": _binary(operator.ge),
    "tanh": _unary(torch.tanh), "sigmoid": _unary(torch.sigmoid), "erf": _unary(torch.erf),
    "erfc": _unary(torch.erfc), "exp": _unary(torch.exp), "exp2": _unary(torch.exp2), "log": _unary(torch.log),
    "sqrt": _unary(torch.sqrt), "rsqrt": _unary(torch.rsqrt), "abs": _unary(torch.abs),
    "reciprocal": _unary(torch.reciprocal), "square": _unary(torch.square), "sin": _unary(torch.sin),
    "cos": _unary(torch.cos), "relu": _unary(torch.relu), "log1p": _unary(torch.log1p),
    "expm1": _unary(torch.expm1), "sign": _unary(torch.sign), "ndtr": _unary(torch.special.ndtr),
    "silu": _unary(F.silu), "gelu": _unary(F.gelu), "softplus": _unary(F.softplus),
    "logsigmoid": _unary(F.logsigmoid),
    "clamp": _unary(torch.clamp), "minimum": torch.minimum, "maximum": torch.maximum, "where": torch.where,
    "masked_fill": _masked_fill,
    "mean": _unary(torch.mean), "sum": _unary(torch.sum), "amax": _unary(torch.amax), "amin": _unary(torch.amin),
    "max": _unary(torch.max), "min": _unary(torch.min), "var": _unary(torch.var), "std": _unary(torch.std),
    "var_mean": _unary(torch.var_mean), "norm": _unary(torch.norm),
    "vector_norm": _unary(torch.linalg.vector_norm), "logsumexp": _unary(torch.logsumexp),
    "softmax": _unary(F.softmax), "log_softmax": _unary(F.log_softmax),
    "bmm": _bmm, "mm": torch.mm, "einsum": _einsum, "baddbmm": torch.baddbmm, "linear": F.linear,
    "outer": torch.outer,
    "layer_norm": F.layer_norm, "sdpa": F.scaled_dot_product_attention,
    "transpose": _method("transpose"), "swapaxes": _method("swapaxes"), "permute": _method("permute"),
    "reshape": _method("reshape"), "view": _method("view"), "flatten": _method("flatten"),
    "unflatten": _method("unflatten"), "unsqueeze": _method("unsqueeze"), "squeeze": _method("squeeze"),
    "expand": _method("expand"), "expand_as": _method("expand_as"), "contiguous": _method("contiguous"),
    "chunk": _method("chunk"), "split": _method("split"), "unbind": _method("unbind"),
    "repeat": _sized_method("repeat"), "repeat_interleave": _sized_method("repeat_interleave"),
    "tril": _method("tril"), "triu": _method("triu"), "flip": _method("flip"), "narrow": _method("narrow"),
    "view_as": _method("view_as"), "reshape_as": _method("reshape_as"), "clone": _method("clone"),
    "detach": _method("detach"), "t": _method("t"), "dim": _method("dim"), "numel": _method("numel"),
    "size": _size, "cat": _cat(torch.cat), "stack": _cat(torch.stack),
    "view_as_complex": torch.view_as_complex, "view_as_real": torch.view_as_real, "polar": torch.polar,
    "complex": torch.complex,
    "ones_like": torch.ones_like, "zeros_like": torch.zeros_like, "full_like": torch.full_like,
    # Uninitialised memory that the code overwrites before reading: zeros stand for it.
    "empty_like": torch.zeros_like, "setitem": _setitem,
    "getitem": _getitem, "tuple": _tuple, "slice": slice, "cast": _first, "dropout": _first,
    "shape": _attribute("shape", (torch.Tensor,)), "T": _reverse_dims,
    "mT": _attribute("mT", (torch.Tensor,)), "real": _attribute("real", (torch.Tensor,)),
    "imag": _attribute("imag", (torch.Tensor,)), "dtype": _attribute("dtype", (torch.Tensor,)),
    "ndim": _attribute("ndim", (torch.Tensor,)), "device": _attribute("device", (torch.Tensor,)),
    "values": _attribute("values", ()), "indices": _attribute("indices", ()),
    "attr_min": _attribute("min", (torch.finfo,)), "attr_max": _attribute("max", (torch.finfo,)),
    "attr_eps": _attribute("eps", (torch.finfo,)), "attr_tiny": _attribute("tiny", (torch.finfo,)),
    "finfo": _finfo, "float": float, "int": int,
    "rearrange": _einops(False), "einops_repeat": _einops(True),
}
def _or(*values: Any) -> Any:
    """``a or b`` of numbers: the first that is not zero (or None), else the last."""
    for value in values[:-1]:
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise EvaluationError("`or` of a tensor")
        if value is not None and bool(value):
            return value
    return values[-1]


def _scalar_function(fn: Callable[[float], float]) -> Callable[[Any], float]:
    def apply(value: Any) -> float:
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise EvaluationError("a math function of a tensor")
        return fn(float(value))

    return apply


for _name in V.SCALAR_FUNCTIONS:
    _OPS["math_" + _name] = _scalar_function(getattr(math, _name) if _name != "abs" else abs)
_OPS["math_or"] = _or

#: Layout operations pass their input through when they fail on the probes.
_PASS_THROUGH = frozenset(V.LAYOUT) - {"tuple", "slice", "size", "shape", "dim", "ndim", "numel", "dtype", "device"}


_SPLITS = frozenset({"split", "chunk"})


def _const_value(node: Node) -> Any:
    value = node.value
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "dtype":
        return _DTYPES.get(value[1], torch.float64)
    return value


class Evaluator:
    """Values of the nodes of trees under one assignment of the free variables.

    ``env`` maps variable names to probe values; ``overrides`` replaces the value of
    given nodes (by id), which is how a reference re-evaluates an expression with
    another input. Every value is computed once.
    """

    def __init__(self, env: dict[str, Any], overrides: dict[int, Any] | None = None,
                 fill: Callable[[Node, torch.Tensor], torch.Tensor] | None = None):
        self.env = env
        self.memo: dict[int, Any] = dict(overrides or {})
        self.fill = fill
        #: Nodes whose value stands in for one the probes could not give (a view to
        #: sizes they do not have, passed through; a term filled in): shapes read
        #: through them are not the code's.
        self.stand_ins: set[int] = set()

    def value(self, root: Node) -> Any:
        """The value of ``root``, or ``FAIL`` when it cannot be computed."""
        memo = self.memo
        if id(root) in memo:
            return memo[id(root)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for node in walk(root):
                if id(node) not in memo:
                    memo[id(node)] = self._compute(node)
        return memo[id(root)]

    def _compute(self, node: Node) -> Any:
        if node.op == VAR:
            return self.env.get(node.value, FAIL)
        if node.op == CONST:
            return _const_value(node)
        if node.op == "star":
            return FAIL  # only meaningful inside a call or tuple; expanded there
        fn = _OPS.get(node.op)
        if fn is None:
            return FAIL
        args: list[Any] = []
        for arg in node.args:
            if arg.op == "star":
                inner = self.memo.get(id(arg.args[0]), FAIL)
                if inner is FAIL or not isinstance(inner, (tuple, list, torch.Size)):
                    return self._pass_through(node)
                args.extend(inner)
                continue
            value = self.memo[id(arg)]
            if value is FAIL:
                return self._pass_through(node)
            args.append(value)
        kwargs = {}
        for name, arg in node.kwargs:
            value = self.memo[id(arg)]
            if value is FAIL:
                return self._pass_through(node)
            kwargs[name] = value
        try:
            result = fn(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError,
                EvaluationError, AttributeError, NotImplementedError):
            return self._pass_through(node)
        if isinstance(result, torch.Tensor) and result.numel() > MAX_ELEMENTS:
            return FAIL
        if node.op in ("add", "sub") and isinstance(result, torch.Tensor) and self.fill is not None \
                and any(isinstance(a, torch.Tensor) and a.ndim and a.shape != result.shape for a in args) \
                and any(_gathers(a) for a in node.args):
            # A term gathered from a table by an index (a relative-position bias) that
            # broadcast the scores to another shape does not fit the probes: it is read
            # as a term that fits.
            filled = self._filled_term(node)
            if filled is not FAIL and filled.shape != result.shape:
                self.stand_ins.add(id(node))
                return filled
        return result

    def _pass_through(self, node: Node) -> Any:
        self.stand_ins.add(id(node))
        if node.op in ("add", "sub") and len(node.args) == 2 and self.fill is not None:
            filled = self._filled_term(node)
            if filled is not FAIL:
                return filled
        if node.op in _PASS_THROUGH and node.args:
            value = self.memo.get(id(node.args[0]), FAIL)
            if isinstance(value, torch.Tensor):
                # A split into sizes the probe does not have (split(self.fused_dims)):
                # pieces of the input's shape, as for a piece the split did not produce.
                return (value,) if node.op in _SPLITS else value
            if (node.op == "getitem" and isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor)
                    and self.fill is not None):
                # A piece the probe's split did not produce (q, k, v = qkv.split(width)
                # on a hypercube): another tensor of the same shape stands for it.
                return self.fill(node, value[0])
        return FAIL


    def _filled_term(self, node: Node) -> Any:
        """``scores + bias`` where the bias does not fit the probes (a relative-position
        bias gathered from a table by an index buffer) and shares no variable with the
        scores as data (a size read from the input is no data): another tensor of the
        scores' shape stands for it."""
        a, b = node.args
        for keep, other in ((a, b), (b, a)):
            value = self.memo.get(id(keep), FAIL)
            if (isinstance(value, torch.Tensor) and keep.ops & V.MATMULS and not other.ops & V.MATMULS
                    and other.vars and not data_vars(keep) & data_vars(other)):
                term = self.fill(other, value)  # type: ignore[misc]
                self.memo[id(other)] = term  # what the term is read as, wherever it is asked for
                if node.op == "add":
                    return value + term
                return value - term if keep is a else term - value
        return FAIL


def _gathers(node: Node) -> bool:
    """Whether ``node`` indexes a tensor with a variable (``table[index.view(-1)]``)."""
    return any(n.op == "getitem" and len(n.args) == 2 and n.args[1].vars and n.args[1].op != "tuple"
               and not n.args[1].op == "slice" for n in walk(node))


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point and value.numel() > 0
