"""The reference functions hand-written code is compared with, and the hand-written
forms ``torchaxe verify`` measures against their fused replacements.

Every function here is plain torch on tensors; nothing imports torch_npu. Where an NPU
replacement's documented formula is known (``torch_npu.fast_gelu``), it is written out
so that its numerical difference can be shown on any device, labelled as emulated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ------------------------------------------------------------------ references
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def mish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tanh(torch.nn.functional.softplus(x))


def swiglu(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch_npu.npu_swiglu's documented formula: halves A, B of z along dim, silu(A) * B."""
    a, b = z.chunk(2, dim)
    return silu(a) * b


def glu(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """F.glu's formula: halves A, B of z along dim, A * sigmoid(B)."""
    a, b = z.chunk(2, dim)
    return a * torch.sigmoid(b)


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_normalise_eps_outside(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)


def rms_normalise_eps_clamped(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(eps)


def layer_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps)


def layer_normalise_eps_outside(x: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / ((x - mean).pow(2).mean(-1, keepdim=True).sqrt() + eps)


def layer_normalise_unbiased(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) with the unbiased std (the annotated Transformer's)."""
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / (x.std(-1, keepdim=True) + eps)


def layer_normalise_unbiased_inside(x: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(x.var(-1, keepdim=True) + eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)


def fast_gelu_documented(x: torch.Tensor) -> torch.Tensor:
    """torch_npu.fast_gelu as its documentation writes it: x / (1 + e^(-1.702|x|)) *
    e^(0.851 (x - |x|)), which is x * sigmoid(1.702 x)."""
    return x / (1.0 + torch.exp(-1.702 * x.abs())) * torch.exp(0.851 * (x - x.abs()))


# ------------------------------------------------------------------ verify forms
@dataclass(frozen=True)
class VerifyForm:
    """One hand-written form and its fused replacements, for ``torchaxe verify``."""

    category: str
    hand_text: str
    #: (B, ..., E) of the main input when --shape is not given.
    default_shape: tuple[int, ...]
    make_inputs: Callable[[tuple[int, ...], torch.dtype, str, torch.Generator], tuple[Any, ...]]
    hand: Callable[..., torch.Tensor]
    #: Replacement text and function on torch devices (cpu, cuda); empty when torch has none.
    fused_text: str | None = None
    fused: Callable[..., torch.Tensor] | None = None
    #: The npu replacement's text, and its documented formula where it is known.
    npu_text: str | None = None
    npu_documented: Callable[..., torch.Tensor] | None = None
    #: Minimum rank of --shape.
    min_rank: int = 1
    available: Callable[[], bool] = field(default=lambda: True)


def _one(shape, dtype, device, g):
    return (torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype) * 2,)


def _norm_inputs(shape, dtype, device, g):
    x = torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    w = (torch.rand(shape[-1], generator=g, dtype=torch.float32) + 0.5).to(device=device, dtype=dtype)
    b = torch.randn(shape[-1], generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    return x, w, b


def _attention_inputs(shape, dtype, device, g):
    return tuple(torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype) for _ in range(3))


def _rotary_inputs(shape, dtype, device, g):
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    angle = torch.rand(shape[-2], shape[-1] // 2, generator=g) * 6.2831853
    angle = torch.cat((angle, angle), -1)
    cos, sin = angle.cos(), angle.sin()
    return tuple(t.to(device=device, dtype=dtype) for t in (x, cos, sin))


def _rms_hand(x, w, b):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rms_fused(x, w, b):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _layer_hand(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


def _layer_fused(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _softmax_hand(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def _attention_hand(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return torch.softmax(scores, dim=-1) @ v


def _swiglu_hand(x):
    a, b = x.chunk(2, -1)
    return a * torch.sigmoid(a) * b


def _glu_hand(x):
    a, b = x.chunk(2, -1)
    return a * torch.sigmoid(b)


def _rotary_hand(x, cos, sin):
    return x * cos + rotate_half(x) * sin


FORMS: dict[str, VerifyForm] = {
    f.category: f
    for f in (
        VerifyForm("gelu_tanh", "0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))", (8, 256, 1024), _one,
                   gelu_tanh, 'F.gelu(x, approximate="tanh")', lambda x: F.gelu(x, approximate="tanh"),
                   "torch_npu.fast_gelu(x)", fast_gelu_documented),
        VerifyForm("gelu_erf", "0.5 * x * (1 + erf(x / sqrt(2)))", (8, 256, 1024), _one, gelu_erf, "F.gelu(x)",
                   F.gelu, "torch_npu.fast_gelu(x)", fast_gelu_documented),
        VerifyForm("quick_gelu", "x * sigmoid(1.702 * x)", (8, 256, 1024), _one, quick_gelu, None, None,
                   "torch_npu.fast_gelu(x)", fast_gelu_documented),
        VerifyForm("silu", "x * sigmoid(x)", (8, 256, 1024), _one, silu, "F.silu(x)", F.silu),
        VerifyForm("mish", "x * tanh(softplus(x))", (8, 256, 1024), _one, mish, "F.mish(x)", F.mish),
        VerifyForm("swiglu", "a, b = x.chunk(2, -1); a * sigmoid(a) * b", (8, 256, 2048), _one, _swiglu_hand,
                   "F.silu(a) * b", lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
                   "torch_npu.npu_swiglu(x, dim=-1)"),
        VerifyForm("glu", "a, b = x.chunk(2, -1); a * sigmoid(b)", (8, 256, 2048), _one, _glu_hand,
                   "F.glu(x, dim=-1)", lambda x: F.glu(x, -1)),
        VerifyForm("rms_norm", "x * rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w", (8, 256, 1024),
                   _norm_inputs, _rms_hand, "F.rms_norm(x, (x.shape[-1],), w, 1e-6)", _rms_fused,
                   "torch_npu.npu_rms_norm(x, w, epsilon=1e-6)[0]",
                   available=lambda: hasattr(F, "rms_norm")),
        VerifyForm("layer_norm", "(x - mean) / sqrt(var + 1e-5) * w + b", (8, 256, 1024), _norm_inputs, _layer_hand,
                   "F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)", _layer_fused),
        VerifyForm("softmax", "e = exp(x - x.amax(-1, keepdim=True)); e / e.sum(-1, keepdim=True)", (8, 256, 1024),
                   _one, _softmax_hand, "torch.softmax(x, dim=-1)", lambda x: torch.softmax(x, -1)),
        VerifyForm("attention", "softmax(q @ k.transpose(-2, -1) / sqrt(E)) @ v", (4, 8, 256, 64), _attention_inputs,
                   _attention_hand, "F.scaled_dot_product_attention(q, k, v)", F.scaled_dot_product_attention,
                   'torch_npu.npu_fusion_attention(q, k, v, head_num, "BNSD", scale=...)[0]', None, min_rank=3),
        VerifyForm("rotary", "x * cos + rotate_half(x) * sin", (4, 8, 256, 64), _rotary_inputs, _rotary_hand, None,
                   None, "torch_npu.npu_rotary_mul(x, cos, sin)", min_rank=2),
    )
}
