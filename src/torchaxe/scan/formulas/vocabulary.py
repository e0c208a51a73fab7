"""The whitelist: which names the lowering understands and the operation each one
becomes. A call that is not listed here is never interpreted; it becomes an opaque
free variable.

Operation names are canonical: ``torch.tanh(x)``, ``x.tanh()`` and
``F.tanh(x)`` are all ``tanh``.
"""

from __future__ import annotations

import math

#: Qualified function names (through the file's imports) -> operation.
FUNCTIONS: dict[str, str] = {}


def _register(op: str, *names: str) -> None:
    for name in names:
        FUNCTIONS[name] = op


_T, _F, _S, _L = "torch.", "torch.nn.functional.", "torch.special.", "torch.linalg."
for _op in ("tanh", "sigmoid", "exp", "log", "sqrt", "rsqrt", "abs", "reciprocal", "neg", "square", "sin", "cos",
            "relu", "log1p", "expm1", "sign", "clamp", "minimum", "maximum", "where", "masked_fill", "mean", "sum",
            "amax", "amin", "var", "std", "var_mean", "norm", "logsumexp", "softmax", "log_softmax", "matmul", "bmm",
            "mm", "einsum", "baddbmm", "transpose", "permute", "reshape", "flatten", "unflatten", "unsqueeze",
            "squeeze", "cat", "stack", "chunk", "split", "unbind", "view_as_complex", "view_as_real", "polar",
            "complex", "ones_like", "zeros_like", "full_like", "empty_like", "tril", "triu", "flip", "narrow", "repeat_interleave", "erf",
            "erfc", "pow", "mul", "add", "sub", "div", "max", "min", "exp2", "dropout", "tensor", "finfo",
            "swapaxes", "t", "outer"):
    FUNCTIONS[_T + _op] = _op
_register("div", _T + "true_divide", _T + "divide")
_register("mul", _T + "multiply")
_register("sub", _T + "subtract")
_register("cat", _T + "concat", _T + "concatenate")
_register("clamp", _T + "clip")
_register("transpose", _T + "swapdims")
_register("swapaxes", _T + "swapaxes")
_register("sigmoid", _S + "expit", _F + "sigmoid")
_register("erf", _S + "erf")
_register("erfc", _S + "erfc")
_register("ndtr", _S + "ndtr")
_register("exp2", _S + "exp2")
_register("expm1", _S + "expm1")
_register("log1p", _S + "log1p")
_register("softmax", _F + "softmax", _S + "softmax")
_register("log_softmax", _F + "log_softmax", _S + "log_softmax")
_register("tanh", _F + "tanh")
_register("relu", _F + "relu")
_register("silu", _F + "silu")
_register("gelu", _F + "gelu")
_register("softplus", _F + "softplus")
_register("logsigmoid", _F + "logsigmoid")
_register("dropout", _F + "dropout", _T + "dropout", _F + "dropout1d", _F + "dropout2d")
_register("linear", _F + "linear")
_register("layer_norm", _F + "layer_norm", _T + "layer_norm")
_register("rms_norm", _F + "rms_norm", _T + "rms_norm")
# Lowered to its arithmetic: x / clamp(vector_norm(x, dim), min=eps) (p=2 only).
_register("normalize", _F + "normalize")
_register("sdpa", _F + "scaled_dot_product_attention")
_register("norm", _L + "norm")
_register("vector_norm", _L + "vector_norm")
_register("matmul", _L + "matmul")
_register("finfo", _T + "finfo", _T + "iinfo")
# einops moves axes by pattern: evaluated with views (einops_patterns), never imported.
_register("rearrange", "einops.rearrange")
_register("einops_repeat", "einops.repeat")
# math / numpy on constants (folded when every argument is a number).
for _mod in ("math.", "numpy."):
    for _op in ("sqrt", "exp", "log", "tanh", "erf", "abs"):
        FUNCTIONS[_mod + _op] = _op
    FUNCTIONS[_mod + "pow"] = "pow"
    FUNCTIONS[_mod + "power"] = "pow"

#: math/numpy functions applied to a variable: ``math_<name>`` of a number.
SCALAR_FUNCTIONS = frozenset({"sqrt", "exp", "log", "tanh", "erf", "abs"})

#: Builtins (names no import binds and no local assigns).
BUILTINS: dict[str, str] = {"float": "float", "int": "int", "abs": "abs", "pow": "pow"}

#: Tensor method names -> operation (the receiver becomes the first argument).
METHODS: dict[str, str] = {
    name: name
    for name in (
        "tanh", "sigmoid", "erf", "erfc", "exp", "log", "sqrt", "rsqrt", "abs", "reciprocal", "neg", "pow", "square",
        "sin", "cos", "relu", "log1p", "expm1", "sign", "clamp", "masked_fill", "mean", "sum", "amax", "amin", "var",
        "std", "norm", "logsumexp", "softmax", "log_softmax", "matmul", "bmm", "mm", "transpose", "permute",
        "reshape", "view", "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "expand_as", "contiguous",
        "chunk", "split", "unbind", "repeat", "repeat_interleave", "tril", "triu", "flip", "narrow", "view_as",
        "reshape_as", "size", "dim", "max", "min", "mul", "add", "sub", "div", "clone", "detach", "t", "swapaxes",
        "exp2", "outer", "masked_fill_", "baddbmm", "where",
    )
}
METHODS.update({
    "clip": "clamp", "true_divide": "div", "divide": "div", "multiply": "mul", "subtract": "sub", "negative": "neg",
    "swapdims": "transpose", "masked_fill_": "masked_fill", "mul_": "mul", "add_": "add", "sub_": "sub",
    "div_": "div", "pow_": "pow", "exp_": "exp", "tanh_": "tanh", "sigmoid_": "sigmoid", "neg_": "neg",
    "sqrt_": "sqrt", "rsqrt_": "rsqrt", "erf_": "erf", "clamp_": "clamp", "softmax_": "softmax",
    "float": "cast", "half": "cast", "bfloat16": "cast", "double": "cast", "to": "cast", "type": "cast",
    "type_as": "cast", "cuda": "cast", "cpu": "cast", "npu": "cast", "numel": "numel",
})

#: Attribute names read from a value (``x.shape``, ``x.T``, ``freqs.real``).
ATTRIBUTES: dict[str, str] = {
    "shape": "shape", "T": "T", "mT": "mT", "real": "real", "imag": "imag", "dtype": "dtype", "ndim": "ndim",
    "values": "values", "indices": "indices", "min": "attr_min", "max": "attr_max", "eps": "attr_eps",
    "tiny": "attr_tiny", "device": "device",
}

#: Qualified names that are numbers.
CONSTANTS: dict[str, float] = {
    "math.pi": math.pi, "math.e": math.e, "math.inf": math.inf, "math.tau": math.tau,
    "numpy.pi": math.pi, "numpy.e": math.e, "numpy.inf": math.inf, "torch.pi": math.pi, "torch.e": math.e,
    "torch.inf": math.inf,
}

#: Qualified dtype names (casts are transparent to fingerprints; the name is kept).
DTYPES = frozenset(
    "torch." + d for d in ("float32", "float", "float16", "half", "bfloat16", "float64", "double", "bool", "int64",
                           "long", "int32", "int", "int8", "uint8", "complex64", "cfloat", "complex128")
)

# ------------------------------------------------------------- operation classes
#: Operations that move or reinterpret data without arithmetic.
LAYOUT = frozenset({
    "transpose", "permute", "reshape", "view", "flatten", "unflatten", "unsqueeze", "squeeze", "expand",
    "expand_as", "contiguous", "chunk", "split", "unbind", "cat", "stack", "getitem", "repeat", "repeat_interleave",
    "flip", "narrow", "view_as", "reshape_as", "clone", "detach", "cast", "T", "mT", "t", "swapaxes", "tuple",
    "slice", "size", "shape", "dim", "ndim", "numel", "dtype", "device", "dropout", "values", "indices",
    "rearrange", "einops_repeat",
})
#: Reductions over a dimension.
REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "max", "min", "var", "std", "var_mean", "norm",
                        "vector_norm", "logsumexp"})
MATMULS = frozenset({"matmul", "bmm", "mm", "einsum", "baddbmm"})
#: Operations whose presence makes a tree worth evaluating at all.
ANCHORS = frozenset({"tanh", "erf", "erfc", "ndtr", "sigmoid", "exp", "exp2", "rsqrt", "sqrt", "silu", "softmax",
                     "view_as_complex", "cat", "stack", "setitem", "flip", "mean", "var", "std", "var_mean", "norm", "vector_norm"})
#: Keyword arguments dropped before evaluation: they write to or retype the probes.
DROPPED_KEYWORDS = frozenset({"out", "inplace", "dtype", "device", "non_blocking", "memory_format", "copy"})
