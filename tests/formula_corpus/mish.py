"""Mish written by hand, x * tanh(softplus(x)), in the styles of detectors and
backbones that use it, and forms that only resemble it."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class MishModule(nn.Module):  # formula: mish
    def forward(self, x):
        return x * F.softplus(x).tanh()


class MishFunction(torch.autograd.Function):  # formula: mish
    # memory-efficient: only the input is saved; the backward is written by hand.
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.mul(torch.tanh(F.softplus(x)))

    @staticmethod
    def backward(ctx, grad_output):
        x = ctx.saved_tensors[0]
        sx = torch.sigmoid(x)
        fx = F.softplus(x).tanh()
        return grad_output * (fx + x * sx * (1 - fx * fx))


def mish_log_exp(x):  # formula: mish
    return x * torch.tanh(torch.log(1 + torch.exp(x)))


def mish_log1p(x):  # formula: mish
    return x * torch.tanh(torch.log1p(x.exp()))


def mish_two_statements(x):  # formula: mish
    sp = F.softplus(x)
    return x * sp.tanh()


class MishInplace(nn.Module):  # formula: mish
    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return x.mul_(F.softplus(x).tanh()) if self.inplace else x.mul(F.softplus(x).tanh())


def tanh_gate(x):  # lookalike: mish
    return x * torch.tanh(x)


def mish_other_input(x, y):  # lookalike: mish
    return x * torch.tanh(F.softplus(y))


def softplus_tanh_only(x):  # lookalike: mish
    return torch.tanh(F.softplus(x))


def mish_already_fused(x):  # lookalike: mish
    return F.mish(x)


def mish_with_beta(x):  # lookalike: mish
    return x * torch.tanh(F.softplus(x, beta=2.0))


def log_tanh(x):  # lookalike: mish
    return x * torch.tanh(torch.log(1 + x.abs()))
