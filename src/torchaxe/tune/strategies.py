"""Tuning strategies: ways to run one subgraph, each applied to a module in place.

A strategy changes only the module object it is given (instance attributes,
``module.compile`` -- or, for torch's own layers, which that leaves eager, a compiled
``forward``: see runtime/compile_module.py --, parameter memory format), never its
class, its source file or its ``state_dict`` keys, so the same call that built a candidate during tuning swaps the
winner into the user's model later (:func:`torchaxe.tune.apply`).

=========================  ===============================================================
``eager``                  the module as written (the reference every candidate is checked against)
``compile``                ``module.compile()``: torch.compile, default mode
``max-autotune``           ``module.compile(mode="max-autotune-no-cudagraphs")``
``channels-last``          parameters and 4-D inputs in channels_last (modules with 2-D convolutions)
``replace``                the formula rules' fused operators swapped in (see ``replacements.py``)
``replace+compile``        both of the above
``aoe``                    Ascend AOE through torch_npu (npu only; see ``aoe.py``)
=========================  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from torchaxe.runtime.compile_module import compile_in_place
from torchaxe.tune import replacements

#: Every strategy name, in the order they are tried.
ALL = ("eager", "compile", "max-autotune", "channels-last", "replace", "replace+compile", "aoe")
#: The strategies that compile the subgraph with torch.compile.
COMPILING = ("compile", "max-autotune", "replace+compile")
MAX_AUTOTUNE_MODE = "max-autotune-no-cudagraphs"


@dataclass
class StrategyContext:
    """What a strategy needs to know besides the module."""

    #: cpu, cuda or npu.
    target: str = "cpu"
    #: The torch.compile backend: "inductor" normally; tests use "eager" or "aot_eager",
    #: which exercise the same capture without the minutes of code generation.
    compile_backend: str = "inductor"
    #: The scanner's replacements for this subgraph (computed when first needed).
    plan: replacements.ReplacementPlan | None = None
    #: Runs AOE on a dumped graph folder (injectable; see aoe.py).
    aoe_runner: Callable[..., Any] | None = None
    #: Runs the subgraph's example once (set by the tuner; None when applying).
    run_example: Callable[[nn.Module], None] | None = None
    notes: list[str] = field(default_factory=list)

    def replacement_plan(self, module: nn.Module) -> replacements.ReplacementPlan:
        if self.plan is None:
            try:
                self.plan = replacements.plan_for(module, self.target)
            except Exception as exc:  # noqa: BLE001 - the scanner is an aid here; never fatal
                self.plan = replacements.ReplacementPlan(skipped=[f"scanning the sources failed: {exc}"])
        return self.plan


def _compile_kwargs(ctx: StrategyContext, mode: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"backend": ctx.compile_backend}
    # Modes are inductor's; other backends take none.
    if mode is not None and ctx.compile_backend == "inductor":
        kwargs["mode"] = mode
    return kwargs


def _has_conv2d(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in module.modules())


def unavailable(name: str, module: nn.Module, ctx: StrategyContext) -> str | None:
    """Why ``name`` does not apply to this subgraph here, or None when it does."""
    if name not in ALL:
        return f"unknown strategy {name!r}"
    if name in COMPILING and not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if name == "channels-last" and not _has_conv2d(module):
        return "no 2-D convolution in the subgraph"
    if name in ("replace", "replace+compile"):
        plan = ctx.replacement_plan(module)
        if not plan:
            why = "; ".join(plan.skipped[:2])
            return "no formula the scanner recognised can be swapped at run time" + (f" ({why})" if why else "")
    if name == "aoe":
        if ctx.target != "npu":
            return "AOE tunes Ascend NPU operators only"
        from torchaxe.backends.npu import aoe_available

        missing = aoe_available()
        if missing:
            return missing
    return None


def apply(name: str, module: nn.Module, ctx: StrategyContext) -> list[str]:
    """Apply strategy ``name`` to ``module`` in place; returns notes on what it did."""
    if name == "eager":
        return []
    if name == "compile":
        compile_in_place(module, **_compile_kwargs(ctx, None))
        return [f"torch.compile (backend {ctx.compile_backend})"]
    if name == "max-autotune":
        compile_in_place(module, **_compile_kwargs(ctx, MAX_AUTOTUNE_MODE))
        return [f"torch.compile mode {MAX_AUTOTUNE_MODE} (backend {ctx.compile_backend})"]
    if name == "channels-last":
        module.to(memory_format=torch.channels_last)
        module.register_forward_pre_hook(_channels_last_inputs)
        return ["parameters and 4-D inputs in channels_last"]
    if name in ("replace", "replace+compile"):
        plan = ctx.replacement_plan(module)
        done = replacements.apply_plan(module, plan)
        then = ctx.compile_backend if name == "replace+compile" else None
        if plan.rewrites:
            module.compile(backend=replacements.AttentionRewrite(then))
            done.extend(f"{r} -> F.scaled_dot_product_attention (rewritten in the captured graph)"
                        for r in plan.rewrites)
        elif then is not None:
            compile_in_place(module, **_compile_kwargs(ctx, None))
        if then is not None:
            done.append(f"torch.compile (backend {ctx.compile_backend})")
        return done
    if name == "aoe":
        from torchaxe.tune import aoe

        return aoe.apply(module, ctx)
    raise ValueError(f"unknown strategy {name!r}")


def _channels_last_inputs(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4
                 else a for a in args)
