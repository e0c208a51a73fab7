"""AX202: gradients zeroed in place instead of released."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Edit, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules.ax201_unfused_optimizer import NPU_FUSED
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Modules whose ``NpuFused*`` optimizers keep all gradients in one combined buffer.
_NPU_FUSED_MODULES = ("torch_npu.optim.", "apex.optimizers.")

NPU_NOTE = (
    "torch_npu's NpuFused* optimizers refuse set_to_none=True and break when gradients are "
    "freed, so keep set_to_none=False wherever they are used"
)


class ZeroGradWithoutSetToNone(Rule):
    """
    ## What it does
    Flags `zero_grad(set_to_none=False)` (or `zero_grad(False)`), on an optimizer or
    a module.

    ## Why is this bad?
    Filling every gradient with zeros launches one memset kernel per parameter (or
    per group with `foreach`) every step, and the next backward pass then adds into
    those zeros instead of writing fresh gradients. `set_to_none=True`, the default
    since torch 2.0, just drops the references: no kernels, and the memory is free
    until backward needs it again.

    ## Example
    ```python
    optimizer.zero_grad(set_to_none=False)
    ```

    ## Use instead
    ```python
    optimizer.zero_grad()
    ```

    ## Fix safety
    Unsafe. After the change a parameter's `.grad` is `None` (not zeros) until
    backward writes it, so code that reads or updates `.grad` after `zero_grad` (a
    gradient norm, a hand-written update, a hook) may fail, and `torch.optim`
    optimizers skip parameters whose gradient is `None` instead of stepping them
    with a zero gradient (which matters with momentum or weight decay). On npu the
    rule stays silent in a file that uses a `NpuFused*` optimizer, since those refuse
    `set_to_none=True`; its fix is display-only in a file whose `torch.optim`
    optimizer AX201 would turn into one.
    """

    code = "AX202"
    name = "zero-grad-without-set-to-none"
    category = "zero_grad_no_set_to_none"
    message = "zero_grad(set_to_none=False) fills every gradient with zeros each step"
    fix_title = "drop set_to_none=False (the default sets gradients to None)"
    fix_safety = Applicability.UNSAFE
    requires_text = ("zero_grad",)
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/generated/torch.optim.Optimizer.zero_grad.html",
        "https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#use-parameter-grad-none-instead-of-model-zero-grad-or-optimizer-zero-grad",
    )
    examples = (
        Invalid(
            "import torch\nopt = torch.optim.SGD(params, lr=0.1)\nopt.zero_grad(set_to_none=False)\n",
            fixed="import torch\nopt = torch.optim.SGD(params, lr=0.1)\nopt.zero_grad()\n", lines=(3,),
        ),
        Invalid("import torch\nmodel.zero_grad(False)\n", target="cuda", fixed="import torch\nmodel.zero_grad()\n", lines=(2,)),
        Invalid(
            "import torch\nself.optimizer.zero_grad(\n    set_to_none=False,\n)\n",
            fixed="import torch\nself.optimizer.zero_grad()\n", lines=(2,),
        ),
        Invalid(
            "import torch\nfor x in data:\n    model.zero_grad(set_to_none=False)\n    opt.zero_grad(set_to_none=False)\n",
            target="npu",
            fixed="import torch\nfor x in data:\n    model.zero_grad()\n    opt.zero_grad()\n", lines=(3, 4),
        ),
        Invalid(
            "import torch\nopt = torch.optim.AdamW(params)\nopt.zero_grad(set_to_none=False)\n",
            target="npu", lines=(3,),
        ),
        Valid("import torch\nopt.zero_grad()\n"),
        Valid("import torch\nopt.zero_grad(set_to_none=True)\n"),
        Valid("import torch\nopt.zero_grad(set_to_none=cfg.set_to_none)\n"),
        Valid("import torch\nopt.zero_grad(set_to_none=False)  # noqa: AX202\n"),
        Valid(
            "import torch_npu\nopt = torch_npu.optim.NpuFusedAdamW(model.parameters())\n"
            "model.zero_grad(set_to_none=False)\n",
            target="npu",
        ),
        Valid(
            "from apex.optimizers import NpuFusedSGD\nopt = NpuFusedSGD(model.parameters(), lr=0.1)\n"
            "opt.zero_grad(set_to_none=False)\n",
            target="npu",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr == "zero_grad"):
            return
        flag = _set_to_none_argument(node)
        if flag is None or not (isinstance(flag, ast.Constant) and flag.value is False):
            return
        fix = ctx.fix(self, [_remove_only_argument(ctx, node, flag)])
        note = ""
        safety = "Fix is unsafe: .grad reads as None, not zeros, until the next backward"
        if ctx.target == "npu":
            if _uses_npu_fused(ctx):
                return  # NpuFused optimizers need set_to_none=False
            note = f"; on npu, {NPU_NOTE}"
            if _becomes_npu_fused(ctx):
                fix = ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY)
                safety = (
                    "Display-only here: this file's torch.optim optimizer has an NpuFused twin (AX201), "
                    "which would need set_to_none=False"
                )
        message = (
            f"zero_grad(set_to_none=False) writes zeros into every gradient each step: one memset kernel per "
            f"parameter to launch and run on {ctx.target}, and gradient memory stays allocated between "
            f"steps; zero_grad() (set_to_none=True, the default since torch 2.0) just drops them{note}. {safety}"
        )
        yield ctx.finding(self, node, message, replacement=f"{ctx.text(func)}()", fix=fix)


def _set_to_none_argument(call: ast.Call) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == "set_to_none":
            return kw.value
    if len(call.args) == 1 and not call.keywords and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    return None


def _remove_only_argument(ctx: FileContext, call: ast.Call, value: ast.expr) -> Edit:
    """Remove the argument (emptying the parentheses when it is the only one)."""
    argument: ast.AST = next((kw for kw in call.keywords if kw.value is value), value)
    return ctx.remove_argument(call, argument) or Edit(ctx.start(argument), ctx.end(argument), "")


def _uses_npu_fused(ctx: FileContext) -> bool:
    """Whether the file names a ``NpuFused*`` optimizer class (torch_npu or Ascend apex)."""
    key = "ax202.npu_fused"
    if key not in ctx.cache:
        found = False
        for node in ctx.nodes(ast.Name, ast.Attribute):
            # The literal dotted text counts too: the fixer adds `import torch_npu`
            # only after its last pass, so AX201's rewrite is seen unimported.
            name = ctx.qualified_name(node) or _dotted(node)
            if name.startswith(_NPU_FUSED_MODULES) and name.rsplit(".", 1)[-1].startswith("NpuFused"):
                found = True
                break
        ctx.cache[key] = found
    return ctx.cache[key]


def _dotted(node: ast.AST) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(node.id)
    return ".".join(reversed(parts))


def _becomes_npu_fused(ctx: FileContext) -> bool:
    """Whether the file builds a ``torch.optim`` optimizer that has a torch_npu fused
    twin (and no ``fused=``/``**kwargs`` to say otherwise): AX201 proposes the switch."""
    key = "ax202.becomes_npu_fused"
    if key not in ctx.cache:
        ctx.cache[key] = any(
            isinstance(node, ast.Call)
            and (ctx.call_name(node) or "").startswith("torch.optim.")
            and (ctx.call_name(node) or "").rsplit(".", 1)[-1] in NPU_FUSED
            and not any(k.arg in (None, "fused") for k in node.keywords)
            for node in ctx.nodes(ast.Call)
        )
    return ctx.cache[key]
