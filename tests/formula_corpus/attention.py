"""Softmax and scaled dot-product attention written by hand, and look-alikes."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange, repeat
from torch.nn.functional import scaled_dot_product_attention as fused_attention


def softmax_stable(x):  # formula: softmax
    e = torch.exp(x - x.max(dim=-1, keepdim=True)[0])
    return e / e.sum(dim=-1, keepdim=True)


def softmax_naive(x):  # formula: softmax
    return torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)


def softmax_logsumexp(x):  # formula: softmax
    return torch.exp(x - torch.logsumexp(x, dim=-1, keepdim=True))


def softmax_rows(x):  # formula: softmax
    return x.exp() / x.exp().sum(1, keepdim=True)


class TemperatureSoftmax(nn.Module):  # formula: softmax
    def forward(self, logits):
        z = logits / self.temperature
        z = z - z.amax(-1, keepdim=True)
        p = z.exp()
        return p / p.sum(-1, keepdim=True)


def softmax_values(scores):  # formula: softmax
    shifted = scores - scores.max(-1, keepdim=True).values
    return shifted.exp() / shifted.exp().sum(-1, keepdim=True)


class CausalSelfAttention(nn.Module):  # formula: attention
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class BertSelfAttention(nn.Module):  # formula: attention
    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        return context_layer


def scaled_dot_product(q, k, v):  # formula: attention
    d_k = q.size(-1)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, v)


class EinsumAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v):
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        return torch.einsum("bhij,bhjd->bhid", attn, v)


def bmm_attention(q, k, v):  # formula: attention
    d = q.shape[-1]
    w = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d)
    w = torch.softmax(w, dim=-1)
    return torch.bmm(w, v)


class VitAttention(nn.Module):  # formula: attention
    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = attn @ v
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class T5StyleAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v, position_bias):
        scores = torch.matmul(q, k.transpose(3, 2))
        scores += position_bias
        attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = F.dropout(attn_weights, p=self.dropout, training=self.training)
        return torch.matmul(attn_weights, v)


class LlamaStyleAttention(nn.Module):  # formula: attention
    def forward(self, xq, keys, values, mask=None):
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        return output.transpose(1, 2).contiguous()


def einsum_bsnd_attention(q, k, v, scale):  # formula: attention
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def attention_one_line(q, k, v):  # formula: attention
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def masked_attention(q, k, v, mask):  # formula: attention
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores.softmax(-1) @ v


# ----------------------------------------------------------------------- look-alikes
def normalise_by_sum(x):  # lookalike: softmax
    return x / x.sum(-1, keepdim=True)


def log_softmax_by_hand(x):  # lookalike: softmax
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


def sigmoid_by_hand(x):  # lookalike: softmax
    return 1.0 / (1.0 + torch.exp(-x))


def softmax_over_everything(x):  # lookalike: softmax
    return torch.exp(x) / torch.exp(x).sum()


def masked_exp_norm(x, m):  # lookalike: softmax
    e = torch.exp(x) * m
    return e / e.sum(-1, keepdim=True)


def softmax_fused(x):  # lookalike: softmax
    return torch.softmax(x, dim=-1)


def sdpa_already(q, k, v):  # lookalike: attention
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def softmax_over_queries(q, k, v):  # lookalike: attention
    return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v


def classifier_mixture(x, w, v):  # lookalike: attention
    return torch.softmax(x @ w, dim=-1) @ v


def sigmoid_attention(q, k, v):  # lookalike: attention
    return torch.sigmoid(q @ k.transpose(-2, -1)) @ v


def linear_attention(q, k, v):  # lookalike: attention
    q = q.softmax(dim=-1)
    k = k.softmax(dim=-2)
    context = k.transpose(-2, -1) @ v
    return q @ context


class GPT2StyleAttention(nn.Module):  # formula: attention
    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = self.attn_dropout(attn_weights)
        if head_mask is not None:
            attn_weights = attn_weights * head_mask
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights


class WhisperStyleAttention(nn.Module):  # formula: attention
    def qkv_attention(self, q, k, v, mask=None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1) * scale
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = q @ k
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        qk = qk.float()
        w = F.softmax(qk, dim=-1).to(q.dtype)
        return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)


def eager_attention_forward(module, query, key_states, value_states, attention_mask, scaling, dropout=0.0):  # formula: attention
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output


def softmax_inplace_divide(logits):  # formula: softmax
    probs = torch.exp(logits - logits.max())
    probs /= probs.sum(-1, keepdim=True)
    return probs


def softmax_div_method(scores):  # formula: softmax
    return scores.exp().div(scores.exp().sum(-1, keepdim=True))


class WindowAttention(nn.Module):  # formula: attention
    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn + self.relative_position_bias.unsqueeze(0)
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)
        return (attn @ v).transpose(1, 2).reshape(B_, N, C)


class CrossAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v):
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        return torch.einsum("b i j, b j d -> b i d", attn, v)


class DistilBertStyleAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v, mask, head_mask=None):
        q = q / math.sqrt(self.dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))
        mask = (mask == 0).view(self.mask_reshp).expand_as(scores)
        scores = scores.masked_fill(mask, torch.tensor(torch.finfo(scores.dtype).min))
        weights = nn.functional.softmax(scores, dim=-1)
        weights = self.dropout(weights)
        if head_mask is not None:
            weights = weights * head_mask
        return torch.matmul(weights, v)


def softmax_module_inline(scores, v):  # formula: attention
    return nn.Softmax(dim=-1)(scores @ v.transpose(-2, -1)) @ v


class ClipStyleAttention(nn.Module):  # formula: attention
    def forward(self, query_states, key_states, value_states):
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        return torch.bmm(attn_probs, value_states)


class FlashOrManualAttention(nn.Module):  # lookalike: attention
    def forward(self, q, k, v):
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = F.softmax(att, dim=-1)
            y = att @ v
        return y


class LevitStyleAttention(nn.Module):  # formula: attention
    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, self.num_heads, -1).split([self.key_dim, self.key_dim, self.val_dim], dim=3)
        q = q.permute(0, 2, 1, 3)
        k = k.permute(0, 2, 3, 1)
        v = v.permute(0, 2, 1, 3)
        attn = q @ k * self.scale + self.attention_bias
        attn = attn.softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(B, N, self.val_attn_dim)


class SoftcappedAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v, mask):
        q = q * self.scaling
        scores = torch.matmul(q, k.transpose(2, 3))
        if self.attn_logit_softcapping is not None:
            scores = scores / self.attn_logit_softcapping
            scores = torch.tanh(scores)
            scores = scores * self.attn_logit_softcapping
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        return torch.matmul(scores, v)


# ----------------------------------------------------------------------- einsum equations built from pieces
HEADS_FIRST = "b h i d, b h j d -> b h i j"


class FStringEinsumAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v):
        kv_eq = "b h j d"
        sim = torch.einsum(f"b h i d, {kv_eq} -> b h i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        return torch.einsum(f"b h i j, {kv_eq} -> b h i d", attn, v)


def constant_equation_attention(q, k, v, scale):  # formula: attention
    sim = torch.einsum(HEADS_FIRST, q, k) * scale
    attn = F.softmax(sim, dim=-1)
    return torch.einsum("b h i j, " + "b h j d -> b h i d", attn, v)


class RuntimeEquationAttention(nn.Module):  # lookalike: attention
    """The equation is chosen at run time: not read, so nothing is claimed."""

    def forward(self, q, k, v):
        sim = torch.einsum(self.qk_equation, q, k) * self.scale
        attn = sim.softmax(dim=-1)
        return torch.einsum(f"{self.av_lhs} -> b h i d", attn, v)


# ----------------------------------------------------------------------- scores from baddbmm
class NeoXStyleAttention(nn.Module):  # formula: attention
    def _attn(self, query, key, value, attention_mask=None):
        batch_size, num_attention_heads, query_length, attn_head_size = query.size()
        key_length = key.size(-2)
        query = query.view(batch_size * num_attention_heads, query_length, attn_head_size)
        key = key.view(batch_size * num_attention_heads, key_length, attn_head_size)
        attn_scores = torch.zeros(
            batch_size * num_attention_heads, query_length, key_length, dtype=query.dtype, device=key.device
        )
        attn_scores = torch.baddbmm(
            attn_scores, query, key.transpose(1, 2), beta=1.0, alpha=1.0 / math.sqrt(attn_head_size)
        )
        attn_scores = attn_scores.view(batch_size, num_attention_heads, query_length, key_length)
        attn_weights = nn.functional.softmax(attn_scores, dim=-1)
        return torch.matmul(attn_weights, value)


class EmptyBaddbmmAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v):
        bh, s, d = q.shape
        scores = torch.empty(bh, s, k.shape[1], dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(scores, q, k.transpose(-1, -2), beta=0, alpha=self.scale)
        probs = scores.softmax(dim=-1)
        return torch.bmm(probs, v)


class AlibiBaddbmmAttention(nn.Module):  # formula: attention
    def forward(self, query_layer, key_layer, value_layer, alibi):
        scores = alibi.baddbmm(batch1=query_layer, batch2=key_layer.transpose(-1, -2), beta=self.beta,
                               alpha=self.inv_norm_factor)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query_layer.dtype)
        return torch.bmm(probs, value_layer)


class BaddbmmWithoutSoftmax(nn.Module):  # lookalike: attention
    """Scores from baddbmm, but no softmax: a linear attention, not SDPA."""

    def forward(self, q, k, v, bias):
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=self.scale)
        return torch.bmm(scores, v)


# ----------------------------------------------------------------------- softmax kept in an attribute
class PatchAttention(nn.Module):  # formula: attention
    def __init__(self, width, heads=8, head_width=64):
        super().__init__()
        self.heads = heads
        self.scale = head_width ** -0.5
        self.attend = nn.Softmax(dim=-1)
        self.to_qkv = nn.Linear(width, heads * head_width * 3, bias=False)

    def forward(self, tokens):
        parts = self.to_qkv(tokens).chunk(3, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads), parts)
        logits = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        return torch.einsum("b h i j, b h j d -> b h i d", self.attend(logits), v)


class SoftmaxFunctionAttribute(nn.Module):  # formula: attention
    def __init__(self, head_width):
        super().__init__()
        self.temperature_inv = 1.0 / math.sqrt(head_width)
        self.normaliser = F.softmax

    def forward(self, q, k, v):
        logits = torch.matmul(q, k.transpose(-2, -1)) * self.temperature_inv
        weights = self.normaliser(logits, dim=-1)
        return torch.matmul(weights, v)


class TorchSoftmaxAttribute(nn.Module):  # formula: attention
    def __init__(self):
        super().__init__()
        self.weights_of = torch.softmax

    def forward(self, q, k, v):
        return self.weights_of(q @ k.mT / math.sqrt(q.shape[-1]), -1) @ v


class SoftmaxOverQueriesModule(nn.Module):  # lookalike: attention
    """The softmax module normalises over the query axis, not the keys."""

    def __init__(self):
        super().__init__()
        self.attend = nn.Softmax(dim=-2)

    def forward(self, q, k, v):
        return torch.matmul(self.attend(torch.matmul(q, k.transpose(-1, -2)) * 0.125), v)


class SoftmaxAttributeOverHeads(nn.Module):  # lookalike: attention
    def __init__(self):
        super().__init__()
        self.normaliser = F.softmax

    def forward(self, q, k, v):
        return self.normaliser(q @ k.transpose(-2, -1), dim=1) @ v


class SoftmaxModuleWithoutDim(nn.Module):  # lookalike: attention
    """nn.Softmax() with no dim picks one by rank at run time: not read."""

    def __init__(self):
        super().__init__()
        self.attend = nn.Softmax()

    def forward(self, q, k, v):
        return self.attend(q @ k.transpose(-2, -1)) @ v


# ----------------------------------------------------------------------- keys that arrive transposed
def attention_with_transposed_keys(q, k_t, v, scale):  # formula: attention
    # k_t: (batch, heads, head_dim, keys), transposed by the caller
    logits = q.matmul(k_t) * scale
    return torch.softmax(logits, dim=-1).matmul(v)


def bmm_with_key_columns(query, key, value):  # formula: attention
    weights = torch.softmax(torch.bmm(query, key) / math.sqrt(query.size(-1)), dim=-1)
    return torch.bmm(weights, value)


def mixture_of_prototypes(h, prototypes, values):  # lookalike: attention
    return torch.softmax(h.matmul(prototypes), dim=-1).matmul(values)


def transposed_keys_over_queries(q, k_t, v):  # lookalike: attention
    return torch.softmax(q @ k_t, dim=-2) @ v


# ----------------------------------------------------------------------- bmm scores with a boolean mask
def bmm_masked_attention(q, k, v, keep):  # formula: attention
    scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.bmm(scores.softmax(-1), v)


class HeadsViewedMaskedAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v, pad):
        scores = torch.bmm(q, k.transpose(-1, -2)) * self.scale
        scores = scores.view(-1, self.n_heads, scores.size(-2), scores.size(-1))
        scores = scores.masked_fill(pad, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        return torch.bmm(probs.view(-1, probs.size(-2), probs.size(-1)), v)


# ----------------------------------------------------------------------- fused call imported by name
class ImportedFusedOrManual(nn.Module):  # lookalike: attention
    """A fallback next to SDPA imported by its own name (called bare)."""

    def forward(self, q, k, v):
        if self.use_fused:
            return fused_attention(q, k, v)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
        return w @ v



# ----------------------------------------------------------------------- other layouts
class SharedKeyValueAttention(nn.Module):  # formula: attention
    """Multi-query attention: every query head reads the same single key/value head."""

    def forward(self, x):
        q = self.split_heads(self.to_q(x))
        k, v = self.to_kv(x).chunk(2, dim=-1)
        logits = torch.einsum("b h i d, b j d -> b h i j", q * self.scale, k)
        weights = logits.softmax(dim=-1)
        return torch.einsum("b h i j, b j d -> b h i d", weights, v)


def channels_first_attention(qkv, heads):  # formula: attention
    """Heads folded into the batch, channels before positions: (B * H, C, T)."""
    bs, width, length = qkv.shape
    ch = width // (3 * heads)
    q, k, v = qkv.reshape(bs * heads, ch * 3, length).split(ch, dim=1)
    factor = 1 / math.sqrt(math.sqrt(ch))
    w = torch.einsum("bct,bcs->bts", q * factor, k * factor)
    w = torch.softmax(w.float(), dim=-1).type(w.dtype)
    return torch.einsum("bts,bcs->bct", w, v).reshape(bs, -1, length)


class ChannelsFirstHeadsAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v):
        sim = torch.einsum("b h d i, b h d j -> b h i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        return torch.einsum("b h i j, b h d j -> b h i d", attn, v)


class ScaledBaddbmmAttention(nn.Module):  # formula: attention
    """Scores made by baddbmm into an empty buffer (beta=0), the scale as alpha."""

    def forward(self, query, key, value):
        buffer = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype)
        scores = torch.baddbmm(buffer, query, key.transpose(-1, -2), beta=0, alpha=self.scale)
        probs = scores.softmax(dim=-1)
        return torch.bmm(probs, value)


def linear_attention_channels_first(q, k, v):  # lookalike: attention
    """Softmax over the features of q and the positions of k, no score matrix."""
    q = q.softmax(dim=-2)
    k = k.softmax(dim=-1)
    context = torch.einsum("b h d n, b h e n -> b h d e", k, v)
    return torch.einsum("b h d e, b h d n -> b h e n", context, q)


def pooled_context(x, logits):  # lookalike: attention
    """Softmax-weighted pooling of the positions: one context vector per head."""
    return torch.einsum("b i n, b c n -> b c i", logits.softmax(dim=-1), x)


def baddbmm_bias_then_scale(bias, q, k, v):  # lookalike: attention
    """alpha scales the product and beta keeps a bias: the scores are not q @ k^T times a scale plus nothing,
    and the weights are normalised over the queries."""
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=0.125)
    return torch.bmm(scores.softmax(dim=-2), v)


# ----------------------------------------------------------------------- chunked (memory-efficient) attention
def summarise_block(q, k, v, bias):  # formula: attention
    """One key block of a memory-efficient attention: the numerator, its row sums and
    the row maxima, merged across blocks by the caller."""
    scores = torch.matmul(q, k.transpose(-1, -2)) + bias
    top = scores.amax(dim=-1, keepdim=True).detach()
    numer = torch.exp(scores - top)
    return torch.matmul(numer, v), numer.sum(dim=-1), top


def merge_blocks(values, sums, maxima):  # lookalike: attention
    """The merge of the blocks: rescaled by exp(max - global max), no scores."""
    overall = maxima.amax(dim=0, keepdim=True)
    factor = torch.exp(maxima - overall)
    values = values * factor.unsqueeze(-1)
    sums = sums * factor
    return values.sum(dim=0) / sums.sum(dim=0).unsqueeze(-1)


def exp_kernel_features(q, k, v):  # lookalike: attention
    """exp of each feature (a positive random-feature map), not of the scores."""
    return torch.exp(q) @ (torch.exp(k).transpose(-1, -2) @ v)


# ----------------------------------------------------------------------- a causal mask made as a boolean triangle
class BoolTriangleCausalAttention(nn.Module):  # formula: attention
    def forward(self, q, k, v):
        T = q.size(-2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).type_as(q)
        return torch.matmul(probs, v)


def triangle_cast_mask_attention(q, k, v):  # formula: attention
    n = q.shape[-2]
    blocked = torch.ones(n, n, device=q.device).triu(1).to(torch.bool)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return scores.masked_fill(blocked, float("-inf")).softmax(dim=-1) @ v


# ----------------------------------------------------------------------- a causal mask compared or negated inline
def tril_compared_mask_attention(q, k, v):  # formula: attention
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    mask = torch.tril(torch.ones(T, T, device=q.device))
    att = att.masked_fill(mask == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


class NegatedTriangleAttention(nn.Module):  # formula: attention
    def forward(self, query, key, value):
        L = query.shape[-2]
        keep = torch.ones(L, L, dtype=torch.bool, device=query.device).tril()
        weights = (query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])).masked_fill(~keep, -1e9)
        return weights.softmax(-1) @ value


def where_compared_mask_attention(q, k, v):  # formula: attention
    n = q.shape[-2]
    causal = torch.tril(torch.ones(n, n, device=q.device))
    scores = torch.where(causal > 0, q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# ----------------------------------------------------------------------- a mask cut to a length given as an argument
def sliced_buffer_attention(q, k, v, bias, T):  # formula: attention
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def sliced_matrix_mask_attention(q, k, v, mask, seq_len):  # formula: attention
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(mask[:seq_len, :seq_len] == 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# ----------------------------------------------------------------------- einops layouts and map
def l2norm(t):
    return F.normalize(t, dim=-1)


class NormedPerceiverAttention(nn.Module):  # formula: attention
    """Keys and values from one projection split in two, heads split by einops through
    map, queries and keys l2-normalised by a helper applied with map."""

    def forward(self, x, latents):
        h = self.heads
        q = self.to_q(latents)
        k, v = self.to_kv(torch.cat((x, latents), dim=-2)).chunk(2, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=h), (q, k, v))
        q, k = map(l2norm, (q, k))
        sim = torch.einsum("... i d, ... j d -> ... i j", q * self.q_scale, k * self.k_scale) * self.scale
        attn = sim.softmax(dim=-1)
        out = torch.einsum("... i j, ... j d -> ... i d", attn, v)
        return rearrange(out, "b h n d -> b n (h d)")


class SharedKeyAttention(nn.Module):  # formula: attention
    """One key/value head shared by every query head; q, k and v unpacked from a tuple
    that spreads a split into it."""

    def forward(self, x):
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q = rearrange(q, "b n (h d) -> b h n d", h=self.heads)
        sim = torch.einsum("b h i d, b j d -> b h i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class NullKeyCosineAttention(nn.Module):  # formula: attention
    """One shared key/value head with a learned null key and value put in front (each
    unbound from one parameter, repeated by einops through map), queries and keys
    l2-normalised and scaled (an RMSNorm of its own), weights softmaxed in float32."""

    def forward(self, x):
        b = x.shape[0]
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q = rearrange(q, "b n (h d) -> b h n d", h=self.heads)
        nk, nv = map(lambda t: repeat(t, "d -> b 1 d", b=b), self.null_kv.unbind(dim=-2))
        k = torch.cat((nk, k), dim=-2)
        v = torch.cat((nv, v), dim=-2)
        q, k = map(l2norm, (q, k))
        q = q * self.q_scale
        k = k * self.k_scale
        sim = torch.einsum("b h i d, b j d -> b h i j", q, k) * self.scale
        attn = sim.softmax(dim=-1, dtype=torch.float32).to(sim.dtype)
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        return rearrange(out, "b h n d -> b n (h d)")


class EinopsPooling(nn.Module):  # lookalike: attention
    """Heads split by einops, then a softmax over positions pools the values with
    learned logits: no query or key."""

    def forward(self, x):
        logits = rearrange(self.to_logits(x), "b n h -> b h n")
        weights = logits.softmax(dim=-1)
        values = rearrange(self.to_v(x), "b n (h d) -> b h n d", h=self.heads)
        return torch.einsum("b h n, b h n d -> b h d", weights, values)


def chunk_summary_heads_middle(query, key, value):  # formula: attention
    """One key chunk of a memory-efficient attention with heads between positions and
    features ('...qhd'): exp of the shifted scores times the values (written first in
    the equation), the sums and maxima kept for the merge."""
    attn_weights = torch.einsum("...qhd,...khd->...qhk", query, key)
    max_score, _ = torch.max(attn_weights, -1, keepdim=True)
    max_score = max_score.detach()
    exp_weights = torch.exp(attn_weights - max_score)
    exp_values = torch.einsum("...vhf,...qhv->...qhf", value, exp_weights)
    return exp_values, exp_weights.sum(dim=-1), torch.einsum("...qhk->...qh", max_score)


def value_weighted_by_exp_gate(value, gate_logits):  # lookalike: attention
    """Values written first and scaled by an exponential gate per head: no scores from
    a query and a key."""
    weights = torch.exp(gate_logits - gate_logits.amax(-1, keepdim=True))
    return torch.einsum("...vhf,...qhv->...qhf", value, weights)


# ----------------------------------------------------------------------- products with softmax weights that are not attention
def weights_transposed(q, k, v):  # lookalike: attention
    """The keys gather from the queries: the weights are used transposed."""
    attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return attn.transpose(-2, -1) @ v


def kept_without_renormalising(q, k, v, keep):  # lookalike: attention
    """Weights zeroed after the softmax and not renormalised."""
    attn = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)
    return (attn * keep) @ v


def complement_weights(q, k, v):  # lookalike: attention
    attn = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)
    return (1 - attn) @ v


def off_by_one_softmax_attention(q, k, v):  # lookalike: attention
    """A null slot in the denominator: exp(s - m) / (exp(-m) + sum exp(s - m))."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    m = s.amax(dim=-1, keepdim=True).clamp(min=0)
    e = torch.exp(s - m)
    return (e / (torch.exp(-m) + e.sum(dim=-1, keepdim=True))) @ v


def spatial_attention_values_first(q, k, v):  # formula: attention
    """Channel-first feature maps: the weights transposed and taken from the right of
    the values, as a VAE's attention block writes it."""
    b, c, h, w = q.shape
    q = q.reshape(b, c, h * w).permute(0, 2, 1)
    k = k.reshape(b, c, h * w)
    w_ = torch.bmm(q, k) * (int(c) ** (-0.5))
    w_ = F.softmax(w_, dim=2)
    v = v.reshape(b, c, h * w)
    out = torch.bmm(v, w_.permute(0, 2, 1))
    return out.reshape(b, c, h, w)


def spatial_attention_einsum_values_first(q, k, v):  # formula: attention
    b, c, h, w = q.shape
    q = rearrange(q, "b c h w -> b (h w) c")
    k = rearrange(k, "b c h w -> b c (h w)")
    w_ = torch.einsum("bij,bjk->bik", q, k) * (int(c) ** (-0.5))
    w_ = torch.nn.functional.softmax(w_, dim=2)
    v = rearrange(v, "b c h w -> b c (h w)")
    w_ = rearrange(w_, "b i j -> b j i")
    return torch.einsum("bij,bjk->bik", v, w_)


def values_times_untransposed_weights(q, k, v):  # lookalike: attention
    """The weights' rows contracted with the values' positions: not an attention."""
    b, c, n = q.shape
    w_ = torch.bmm(q.permute(0, 2, 1), k) * c ** -0.5
    w_ = F.softmax(w_, dim=2)
    return torch.bmm(v, w_)


# ----------------------------------------------------------------------- one query against every key, as a product summed
class ClassTokenAttention(nn.Module):  # formula: attention
    def __init__(self, dim, heads=8):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        cls = q[:, :, :1]
        weights = ((cls * k).sum(dim=-1) * self.scale).softmax(dim=-1)
        return (weights.unsqueeze(2) @ v).transpose(1, 2).reshape(B, 1, C)


def pooled_by_query_similarity(query, keys, values):  # lookalike: attention
    # The weights are cosine similarities normalised by their sum, not a softmax.
    sim = (query[:, None] * keys).sum(-1).relu()
    return (sim / sim.sum(-1, keepdim=True)).unsqueeze(1) @ values


def class_token_scores_by_first_key(q, k, v):  # lookalike: attention
    # Every query scored against the first key only: weights over the queries.
    scores = (q * k[:, :, :1]).sum(-1).softmax(dim=-1)
    return scores.unsqueeze(2) @ v


# ----------------------------------------------------------------------- a fused projection split along a dimension counted from the front
class FusedProjectionAttention(nn.Module):  # formula: attention
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.head_width = width // heads
        self.temperature = self.head_width ** -0.5
        self.project = nn.Linear(width, 3 * width)

    def forward(self, x):
        batch, length = x.shape[:2]
        q, k, v = self.project(x).chunk(3, dim=2)
        q = q.view(batch, length, self.heads, self.head_width).transpose(1, 2)
        k = k.view(batch, length, self.heads, self.head_width).transpose(1, 2)
        v = v.view(batch, length, self.heads, self.head_width).transpose(1, 2)
        weights = torch.softmax(q @ k.transpose(-1, -2) * self.temperature, dim=-1)
        return (weights @ v).transpose(1, 2).reshape(batch, length, -1)


def split_projection_normalised_over_queries(x):  # lookalike: attention
    # A fused projection split along dimension 2 as attention splits it, but the
    # softmax normalises each key's column over the queries: not attention weights.
    q, k, v = x.chunk(3, dim=2)
    return torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v


# ----------------------------------------------------------------------- heads folded into the batch by a count, from inputs that already hold them
class FoldedHeadsBiasedAttention(nn.Module):  # formula: attention
    def __init__(self, heads, head_width):
        super().__init__()
        self.heads = heads
        self.head_width = head_width
        self.inverse_root = head_width ** -0.5

    def forward(self, q, k, v, bias):
        # q, k, v: (batch, heads, length, head_width); bias: (batch * heads, 1, length)
        batch, _, length, _ = q.shape
        q = q.reshape(batch * self.heads, -1, self.head_width)
        k = k.reshape(batch * self.heads, -1, self.head_width).transpose(-1, -2)
        v = v.reshape(batch * self.heads, -1, self.head_width)
        scores = torch.baddbmm(bias, q, k, alpha=self.inverse_root)
        weights = F.softmax(scores.view(batch, self.heads, length, -1), dim=-1)
        return torch.bmm(weights.view(batch * self.heads, length, -1), v)
