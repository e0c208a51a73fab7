"""Rotary position embedding applied by hand, and position code that is not rotary."""

import torch
import torch.nn as nn
from einops import rearrange


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # formula: rotary
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rotate_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_chunk(t, cos, sin):  # formula: rotary
    return t * cos + rotate_half_chunk(t) * sin


def apply_rotary_emb(xq, xk, freqs_cis):  # formula: rotary
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_gptj(x, sin, cos):  # formula: rotary
    return (x * cos) + (rotate_every_two(x) * sin)


def rope_split_halves(x, cos, sin):  # formula: rotary
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):  # formula: rotary
    def forward(self, q, cos, sin):
        half = q.shape[-1] // 2
        q1, q2 = q[..., :half], q[..., half:]
        rotated = torch.cat((-q2, q1), dim=-1)
        return q * cos + rotated * sin


# ----------------------------------------------------------------------- look-alikes
def add_positions(x, pe):  # lookalike: rotary
    return x + pe[: x.size(1)]


def scale_without_rotation(x, cos, sin):  # lookalike: rotary
    return x * cos + x * sin


def concat_halves(x, cos):  # lookalike: rotary
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1, x2), dim=-1) * cos


def swap_halves(x):  # lookalike: rotary
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)


def sinusoidal_table(position, div_term):  # lookalike: rotary
    return torch.cat((torch.sin(position * div_term), torch.cos(position * div_term)), dim=-1)


def apply_partial_rotary(q, cos, sin, rotary_ndims):  # formula: rotary
    q_rot = q[..., :rotary_ndims]
    q_pass = q[..., rotary_ndims:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    return torch.cat((q_embed, q_pass), dim=-1)


# ----------------------------------------------------------------------- applied through a comprehension or a split cache
def _swap_halves(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary_for_each(tensors, cos, sin):  # formula: rotary
    """One rotation applied to a list of tensors (queries and keys) in a comprehension."""
    return [t * cos + _swap_halves(t) * sin for t in tensors]


def rotary_over_pair(q, k, cos, sin):  # formula: rotary
    return tuple(u * cos + _swap_halves(u) * sin for u in (q, k))


def rotary_from_stacked_cache(x, cache):  # formula: rotary
    """cos and sin kept side by side in one cache and split on the way in."""
    cos, sin = cache.unsqueeze(1).chunk(2, dim=-1)
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    turned = torch.stack((-odd, even), dim=-1).flatten(-2)
    return x * cos + turned * sin


def scaled_each(tensors, gain, shift):  # lookalike: rotary
    """Another linear map per element of a comprehension: no rotation."""
    return [t * gain + _swap_halves(shift) for t in tensors]


def gated_from_stacked(x, cache):  # lookalike: rotary
    """A cache split in two, used as a gate and a bias: no rotation of x."""
    gate, bias = cache.chunk(2, dim=-1)
    return x * torch.sigmoid(gate) + bias


# ----------------------------------------------------------------------- einops, map and writes into a new tensor
def rotate_pairs_einops(x):
    x = rearrange(x, "... (d j) -> ... d j", j=2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return rearrange(x, "... d j -> ... (d j)")


def rotary_map_lambda(q, k, pos_emb):  # formula: rotary
    """The pair rotation written with einops, applied to q and k through map."""
    sin, cos = pos_emb
    q, k = map(lambda t: (t * cos) + (rotate_pairs_einops(t) * sin), (q, k))
    return q, k


def rotary_written_into_empty(hidden_states, freqs):  # formula: rotary
    """Even and odd lanes written into a new tensor, cos and sin split from one cache."""
    x_1, x_2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs.unsqueeze(-2).chunk(2, dim=-1)
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x_1 * cos[..., 0::2] - x_2 * sin[..., 1::2]
    out[..., 1::2] = x_1 * sin[..., 1::2] + x_2 * cos[..., 0::2]
    return out.type_as(hidden_states)


def lanes_scaled_into_empty(hidden_states, gains):  # lookalike: rotary
    """Even and odd lanes written into a new tensor, each scaled: no rotation."""
    x_1, x_2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    a, b = gains.unsqueeze(-2).chunk(2, dim=-1)
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x_1 * a[..., 0::2]
    out[..., 1::2] = x_2 * b[..., 1::2]
    return out


def pairs_mapped_without_rotation(q, k, pos_emb):  # lookalike: rotary
    """The same map and einops regrouping, with the pairs kept in place: a scaling."""
    gain, bias = pos_emb
    q, k = map(lambda t: t * gain + rearrange(rearrange(t, "... (d j) -> ... d j", j=2), "... d j -> ... (d j)") * bias,
               (q, k))
    return q, k


class PairFlipRotary(nn.Module):  # formula: rotary
    """Pairs swapped with a flip and the sign folded into the stored sine table: no
    cos or sin names, factors sliced out of buffers with new axes around them."""

    def rotary(self, x_BTHD):
        factor1, factor2 = (
            self.factor1[None, : x_BTHD.size(-3), None, :],
            self.factor2[None, : x_BTHD.size(-3), None, :],
        )
        x_flip = x_BTHD.view(*x_BTHD.shape[:-1], x_BTHD.shape[-1] // 2, 2).flip(-1).view(x_BTHD.shape)
        return factor1 * x_BTHD + factor2 * x_flip


def _rotate_half_into(x):
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    out[..., :half] = -x[..., half:]
    out[..., half:] = x[..., :half]
    return out


def rotary_through_alias(query, cos, sin, use_half=True):  # formula: rotary
    """The rotation picked into a local by a branch, then called through it."""
    if use_half:
        rotate_fn = _rotate_half_into
    else:
        rotate_fn = _swap_halves
    return (query * cos) + (rotate_fn(query) * sin)


class ReversedMix(nn.Module):  # lookalike: rotary
    """Features mixed with their reversal (a flip of the whole last dimension): no
    rotation of pairs or halves."""

    def forward(self, x):
        return self.a[None, :, None, :] * x + self.b[None, :, None, :] * x.flip(-1)


# ----------------------------------------------------------------------- pair maps that are not rotations
def reflect_pairs(x, c, s):  # lookalike: rotary
    """[c s; s -c] on each half pair: a reflection (determinant -1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c + x2 * s, x1 * s - x2 * c), dim=-1)


def symmetric_pair_mix(x, alpha, beta):  # lookalike: rotary
    """[a b; b a]: both members mixed with the same sign."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * alpha + x2 * beta, x2 * alpha + x1 * beta), dim=-1)


def hyperbolic_boost(x, rapidity):  # lookalike: rotary
    """cosh and sinh with the halves swapped: a Lorentz boost."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * torch.cosh(rapidity) + torch.cat((x2, x1), dim=-1) * torch.sinh(rapidity)


def shear_pairs(x, k):  # lookalike: rotary
    """[1 k; 0 1] on interleaved pairs."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even + k * odd, odd), dim=-1).flatten(-2)


def complex_product_of_features(x, y):  # lookalike: rotary
    """The complex product of two feature tensors (a bilinear score), not a rotation."""
    zx = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    zy = torch.view_as_complex(y.float().reshape(*y.shape[:-1], -1, 2))
    return torch.view_as_real(zx * zy).flatten(-2)


def rotate_back(x, cos, sin):  # formula: rotary
    """A rotation by -theta: the sine enters with the other sign."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def rope_from_complex_parts(x, cos, sin):  # formula: rotary
    """The rotation assembled with torch.complex from a cosine and a sine table."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_cis = torch.complex(cos.float(), sin.float())
    return torch.view_as_real(z * freqs_cis).flatten(-2).type_as(x)


def rope_from_angles_complex(x, angles):  # formula: rotary
    rot = torch.complex(torch.cos(angles), torch.sin(angles))
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * rot).flatten(-2).type_as(x)


def rope_map_sequence_axes(xq, xk, freqs_cis):  # formula: rotary
    """Frequencies per position, broadcast over batch and heads by new axes."""
    return map(
        lambda t: torch.view_as_real(
            torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2)) * freqs_cis[None, :, None, :]
        ).flatten(3).type_as(t),
        (xq, xk),
    )


class LearnedComplexGain(nn.Module):  # lookalike: rotary
    """A learned complex gain per channel pair: its magnitude is not one."""

    def __init__(self, dim):
        super().__init__()
        self.re = nn.Parameter(torch.ones(dim // 2))
        self.im = nn.Parameter(torch.zeros(dim // 2))

    def forward(self, x):
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * torch.complex(self.re, self.im)).flatten(-2).type_as(x)


def complex_gain_named_parts(x, gain_real, gain_imag):  # lookalike: rotary
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * torch.complex(gain_real, gain_imag)).flatten(-2)


def apply_rope_stacked_cache(x, rope_cache):  # formula: rotary
    """cos and sin stacked in the cache's last dimension, viewed to broadcast over batch
    and heads with sizes read from the input."""
    T = x.size(1)
    rope_cache = rope_cache[:T]
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    return x_out.flatten(3).type_as(x)


def pair_gain(x, gain):  # lookalike: rotary
    """A learned complex gain per channel pair in real arithmetic, viewed to broadcast."""
    xs = x.reshape(*x.shape[:-1], -1, 2)
    g = gain.view(1, 1, 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * g[..., 0] - xs[..., 1] * g[..., 1],
                       xs[..., 1] * g[..., 0] + xs[..., 0] * g[..., 1]], -1)
    return out.flatten(3)


class CachedRoPE(nn.Module):  # formula: rotary
    """A stacked cos/sin cache, cut to the sequence or indexed by positions, viewed with
    a leading -1."""

    def forward(self, x, input_pos=None):
        rope_cache = self.cache[: x.size(1)] if input_pos is None else self.cache[input_pos]
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xs.size(1), 1, xs.size(3), 2)
        out = torch.stack([xs[..., 0] * rope_cache[..., 0] - xs[..., 1] * rope_cache[..., 1],
                           xs[..., 1] * rope_cache[..., 0] + xs[..., 0] * rope_cache[..., 1]], -1)
        return out.flatten(3).type_as(x)


def rope_one_buffer(x, cache):  # formula: rotary
    """cos and sin side by side in one buffer, sliced apart after a view."""
    head_dim = x.size(-1)
    rope_cache = cache.view(-1, x.size(1), 1, head_dim * 2)
    cos, sin = rope_cache[..., :head_dim], rope_cache[..., head_dim:]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def mix_one_buffer(x, table):  # lookalike: rotary
    """Two learned tables side by side: a per-channel scale and a half-swap mix."""
    width = x.size(-1)
    t = table.view(-1, x.size(1), 1, width * 2)
    a, b = t[..., :width], t[..., width:]
    x1, x2 = x[..., : width // 2], x[..., width // 2:]
    return x * a + torch.cat((-x2, x1), dim=-1) * b


class SlicedCacheRoPE:  # formula: rotary
    """cos and sin sliced from one cache; the half rotation a staticmethod called by
    the class's name."""

    @staticmethod
    def apply_rotary_emb(query, key, rope_cache):
        head_dim = query.shape[-1]
        cos = rope_cache[..., :head_dim]
        sin = rope_cache[..., head_dim:]
        query_f = query.float()
        return ((query_f * cos) + (SlicedCacheRoPE._rotate_half(query_f) * sin)).type_as(query)

    @staticmethod
    def _rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)
