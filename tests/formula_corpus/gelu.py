"""GELU written by hand: the tanh approximation, the exact erf form, quick GELU."""

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def gelu_gpt2(x):  # formula: gelu_tanh
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class NewGELUActivation(nn.Module):  # formula: gelu_tanh
    def forward(self, input: Tensor) -> Tensor:
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


@torch.jit.script
def bias_gelu(bias, y):  # formula: gelu_tanh
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class FastGELUActivation(nn.Module):  # formula: gelu_tanh
    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input * input)))


def gelu_spread(x):  # formula: gelu_tanh
    cube = x * x * x
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * cube)
    return 0.5 * x * (1.0 + inner.tanh())


def gelu_numpy_constant(x):  # formula: gelu_tanh
    return 0.5 * x * (1.0 + torch.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


gelu_lambda = lambda t: 0.5 * t * (1.0 + torch.tanh(0.7978845608028654 * (t + 0.044715 * t ** 3)))  # formula: gelu_tanh


def gelu_sigmoid_form(x):  # formula: gelu_tanh
    return x * torch.sigmoid(1.5957691216057308 * x * (1.0 + 0.044715 * x * x))


def gelu_power_half(x):  # formula: gelu_tanh
    return 0.5 * x * (1 + torch.tanh((2 / math.pi) ** 0.5 * (x + 0.044715 * x.pow(3))))


class MLPInlineGelu(nn.Module):  # formula: gelu_tanh
    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * h ** 3))))


class GeluMethod(nn.Module):  # formula: gelu_tanh
    def _gelu(self, hidden):
        return hidden * 0.5 * (1.0 + F.tanh(0.7978845608 * (hidden + 0.044715 * hidden ** 3)))

    def forward(self, hidden):
        return self._gelu(self.proj(hidden))


def gelu_torch_mul(x):  # formula: gelu_tanh
    return torch.mul(x, 0.5) * (1.0 + torch.tanh(0.7978845608 * torch.add(x, 0.044715 * torch.pow(x, 3))))


def gelu_erf_bert(x):  # formula: gelu_erf
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_erf_constant(x):  # formula: gelu_erf
    return 0.5 * x * (1 + torch.erf(x * 0.7071067811865476))


def gelu_ndtr(x):  # formula: gelu_erf
    return x * torch.special.ndtr(x)


def gelu_erfc(x):  # formula: gelu_erf
    return 0.5 * x * torch.erfc(-x / math.sqrt(2))


def gelu_erf_spread(x):  # formula: gelu_erf
    cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return x * cdf


class GELUMethods(nn.Module):  # formula: gelu_erf
    def forward(self, input):
        return input.mul(0.5).mul(1.0 + torch.erf(input / 1.4142135623730951))


erf_gelu_lambda = lambda x: x * (torch.erf(x / math.sqrt(2)) + 1) / 2  # formula: gelu_erf


def gelu_erf_special(x):  # formula: gelu_erf
    return 0.5 * x * (1.0 + torch.special.erf(x / 2 ** 0.5))


def quick_gelu_clip(x: torch.Tensor):  # formula: quick_gelu
    return x * torch.sigmoid(1.702 * x)


class QuickGELU(nn.Module):  # formula: quick_gelu
    def forward(self, x):
        return torch.sigmoid(x * 1.702) * x


def quick_gelu_exp(x):  # formula: quick_gelu
    return x / (1 + torch.exp(-1.702 * x))


def quick_gelu_method(x):  # formula: quick_gelu
    return x * (1.702 * x).sigmoid()


# ----------------------------------------------------------------------- look-alikes
def tanh_gate(x):  # lookalike: gelu_tanh
    return 0.5 * x * (1 + torch.tanh(x))


def gelu_typo(x):  # lookalike: gelu_tanh
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.44715 * x ** 3)))


def gelu_cdf_only(x):  # lookalike: gelu_tanh
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def mish(x):  # formula: mish
    return x * torch.tanh(F.softplus(x))


def gelu_two_inputs(x, y):  # lookalike: gelu_tanh
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (y + 0.044715 * y ** 3)))


def gelu_already_fused(x):  # lookalike: gelu_tanh
    return F.gelu(x, approximate="tanh")


def erf_only(x):  # lookalike: gelu_erf
    return torch.erf(x / math.sqrt(2.0))


def gelu_erf_wrong_scale(x):  # lookalike: gelu_erf
    return 0.5 * x * (1.0 + torch.erf(x / 2.0))


def normal_cdf(x):  # lookalike: gelu_erf
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def x_erf(x):  # lookalike: gelu_erf
    return x * torch.erf(x)


def gelu_fused_erf(x):  # lookalike: gelu_erf
    return F.gelu(x)


def sigmoid_slope(x):  # lookalike: quick_gelu
    return x * torch.sigmoid(1.5 * x)


def quick_gelu_other_input(x, y):  # lookalike: quick_gelu
    return x * torch.sigmoid(1.702 * y)


def sigmoid_only(x):  # lookalike: quick_gelu
    return torch.sigmoid(1.702 * x)


def openai_gelu(x):  # formula: gelu_tanh
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def erf_gelu_ones_like(x):  # formula: gelu_erf
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))


def gelu_backward(g, x):  # lookalike: gelu_tanh
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


def clipped_gelu(x, lo, hi):  # lookalike: gelu_erf
    return torch.clip(F.gelu(x), lo, hi)


SQRT_TWO_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_COEFF = 0.044715


def gelu_module_constants(x):  # formula: gelu_tanh
    return 0.5 * x * (1.0 + torch.tanh(SQRT_TWO_OVER_PI * (x + GELU_COEFF * torch.pow(x, 3.0))))


class GELUWithConstants(nn.Module):  # formula: gelu_tanh
    def __init__(self):
        super().__init__()
        self.kappa = math.sqrt(2.0 / math.pi)
        self.beta = 0.044715

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(self.kappa * (x + self.beta * x * x * x)))


def gelu_function_attribute(x):  # formula: gelu_tanh
    if not hasattr(gelu_function_attribute, "_a"):
        gelu_function_attribute._a = math.sqrt(2 / math.pi)
    return 0.5 * x * (1 + torch.tanh(gelu_function_attribute._a * (x + 0.044715 * torch.pow(x, 3))))


def gelu_rescaled_attribute(x):  # lookalike: gelu_tanh
    # The attribute is set twice (the second time to another scale): no constant.
    if not hasattr(gelu_rescaled_attribute, "_a"):
        gelu_rescaled_attribute._a = math.sqrt(2 / math.pi)
    out = 0.5 * x * (1 + torch.tanh(gelu_rescaled_attribute._a * (x + 0.044715 * torch.pow(x, 3))))
    gelu_rescaled_attribute._a = 1.5
    return out
