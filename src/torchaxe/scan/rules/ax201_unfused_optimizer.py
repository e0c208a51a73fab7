"""AX201: an optimizer built without its fused implementation."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: torch.optim class -> (torch_npu.optim replacement, keywords the replacement accepts).
#: Signatures from the torch_npu API reference (torch_npu.optim.NpuFused*).
NPU_FUSED = {
    "Adam": ("NpuFusedAdam", {"lr", "betas", "eps", "weight_decay", "amsgrad"}),
    "AdamW": ("NpuFusedAdamW", {"lr", "betas", "eps", "weight_decay", "amsgrad"}),
    "SGD": ("NpuFusedSGD", {"lr", "momentum", "dampening", "weight_decay", "nesterov"}),
    "Adadelta": ("NpuFusedAdadelta", {"lr", "rho", "eps", "weight_decay"}),
    "RMSprop": ("NpuFusedRMSprop", {"lr", "alpha", "eps", "weight_decay", "momentum", "centered"}),
}

NPU_CONSTRAINTS = (
    "NpuFused optimizers take fp16/fp32 parameters only, refuse zero_grad(set_to_none=True), "
    "and break if a parameter is reallocated (model.cpu(), a parameter set to a new tensor or None)"
)


class UnfusedOptimizer(Rule):
    """
    ## What it does
    Flags a `torch.optim` optimizer built without its fused implementation when the
    installed torch has one for the target (read from the real signature: `Adam`,
    `AdamW`, `SGD` and `Adagrad` take `fused=` in torch 2.13), and on Ascend NPU any
    optimizer that `torch_npu.optim` has a fused twin for.

    ## Why is this bad?
    An unfused optimizer launches several small kernels per parameter (or per group of
    parameters with `foreach`) every step; on an NPU the host spends its time issuing
    them and the device waits. A fused optimizer updates all parameters in one or a
    few kernels.

    ## Example
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ```

    ## Use instead
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)   # cpu, cuda
    opt = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-3)   # npu
    ```

    ## Fix safety
    Unsafe. The fused kernels round differently in the last bits, `fused=True` raises
    at the first step when a parameter is not a floating-point tensor on a supported
    device, and the NPU optimizers accept fp16/fp32 parameters only, refuse
    `zero_grad(set_to_none=True)` and must keep the same parameter objects. Calls with
    `**kwargs` are not flagged: they may already choose an implementation. NPU
    replacements are unverified on Ascend hardware.

    ## References
    - https://pytorch.org/docs/stable/optim.html#algorithms
    - https://www.hiascend.com/document (torch_npu.optim.NpuFusedAdamW)
    """

    code = "AX201"
    name = "unfused-optimizer"
    category = "optimizer_unfused"
    message = "optimizer built without its fused implementation"
    fix_title = "use the fused optimizer"
    fix_safety = Applicability.UNSAFE
    requires_text = ("optim",)
    #: The class name appears in the file even when imported under another name.
    #: "Adam" also covers AdamW, NAdam, RAdam, Adamax and SparseAdam.
    also_requires_text = ("Adam", "SGD", "Adagrad", "Adadelta", "RMSprop", "Rprop", "LBFGS", "Adafactor", "Muon")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/optim.html#algorithms",
        "https://www.hiascend.com/document (torch_npu.optim)",
    )
    examples = (
        Invalid(
            "import torch\nopt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n",
            fixed="import torch\nopt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)\n",
        ),
        Invalid(
            "import torch.optim as optim\nopt = optim.SGD(\n    params,\n    lr=0.1,\n)\n",
            target="cuda",
            fixed="import torch.optim as optim\nopt = optim.SGD(\n    params,\n    lr=0.1,\n    fused=True,\n)\n",
        ),
        Invalid(
            "from torch.optim import Adam as A\nopt = A(params, foreach=True)\n",
            fixed="from torch.optim import Adam as A\nopt = A(params, fused=True)\n",
        ),
        Invalid(
            "import torch\nopt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n",
            target="npu",
            fixed="import torch\nimport torch_npu\nopt = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-3)\n",
        ),
        Invalid("import torch\nopt = torch.optim.RMSprop(params, lr=1e-2, foreach=False)\n", target="npu"),
        Valid("import torch\nopt = torch.optim.AdamW(params, fused=True)\n"),
        Valid("import torch\nopt = torch.optim.AdamW(params, **cfg)\n"),
        Valid("import torch\nopt = torch.optim.AdamW(params, differentiable=True)\n"),
        Valid("import torch\nopt = torch.optim.RMSprop(params)\n", target="cuda"),
        Valid("import torch\nopt = torch.optim.AdamW(params)  # noqa: AX201\n"),
        Valid("from mylib import AdamW\nopt = AdamW(params)\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        name = ctx.call_name(node)
        if not name or not name.startswith("torch.optim.") or name.count(".") != 2:
            return
        cls = name.rsplit(".", 1)[1]
        keywords = {k.arg: k for k in node.keywords}
        if None in keywords or "fused" in keywords:
            return  # **kwargs may choose an implementation; fused= is the user's choice
        if _is_true(keywords.get("differentiable")):
            return  # fused kernels do not support differentiable=True
        if ctx.target == "npu":
            yield from self._npu(node, ctx, cls, keywords)
            return
        if cls not in ctx.capabilities.get("fused_optimizers", ()):
            return
        if "foreach" in keywords:
            edits = [ctx.replace(keywords["foreach"], "fused=True")]
        else:
            edits = ctx.add_keyword(node, "fused=True")
        yield ctx.finding(
            self,
            node,
            f"torch.optim.{cls} runs unfused on {ctx.target}: fused=True updates all parameters "
            f"in one kernel per step (torch {ctx.capabilities.get('torch_version') or '2.x'} supports it)",
            replacement=f"torch.optim.{cls}(..., fused=True)",
            fix=ctx.fix(self, edits, title="pass fused=True"),
        )

    def _npu(self, node: ast.Call, ctx: FileContext, cls: str, keywords: dict) -> Iterable[Finding]:
        if cls not in NPU_FUSED:
            return
        fused, accepted = NPU_FUSED[cls]
        replacement = f"torch_npu.optim.{fused}"
        message = (
            f"torch.optim.{cls} issues many small operators per step on the NPU; "
            f"{replacement} fuses the update ({NPU_CONSTRAINTS}; unverified on Ascend hardware)"
        )
        extra = sorted(set(keywords) - accepted)
        if extra:
            fix = ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY, title=f"use {replacement} (drop {', '.join(extra)})")
        else:
            fix = ctx.fix(self, [ctx.replace(node.func, replacement)], imports=("import torch_npu",), title=f"use {replacement}")
        yield ctx.finding(self, node, message, replacement=f"{replacement}(...)", fix=fix)


def _is_true(keyword: ast.keyword | None) -> bool:
    return keyword is not None and isinstance(keyword.value, ast.Constant) and keyword.value.value is True
