"""AX103: a function or module whose name says it hand-writes an operator that has a
fused implementation (GELU, SiLU, Mish, RMSNorm, attention, rotary embedding, SwiGLU).

This is the name-level check; recognising the same math by meaning, whatever it is
called, is the job of the formula rules (AX110-AX120): a definition in which one of
them found a formula is left to it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import DEFINITION_TYPES, FileContext, called_names, walk_scope
from torchaxe.scan.formulas.analysis import covers
from torchaxe.scan.rules.base import Invalid, Rule, Valid


@dataclass(frozen=True)
class FusedOp:
    """A family of hand-written operators and its fused replacement per target."""

    label: str
    names: frozenset[str]
    #: Dotted call names (or suffixes) that show the body already uses a fused op.
    fused_calls: tuple[str, ...]
    replacement: dict[str, str]
    #: Whether the body must contain a softmax and a matrix product to count.
    needs_attention_math: bool = False


def _names(*names: str) -> frozenset[str]:
    return frozenset(n.lower() for n in names)


OPS = (
    FusedOp(
        "GELU",
        _names("gelu", "gelu_new", "gelu_fast", "gelu_impl", "gelu_tanh", "bias_gelu", "new_gelu", "tanh_gelu",
               "GELUActivation", "NewGELUActivation", "FastGELUActivation", "GeLU", "GELUTanh"),
        ("gelu", "fast_gelu"),
        {"cpu": 'F.gelu(x, approximate="tanh") (or F.gelu(x) for the erf form)',
         "cuda": 'F.gelu(x, approximate="tanh") (or F.gelu(x) for the erf form)',
         "npu": "torch_npu.fast_gelu(x)"},
    ),
    FusedOp(
        "SiLU/Swish",
        _names("swish", "silu", "SiLU", "Swish", "SiLUActivation"),
        ("silu", "npu_silu"),
        {"cpu": "F.silu(x)", "cuda": "F.silu(x)", "npu": "F.silu(x) (or torch_npu.contrib.module.SiLU)"},
    ),
    FusedOp(
        "Mish",
        _names("mish", "Mish", "MishActivation"),
        ("mish",),
        {"cpu": "F.mish(x)", "cuda": "F.mish(x)", "npu": "F.mish(x) (or torch_npu.contrib.module.Mish)"},
    ),
    FusedOp(
        "RMSNorm",
        _names("rms_norm", "rmsnorm", "RMSNorm", "RmsNorm", "LlamaRMSNorm", "T5LayerNorm", "MistralRMSNorm", "Qwen2RMSNorm"),
        ("rms_norm", "npu_rms_norm", "RMSNorm"),
        {"cpu": "torch.nn.functional.rms_norm(x, (dim,), weight, eps) / torch.nn.RMSNorm",
         "cuda": "torch.nn.functional.rms_norm(x, (dim,), weight, eps) / torch.nn.RMSNorm",
         "npu": "torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]"},
    ),
    FusedOp(
        "attention",
        _names("attention", "attn", "_attn", "self_attention", "scaled_dot_product", "scaled_dot_product_attention",
               "dot_product_attention", "Attention", "SelfAttention", "CausalSelfAttention", "MultiHeadAttention"),
        ("scaled_dot_product_attention", "npu_fusion_attention", "flash_attn_func", "memory_efficient_attention"),
        {"cpu": "F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...)",
         "cuda": "F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...) (flash / memory-efficient kernels)",
         "npu": "torch_npu.npu_fusion_attention(q, k, v, head_num, input_layout, ...)"},
        needs_attention_math=True,
    ),
    FusedOp(
        "rotary embedding",
        # (Not ``rotate_half``: a helper of the rotation, whose caller AX119 reports.)
        _names("apply_rotary_pos_emb", "apply_rotary_emb", "apply_rope", "rope"),
        ("npu_rotary_mul", "apply_rotary_emb_qkv_", "apply_rotary_emb_kv_", "apply_rotary_emb_func",
         "liger_rotary_pos_emb"),
        {"npu": "torch_npu.npu_rotary_mul(x, cos, sin)"},
    ),
    FusedOp(
        "SwiGLU",
        _names("swiglu", "SwiGLU", "swi_glu"),
        ("npu_swiglu",),
        {"npu": "torch_npu.npu_swiglu(x, dim=-1)"},
    ),
)

_BY_NAME = {name: op for op in OPS for name in op.names}
class _Definitions:
    """The rule looks only at definitions with these names (any case): a file without
    one is not parsed. ``search(text)`` is whether a line of ``text`` starts, after
    indentation and an optional ``async``, with ``def NAME`` or ``class NAME``. Two
    patterns that start with the keyword's literal text, each match checked for the
    line's start, find that several times faster than one pattern anchored at
    every line."""

    def __init__(self, names: Iterable[str]) -> None:
        alternatives = "|".join(sorted(names))
        self.patterns = tuple(re.compile(keyword + r"[ \t]+(?i:" + alternatives + r")\b") for keyword in ("def", "class"))

    def search(self, text: str) -> bool:
        for pattern in self.patterns:
            for match in pattern.finditer(text):
                start = text.rfind("\n", 0, match.start()) + 1
                if _LINE_HEAD.fullmatch(text, start, match.start()):
                    return True
        return False


_LINE_HEAD = re.compile(r"[ \t]*(?:async[ \t]+)?")
_DEFINITION = _Definitions(_BY_NAME)

# A file is only parsed for this rule when one of these appears in it: the names
# above as they are spelled in code (plain substring tests are cheap; a regex over
# every file is not). Lower and capitalised spellings cover the snake_case function
# and CamelCase class forms.
_PREFILTER = (
    "gelu", "GELU", "GeLU", "Gelu", "silu", "SiLU", "swish", "Swish", "mish", "Mish",
    "rms_norm", "rmsnorm", "RMSNorm", "RmsNorm", "T5LayerNorm", "ttention", "attn",
    "scaled_dot_product", "rotary", "apply_rope", "def rope(", "swiglu",
    "SwiGLU", "swi_glu",
)
_SOFTMAX = ("softmax",)
_MATMUL = ("matmul", "bmm", "einsum", "baddbmm")


def _does_math(nodes: list[ast.AST]) -> bool:
    """Tensor arithmetic: a binary operator or a call, not a bare delegation."""
    return sum(isinstance(n, (ast.BinOp, ast.Call)) for n in nodes) >= 2


class HandWrittenFusedOp(Rule):
    """
    ## What it does
    Flags functions and `nn.Module` classes named after an operator that has a fused
    implementation — GELU variants, SiLU/Swish, Mish, RMSNorm, attention, rotary
    position embedding, SwiGLU — when their body computes it with elementary tensor
    operations instead of calling the fused operator.

    ## Why is this bad?
    A hand-written activation or norm runs as a chain of elementwise kernels, each
    reading and writing the whole tensor, forward and backward; a fused operator reads
    it once. Hand-written attention materialises the full score matrix that
    `scaled_dot_product_attention` (flash / memory-efficient kernels) or
    `torch_npu.npu_fusion_attention` never builds.

    ## Example
    ```python
    def gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    ```

    ## Use instead
    ```python
    F.gelu(x, approximate="tanh")      # cpu, cuda
    torch_npu.fast_gelu(x)             # npu
    ```

    ## Fix safety
    Display-only: which fused form is equivalent depends on the exact math (erf or tanh
    GELU, where the epsilon sits in a norm, the mask convention in attention), and a
    replacement can change numerics. The formula rules (AX110-AX120) check equivalence
    numerically; a definition in which they found the formula is not reported here
    again. NPU replacements are unverified on Ascend hardware.
    """

    code = "AX103"
    name = "hand-written-fused-op"
    category = "affinity_api"
    message = "hand-written operator with a fused implementation"
    node_types = DEFINITION_TYPES
    requires_text = _PREFILTER
    requires_pattern = _DEFINITION
    uses_formulas = True
    references = (
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html",
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.rms_norm.html",
        "https://www.hiascend.com/document (torch_npu.fast_gelu, npu_rms_norm, npu_fusion_attention, npu_rotary_mul)",
    )
    examples = (
        Invalid(
            "import torch\nfrom kernels import softplus_approx\ndef mish(x):\n"
            "    return x * torch.tanh(softplus_approx(x))\n", lines=(3,)
        ),
        Invalid(
            "import torch\nclass RMSNorm(torch.nn.Module):\n    def forward(self, x):\n"
            "        norm = x.norm(2, dim=-1, keepdim=True) * self.scale\n"
            "        return x / (norm + self.eps) * self.g\n",
            target="npu", lines=(2,),
        ),
        Invalid(
            "import torch\ndef attention(q, k, v, equation):\n    s = torch.einsum(equation, q, k)\n"
            "    return torch.softmax(s, -1) @ v\n",
            target="cuda", lines=(2,),
        ),
        Invalid("import torch\nfrom mylib import rotate\ndef apply_rotary_pos_emb(q, cos, sin):\n"
                "    return q * cos + rotate(q) * sin\n", target="npu", lines=(3,)),
        # The rotation's helper alone is not the rotary embedding.
        Valid("import torch\ndef rotate_half(x):\n    a, b = x.chunk(2, -1)\n    return torch.cat((-b, a), -1)\n",
              target="npu"),
        # The fused operator picked in __init__, the hand-written form kept for old torch.
        Valid("import torch\nclass MishActivation(torch.nn.Module):\n    def __init__(self):\n"
              "        super().__init__()\n        self.act = torch.nn.functional.mish\n"
              "    def _mish_python(self, x):\n        return x * torch.tanh(torch.nn.functional.softplus(x))\n"
              "    def forward(self, x):\n        return self.act(x)\n"),
        # A subclass that only configures its parent computes nothing itself.
        Valid("import torch\nclass SwiGLU(CustomGLU):\n    def __init__(self, dim=-1):\n"
              "        super().__init__(torch.nn.SiLU(), dim)\n", target="npu"),
        # Recognised by meaning by AX110 (and reported there), so not reported by name.
        Valid(
            "import math, torch\ndef gelu(x):\n"
            "    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))\n"
        ),
        Valid("import torch.nn.functional as F\ndef gelu(x):\n    return F.gelu(x)\n"),
        Valid("import torch\ndef rotate_half(x):\n    a, b = x.chunk(2, -1)\n    return torch.cat((-b, a), -1)\n", target="cuda"),
        Valid(
            "import torch\nimport torch.nn.functional as F\ndef attention(q, k, v):\n"
            "    return F.scaled_dot_product_attention(q, k, v)\n"
        ),
        Valid("import torch\ndef attention(q, k, v):\n    return q + k + v\n"),
        Valid("import torch\ndef gelu(x):\n    return x\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, DEFINITION_TYPES)
        op = _BY_NAME.get(node.name.lower())
        if op is None or ctx.target not in op.replacement:
            return
        if isinstance(node, ast.ClassDef):
            # What its methods compute; __init__ only builds the module.
            body = [n for stmt in node.body if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and stmt.name != "__init__" for n in walk_scope(stmt)]
        else:
            body = list(walk_scope(node))
        called = called_names(body)
        # A definition that calls the fused operator, or holds it to call later (an
        # `__init__` picking `F.mish` and keeping the hand-written form for old torch),
        # keeps the hand-written form as a fallback.
        if any(c in called or c in _referenced(node) for c in op.fused_calls):
            return
        if not _does_math(body):
            return
        if op.needs_attention_math:
            has_matmul = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult) for n in body) or any(
                c in called for c in _MATMUL
            )
            if not (has_matmul and any(c in called for c in _SOFTMAX)):
                return
        if covers(ctx, node):
            return  # the formula rules (AX110-AX120) report this math by meaning
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        replacement = op.replacement[ctx.target]
        note = ""
        if op.label == "SwiGLU" and ctx.target == "npu":
            split = _split_halves(body)
            if split is not None:
                dim, gates_second = split
                replacement = f"torch_npu.npu_swiglu(x, dim={dim})"
                if gates_second:
                    note = ("; npu_swiglu gates the first half (silu(first) * second) and this code gates the "
                            "second: swap the halves where x is made (the two halves of the projection's "
                            "weight) before using it")
        yield ctx.finding(
            self,
            node,
            f"{kind} {node.name} computes {op.label} by hand as a chain of small kernels; "
            f"the fused operator on {ctx.target} is {replacement}{note}"
            + (" (unverified on Ascend hardware)" if ctx.target == "npu" else ""),
            replacement=replacement,
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY, title=f"use {replacement}"),
        )


def _split_halves(body: list[ast.AST]) -> tuple[str, bool] | None:
    """``a, b = x.chunk(2, dim)`` (or ``torch.chunk(x, 2, dim)``) in ``body``: the
    split's dim as written, and whether a call reads the second half alone (the
    activation gating it: ``a * act(b)``) and none the first."""
    for node in body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)
                and len(node.targets[0].elts) == 2 and all(isinstance(e, ast.Name) for e in node.targets[0].elts)
                and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name != "chunk":
            continue
        positional = call.args[1:] if isinstance(func, ast.Attribute) else call.args[2:]
        dim_node = next((k.value for k in call.keywords if k.arg == "dim"), positional[0] if positional else None)
        dim = ast.unparse(dim_node) if dim_node is not None else "0"
        first, second = (e.id for e in node.targets[0].elts)

        def gated(half: str) -> bool:
            return any(isinstance(n, ast.Call) and n is not call and len(n.args) == 1
                       and isinstance(n.args[0], ast.Name) and n.args[0].id == half for n in body)

        return dim, gated(second) and not gated(first)
    return None


def _referenced(node: ast.AST) -> set[str]:
    """Attribute names read anywhere in ``node`` (``nn.functional.mish``)."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}
