"""The scanner's replacements, swapped in at run time.

The formula rules (AX110-AX120) recognise hand-written GELUs, norms and attention in
the source of a module's class by their values; ``swaps.py`` says which of them a
fused operator can replace at run time (a *whole* function that computes the
formula). For the tuner's subgraphs the function is replaced without touching the
file (the ``replace`` knob, ``replace.py``, does it for every instance of a class):

* a method (``RMSNorm.forward``) is replaced on the module instance;
* a module-level function (``gelu_tanh``) is replaced, for the modules of the
  subgraph only, by re-binding the methods that call it to a copy of their globals
  in which the name points to the fused operator (the compiled code is reused: no
  source is executed).

Attention is usually spread over several statements (``q @ k.transpose``, a scale, a
mask, softmax, ``@ v``). Where the scanner recognised it (no dropout, heads before
sequence), the subgraph is captured by torch.compile with a backend that rewrites the
captured graph: the chain ``matmul -> scale -> masked_fill -> softmax -> matmul`` becomes
one ``F.scaled_dot_product_attention`` call (then runs as is, or goes on to the
compile backend). Other spread matches have no runtime replacement; the plan says
so and ``torchaxe fix`` or a hand edit applies them. Every replacement is then checked
against eager like any other strategy.
"""

from __future__ import annotations

import inspect
import operator
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchaxe.tune.signature import class_file
from torchaxe.tune.swaps import SUPPORTED, FunctionSwap, file_swaps, reference

__all__ = ["SUPPORTED", "AttentionRewrite", "FunctionSwap", "ReplacementPlan", "apply_plan", "fused_function",
           "plan_for", "rewrite_attention"]


@dataclass
class ReplacementPlan:
    """What the scanner found for the classes of one subgraph."""

    swaps: list[FunctionSwap] = field(default_factory=list)
    #: Recognised attention to rewrite to SDPA in the captured graph ("attention in C.forward").
    rewrites: list[str] = field(default_factory=list)
    #: Recognised formulas that cannot be swapped at run time, with the reason.
    skipped: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swaps or self.rewrites)


# ------------------------------------------------------------------ finding


def plan_for(module: nn.Module, target: str = "cpu") -> ReplacementPlan:
    """The runtime replacements for every class used in ``module`` (and the functions
    their methods call), from the formula rules' matches in their source files."""
    plan = ReplacementPlan()
    files: dict[str, set[str]] = {}
    for sub in module.modules():
        path = class_file(type(sub))
        if path and not path.startswith(sys.prefix):
            files.setdefault(path, set()).add(type(sub).__qualname__)
    for path, classes in sorted(files.items()):
        found = file_swaps(path, target, owners=classes)
        plan.swaps.extend(found.swaps)
        plan.rewrites.extend(found.rewrites)
        plan.skipped.extend(found.skipped)
    return plan


# ------------------------------------------------------------------ applying


def fused_function(swap: FunctionSwap, fn: Callable) -> Callable:
    """A function with ``fn``'s signature that calls the fused operator."""
    signature = inspect.signature(fn)
    params = set(signature.parameters)
    refs = {role: reference(text, params) for role, text in swap.inputs if text is not None}
    constants = dict(swap.params)

    def value(role: str, bound: dict[str, Any], default: Any = None) -> Any:
        ref = refs.get(role)
        if ref is None:
            return constants.get(role, default)
        if isinstance(ref, float):
            return ref
        name, chain = ref
        out = bound[name]
        for attr in chain:
            out = getattr(out, attr)
        return out

    category = swap.category

    def fused(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x = value("x", a)
        if category == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        if category == "gelu_erf":
            return F.gelu(x)
        if category == "silu":
            return F.silu(x)
        if category == "mish":
            return F.mish(x)
        eps = float(value("eps", a, 1e-5))
        weight = value("weight", a)
        if category == "rms_norm":
            # No eps seen (F.normalize's clamp): zero rows stay zeros, not NaN.
            return F.rms_norm(x, (x.shape[-1],), weight, eps or 1e-24)
        return F.layer_norm(x, (x.shape[-1],), weight, value("bias", a), eps)

    fused.__name__ = getattr(fn, "__name__", "fused")
    fused.__torchaxe_replaces__ = swap.label()  # type: ignore[attr-defined]
    return fused


def _defining_module(swap: FunctionSwap, classes: dict[str, type]) -> dict[str, Any] | None:
    """The globals of the file that defines the swapped function, through a method of
    a class from that file (not ``sys.modules``: see ``signature.class_file``)."""
    for cls in classes.values():
        for value in vars(cls).values():
            if isinstance(value, types.FunctionType) and value.__code__.co_filename == swap.file:
                return value.__globals__
    return None


def _names_in(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_in(const)
    return names


def _swapped_namespace(namespace: dict[str, Any], replaced: dict[str, Callable]) -> dict[str, Any]:
    """A copy of a module's globals with ``replaced`` swapped in, as the ``__dict__``
    of a real module registered in ``sys.modules`` (torch.compile looks functions'
    globals up by module name when it guards them)."""
    name = f"torchaxe._swapped.{namespace.get('__name__', 'module')}.{len(_SWAPPED)}"
    shadow = types.ModuleType(name)
    shadow.__dict__.update({k: v for k, v in namespace.items() if k not in ("__name__", "__spec__", "__loader__")})
    shadow.__dict__.update(replaced)
    sys.modules[name] = shadow
    _SWAPPED.append(shadow)
    return shadow.__dict__


_SWAPPED: list[types.ModuleType] = []


def apply_plan(module: nn.Module, plan: ReplacementPlan) -> list[str]:
    """Swap the replacements into ``module``'s submodules in place (instance
    attributes only: classes, files and ``state_dict`` keys are untouched). Returns
    what was swapped."""
    done: list[str] = []
    subs = list(module.modules())
    classes = {type(s).__qualname__: type(s) for s in subs}
    function_swaps: dict[int, tuple[dict[str, Any], dict[str, Callable]]] = {}
    for swap in plan.swaps:
        if swap.owner is not None:
            cls = classes.get(swap.owner)
            original = getattr(cls, swap.name, None) if cls is not None else None
            if not isinstance(original, types.FunctionType):
                continue
            fused = fused_function(swap, original)
            for sub in subs:
                if type(sub) is cls:
                    object.__setattr__(sub, swap.name, types.MethodType(fused, sub))
            done.append(swap.label())
            continue
        namespace = _defining_module(swap, classes)
        original = namespace.get(swap.name) if namespace is not None else None
        if not isinstance(original, types.FunctionType):
            continue
        key = id(namespace)
        function_swaps.setdefault(key, (namespace, {}))[1][swap.name] = fused_function(swap, original)
        done.append(swap.label())
    for namespace, replaced in function_swaps.values():
        globals_copy = _swapped_namespace(namespace, replaced)
        for sub in subs:
            cls = type(sub)
            for attr, fn in vars(cls).items():
                if not isinstance(fn, types.FunctionType) or fn.__globals__ is not namespace:
                    continue
                if attr in vars(sub) or not (_names_in(fn.__code__) & set(replaced)):
                    continue
                rebound = types.FunctionType(fn.__code__, globals_copy, fn.__name__, fn.__defaults__, fn.__closure__)
                rebound.__kwdefaults__ = fn.__kwdefaults__
                rebound.__qualname__ = fn.__qualname__
                object.__setattr__(sub, attr, types.MethodType(rebound, sub))
    return done


# ------------------------------------------------------------------ attention in the captured graph

_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax}
_MATMUL = {operator.matmul, torch.matmul, torch.bmm}


def _is_call(node: Any, targets: set[Any], method: str | None = None) -> bool:
    if node.op == "call_function" and node.target in targets:
        return True
    return method is not None and node.op == "call_method" and node.target == method


def _last_two_swapped(node: Any) -> Any:
    """``k`` when ``node`` is ``k.transpose(-2, -1)`` (or ``-1, -2``), else None."""
    if node.op == "call_method" and node.target == "transpose" and len(node.args) == 3:
        dims = set(node.args[1:])
    elif node.op == "call_function" and node.target is torch.transpose and len(node.args) == 3:
        dims = set(node.args[1:])
    else:
        return None
    return node.args[0] if dims == {-2, -1} else None


def rewrite_attention(gm: Any) -> int:
    """Rewrite every ``softmax(mask(q @ k^T * scale)) @ v`` chain of an FX graph
    captured by torch.compile into ``F.scaled_dot_product_attention``; returns how
    many. A chain whose intermediates are used elsewhere is left as it is."""
    graph = gm.graph
    done = 0
    for soft in list(graph.nodes):
        if not _is_call(soft, _SOFTMAX, "softmax"):
            continue
        dim = soft.kwargs.get("dim", soft.args[1] if len(soft.args) > 1 else None)
        if dim != -1 or len(soft.users) != 1:
            continue
        out = next(iter(soft.users))
        if not _is_call(out, _MATMUL) or out.args[0] is not soft or len(out.args) != 2:
            continue
        v = out.args[1]
        node = soft.args[0]
        keep = None
        drop_mask = None
        if node.op == "call_method" and node.target == "masked_fill" and len(node.args) == 3:
            fill = node.args[2]
            if not (isinstance(fill, float) and fill == float("-inf")) or len(node.users) != 1:
                continue
            drop_mask, node = node.args[1], node.args[0]
            if drop_mask.op == "call_function" and drop_mask.target is operator.invert:
                keep = drop_mask.args[0]
        scale = 1.0
        if node.op == "call_function" and node.target in (operator.truediv, operator.mul) \
                and isinstance(node.args[1], (int, float)) and len(node.users) == 1:
            scale = 1.0 / node.args[1] if node.target is operator.truediv else float(node.args[1])
            node = node.args[0]
        if not _is_call(node, _MATMUL) or len(node.users) != 1 or len(node.args) != 2:
            continue
        q, kt = node.args
        k = _last_two_swapped(kt)
        if k is None or len(kt.users) != 1:
            continue
        with graph.inserting_before(out):
            if drop_mask is not None and keep is None:
                keep = graph.call_function(operator.invert, (drop_mask,))
            kwargs = {"attn_mask": keep, "scale": scale} if keep is not None else {"scale": scale}
            fused = graph.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
        out.replace_all_uses_with(fused)
        done += 1
    if done:
        graph.eliminate_dead_code()
        gm.recompile()
    return done


class AttentionRewrite:
    """A torch.compile backend: rewrite attention to SDPA, then run the graph as it
    is (``then=None``) or hand it to the named backend (``"inductor"``, ...)."""

    def __init__(self, then: str | None = None) -> None:
        self.then = then
        self.rewritten = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.rewritten += rewrite_attention(gm)
        if self.then is None:
            return gm.forward
        from torch._dynamo import lookup_backend

        return lookup_backend(self.then)(gm, example_inputs)
