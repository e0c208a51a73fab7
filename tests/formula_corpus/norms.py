"""RMSNorm and LayerNorm written by hand, and normalisations that are neither."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):  # formula: rms_norm
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class LlamaStyleRMSNorm(nn.Module):  # formula: rms_norm
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class T5StyleLayerNorm(nn.Module):  # formula: rms_norm
    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class GemmaStyleRMSNorm(nn.Module):  # formula: rms_norm
    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def rms_norm(x, weight, eps=1e-6):  # formula: rms_norm
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight


class ScaledRMSNorm(nn.Module):  # formula: rms_norm
    def forward(self, x):
        norm = x.norm(2, dim=-1, keepdim=True) * (x.shape[-1] ** -0.5)
        return self.g * x / (norm + self.eps)


class RMSNormSqrt(nn.Module):  # formula: rms_norm
    def forward(self, x):
        return x / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps) * self.scale


def rms_norm_chain(x, weight, eps: float = 1e-5):  # formula: rms_norm
    return (x * x).mean(-1, keepdim=True).add(eps).rsqrt() * x * weight


def rms_norm_power(x):  # formula: rms_norm
    return x * (x.square().mean(-1, keepdim=True) + 1e-5) ** -0.5


class LayerNorm(nn.Module):  # formula: layer_norm
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return self.a * (x - mean) / torch.sqrt(var + self.eps) + self.b


class BertLayerNorm(nn.Module):  # formula: layer_norm
    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


def layer_norm_var_mean(x, weight, bias, eps=1e-5):  # formula: layer_norm
    var, mean = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def layer_norm_one_expression(x, w, b, eps=1e-5):  # formula: layer_norm
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, correction=0) + eps) * w + b


def layer_norm_sums(x, w, b):  # formula: layer_norm
    # Means as sums over the size unpacked from x, the root as a power (llm.c's tutorial).
    B, T, C = x.size()
    mean = x.sum(-1, keepdim=True) / C
    xshift = x - mean
    var = (xshift**2).sum(-1, keepdim=True) / C
    rstd = (var + 1e-5) ** -0.5
    return xshift * rstd * w + b


def sum_of_squares_root(x):  # lookalike: layer_norm
    # A root of a sum of squares (an L2 length), nothing subtracted: no norm of x.
    return (x.pow(2).sum(-1, keepdim=True) + 1e-6) ** 0.5


def layer_norm_no_affine(x):  # formula: layer_norm
    mu = x.mean(dim=-1, keepdim=True)
    sigma2 = ((x - mu) ** 2).mean(dim=-1, keepdim=True)
    return (x - mu) / (sigma2 + 1e-6).sqrt()


class AnnotatedLayerNorm(nn.Module):  # formula: layer_norm
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class ChannelsLastLayerNorm(nn.Module):  # formula: layer_norm
    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) * torch.rsqrt(s + self.eps)
        return x * self.weight + self.bias


# ----------------------------------------------------------------------- look-alikes
def l2_normalize(x):  # lookalike: rms_norm
    return x / x.norm(dim=-1, keepdim=True)


def mean_abs_norm(x, eps=1e-6):  # lookalike: rms_norm
    return x / (x.abs().mean(-1, keepdim=True) + eps)


def sum_of_squares_norm(x, eps=1e-6):  # lookalike: rms_norm
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def rms_over_batch(x, eps=1e-6):  # lookalike: rms_norm
    return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps)


def max_norm(x, eps=1e-6):  # lookalike: rms_norm
    return x / (x.abs().amax(-1, keepdim=True) + eps)


def rms_fused(x, w):  # lookalike: rms_norm
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def batch_norm_by_hand(x, eps=1e-5):  # lookalike: layer_norm
    mean = x.mean(0, keepdim=True)
    var = x.var(0, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + eps)


def centre_only(x):  # lookalike: layer_norm
    return x - x.mean(-1, keepdim=True)


def scale_by_mean(x):  # lookalike: layer_norm
    return x / x.mean(-1, keepdim=True)


def layer_norm_fused(x, w, b):  # lookalike: layer_norm
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def standardise_global(x):  # lookalike: layer_norm
    return (x - x.mean()) / x.std()


class ConvNextLayerNorm(nn.Module):  # formula: layer_norm
    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


def hard_swish(x):  # lookalike: silu
    return x * F.relu6(x + 3) / 6


class GlobalResponseNorm(nn.Module):  # lookalike: rms_norm
    def forward(self, x):
        x_g = x.norm(p=2, dim=self.spatial_dim, keepdim=True)
        x_n = x_g / (x_g.mean(dim=self.channel_dim, keepdim=True) + self.eps)
        return x + torch.addcmul(self.bias.view(self.wb_shape), self.weight.view(self.wb_shape), x * x_n)


# ----------------------------------------------------------------------- channels-first RMSNorm, L2 forms
def channel_rms_norm(feature_map, gain, eps: float = 1e-6):  # formula: rms_norm
    ms = feature_map.pow(2).mean(dim=1, keepdim=True)
    return feature_map * torch.rsqrt(ms + eps) * gain[:, None, None]


class ChannelRMSNorm2d(nn.Module):  # formula: rms_norm
    def forward(self, x):
        inv = (x.square().mean(1, keepdim=True) + self.eps).rsqrt()
        return x * inv * self.weight.view(1, -1, 1, 1)


class UnitSphereRMSNorm(nn.Module):  # formula: rms_norm
    def __init__(self, features):
        super().__init__()
        self.scale = features ** 0.5
        self.gain = nn.Parameter(torch.ones(features))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gain


class BareUnitSphereRMSNorm(nn.Module):  # formula: rms_norm
    def __init__(self, features):
        super().__init__()
        self.scale = math.sqrt(features)

    def forward(self, x):
        return self.scale * F.normalize(x, p=2, dim=-1)


def l2_rms_norm(x, gain, dim: int):  # formula: rms_norm
    rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True) * dim ** -0.5
    return x / rms.clamp(min=1e-6) * gain


class CosineFeatures(nn.Module):  # lookalike: rms_norm
    """Unit vectors times a learned temperature: an L2 normalisation, not RMSNorm."""

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.temperature * self.gain


def l1_normalise_scaled(x, scale):  # lookalike: rms_norm
    return F.normalize(x, p=1, dim=-1) * scale


def unit_vectors_with_gain(x, gain):  # lookalike: rms_norm
    return F.normalize(x, dim=-1) * gain


def channel_mean_square_only(x, eps=1e-6):  # lookalike: rms_norm
    return x / (x.pow(2).mean(1, keepdim=True) + eps)


def channel_layer_norm_weighted(x, w, b, eps=1e-6):  # formula: layer_norm
    mu = x.mean(1, keepdim=True)
    var = (x - mu).pow(2).mean(1, keepdim=True)
    return w[:, None, None] * ((x - mu) * torch.rsqrt(var + eps)) + b[:, None, None]



class DualLayoutNorm(nn.Module):  # formula: layer_norm
    """The fused call serves channels-last input; channels-first input is normalised by
    hand over dim 1, a layout the fused call in the same method does not cover."""

    def forward(self, x):
        if self.channels_last:
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        mean = x.mean(1, keepdim=True)
        centred = x - mean
        var = centred.square().mean(1, keepdim=True)
        return self.weight[:, None, None] * centred / torch.sqrt(var + self.eps) + self.bias[:, None, None]


class LastDimFallbackNorm(nn.Module):  # lookalike: layer_norm
    """The hand-written form over the last dimension is the fallback of the fused call
    beside it: nothing to replace."""

    def forward(self, x):
        if self.use_fused:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5)
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class ScaledL2RMSNorm(nn.Module):  # formula: rms_norm
    """The L2 norm scaled by a factor __init__ computes from the size, eps as a floor."""

    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.scale = dim ** -0.5
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = torch.norm(x, dim=-1, keepdim=True) * self.scale
        return x / norm.clamp(min=self.eps) * self.g


class TemperatureL2Norm(nn.Module):  # lookalike: rms_norm
    """A learned temperature, not a function of the size: an L2 normalisation."""

    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(dim ** -0.5))
        self.eps = eps

    def forward(self, x):
        norm = torch.norm(x, dim=-1, keepdim=True) * self.scale
        return x / norm.clamp(min=self.eps)


class GatedScaledRMSNorm(nn.Module):  # formula: rms_norm
    """The norm kept in a local, then optionally gated by a sigmoid in the same method."""

    def __init__(self, dim, *, eps=1e-8, gated=False):
        super().__init__()
        self.eps = eps
        self.scale = dim ** -0.5
        self.gamma = nn.Parameter(torch.ones(dim))
        self.gate = nn.Parameter(torch.ones(dim)) if gated else None

    def forward(self, x):
        norm = x.norm(keepdim=True, dim=-1) * self.scale
        out = (x / norm.clamp(min=self.eps)) * self.gamma
        if self.gate is None:
            return out
        return out * (x * self.gate).sigmoid()


class AdditiveAttentionScores(nn.Module):  # lookalike: rms_norm
    # An L2 normalisation of scores that a stored size factor multiplies *inside*: the
    # factor cancels out; this is no RMSNorm with a weight (SwiftFormer).
    def __init__(self, dim):
        super().__init__()
        self.w_g = nn.Parameter(torch.randn(dim, 1))
        self.scale_factor = dim ** -0.5

    def forward(self, query):
        return F.normalize(query @ self.w_g * self.scale_factor, dim=1)
