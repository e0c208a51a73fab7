"""AX204: an optimizer from NVIDIA apex where torch or torch_npu has its own fused one."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Iterable

from torchaxe.findings import Applicability, Edit, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules.base import Invalid, Rule, Valid

_KEEP = object()  # keyword passed through unchanged


@dataclass(frozen=True)
class _Mapping:
    """How one apex optimizer's arguments carry over to a replacement class.

    ``keywords`` maps each apex keyword to ``_KEEP`` or to the literal values that
    may be dropped because the replacement behaves the same without them; any other
    keyword or value makes the fix display-only.
    """

    replacement: str
    keywords: dict[str, object] = field(default_factory=dict)
    #: Positional arguments that line up with the replacement's (params, lr, ...).
    positional: int = 2
    #: Keywords the fix adds when absent, because the defaults differ.
    defaults: tuple[tuple[str, str], ...] = ()
    #: A display-only suggestion whatever the arguments (semantics differ).
    advisory: str | None = None


_ADAM_KEYWORDS = {
    "lr": _KEEP,
    "betas": _KEEP,
    "eps": _KEEP,
    "weight_decay": _KEEP,
    "amsgrad": (False,),  # apex raises on amsgrad=True
    "bias_correction": (True,),  # torch always corrects the bias
    "set_grad_none": (True, False),  # under torch 2.x zero_grad() sets None either way
    "master_weights": (False,),
    "use_master": (False,),
}
_SGD_KEYWORDS = {
    "lr": _KEEP,
    "momentum": _KEEP,
    "dampening": _KEEP,
    "weight_decay": _KEEP,
    "nesterov": _KEEP,
    "wd_after_momentum": (False,),
    "materialize_master_grads": (True,),  # only read under apex.amp
    "set_grad_none": (True, False),
}
_ADAGRAD_KEYWORDS = {
    "lr": _KEEP,
    "eps": _KEEP,
    "weight_decay": _KEEP,
    "adagrad_w_mode": (False,),
    "set_grad_none": (True, False),
}
_LAMB_NOTE = (
    "apex's LAMB clips by the global gradient norm (max_grad_norm=1.0), averages gradients and "
    "defaults to weight_decay=0.01, while NpuFusedLamb(params, lr, betas, eps=1e-6, weight_decay=0, "
    "adam=False, use_global_grad_norm=False) does not: set its arguments by hand and compare the loss curves"
)

#: apex class -> target -> mapping. FusedAdam's class depends on adam_w_mode (see _adam).
_TORCH: dict[str, _Mapping] = {
    "FusedSGD": _Mapping("torch.optim.SGD", _SGD_KEYWORDS, positional=6),
    "FusedAdagrad": _Mapping("torch.optim.Adagrad", _ADAGRAD_KEYWORDS),
}
_NPU: dict[str, _Mapping] = {
    "FusedSGD": _Mapping("torch_npu.optim.NpuFusedSGD", _SGD_KEYWORDS, positional=6),
    "FusedLAMB": _Mapping("torch_npu.optim.NpuFusedLamb", advisory=_LAMB_NOTE),
    "FusedMixedPrecisionLamb": _Mapping("torch_npu.optim.NpuFusedLamb", advisory=_LAMB_NOTE),
}


class ApexFusedOptimizer(Rule):
    """
    ## What it does
    Flags an optimizer from `apex.optimizers` (`FusedAdam`, `FusedSGD`,
    `FusedAdagrad`; on npu also `FusedLAMB`) when the target has a fused optimizer
    of its own: `torch.optim.AdamW/Adam/SGD/Adagrad(fused=True)` on cuda and cpu,
    `torch_npu.optim.NpuFusedAdamW/NpuFusedAdam/NpuFusedSGD/NpuFusedLamb` on npu.

    ## Why is this bad?
    apex's kernels are CUDA-only: on cpu and on Ascend NPU the optimizer cannot run
    at all, and the code falls back to, or gets ported to, a slow path. On cuda,
    torch's own fused optimizers do the same multi-tensor update, and with
    `torch.amp.GradScaler` they unscale the gradients and skip overflowing steps
    inside the kernel, where apex needs a separate unscale pass and a host sync;
    apex (a long CUDA build) is then no longer needed.

    `FusedAdam` defaults to `adam_w_mode=True` (decoupled weight decay, i.e. AdamW)
    with `weight_decay=0`, while `torch.optim.AdamW` and `NpuFusedAdamW` default to
    `weight_decay=0.01`: the fix maps `FusedAdam` to the AdamW class and passes
    `weight_decay=0` when the call did not set it (`adam_w_mode=False` maps to Adam).

    ## Example
    ```python
    opt = apex.optimizers.FusedAdam(model.parameters(), lr=1e-3)
    ```

    ## Use instead
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0, fused=True)  # cpu, cuda
    opt = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-3, weight_decay=0)  # npu
    ```

    ## Fix safety
    Unsafe. The arguments map one to one (apex-only switches are dropped only at
    values that change nothing), but fused kernels round differently in the last
    bits, `fused=True` needs floating-point parameters on a supported device, and
    the NPU optimizers accept fp16/fp32 parameters only, refuse
    `zero_grad(set_to_none=True)` and must keep the same parameter objects. The
    fix is display-only when an argument has no counterpart (`bias_correction=False`,
    `master_weights=True`, `**kwargs`, positional arguments in apex-only order),
    when the file also uses `apex.amp` (it wraps the optimizer), and always for LAMB,
    whose apex and NPU versions differ in gradient clipping and defaults. NPU
    replacements are unverified on Ascend hardware.
    """

    code = "AX204"
    name = "apex-fused-optimizer"
    category = "optimizer_unfused"
    message = "NVIDIA apex optimizer where the target has a fused optimizer of its own"
    fix_title = "use the target's own fused optimizer"
    fix_safety = Applicability.UNSAFE
    requires_text = ("apex",)
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/optim.html#algorithms",
        "https://nvidia.github.io/apex/optimizers.html",
        "https://www.hiascend.com/document (torch_npu.optim.NpuFusedAdamW, NpuFusedLamb)",
    )
    examples = (
        Invalid(
            "import apex\nopt = apex.optimizers.FusedAdam(model.parameters(), lr=1e-3)\n",
            target="cuda",
            fixed=(
                "import apex\nimport torch\n"
                "opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0, fused=True)\n"
            ), lines=(2,),
        ),
        Invalid(
            "import torch\nfrom apex.optimizers import FusedAdam\n"
            "opt = FusedAdam(params, lr=1e-3, adam_w_mode=False, weight_decay=1e-4)\n",
            target="cuda",
            fixed=(
                "import torch\nfrom apex.optimizers import FusedAdam\n"
                "opt = torch.optim.Adam(params, lr=1e-3, weight_decay=1e-4, fused=True)\n"
            ), lines=(3,),
        ),
        Invalid(
            "import torch\nfrom apex.optimizers import FusedAdam as FA\nopt = FA(\n    params,\n"
            "    lr=1e-3,\n    bias_correction=True,\n)\n",
            target="npu",
            fixed=(
                "import torch\nfrom apex.optimizers import FusedAdam as FA\nimport torch_npu\n"
                "opt = torch_npu.optim.NpuFusedAdamW(\n    params,\n    lr=1e-3,\n    weight_decay=0,\n)\n"
            ), lines=(3,),
        ),
        Invalid(
            "import torch\nfrom apex.optimizers import FusedSGD\n"
            "opt = FusedSGD(params, 0.1, 0.9, weight_decay=5e-4, nesterov=True)\n",
            fixed=(
                "import torch\nfrom apex.optimizers import FusedSGD\n"
                "opt = torch.optim.SGD(params, 0.1, 0.9, weight_decay=5e-4, nesterov=True, fused=True)\n"
            ), lines=(3,),
        ),
        Invalid(
            "import torch\nfrom apex.optimizers import FusedSGD\nopt = FusedSGD(params, lr=0.1, momentum=0.9)\n",
            target="npu",
            fixed=(
                "import torch\nfrom apex.optimizers import FusedSGD\nimport torch_npu\n"
                "opt = torch_npu.optim.NpuFusedSGD(params, lr=0.1, momentum=0.9)\n"
            ), lines=(3,),
        ),
        Invalid("import apex\nopt = apex.optimizers.FusedLAMB(params, lr=1e-3)\n", target="npu", lines=(2,)),
        Invalid("import apex\nopt = apex.optimizers.FusedAdam(params, lr=1e-3, bias_correction=False)\n", target="cuda", lines=(2,)),
        Invalid("import apex\nopt = apex.optimizers.FusedAdam(params, **cfg)\n", target="cuda", lines=(2,)),
        Invalid(
            "from apex import amp\nfrom apex.optimizers import FusedAdam\nopt = FusedAdam(params)\n"
            "model, opt = amp.initialize(model, opt, opt_level='O2')\n",
            target="cuda", lines=(3,),
        ),
        Valid("import apex\nopt = apex.optimizers.FusedLAMB(params, lr=1e-3)\n", target="cuda"),
        Valid("import apex\nopt = apex.optimizers.FusedNovoGrad(params, lr=1e-3)\n", target="npu"),
        Valid("from apex.optimizers import NpuFusedAdamW\nopt = NpuFusedAdamW(params, lr=1e-3)\n", target="npu"),
        Valid("import torch\nopt = torch.optim.AdamW(params, fused=True)\n", target="cuda"),
        Valid("from mylib.optimizers import FusedAdam\nopt = FusedAdam(params)\n", target="cuda"),
        Valid("import apex\nopt = apex.optimizers.FusedAdam(params)  # noqa: AX204\n", target="cuda"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        name = ctx.call_name(node) or ""
        if not name.startswith("apex.optimizers."):
            return
        cls = name.rsplit(".", 1)[1]
        mapping = _adam(node, ctx.target) if cls == "FusedAdam" else _table(ctx.target).get(cls)
        if mapping is None:
            return
        replacement_cls = mapping.replacement
        if ctx.target != "npu" and replacement_cls.rsplit(".", 1)[1] not in ctx.capabilities.get("fused_optimizers", ()):
            return  # no fused torch kernel on this target: apex is the faster choice
        edits, blockers = _edits(node, ctx, mapping)
        if _uses_apex_amp(ctx):
            blockers.append("the file uses apex.amp, which wraps the optimizer")
        shown = f"{replacement_cls}(...{', fused=True' if ctx.target != 'npu' else ''})"
        if mapping.advisory or blockers:
            reason = mapping.advisory or "; ".join(blockers)
            fix = ctx.fix(
                self, [], applicability=Applicability.DISPLAY_ONLY, title=f"use {replacement_cls} ({reason})"
            )
            safety = f"Display-only: {reason}"
        else:
            imports = ("import torch_npu",) if ctx.target == "npu" else ("import torch",)
            fix = ctx.fix(self, edits, imports=imports, title=f"use {replacement_cls}")
            safety = "Fix is unsafe: fused kernels round differently in the last bits"
        yield ctx.finding(
            self,
            node,
            f"{_why(cls, ctx.target, replacement_cls)}. {_adam_note(cls, replacement_cls)}{safety}",
            replacement=shown,
            fix=fix,
        )


def _table(target: str) -> dict[str, _Mapping]:
    return _NPU if target == "npu" else _TORCH


def _adam(call: ast.Call, target: str) -> _Mapping:
    """FusedAdam's replacement: the AdamW class unless ``adam_w_mode=False`` (a
    non-literal mode leaves the fix display-only, through the keyword check)."""
    mode = next((k.value for k in call.keywords if k.arg == "adam_w_mode"), None)
    decoupled = not (isinstance(mode, ast.Constant) and mode.value in (False, 0))
    keywords = {**_ADAM_KEYWORDS, "adam_w_mode": (True, False, 1, 0)}
    if target == "npu":
        keywords["capturable"] = (False,)
        cls = "torch_npu.optim.NpuFusedAdamW" if decoupled else "torch_npu.optim.NpuFusedAdam"
    else:
        keywords["capturable"] = _KEEP
        cls = "torch.optim.AdamW" if decoupled else "torch.optim.Adam"
    defaults = (("weight_decay", "0"),) if decoupled else ()
    return _Mapping(cls, keywords, defaults=defaults)


def _edits(call: ast.Call, ctx: FileContext, mapping: _Mapping) -> tuple[list[Edit], list[str]]:
    """The edits turning the apex call into the replacement call, and the reasons
    (if any) why they would not be exact."""
    blockers: list[str] = []
    if mapping.advisory:
        return [], blockers
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        blockers.append("*args/**kwargs may pass apex-only settings")
    if len(call.args) > mapping.positional:
        blockers.append("positional arguments after lr follow apex's order")
    edits = [ctx.replace(call.func, mapping.replacement)]
    present = set()
    for kw in call.keywords:
        if kw.arg is None:
            continue
        present.add(kw.arg)
        rule = mapping.keywords.get(kw.arg)
        if rule is _KEEP or kw.arg == "params":
            continue
        if rule is None:
            blockers.append(f"{kw.arg}= has no counterpart")
            continue
        assert isinstance(rule, tuple)
        if not isinstance(kw.value, ast.Constant):
            blockers.append(f"{kw.arg}={ctx.text(kw.value)} is only known at run time")
            continue
        value = kw.value.value
        if not any(value == v and type(value) is type(v) for v in rule):
            blockers.append(f"{kw.arg}={ctx.text(kw.value)} has no counterpart")
            continue
        drop = ctx.remove_argument(call, kw)
        if drop is None:
            blockers.append(f"{kw.arg}= cannot be removed cleanly (comments around it)")
            continue
        edits.append(drop)
    adds = [f"{k}={v}" for k, v in mapping.defaults if k not in present]
    if not mapping.replacement.startswith("torch_npu."):
        adds.append("fused=True")
    if adds:
        edits.extend(ctx.add_keyword(call, ", ".join(adds)))
    return edits, blockers


def _why(cls: str, target: str, replacement: str) -> str:
    if target == "npu":
        return (
            f"apex.optimizers.{cls} runs CUDA kernels that do not exist on Ascend NPU; {replacement} fuses "
            "the update on the NPU (fp16/fp32 parameters only, refuses zero_grad(set_to_none=True), "
            "parameters must keep their identity; unverified on Ascend hardware)"
        )
    if target == "cpu":
        return (
            f"apex.optimizers.{cls} needs CUDA and cannot run on cpu; {replacement}(..., fused=True) "
            "has a fused CPU kernel that updates all parameters in one pass"
        )
    return (
        f"apex.optimizers.{cls} is a separately built CUDA extension; {replacement}(..., fused=True) does "
        "the same multi-tensor update in torch itself, and with torch.amp.GradScaler unscales and skips "
        "overflowing steps inside the kernel instead of a separate unscale pass and host sync (and apex "
        "is no longer needed)"
    )


def _adam_note(cls: str, replacement: str) -> str:
    if cls != "FusedAdam":
        return ""
    if replacement.endswith("AdamW"):
        return (
            "FusedAdam defaults to adam_w_mode=True (AdamW's decoupled weight decay) with weight_decay=0, "
            "where the AdamW classes default to 0.01, so weight_decay=0 is passed when the call does not set it. "
        )
    return "adam_w_mode=False means L2 weight decay, i.e. Adam. "


def _uses_apex_amp(ctx: FileContext) -> bool:
    key = "ax204.apex_amp"
    if key not in ctx.cache:
        ctx.cache[key] = any(v == "apex.amp" or v.startswith("apex.amp.") for v in ctx.imports.values()) or any(
            (ctx.qualified_name(n) or "").startswith("apex.amp.")
            for n in ctx.nodes(ast.Attribute)
        )
    return ctx.cache[key]
