"""SiLU, SwiGLU and GLU written by hand, and gates that only look like them."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import sigmoid


def swish(x):  # formula: silu
    return x * torch.sigmoid(x)


def silu_exp(x):  # formula: silu
    return x / (1 + torch.exp(-x))


def silu_method(x):  # formula: silu
    return x.sigmoid() * x


class Swish(nn.Module):  # formula: silu
    def forward(self, x):
        return x * F.sigmoid(x)


def silu_reciprocal(x):  # formula: silu
    return x * (1.0 + torch.exp(-x)).reciprocal()


def silu_torch_mul(x):  # formula: silu
    return torch.mul(x, torch.sigmoid(x))


def silu_spread(h):  # formula: silu
    gate = torch.sigmoid(h)
    out = h * gate
    return out


def silu_imported(h):  # formula: silu
    return h * sigmoid(h)


def silu_tanh(x):  # formula: silu
    return 0.5 * x * (1.0 + torch.tanh(x / 2))


class FeedForward(nn.Module):  # formula: swiglu
    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GatedMLP(nn.Module):  # formula: swiglu
    def forward(self, x):
        x, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * x)


def swiglu_split(h):  # formula: swiglu
    a, b = torch.split(h, h.shape[-1] // 2, dim=-1)
    return a * torch.sigmoid(a) * b


def swiglu_slices(x):  # formula: swiglu
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SwiGLU(nn.Module):  # formula: swiglu
    def forward(self, x):
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        hidden = F.silu(x1) * x2
        return self.w3(hidden)


def swiglu_torch_chunk(x):  # formula: swiglu
    x = torch.chunk(x, 2, -1)
    return torch.nn.functional.silu(x[0]) * x[1]


def swiglu_gate_up(gate, up):  # formula: swiglu
    return F.silu(gate) * up


def glu(x):  # formula: glu
    a, b = x.chunk(2, dim=-1)
    return a * torch.sigmoid(b)


class ConformerGLU(nn.Module):  # formula: glu
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, inputs):
        outputs, gate = inputs.chunk(2, dim=self.dim)
        return outputs * gate.sigmoid()


def glu_slices(x):  # formula: glu
    h = x.shape[-1] // 2
    return x[..., :h] * torch.sigmoid(x[..., h:])


def glu_split_channels(x):  # formula: glu
    a, b = torch.split(x, x.shape[1] // 2, dim=1)
    return a * b.sigmoid()


def glu_torch_chunk(x):  # formula: glu
    parts = torch.chunk(x, 2, 1)
    return parts[0] * torch.sigmoid(parts[1])


# ----------------------------------------------------------------------- look-alikes
def glu_reversed(x):  # lookalike: glu
    a, b = x.chunk(2, dim=-1)
    return torch.sigmoid(a) * b


def wavenet_gate(x):  # lookalike: glu
    a, b = x.chunk(2, dim=1)
    return torch.tanh(a) * torch.sigmoid(b)


class GatedConv(nn.Module):  # lookalike: glu
    def forward(self, x):
        return self.conv(x) * torch.sigmoid(self.gate(x))


def glu_fused(x):  # lookalike: glu
    return F.glu(x, dim=-1)


def lstm_output(gates, c):  # lookalike: glu
    i, f, g, o = gates.chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c)



def gated_by_other(x, y):  # lookalike: silu
    return x * torch.sigmoid(y)


def doubled_sigmoid(x):  # lookalike: silu
    return torch.sigmoid(x) * 2


def negative_swish(x):  # lookalike: silu
    return x * torch.sigmoid(-x)


def silu_fused(x):  # lookalike: silu
    return F.silu(x)


def geglu(x):  # lookalike: swiglu
    a, b = x.chunk(2, dim=-1)
    return F.gelu(a) * b


def silu_sum(a, b):  # lookalike: swiglu
    return F.silu(a) + b


def silu_of_product(a, b):  # lookalike: swiglu
    return F.silu(a * b)


def relu_gate(a, b):  # lookalike: swiglu
    return F.relu(a) * b


class SwishImplementation(torch.autograd.Function):  # formula: silu
    @staticmethod
    def forward(ctx, i):
        result = i * torch.sigmoid(i)
        ctx.save_for_backward(i)
        return result


class SwishBackward(torch.autograd.Function):  # lookalike: silu
    @staticmethod
    def backward(ctx, grad_output):
        i = ctx.saved_tensors[0]
        sigmoid_i = torch.sigmoid(i)
        return grad_output * (sigmoid_i * (1 + i * (1 - sigmoid_i)))


def mish_backward(x, grad_output):  # lookalike: silu
    x_sigmoid = torch.sigmoid(x)
    x_tanh_sp = F.softplus(x).tanh()
    return grad_output.mul(x_tanh_sp + x * x_sigmoid * (1 - x_tanh_sp * x_tanh_sp))


def swish_or_fused(x, fused=False):  # lookalike: silu
    if fused:
        return F.silu(x)
    return x * torch.sigmoid(x)
