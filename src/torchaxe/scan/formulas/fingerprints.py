"""Numeric fingerprints: which reference function, if any, a tree computes.

A root is evaluated once on the primary probe; every subtree that holds a relevant
operation is then compared with the references that fit its shape, largest subtree
first, and a subtree inside a match is not looked at again. A match must hold on the
confirmation probes too (another size, values up to |x| ~ 30, float32). Results are
cached by the root's normalised text and variable roles, so the same formula written
in many files is evaluated once per process.

Where a reference has parameters (a norm's eps, weight and bias, attention's scale,
rotary's cos and sin) they are fitted from the values and then identified with a
subtree (``self.weight``, ``1 + self.weight``) when one holds them.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any, Callable

import torch

from torchaxe.scan.formulas import prefilter as P
from torchaxe.scan.formulas import references as R
from torchaxe.scan.formulas import vocabulary as V
from torchaxe.scan.formulas.interpreter import Evaluator, broadcast_shape, is_tensor
from torchaxe.scan.formulas.ir import CONST, VAR, Node, walk
from torchaxe.scan.formulas.prefilter import dominator, dominators, ops_outside
from torchaxe.scan.formulas.probes import (
    CONFIRMATIONS, INT, PRIMARY, RESHAPES, SCALAR, Probe, data_vars, fitted_roles, fresh_full, half_width_roles,
    make_env, scalar_value, scalarish, single_count_roles, sized_count_roles, widened_roles,
)
from torchaxe.scan.formulas.store import Match

CATEGORIES = ("attention", "rotary", "swiglu", "glu", "layer_norm", "rms_norm", "softmax", "gelu_tanh", "gelu_erf",
              "quick_gelu", "silu", "mish")


# ------------------------------------------------------------------ probing
_ENV_CACHE: dict[tuple[Probe, str, str], Any] = {}


class Probing:
    """Values of one tree's nodes on one probe, and comparisons at its tolerance."""

    def __init__(self, roles: dict[str, str], probe: Probe):
        self.roles = roles
        self.probe = probe
        env = {}
        missing = {}
        for name, role in roles.items():
            key = (probe, name, role)
            if key in _ENV_CACHE:
                env[name] = _ENV_CACHE[key]
            else:
                missing[name] = role
        if missing:
            fresh = make_env(missing, probe)
            for name, value in fresh.items():
                _ENV_CACHE[(probe, name, missing[name])] = value
            env.update(fresh)
        if len(_ENV_CACHE) > 50_000:
            _ENV_CACHE.clear()
        self.env = env
        self.evaluator = Evaluator(env, fill=self._fill)
        self.float64 = probe.dtype == "float64"

    def _fill(self, node: Node, like: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.probe.seed * 7919 + zlib.crc32(node.key.encode())) & 0x7FFFFFFF)
        return torch.randn(like.shape, generator=g, dtype=like.dtype) * self.probe.sigma

    def tensor(self, node: Node) -> torch.Tensor | None:
        value = self.evaluator.value(node)
        return value if is_tensor(value) else None

    def value(self, node: Node) -> Any:
        return self.evaluator.value(node)

    def reevaluate(self, root: Node, overrides: dict[int, Any]) -> torch.Tensor | None:
        value = Evaluator(self.env, overrides, self._fill).value(root)
        return value if is_tensor(value) else None

    def fresh(self, like: torch.Tensor, salt: str) -> torch.Tensor:
        x = fresh_full(self.probe, salt)
        if x.shape != like.shape:
            g = torch.Generator().manual_seed(hash(salt) & 0xFFFF)
            x = torch.randn(like.shape, generator=g, dtype=like.dtype) * self.probe.sigma
        return x.to(like.dtype)

    def compare(self, cand: Any, ref: Any) -> tuple[bool, float, float]:
        """Whether ``cand`` equals ``ref`` to this probe's tolerance, with the max
        absolute and relative error."""
        if not isinstance(cand, torch.Tensor) or not isinstance(ref, torch.Tensor):
            return False, math.inf, math.inf
        if cand.shape != ref.shape:
            try:
                cand = cand.expand(ref.shape) if cand.numel() <= ref.numel() else cand
            except RuntimeError:
                return False, math.inf, math.inf
            if cand.shape != ref.shape:
                return False, math.inf, math.inf
        if cand.is_complex() or ref.is_complex():
            return False, math.inf, math.inf
        cand = cand.to(torch.float64)
        ref = ref.to(torch.float64)
        finite = torch.isfinite(ref)
        if not torch.equal(torch.isfinite(cand), finite) or not bool(finite.any()):
            return False, math.inf, math.inf
        if not bool(finite.all()):
            if not torch.equal(cand[~finite], ref[~finite]) and not bool(torch.isnan(ref[~finite]).all()):
                return False, math.inf, math.inf
            cand, ref = cand[finite], ref[finite]
        diff = (cand - ref).abs()
        magnitude = ref.abs()
        top = float(magnitude.max())
        # Relative where the reference is large, absolute where it is small: 1e-4
        # accepts constants truncated to four digits (0.7978 for sqrt(2/pi), 3e-5)
        # and still tells the tanh GELU from the erf GELU (5e-4 apart).
        tol = 1e-4 if self.float64 else 2e-4
        ok = bool((diff <= tol * magnitude.clamp_min(1.0)).all())
        max_abs = float(diff.max())
        return ok, max_abs, max_abs / max(top, 1e-30)


# ------------------------------------------------------------------ tree helpers
def depends_on(root: Node, target: Node) -> set[int]:
    """Ids of the nodes under ``root`` whose value depends on ``target``."""
    dep: set[int] = set()
    for node in walk(root):
        if node is target or any(id(c) in dep for c in node.children()):
            dep.add(id(node))
    return dep


def _float_constants(node: Node) -> list[tuple[float, Node]]:
    return [(n.value, n) for n in walk(node) if n.op == CONST and isinstance(n.value, float) and 0.0 < n.value < 0.5]


def _reduced(root: Node) -> set[int]:
    """The nodes a reduction of ``root`` reads: what they compute is normalised, not a
    weight or factor of the result (the factor in ``F.normalize(q @ w * self.scale,
    dim=1)`` cancels out whatever its value)."""
    return {id(n) for r in walk(root) if r.op in V.REDUCTIONS for n in walk(r)}


def _identify(probing: Probing, root: Node, avoid: Node, target: torch.Tensor, neutral: float) -> tuple[str, Node | None] | None:
    """Which subtree of ``root`` (not depending on ``avoid``) holds ``target``, a
    per-channel vector: ``("none", None)`` when it is the neutral value, ``("node",
    n)`` when a subtree holds it, ``None`` when nothing does."""
    if probing.compare(target, torch.full_like(target, neutral))[0]:
        return "none", None
    dependent = depends_on(root, avoid)
    reduced = _reduced(root)
    size = target.numel()
    for node in sorted(walk(root), key=lambda n: n.size):
        if id(node) in dependent or not node.vars or id(node) in reduced:
            continue
        value = probing.value(node)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = torch.full_like(target, float(value))
        if not isinstance(value, torch.Tensor) or value.is_complex() or value.numel() not in (1, size):
            continue
        if probing.compare(value.reshape(-1).expand(size).to(target.dtype), target)[0]:
            return "node", node
    return None


def _scalar(probing: Probing, node: Node | None, size: int) -> bool:
    """Whether a norm's weight or bias is one number, not a vector over the channels."""
    if node is None or size == 1:
        return False
    value = probing.value(node)
    return not isinstance(value, torch.Tensor) or value.numel() == 1


_FACTOR_NAMES = re.compile(r"scale|dim|size", re.IGNORECASE)


def _named_factor(node: Node) -> bool:
    """A stored square root of a size: ``self.scale``, ``dim ** -0.5``, ``math.sqrt(d)``."""
    while node.op == "cast" and node.args:
        node = node.args[0]
    if node.op == VAR:
        return bool(_FACTOR_NAMES.search(node.value.rsplit(".", 1)[-1].split("@", 1)[0]))
    if node.op == "pow" and len(node.args) == 2 and node.args[1].op == CONST:
        return node.args[1].value in (0.5, -0.5)
    return node.op in ("math_sqrt", "sqrt", "rsqrt")


# ------------------------------------------------------------------ matchers
class Matcher:
    categories: tuple[str, ...] = ()

    def precheck(self, node: Node) -> bool:
        raise NotImplementedError

    def check(self, node: Node, probing: Probing, allowed: frozenset[str]) -> Match | None:
        raise NotImplementedError


_UNARY: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor], str], ...] = (
    ("gelu_tanh", R.gelu_tanh, "0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3)))"),
    ("gelu_erf", R.gelu_erf, "0.5*x*(1 + erf(x/sqrt(2)))"),
    ("quick_gelu", R.quick_gelu, "x*sigmoid(1.702*x)"),
    ("silu", R.silu, "x*sigmoid(x)"),
    ("mish", R.mish, "x*tanh(softplus(x))"),
)


class ActivationMatcher(Matcher):
    """GELU (tanh and erf), quick GELU, SiLU and Mish written out elementwise."""

    categories = tuple(c for c, _, _ in _UNARY)

    def precheck(self, node: Node) -> bool:
        return P.activation(node)

    def check(self, node, probing, allowed):
        x_node = P.activation_input(node)
        if x_node is None:
            return None
        y, x = probing.tensor(node), probing.tensor(x_node)
        if y is None or x is None or y.shape != x.shape:
            return None
        best = None
        for category, fn, text in _UNARY:
            if category not in allowed:
                continue
            ok, err, rel = probing.compare(y, fn(x))
            if ok and (best is None or err < best.max_abs):
                best = Match(category, node, {"x": x_node}, {}, text, err, rel)
        return best


class SoftmaxMatcher(Matcher):
    """exp(x - max) / sum(exp(x - max)) and its variants."""

    categories = ("softmax",)

    def precheck(self, node):
        return P.softmax(node)

    def check(self, node, probing, allowed):
        y = probing.tensor(node)
        if y is None:
            return None
        # The smallest input first: exp(x - max(x)) is a softmax of x, not of x - max(x).
        for x_node in sorted((d for d in dominators(node) if "exp" in ops_outside(node, d)), key=lambda d: d.size):
            found = self._check_input(node, x_node, y, probing)
            if found is not None:
                return found
        return None

    def _check_input(self, node: Node, x_node: Node, y: torch.Tensor, probing: Probing) -> Match | None:
        x = probing.tensor(x_node)
        if x is None or y.shape != x.shape:
            return None
        for dim in range(-1, -x.ndim - 1, -1):
            ok, err, rel = probing.compare(y, torch.softmax(x, dim))
            if ok:
                inputs = {"x": x_node}
                dim_node = self._dim_node(node, x_node)
                if dim_node is not None:
                    inputs["dim"] = dim_node
                return Match("softmax", node, inputs, {"dim": dim}, "exp(x - max(x)) / sum(exp(x - max(x)))", err, rel)
        return None

    def _dim_node(self, node: Node, x_node: Node) -> Node | None:
        """The dimension argument of the normalising sum, as written."""
        dependent = depends_on(node, x_node)
        for n in sorted(walk(node), key=lambda n: n.op != "sum"):
            if n.op in ("sum", "logsumexp", "amax", "max") and id(n) in dependent:
                dim = n.args[1] if len(n.args) > 1 else n.kwarg("dim")
                if dim is not None and (dim.op != CONST or isinstance(dim.value, int)):
                    return dim
        return None


def _reduction_dims(node: Node) -> tuple[list[str], list[int]]:
    """The dimensions a norm's reductions are over, as written: the names they come
    from (``mean(self.dim)``: what it holds, the scan cannot know) and the numbers."""
    names: set[str] = set()
    numbers: set[int] = set()

    def take(arg: Node) -> None:
        if arg.op == CONST:
            values = arg.value if isinstance(arg.value, tuple) else (arg.value,)
            numbers.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
        elif arg.vars:
            names.update(arg.vars)

    for n in walk(node):
        if n.op not in P.NORM_REDUCE:
            continue
        # x.mean(dim, keepdim), x.norm(p, dim), torch.var(x, dim)
        index = 2 if n.op in ("norm", "vector_norm") else 1
        if len(n.args) > index:
            take(n.args[index])
        for key, arg in n.kwargs:
            if key in ("dim", "axis"):
                take(arg)
    return sorted(names), sorted(numbers)


def _regroups_last_dimension(node: Node) -> bool:
    """Whether the data is reshaped inside the formula so that its last dimension
    changes (``x.view(N, groups, -1)`` before the statistics and back after, as a
    GroupNorm written out does): its statistics are over groups of channels, which no
    norm over the last dimension computes. The probes cannot tell (a reshape passes
    them through), so the call is read: a flatten, an unflatten, or a reshape to
    several sizes ending in -1."""
    data = data_vars(node)
    for n in walk(node):
        if n.op not in RESHAPES or not n.args or not n.args[0].vars & data:
            continue  # a weight's reshape ([C] to [1, C, 1, 1]) is no regrouping
        if n.op in ("flatten", "unflatten"):
            return True
        if n.op in ("rearrange", "einops_repeat"):
            # 'b (g c) h w -> b g c h w' regroups; 'b c h w -> b h w c' only moves axes.
            pattern = n.args[1] if len(n.args) > 1 else None
            if pattern is None or pattern.op != CONST or "(" in str(pattern.value):
                return True
            continue
        sizes = n.args[1].args if len(n.args) == 2 and n.args[1].op == "tuple" else n.args[1:]
        if len(sizes) >= 2 and sizes[-1].op == CONST and sizes[-1].value == -1:
            return True
    return False


class NormMatcher(Matcher):
    """LayerNorm and RMSNorm over the last dimension, with fitted eps, weight and bias."""

    categories = ("layer_norm", "rms_norm")

    def precheck(self, node):
        return P.norm(node)

    def _eps(self, node: Node, probing: Probing) -> list[tuple[float, Node | None]]:
        eps: list[tuple[float, Node | None]] = [(0.0, None)]
        for n in walk(node):
            if n.op == VAR and probing.roles.get(n.value) == SCALAR:
                eps.append((scalar_value(n.value), n))
        eps.extend(_float_constants(node))
        return eps

    def check(self, node, probing, allowed):
        if _regroups_last_dimension(node):
            return None  # x.view(N, groups, -1): a GroupNorm, not a norm over the last dimension
        found = self._check(node, probing, allowed)
        if found is not None:
            names, numbers = _reduction_dims(node)
            named = [name for name in names if probing.roles.get(name) == INT]
            if named:
                # The probes gave the name -1, so the fit says "the last dimension";
                # the code may hold any other.
                found.params["dim_from"] = named
            if found.params.get("dim", -1) != -1 and len(numbers) == 1:
                found.params["dim_written"] = numbers[0]  # dim 1 on the probes' 4-D inputs is -3
        return found

    def _check(self, node, probing, allowed):
        y = probing.tensor(node)
        if y is None or y.ndim < 1:
            return None
        eps_candidates = self._eps(node, probing)
        for x_node in P.norm_inputs(node):
            x = probing.tensor(x_node)
            if x is None or x.shape != y.shape or not ops_outside(node, x_node) & P.NORM_ROOT:
                continue
            if x.shape[-1] < 2:
                continue  # a norm over one element is anything (GRN's spatial norm on a probe)
            # Every eps that fits, the closest kept: a small eps (1e-6) also fits as
            # none within the probes' tolerance, and the fix must keep it.
            fits = []
            for eps, eps_node in eps_candidates:
                found = None
                if "layer_norm" in allowed:
                    found = self._fit_layer(node, x_node, x, y, eps, eps_node, probing)
                if not found and "rms_norm" in allowed:
                    found = self._fit_rms(node, x_node, x, y, eps, eps_node, probing)
                if found:
                    fits.append(found)
            if fits:
                return min(fits, key=lambda f: f.max_rel)
            if allowed & {"layer_norm", "rms_norm"} and x.ndim > 1:
                # Channels-first LayerNorm (ConvNeXt) and RMSNorm (timm's RmsNorm2d): the
                # same over another dimension.
                for dim in range(-2, -x.ndim, -1):  # never dim 0: that is a batch (BatchNorm)
                    xm, ym = x.movedim(dim, -1), y.movedim(dim, -1)
                    fits = []
                    for eps, eps_node in eps_candidates:
                        found = None
                        if "layer_norm" in allowed:
                            found = self._fit_layer(node, x_node, xm, ym, eps, eps_node, probing)
                        if not found and "rms_norm" in allowed:
                            found = self._fit_rms(node, x_node, xm, ym, eps, eps_node, probing)
                        if found:
                            found.params["dim"] = dim
                            fits.append(found)
                    if fits:
                        return min(fits, key=lambda f: f.max_rel)  # the closest eps, as above
        return None

    def _fit_rms(self, node, x_node, x, y, eps, eps_node, probing):
        size = x.shape[-1]
        variants = [("inside", R.rms_normalise)]
        if eps:
            variants.append(("outside", R.rms_normalise_eps_outside))
            variants.append(("clamped", R.rms_normalise_eps_clamped))
        for placement, fn in variants:
            base = fn(x, eps)
            flat_b, flat_y = base.reshape(-1, size), y.reshape(-1, size)
            gain = (flat_b * flat_y).sum(0) / (flat_b * flat_b).sum(0).clamp_min(1e-30)
            ok, err, rel = probing.compare(y, base * gain)
            if not ok:
                continue
            weight = _identify(probing, node, x_node, gain, 1.0)
            factor = None
            if weight is None:
                scaled = self._scaled_weight(node, x_node, gain, probing)
                if scaled is None:
                    continue
                weight, factor = scaled
            inputs = {"x": x_node}
            if weight[1] is not None:
                inputs["weight"] = weight[1]
            if eps_node is not None:
                inputs["eps"] = eps_node
            text = {"inside": "x * rsqrt(mean(x**2, -1) + eps)", "outside": "x / (sqrt(mean(x**2, -1)) + eps)",
                    "clamped": "x / max(sqrt(mean(x**2, -1)), eps)"}[placement]
            if weight[1] is not None:
                text += " * weight"
            params = {"eps": eps, "eps_placement": placement, "casts": "cast" in node.ops}
            if _scalar(probing, weight[1], size):
                params["scalar_weight"] = True
            if factor is not None:
                inputs["factor"] = factor
                params["factor"] = True
                text += ", up to a constant factor"
            return Match("rms_norm", node, inputs, params, text, err, rel)
        return None

    def _scaled_weight(self, node: Node, x_node: Node, gain: torch.Tensor, probing: Probing):
        """An RMSNorm up to a constant factor written as a stored scale (``F.normalize(x,
        dim=-1) * self.scale * self.g`` with ``self.scale = dim ** 0.5``, whose value the
        probe cannot know): the gain is ``c * weight`` for one number c > 0, and a
        factor named like a scale or a size multiplies or divides the normalised value.
        A plain L2 normalisation has no such factor and stays unmatched. Returns the
        weight (as ``_identify`` does) and the factor's subtree."""
        dependent = depends_on(node, x_node)
        reduced = _reduced(node)
        numbers: list[Node] = []
        for n in walk(node):
            if n.op not in ("mul", "div") or id(n) not in dependent or len(n.args) != 2 or id(n) in reduced:
                continue
            for other in n.args:
                if id(other) in dependent or not other.vars or any(other is m for m in numbers):
                    continue
                value = probing.value(other)
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    value = float(value)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    numbers.append(other)
        # One stored factor and no other number (``* self.scale * self.temperature``
        # would leave the second unaccounted for).
        if len(numbers) != 1 or not _named_factor(numbers[0]):
            return None
        factor = numbers[0]
        value = probing.value(factor)
        if float(value) <= 0:
            return None
        g = gain.to(torch.float64).reshape(-1)
        if float(g.min()) <= 0:
            return None
        if probing.compare(g, torch.full_like(g, float(g.mean())))[0]:
            return ("none", None), factor
        size = g.numel()
        for n in sorted(walk(node), key=lambda n: n.size):
            if id(n) in dependent or not n.vars or n is factor:
                continue
            value = probing.value(n)
            if not isinstance(value, torch.Tensor) or value.is_complex() or value.numel() != size:
                continue
            w = value.reshape(-1).to(torch.float64)
            denom = float((w * w).sum())
            if denom <= 0:
                continue
            c = float((g * w).sum()) / denom
            if c > 0 and probing.compare(g, c * w)[0]:
                return ("node", n), factor
        return None

    def _fit_layer(self, node, x_node, x, y, eps, eps_node, probing):
        size = x.shape[-1]
        if size < 3:
            return None
        variants = [("inside", R.layer_normalise)]
        if eps:
            variants.append(("outside", R.layer_normalise_eps_outside))
        # The unbiased variance is another normalisation (by a constant factor); it is
        # reported as LayerNorm with that difference named, never rewritten.
        variants.append(("unbiased", R.layer_normalise_unbiased_inside))
        if eps:
            variants.append(("unbiased, outside", R.layer_normalise_unbiased))
        for placement, fn in variants:
            base = fn(x, eps)
            flat_b, flat_y = base.reshape(-1, size), y.reshape(-1, size)
            mean_b, mean_y = flat_b.mean(0), flat_y.mean(0)
            cov = ((flat_b - mean_b) * (flat_y - mean_y)).mean(0)
            var = ((flat_b - mean_b) ** 2).mean(0).clamp_min(1e-30)
            gain = cov / var
            shift = mean_y - gain * mean_b
            ok, err, rel = probing.compare(y, base * gain + shift)
            if not ok:
                continue
            weight = _identify(probing, node, x_node, gain, 1.0)
            bias = _identify(probing, node, x_node, shift, 0.0)
            if weight is None or bias is None:
                continue
            inputs = {"x": x_node}
            if weight[1] is not None:
                inputs["weight"] = weight[1]
            if bias[1] is not None:
                inputs["bias"] = bias[1]
            if eps_node is not None:
                inputs["eps"] = eps_node
            text = {"inside": "(x - mean) / sqrt(var + eps)", "outside": "(x - mean) / (std + eps)",
                    "unbiased": "(x - mean) / sqrt(unbiased var + eps)",
                    "unbiased, outside": "(x - mean) / (unbiased std + eps)"}[placement]
            params = {"eps": eps, "eps_placement": placement, "casts": "cast" in node.ops}
            if _scalar(probing, weight[1], size) or _scalar(probing, bias[1], size):
                params["scalar_weight"] = True  # one number for every channel: not F.layer_norm's weight
            return Match("layer_norm", node, inputs, params,
                         text + (" * weight" if weight[1] is not None else "") + (" + bias" if bias[1] is not None else ""),
                         err, rel)
        return None


def _applied(apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], a: torch.Tensor,
             b: torch.Tensor) -> torch.Tensor | None:
    try:
        return apply(a, b)
    except (RuntimeError, IndexError):
        return None  # the operands do not have the layout's shapes


def _rank(t: torch.Tensor, ndim: int) -> torch.Tensor:
    if t.ndim != ndim:
        raise IndexError("another rank")
    return t


#: The attention layouts read from einsum operands, each as the scores q @ k^T (from q
#: and k) and the output weights @ v (from the weights and v) would be in that layout:
#: BNSD (batch, heads, sequence, head_dim); BSND (sequence before heads); BNSD-shared,
#: one key/value head shared by every query head (multi-query attention, k and v of
#: shape (batch, sequence, head_dim)); BDS, channels before positions (batch [* heads],
#: head_dim, sequence), as diffusion U-Nets write it.
_SCORE_LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "BNSD": lambda q, k: q @ k.transpose(-2, -1),
    "BSND": lambda q, k: _rank(q, 4).transpose(1, 2) @ _rank(k, 4).transpose(1, 2).transpose(-2, -1),
    "BNSD-shared": lambda q, k: _rank(q, 4) @ _rank(k, 3).unsqueeze(1).transpose(-2, -1),
    "BDS": lambda q, k: _rank(q, k.ndim).transpose(-2, -1) @ k,
    # positions first, heads in the middle, and the scores kept so ('...qhd,...khd->...qhk')
    "BSND-qhk": lambda q, k: (_rank(q, 4).transpose(1, 2) @ _rank(k, 4).transpose(1, 2).transpose(-2, -1)).transpose(1, 2),
    # a key that arrives transposed ('bij,bjk->bik' of q and a channel-first k): kept
    # only where the operand is named like a key (``analysis``)
    "BNSD-kt-as-written": lambda q, k: q @ k,
}
_VALUE_LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "BNSD": lambda p, v: p @ v,
    "BSND": lambda p, v: (_rank(p, 4) @ _rank(v, 4).transpose(1, 2)).transpose(1, 2),
    "BNSD-shared": lambda p, v: _rank(p, 4) @ _rank(v, 3).unsqueeze(1),
    "BDS": lambda p, v: (_rank(p, v.ndim) @ v.transpose(-2, -1)).transpose(-2, -1),
    # values channels-first, output positions-first ('b h i j, b h d j -> b h i d')
    "BDS-v": lambda p, v: _rank(p, v.ndim) @ v.transpose(-2, -1),
    # weights (b, q, h, k) and values (b, k, h, d), as '...qhk,...khd->...qhd' takes them
    "BSND-qhk": lambda p, v: (_rank(p, 4).transpose(1, 2) @ _rank(v, 4).transpose(1, 2)).transpose(1, 2),
}


#: Layouts whose weights keep the heads last and normalise over a middle dimension,
#: as einsum writes them: SBND, sequence first ('ibhd,jbhd->ijbh', softmax over j =
#: dim 1; Transformer-XL), and BSND-kh, heads after both positions ('bihd,bjhd->bijh',
#: softmax over dim 2). Each maps to the dimension the softmax runs over.
_HEADS_LAST_SCORES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "SBND": lambda q, k: (_rank(q, 4).permute(1, 2, 0, 3) @ _rank(k, 4).permute(1, 2, 3, 0)).permute(2, 3, 0, 1),
    "BSND-kh": lambda q, k: (_rank(q, 4).transpose(1, 2) @ _rank(k, 4).permute(0, 2, 3, 1)).permute(0, 2, 3, 1),
}
_HEADS_LAST_VALUES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "SBND": lambda p, v: (_rank(p, 4).permute(2, 3, 0, 1) @ _rank(v, 4).permute(1, 2, 0, 3)).permute(2, 0, 1, 3),
    "BSND-kh": lambda p, v: (_rank(p, 4).permute(0, 3, 1, 2) @ _rank(v, 4).transpose(1, 2)).transpose(1, 2),
}
_HEADS_LAST_DIM = {"SBND": 1, "BSND-kh": 2}


def _filler(node: Node, probing: Any) -> bool:
    """Whether ``node`` is one value everywhere (a fill such as -inf or the dtype's
    minimum, which may read the scores' dtype but not their values)."""
    if node.is_const:
        return True
    if scalarish(node):
        return True
    t = probing.tensor(node)
    return t is not None and t.numel() >= 1 and bool((t == t.flatten()[0]).all())


class AttentionMatcher(Matcher):
    """softmax(q @ k^T * scale [+ mask]) [dropout] @ v, matmul or einsum forms."""

    categories = ("attention",)

    def precheck(self, node):
        return P.attention(node)

    def check(self, node, probing, allowed):
        if node.op == "einsum":
            if len(node.args) != 3:
                return None
            p_node, v_node = node.args[1], node.args[2]
            if not p_node.ops & {"softmax", "exp"} and v_node.ops & {"softmax", "exp"}:
                # '...vhf,...qhv->...qhf': the values written first.
                p_node, v_node = v_node, p_node
        elif len(node.args) == 2:
            p_node, v_node = node.args
            if not p_node.ops & {"softmax", "exp"} and v_node.ops & {"softmax", "exp"}:
                p_node, v_node = v_node, p_node  # bmm(v, w.permute(0, 2, 1)): values first
        else:
            return None
        p, v, y = probing.tensor(p_node), probing.tensor(v_node), probing.tensor(node)
        if p is None or v is None or y is None or p.ndim < 2 or v.ndim < 2:
            return None
        tol = 1e-6 if probing.float64 else 1e-4

        def stochastic(t: torch.Tensor) -> bool:
            return float(t.min()) >= -tol and bool(((t.sum(-1) - 1).abs() <= tol * t.shape[-1]).all())

        # Weights normalised over a middle dimension, heads last (einsum's 'ijbh'): read
        # with that dimension moved last, the layouts of _HEADS_LAST_VALUES.
        kdim = next((d for d in (1, 2) if node.op == "einsum" and p.ndim == 4 and not stochastic(p)
                     and stochastic(p.movedim(d, -1))), None)
        transposed = False
        values_first = (node.args[1] if node.op == "einsum" else node.args[0]) is v_node
        if kdim is None and values_first and not stochastic(p) and stochastic(p.transpose(-2, -1)):
            # The weights transposed and taken from the right, values first (v @ w^T, as
            # LDM's AttnBlock writes it): the softmax before the transpose is the weights.
            weights = p.transpose(-2, -1)
            inner = next((n for n in sorted(walk(p_node), key=lambda n: -n.size) if n is not p_node
                          and "softmax" in n.ops and (t := probing.tensor(n)) is not None
                          and t.shape == weights.shape and torch.equal(t, weights)), None)
            if inner is None:
                return None
            p_node, p, transposed = inner, weights, True
        weights_node, extra_factor, unnormalised = p_node, False, False
        p_raw = p
        if kdim is not None:
            p = p.movedim(kdim, -1)
        elif not stochastic(p):
            # Weights scaled after the softmax (a head mask): find the softmax itself.
            inner = [n for n in walk(p_node) if n is not p_node and n.ops & {"softmax", "exp"}
                     and n.op not in (VAR, CONST)]
            weights_node = next((n for n in sorted(inner, key=lambda n: -n.size)
                                 if (t := probing.tensor(n)) is not None and t.shape == p.shape and stochastic(t)), None)
            if weights_node is not None:
                inner = probing.tensor(weights_node)
                # A factor applied after the softmax must scale whole rows (a head
                # mask): one that varies along them (a keep-mask without renormalising,
                # 1 - p, a threshold) or a transpose of the weights is another product.
                if not _row_scaled(p, inner):
                    return None
                p, extra_factor = inner, True
            elif "exp" in p_node.ops and float(p.min()) >= 0 and bool((p.sum(-1) > 0).all()) \
                    and stochastic(p / p.sum(-1, keepdim=True)):
                # exp(s - max(s)) @ v with the sum kept apart: one chunk of a
                # memory-efficient attention, normalised once the chunks are merged.
                weights_node, p, extra_factor, unnormalised = p_node, p / p.sum(-1, keepdim=True), True, True
            else:
                return None
        layout = None
        value_layouts = _VALUE_LAYOUTS if kdim is None else {
            name: apply for name, apply in _HEADS_LAST_VALUES.items() if _HEADS_LAST_DIM[name] == kdim}
        if node.op != "einsum" and not transposed:
            layout = "BNSD"
        else:
            layout = next((name for name, apply in value_layouts.items()
                           if (ref := _applied(apply, p_raw, v)) is not None and probing.compare(y, ref)[0]), None)
        if layout is None:
            return None

        def last(t: torch.Tensor) -> torch.Tensor:
            """A tensor of the weights' layout with the dimension they sum over last."""
            return t if kdim is None else t.movedim(kdim, -1)

        p_node = weights_node
        for s_node in sorted((n for n in walk(p_node) if n.op in ("matmul", "bmm", "einsum") or P.product_sum(n)),
                             key=lambda n: -n.size):
            s_raw = probing.tensor(s_node)
            if s_raw is None or s_raw.shape[-1:] != p_raw.shape[-1:] or s_raw.numel() != p.numel():
                continue
            # Scores made per (batch * head) by bmm and viewed back to four dimensions
            # (GPT-NeoX) are the same scores: compared in the weights' shape.
            s = last(s_raw.reshape(p_raw.shape))
            qk = self._split_qk(s_node, s_raw, probing,
                                _SCORE_LAYOUTS if kdim is None else {layout: _HEADS_LAST_SCORES[layout]})
            if qk is None:
                continue
            q_node, k_node, qk_layout = qk
            fit = self._fit(p_node, s_node, p, s, probing, last, p_raw.shape)
            if fit is None:
                continue
            scale, additive, weight = fit
            q = probing.tensor(q_node)
            head = q.shape[-1] if q is not None else 0
            inputs = {"q": q_node, "k": k_node, "v": v_node}
            params: dict[str, Any] = {
                "scale": scale,
                "default_scale": bool(head) and abs(scale * math.sqrt(head) - 1.0) < 1e-5,
                "masked": bool(additive is not None or (p <= 0).any() or p_node.ops & {"masked_fill", "where"}
                               or extra_factor),
                "dropout": "dropout" in node.ops,
                "layout": _combined_layout(layout, qk_layout),
                "k_transposed": qk_layout in ("BNSD-kt", "BNSD-kt-as-written"),
                # 3: (batch * heads, sequence, head_dim) as bmm takes them; 0 when the
                # probes could not give q the code's shape (a view passed through).
                "rank": q.ndim if q is not None and not any(
                    id(n) in probing.evaluator.stand_ins for n in walk(q_node)) else 0,
            }
            v_known = not any(id(n) in probing.evaluator.stand_ins for n in walk(v_node))
            if q is not None and v.ndim != q.ndim and params["rank"] and v_known:
                # q and k flattened to (batch * heads, ...) for bmm while v keeps its heads
                # (GPT-NeoX): the fused call needs them in one shape.
                params["v_rank"] = v.ndim
            if unnormalised:
                params["chunked"] = True
            if qk_layout == "BNSD-kt-as-written":
                params["key_as_written"] = True
            if additive is not None:
                inputs["mask"] = additive
                params["mask_added"] = True  # a float mask added to the scores, as SDPA adds attn_mask
                # 1 when added after the scale; 1/sqrt(d) for (q @ k^T + mask) / sqrt(d).
                params["mask_weight"] = weight
            # The boolean mask: masked_fill's condition (True where masked), or where's
            # (True where the scores are kept, when they are its first branch). Beside a
            # float mask added to the scores it is a second input, which SDPA's one
            # attn_mask must fold in.
            role = "fill_mask" if additive is not None else "mask"
            for mask_holder in walk(p_node):
                if role in inputs:
                    break
                if mask_holder.op == "masked_fill" and len(mask_holder.args) >= 2:
                    inputs[role] = mask_holder.args[1]
                elif mask_holder.op == "where" and len(mask_holder.args) == 3:
                    cond, kept, other = mask_holder.args
                    if _filler(other, probing) and any(n is s_node for n in walk(kept)):
                        inputs[role] = cond
                        params["mask_keeps"] = True  # already True where attention is allowed
                    elif _filler(kept, probing) and any(n is s_node for n in walk(other)):
                        inputs[role] = cond
            scale_node = self._scale_node(p_node, s_node, scale, probing)
            if scale_node is not None:
                inputs["scale"], params["scale_op"] = scale_node
                # sqrt(q.size(-1)) is SDPA's default; sqrt(self.head_dim) is only equal to it.
                params["scale_from_shape"] = bool(scale_node[0].vars) and scale_node[0].vars <= (
                    data_vars(q_node) | data_vars(k_node))
            text = "softmax(q @ k^T * scale" + (" + mask" if params["masked"] else "") + ") @ v"
            if unnormalised:
                text = "exp(q @ k^T * scale - max) @ v, the chunk of a softmax(q @ k^T * scale) @ v"
            logits = scale * s.to(torch.float64)
            if additive is not None:
                logits = logits + weight * last(probing.tensor(additive).to(torch.float64).expand_as(p_raw))
            ref_p = torch.softmax(torch.where(p > 1e-30, logits, torch.full_like(logits, -math.inf)), -1)
            if unnormalised and not _chunk_exponent(p_raw, logits):
                continue
            if extra_factor:
                ok, err, rel = probing.compare(p, ref_p)  # the weights; the head mask is the user's
            else:
                if kdim is not None:
                    ref_p = ref_p.movedim(-1, kdim)  # back to the code's layout
                ref = _applied(value_layouts[layout], ref_p, v.to(torch.float64))
                ok, err, rel = probing.compare(y, ref)
            if not ok:
                continue
            return Match("attention", node, inputs, params, text, err, rel)
        return None

    def _split_qk(self, s_node: Node, s: torch.Tensor, probing: Probing,
                  layouts: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = _SCORE_LAYOUTS):
        if P.product_sum(s_node):
            # (q[:, :, 0:1] * k).sum(-1): the scores of one query position (a class
            # token) against every key, q @ k^T without its length-one dimension.
            a_node, b_node = s_node.args[0].args
            a, b = probing.tensor(a_node), probing.tensor(b_node)
            if a is None or b is None or a.ndim < 3 or a.ndim != b.ndim:
                return None
            for q_node, k_node, q, k in ((a_node, b_node, a, b), (b_node, a_node, b, a)):
                if q.shape[-2] == 1 and k.shape[-2] > 1 and q.shape[-1] == k.shape[-1]:
                    ref = q @ k.transpose(-2, -1)
                    if ref.numel() == s.numel() and probing.compare(s, ref.reshape(s.shape))[0]:
                        return q_node, k_node, "BNSD"
            return None
        if s_node.op == "einsum":
            if len(s_node.args) != 3:
                return None
            a_node, b_node = s_node.args[1], s_node.args[2]
            a, b = probing.tensor(a_node), probing.tensor(b_node)
            if a is None or b is None:
                return None
            for name, apply in layouts.items():
                ref = _applied(apply, a, b)
                if ref is not None and probing.compare(s, ref)[0]:
                    return a_node, b_node, name
            return None
        if len(s_node.args) != 2:
            return None
        a_node, kt_node = s_node.args
        if kt_node.op not in P.TRANSPOSES or not kt_node.args:
            # A key transposed where it was made (Whisper's permute(0, 2, 3, 1)).
            if kt_node.ops & P.TRANSPOSES:
                return a_node, kt_node, "BNSD-kt"
            # A key that arrives transposed, (b, h, d, s) (``q.matmul(k)``): the same
            # product as ``x @ w``, so ``analysis`` keeps it only where the operand is
            # named like a key.
            return a_node, kt_node, "BNSD-kt-as-written"
        k_node = kt_node.args[0]
        a, k = probing.tensor(a_node), probing.tensor(k_node)
        if a is None or k is None or k.ndim < 2:
            return None
        if probing.compare(s, a @ k.transpose(-2, -1))[0]:
            return a_node, k_node, "BNSD"
        # k.permute(0, 2, 3, 1): transposed while it is moved to heads-first.
        return a_node, kt_node, "BNSD-kt"

    def _fit(self, p_node: Node, s_node: Node, p: torch.Tensor, s: torch.Tensor, probing: Probing,
             last: Callable[[torch.Tensor], torch.Tensor] | None = None, shape: torch.Size | None = None):
        """The scale c and an additive term M with p = softmax(c * s + M) on the
        entries softmax keeps; None when no such c > 0 exists. ``p`` and ``s`` are
        normalised over their last dimension; ``last`` puts a term of the code's
        layout (the weights' ``shape`` there) in theirs."""
        p64, s64 = p.to(torch.float64), s.to(torch.float64)
        valid = p64 > 1e-30
        count = valid.sum(-1, keepdim=True).clamp_min(1)

        def centre(t: torch.Tensor) -> torch.Tensor:
            t = torch.where(valid, t, torch.zeros_like(t))
            return torch.where(valid, t - t.sum(-1, keepdim=True) / count, torch.zeros_like(t))

        logp = centre(torch.log(torch.where(valid, p64, torch.ones_like(p64))))
        cs = centre(s64)
        denom = float((cs * cs).sum())
        if denom <= 0:
            return None
        scale = float((logp * cs).sum()) / denom
        tol = (1e-6 if probing.float64 else 2e-4) * max(1.0, float(logp.abs().max()))
        if scale > 0 and float((logp - scale * cs).abs().max()) <= tol:
            return scale, None, 0.0
        dependent = depends_on(p_node, s_node)
        # Additive terms: the operands of a sum whose other operand holds the scores.
        terms = [a for n in walk(p_node) if n.op in ("add", "sub") and id(n) in dependent
                 for a in n.args if id(a) not in dependent and a.vars]
        for m_node in terms:
            m = probing.tensor(m_node)
            if m is None:
                continue
            try:
                m = m.to(torch.float64).expand(shape if shape is not None else p64.shape)
                cm = centre(last(m) if last is not None else m)
            except RuntimeError:
                continue
            design = torch.stack((cs[valid], cm[valid]), -1)
            if design.shape[0] < 2 or not bool(torch.isfinite(design).all()):
                continue  # nothing to fit (LAPACK would complain on stderr)
            coef = torch.linalg.lstsq(design, logp[valid].unsqueeze(-1)).solution.squeeze(-1)
            scale, weight = float(coef[0]), float(coef[1])
            if scale > 0 and abs(weight) > 1e-3 and float((logp - scale * cs - weight * cm).abs().max()) <= tol:
                return scale, m_node, weight
        return None

    def _scale_node(self, p_node: Node, s_node: Node, scale: float, probing: Probing):
        dependent = depends_on(p_node, s_node)
        for node in walk(p_node):
            if node.op not in ("mul", "div") or id(node) not in dependent or len(node.args) != 2:
                continue
            for i, other in enumerate(node.args):
                if id(other) in dependent:
                    continue
                value = probing.value(other)
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    value = float(value)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value == 0:
                    continue
                if node.op == "mul" and abs(value - scale) <= 1e-5 * abs(scale):
                    return other, "mul"
                if node.op == "div" and i == 1 and abs(1.0 / value - scale) <= 1e-5 * abs(scale):
                    return other, "div"
        return None


class RotaryMatcher(Matcher):
    """x * cos + rotate(x) * sin, with rotate-half, interleaved or complex-multiply
    rotation: the tree is linear in x with a per-element cos and sin, which are
    solved for from three evaluations."""

    categories = ("rotary",)

    def precheck(self, node):
        return P.rotary(node)

    def _inputs(self, node: Node) -> list[Node]:
        found: list[Node] = []
        for n in walk(node):
            if n.op in ("getitem", "chunk", "split", "unbind", "reshape", "view", "view_as_complex", "cast",
                        "unflatten", "rearrange") and n.args:
                chain = [n.args[0]]
                while chain[-1].op == "cast" and chain[-1].args:
                    chain.append(chain[-1].args[0])
                # The uncast input first: it is what a replacement takes.
                for x in reversed(chain):
                    if x.vars and x is not node and all(x is not f for f in found):
                        found.append(x)
        return found[:6]

    def check(self, node, probing, allowed):
        y = probing.tensor(node)
        if y is None or y.ndim < 2 or y.shape[-1] % 2:
            return None
        for x_node in self._inputs(node):
            x0 = probing.tensor(x_node)
            if x0 is None or x0.shape[-1] != y.shape[-1]:
                continue
            if _passes_part_through(node, x_node):
                # cat((rotated, x[..., rot_dim:])): a partial rotation, reported where
                # the rotation of the slice is written (on the probes the slice may be all
                # of x, and the whole would read as a rotation of x).
                continue
            try:
                if broadcast_shape(x0.shape, y.shape) != y.shape:
                    continue
            except RuntimeError:
                continue
            check = probing.fresh(x0, "rotary")
            y_check = probing.reevaluate(node, {id(x_node): check})
            if y_check is None or y_check.shape != y.shape:
                continue
            x0 = x0.expand(y.shape)
            for mode, rotate in (("half", R.rotate_half), ("interleave", R.rotate_interleave)):
                solved = _solve_rotation(node, x_node, check, y.shape, probing, rotate, {})
                if solved is None:
                    continue
                cos, sin = solved
                if float(sin.abs().max()) < 1e-6:
                    continue
                xc = check.expand(y.shape).to(torch.float64)
                ok, err, rel = probing.compare(y_check, xc * cos + rotate(xc) * sin)
                x064 = x0.to(torch.float64)
                ok0 = probing.compare(y, x064 * cos + rotate(x064) * sin)[0]
                if not (ok and ok0):
                    continue
                if float(cos.abs().max()) < 1e-6:
                    continue  # rotate(x) * s alone: the rotation's helper, not its application
                # Any linear map of each pair (a reflection, a shear, a symmetric mix)
                # solves to some per-element cos and sin. A rotation gives both members of
                # a pair one angle: with every other input made equal within each pair,
                # the solved cos and sin must be too.
                if "view_as_complex" in node.ops and not torch.allclose(
                        cos * cos + sin * sin, torch.ones_like(cos), atol=1e-6):
                    continue  # a complex product that scales: a filter or a gain, not a rotation
                shared = self._solve_shared(node, x_node, probing, mode, rotate)
                if shared is None:
                    continue
                params: dict[str, Any] = {"mode": mode}
                if not shared:
                    # The sign kept in the stored sine table (x * c + swap(x) * s): only a
                    # function named like a rotary counts (analysis decides).
                    params["sign_folded"] = True
                inputs = {"x": x_node}
                cos_holder = self._holder(node, x_node, cos, probing)
                sin_holder = self._holder(node, x_node, sin, probing)
                if sin_holder is None and (negated := self._holder(node, x_node, -sin, probing)) is not None:
                    sin_holder, params["sin_negated"] = negated, True  # a rotation by -theta
                if cos_holder is None and sin_holder is None and shared:
                    # Tables as wide as one member of each pair (x1 * cos + x2 * sin on the
                    # halves): the replacement widens them.
                    cos_holder = self._holder(node, x_node, _first_members(cos, mode), probing)
                    half_sin = _first_members(sin, mode)
                    sin_holder = self._holder(node, x_node, half_sin, probing)
                    if sin_holder is None and (negated := self._holder(node, x_node, -half_sin, probing)) is not None:
                        sin_holder, params["sin_negated"] = negated, True
                    if cos_holder is not None and sin_holder is not None:
                        params["half_tables"] = True
                    else:
                        cos_holder = sin_holder = None
                        params.pop("sin_negated", None)
                if cos_holder is not None:
                    inputs["cos"] = cos_holder
                if sin_holder is not None:
                    inputs["sin"] = sin_holder
                text = "x * cos + rotate_half(x) * sin" if mode == "half" else "x * cos + rotate_interleaved(x) * sin"
                return Match("rotary", node, inputs, params, text, err, rel)
        return None

    def _solve_shared(self, node: Node, x_node: Node, probing: Probing, mode: str,
                      rotate: Callable[[torch.Tensor], torch.Tensor]) -> bool | None:
        """Solve cos and sin again with every input but x equal within each pair: True
        when they come out shared within pairs (a rotation), False when only the sine is
        shared up to the rotation's signs (the sign folded into it), None otherwise."""
        x_vars = {id(n) for n in walk(x_node) if n.op == VAR}
        overrides: dict[int, Any] = {}
        y = probing.tensor(node)
        width = y.shape[-1] if y is not None and y.ndim else None
        for n in walk(node):
            if n.op == VAR and id(n) not in x_vars:
                v = probing.value(n)
                if isinstance(v, torch.Tensor) and v.ndim and v.shape[-1] % 2 == 0 and v.is_floating_point():
                    overrides[id(n)] = _share_pairs(v, mode, width)
        solved = _solve_rotation(node, x_node, probing.tensor(x_node), y.shape, probing, rotate, overrides) \
            if y is not None else None
        if solved is None:
            return None
        cos, sin = solved
        if not _pair_shared(cos, mode):
            return None
        if _pair_shared(sin, mode):
            return True
        return False if _pair_shared(sin * _rotation_signs(sin, mode), mode) else None

    def _holder(self, node: Node, x_node: Node, target: torch.Tensor, probing: Probing) -> Node | None:
        """The smallest part of ``node``, not made from x, that holds ``target`` (the
        cos or sin table); a slice of it holding the same on the probes is taken
        instead (``self.cos_cached[:seq_len]``: the probes' sequence is the table's
        whole length, the code's need not be)."""
        memo: dict[int, bool] = {}
        found: list[Node] = []
        for n in sorted(walk(node), key=lambda n: n.size):
            if _reads_values_of(n, x_node, memo) or not n.vars:
                continue
            v = probing.tensor(n)
            if v is None:
                continue
            try:
                if probing.compare(v.expand(target.shape), target)[0]:
                    found.append(n)
            except RuntimeError:
                continue
        if not found:
            return None
        holder = found[0]
        while (sliced := next((n for n in found if n.op == "getitem" and n.args and n.args[0] is holder), None)):
            holder = sliced
        return holder


_SHAPE_READS = frozenset({"shape", "size", "dim", "ndim", "numel"})


def _reads_values_of(node: Node, x_node: Node, memo: dict[int, bool]) -> bool:
    """Whether ``node`` reads the values of ``x_node``, not only its shape
    (``cos[:, :, :x.shape[2]]`` reads the shape)."""
    key = id(node)
    if key not in memo:
        memo[key] = node is x_node or (node.op not in _SHAPE_READS
                                       and any(_reads_values_of(c, x_node, memo) for c in node.children()))
    return memo[key]


def _combined_layout(values: str, scores: str) -> str:
    """The attention's layout from its values' and its scores' layouts. A key written
    transposed goes with either; channel-first values after a positions-first query
    and a channel-first key (LDM's AttnBlock: ``bmm(q.permute(0, 2, 1), k)``) are
    "BDS-q"; anything else not one layout is "mixed"."""
    transposed_key = scores in ("BNSD-kt", "BNSD-kt-as-written")
    if values == "BDS" and transposed_key:
        return "BDS-q"
    return values if scores == values or transposed_key else "mixed"


def _chunk_exponent(p: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether unnormalised weights are exp(logits) or exp(logits - max(logits)) row by
    row, as a chunk of a memory-efficient attention makes them; an extra term in the
    denominator (the off-by-one softmax) is something else."""
    p64 = p.to(torch.float64).reshape(logits.shape)
    kept = p64 > 1e-30
    gap = torch.where(kept, torch.log(torch.where(kept, p64, torch.ones_like(p64))) - logits, torch.zeros_like(p64))
    row_max = torch.where(kept, logits, torch.full_like(logits, -math.inf)).amax(-1, keepdim=True)
    tol = 1e-5 * max(1.0, float(logits.abs().max()))
    plain = gap.abs().amax() <= tol  # gap is zero where nothing is kept
    shifted = torch.where(kept, gap + row_max, torch.zeros_like(gap)).abs().amax() <= tol
    return bool(plain or shifted)


def _row_scaled(p: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``p`` is ``weights`` times a factor constant along each row."""
    if p.shape != weights.shape:
        return False
    p64, w64 = p.to(torch.float64), weights.to(torch.float64)
    kept = w64 > 1e-12
    ratio = torch.where(kept, p64 / torch.where(kept, w64, torch.ones_like(w64)), torch.zeros_like(w64))
    first = ratio.gather(-1, kept.to(torch.int64).argmax(-1, keepdim=True))
    return bool(torch.allclose(torch.where(kept, ratio, first), first.expand_as(ratio), rtol=1e-6, atol=1e-9))


def _solve_rotation(node: Node, x_node: Node, like: torch.Tensor, shape: torch.Size, probing: Probing,
                    rotate: Callable[[torch.Tensor], torch.Tensor],
                    overrides: dict[int, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The per-element cos and sin of a tree linear in x, from two evaluations: x = 1
    and x = rotate(1) make the 2x2 system per element well conditioned (determinant -2),
    even in float32."""
    x1 = torch.ones_like(like)
    x2 = rotate(x1)
    y1 = probing.reevaluate(node, {**overrides, id(x_node): x1})
    y2 = probing.reevaluate(node, {**overrides, id(x_node): x2})
    if y1 is None or y2 is None or y1.shape != shape or y2.shape != shape:
        return None
    x1, x2 = x1.expand(shape).to(torch.float64), x2.expand(shape).to(torch.float64)
    r1, r2 = rotate(x1), rotate(x2)
    det = x1 * r2 - x2 * r1
    y1, y2 = y1.to(torch.float64), y2.to(torch.float64)
    return (y1 * r2 - y2 * r1) / det, (x1 * y2 - x2 * y1) / det


def _first_members(t: torch.Tensor, mode: str) -> torch.Tensor:
    """The first member of every rotated pair in ``t``: its first half, or its even
    positions."""
    return t[..., : t.shape[-1] // 2] if mode == "half" else t[..., 0::2]


def _share_pairs(t: torch.Tensor, mode: str, width: int | None = None) -> torch.Tensor:
    """``t`` with the second member of every pair set to the first. A table holding
    several of the rotation's widths side by side (cos and sin in one buffer, sliced
    apart) has its pairs shared within each width."""
    if width and t.shape[-1] != width and t.shape[-1] % width == 0:
        blocks = t.reshape(*t.shape[:-1], t.shape[-1] // width, width)
        return _share_pairs(blocks, mode).reshape(t.shape)
    out = t.clone()
    if mode == "half":
        half = t.shape[-1] // 2
        out[..., half:] = t[..., :half]
    else:
        out[..., 1::2] = t[..., 0::2]
    return out


def _pair_shared(t: torch.Tensor, mode: str) -> bool:
    """Whether both members of every rotated pair have the same value in ``t``."""
    if mode == "half":
        a, b = t.chunk(2, -1)
    else:
        a, b = t[..., 0::2], t[..., 1::2]
    return bool(torch.allclose(a, b, rtol=1e-6, atol=1e-9))


def _rotation_signs(t: torch.Tensor, mode: str) -> torch.Tensor:
    """-1 on the first member of each pair, +1 on the second (the signs a rotation's
    sine takes when the swap is written without its negation)."""
    signs = torch.ones(t.shape[-1], dtype=t.dtype)
    if mode == "half":
        signs[: t.shape[-1] // 2] = -1
    else:
        signs[0::2] = -1
    return signs


def _passes_part_through(node: Node, x_node: Node) -> bool:
    """Whether ``node`` concatenates an untouched slice of ``x_node`` (or of the tensor
    ``x_node`` is a slice of) with something else."""
    sources = {id(x_node)}
    if x_node.op == "getitem" and x_node.args:
        sources.add(id(x_node.args[0]))
    while node.op in ("cast", "contiguous") and node.args:
        node = node.args[0]
    if node.op != "cat" or not node.args or node.args[0].op != "tuple":
        return False
    for item in node.args[0].args:
        while item.op in ("cast", "contiguous") and item.args:
            item = item.args[0]
        if item.op == "getitem" and item.args and id(item.args[0]) in sources and item is not x_node:
            return True
    return False


class SwigluMatcher(Matcher):
    """silu(a) * b, and silu(z[..., :h]) * z[..., h:] from one tensor (chunk, split, slices)."""

    categories = ("swiglu",)

    def precheck(self, node):
        return P.swiglu(node)

    def check(self, node, probing, allowed):
        y = probing.tensor(node)
        if y is None:
            return None
        for gate, up in (node.args, node.args[::-1]):
            if gate.op == "silu" and gate.args:
                a_node = gate.args[0]
            elif gate.ops & {"sigmoid", "exp"}:
                a_node = dominator(gate)
                if a_node is None:
                    continue
                g, a0 = probing.tensor(gate), probing.tensor(a_node)
                if g is None or a0 is None or not probing.compare(g, R.silu(a0))[0]:
                    continue
            else:
                continue
            if not up.vars or id(up) in depends_on(up, a_node):
                continue
            a, b = probing.tensor(a_node), probing.tensor(up)
            if a is None or b is None or a.shape != b.shape:
                continue
            ok, err, rel = probing.compare(y, R.silu(a) * b)
            if not ok:
                continue
            inputs = {"a": a_node, "b": up}
            shared_a = {id(n) for n in walk(a_node)}
            for z_node in sorted((n for n in walk(up) if id(n) in shared_a and n.vars), key=lambda n: -n.size)[:4]:
                z = probing.tensor(z_node)
                if z is not None and z.shape[-1] == 2 * a.shape[-1] and probing.compare(y, R.swiglu(z, -1))[0]:
                    inputs["z"] = z_node
                    break
            return Match("swiglu", node, inputs, {"single_input": "z" in inputs}, "silu(a) * b", err, rel)
        return None


class GluMatcher(Matcher):
    """a * sigmoid(b) with a and b the two halves of one tensor along one dimension
    (chunk, split, slices): F.glu. A gate on two separate tensors (a gated convolution's
    two branches, an attention output gated by its own projection) is not one."""

    categories = ("glu",)

    def precheck(self, node):
        return P.glu(node)

    def check(self, node, probing, allowed):
        y = probing.tensor(node)
        if y is None:
            return None
        for gate, a_node in (node.args, node.args[::-1]):
            if gate.op != "sigmoid" or not gate.args:
                continue
            b_node = gate.args[0]
            a, b = probing.tensor(a_node), probing.tensor(b_node)
            if a is None or b is None or a.shape != b.shape or a_node is b_node or not a.dim():
                continue
            ok, err, rel = probing.compare(y, a * torch.sigmoid(b))
            if not ok or probing.compare(a, b)[0]:
                continue  # a * sigmoid(a) is SiLU (AX113)
            shared = {id(n) for n in walk(b_node)}
            wholes = sorted((n for n in walk(a_node) if id(n) in shared and n.vars and n.op not in _NOT_WHOLE),
                            key=lambda n: -n.size)
            for z_node in wholes[:6]:
                z = probing.tensor(z_node)
                if z is None or z.dim() != a.dim():
                    continue
                for dim in range(z.dim()):
                    if z.shape[dim] != 2 * a.shape[dim] or not probing.compare(y, R.glu(z, dim))[0]:
                        continue
                    text = _split_dim_text(a_node, z_node)
                    params: dict[str, Any] = {"dim_text": text} if text is not None else {}
                    return Match("glu", node, {"z": z_node}, params, "a * sigmoid(b)", err, rel)
        return None


#: Nodes that are pieces of the split or its sizes, never the tensor split.
_NOT_WHOLE = frozenset({"split", "chunk", "unbind", "tensor_split", "shape", "size", "floordiv", "tuple"})


def _split_dim_text(half: Node, z_node: Node) -> str | None:
    """How the code names the dimension ``z_node`` is split along, read from the split
    that ``half`` is a piece of: a chunk's or split's dimension argument (``0`` when it
    has none; ``self.dim`` as written), ``-1`` for ``z[..., :h]``, the position of the
    one sliced index after full slices (``z[:, :h]``: ``1``). None when it is written
    otherwise: the probes' rank need not be the code's."""
    for n in walk(half):
        if n.op in ("chunk", "split") and n.args and n.args[0] is z_node:
            dim = n.args[2] if len(n.args) > 2 else n.kwarg("dim")
            if dim is None:
                return "0"
            if dim.op == CONST and isinstance(dim.value, int) and not isinstance(dim.value, bool):
                return repr(dim.value)
            if dim.op == VAR and isinstance(dim.value, str) and dim.value.replace(".", "").isidentifier():
                return dim.value
            return None
        if n.op == "getitem" and len(n.args) == 2 and n.args[0] is z_node:
            index = n.args[1]
            items = index.args if index.op == "tuple" else (index,)
            if len(items) == 2 and items[0].op == CONST and items[0].value is Ellipsis:
                return "-1"
            full = [i.op == "slice" and all(a.op == CONST and a.value is None for a in i.args) for i in items]
            if full and not full[-1] and all(full[:-1]) and items[-1].op == "slice":
                return str(len(items) - 1)
            return None
    return None


MATCHERS: tuple[Matcher, ...] = (AttentionMatcher(), RotaryMatcher(), SwigluMatcher(), GluMatcher(), NormMatcher(),
                                 SoftmaxMatcher(), ActivationMatcher())

# ------------------------------------------------------------------ driver
def compute(root: Node, roles: dict[str, str], categories: frozenset[str]) -> list[Match]:
    """The matches in one root, largest first (``store`` caches them)."""
    # Probes are tiny: waking a thread pool costs a thousand times the arithmetic.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        order = list(walk(root))
        primary = Probing(roles, PRIMARY)
        matches = _match(root, primary, categories, order)
        # Categories with a candidate in the tree that the first probes left unmatched
        # (the attention around a matched qk-norm): other guesses at shapes for them.
        unmatched = categories - {m.category for m in matches}
        if matches:
            unmatched = frozenset(c for c in unmatched if c in P.TESTS and any(
                P.TESTS[c](n) for n in P.candidates(order)))
        if unmatched:
            # A tree that does not evaluate may take half-wide inputs; one that splits
            # a tensor in k along its last dimension may take a k-times-wide one (it may
            # evaluate all the same, its pieces broadcasting where they should have
            # met); sizes computed from a head count may need a count of one, alone or
            # with a widened input.
            failed = not is_tensor(primary.value(root))
            widened = widened_roles(root, roles)
            fitted = fitted_roles(root, roles, _sizes) if failed else None
            guesses = (half_width_roles(root, roles) if failed else None, widened, single_count_roles(roles),
                       single_count_roles(widened) if widened is not None else None, fitted,
                       sized_count_roles(roles) if failed else None)
            for second in guesses:
                if second is not None and unmatched:
                    more = _match(root, Probing(second, PRIMARY), unmatched, order)
                    if second is fitted:
                        # Random values stand for the viewed table: a rotation found with
                        # them is as likely a learned pair mix (analysis decides by name).
                        for m in more:
                            m.params["fitted"] = True
                    if more:
                        matches = sorted([*matches, *more], key=lambda m: -m.node.size)
                        unmatched = unmatched - {m.category for m in more}
        return matches
    finally:
        torch.set_num_threads(threads)


def _sizes(args: tuple[Node, ...], roles: dict[str, str], probe: Probe) -> tuple[int, ...] | None:
    """The values of a view's size arguments on ``probe``, when all are whole numbers."""
    probing = Probing(roles, probe)
    values = []
    for arg in args:
        value = probing.value(arg)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        values.append(value)
    return tuple(values)


def _match(root: Node, primary: Probing, categories: frozenset[str], order: list[Node]) -> list[Match]:
    candidates = P.candidates(order)
    if not candidates:
        return []
    roles = primary.roles
    matchers = [m for m in MATCHERS if categories.intersection(m.categories)]
    parents: dict[int, list[Node]] = {}
    for n in order:
        for child in n.children():
            parents.setdefault(id(child), []).append(n)
    covered: set[int] = set()
    found: list[Match] = []
    confirmations: list[Probing] | None = None
    for node in candidates:
        if id(node) in covered:
            continue
        for matcher in matchers:
            if not matcher.precheck(node):
                continue
            match = _safe_check(matcher, node, primary, categories)
            if match is None:
                continue
            if match.category in _ELEMENTWISE and _inside_larger_formula(match, parents):
                continue
            if confirmations is None:
                confirmations = [Probing(roles, p) for p in CONFIRMATIONS]
            if not _confirm(match, matcher, confirmations):
                continue
            found.append(match)
            covered.update(id(n) for n in walk(node))
            break
    return found


_ELEMENTWISE = frozenset({"gelu_tanh", "gelu_erf", "quick_gelu", "silu", "mish"})
_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "pow", "neg", "reciprocal"})


def _inside_larger_formula(match: Match, parents: dict[int, list[Node]]) -> bool:
    """An activation that is one term of more arithmetic on its own input (a
    derivative such as Mish's backward, x*sigmoid(x)*(1 - tanh(...x...)**2)) is not a
    formula a fused activation replaces."""
    x = match.inputs.get("x")
    if x is None:
        return False
    for parent in parents.get(id(match.node), ()):
        if parent.op not in _ARITHMETIC:
            continue
        for other in parent.children():
            if other is not match.node and any(n is x for n in walk(other)):
                return True
    return False


def _safe_check(matcher: Matcher, node: Node, probing: Probing, categories: frozenset[str]) -> Match | None:
    """A check that fails on unusual values (a linear solve, a dtype a comparison
    does not take) is no match: it must not stop the scan."""
    try:
        return matcher.check(node, probing, categories)
    except (RuntimeError, ValueError, TypeError, IndexError, ZeroDivisionError, OverflowError, AttributeError):
        return None


def _confirm(match: Match, matcher: Matcher, probings: list[Probing]) -> bool:
    for probing in probings:
        again = _safe_check(matcher, match.node, probing, frozenset((match.category,)))
        if again is None or again.category != match.category:
            return False
        if probing.float64:
            match.max_abs = max(match.max_abs, again.max_abs)
            match.max_rel = max(match.max_rel, again.max_rel)
    return True
