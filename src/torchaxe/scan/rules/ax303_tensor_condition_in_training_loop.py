"""AX303: Python control flow (if, while, assert, x if c else y) on a tensor's value
on every training step."""

from __future__ import annotations

import ast
from typing import Iterable, Iterator

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules import _tensors as T
from torchaxe.scan.rules.base import Invalid, Rule, Valid

KEYWORD = {ast.If: "if", ast.While: "while", ast.Assert: "assert", ast.IfExp: "... if ... else"}


class TensorConditionInTrainingLoop(Rule):
    """
    ## What it does
    Flags `if`, `while`, `assert` and conditional expressions whose condition is a
    tensor (`if torch.isnan(loss):`, `if loss > best:`, `assert mask.any()`) inside a
    training loop (a loop whose own body calls `backward()` or an optimizer's `step()`,
    or the body of a step function that does, such as `def train_step(batch)`, that the
    file calls in a loop or from another step function; a loss scaler called with the
    loss and the optimizer, `scaler.step(opt)`, `accelerator.backward(loss)` and a
    Lightning `training_step` that steps by hand count as steps). Each element of `any(...)` or `all(...)` over a generator is
    one condition. Identity tests (`if loss is None`) are not tensor conditions.

    ## Why is this bad?
    Python must know the condition's truth to choose a branch, so it calls
    `Tensor.__bool__`, which copies the value to the host: the host blocks until the
    device has finished every kernel queued so far, every step, and cannot queue the
    next step meanwhile. A NaN check on every step costs as much as printing the loss
    on every step.

    Not reported on the `cpu` target (no device queue to drain), in evaluation loops,
    in functions defined inside the loop, or on a few steps only (inside an
    `if step % N == 0:` branch, or after `step % N == 0 and` in the same condition).

    ## Example
    ```python
    for x, y in loader:
        loss = criterion(model(x), y)
        if torch.isnan(loss):
            continue
        loss.backward()
        opt.step()
    ```

    ## Use instead
    ```python
    for step, (x, y) in enumerate(loader):
        loss = criterion(model(x), y)
        bad |= ~torch.isfinite(loss)   # stays on the device
        loss.backward()
        opt.step()
        if step % 100 == 0 and bad:    # one wait every 100 steps
            raise RuntimeError("loss diverged")
    ```
    Or keep the decision on the device: `torch.where(cond, a, b)`, multiplying by a
    mask, or `torch.nan_to_num`. `torch.cuda.amp.GradScaler` already skips steps with
    non-finite gradients without a host check.

    ## Fix safety
    Display-only: the rewrite changes control flow and is the user's to make.
    """

    code = "AX303"
    name = "tensor-condition-in-training-loop"
    category = "host_sync_in_loop"
    message = "a branch depends on a tensor's value on every training step"
    fix_title = "decide on the device (torch.where, masks) or check the condition every N steps"
    fix_safety = Applicability.DISPLAY_ONLY
    targets = ("cuda", "npu")
    requires_text = ("backward", "step(")
    node_types = (ast.If, ast.While, ast.Assert, ast.IfExp)
    references = (
        "https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution",
        "https://pytorch.org/docs/stable/generated/torch.where.html",
    )
    examples = (
        Invalid(
            "import torch\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    if torch.isnan(loss):\n"
            "        continue\n"
            "    loss.backward()\n"
            "    opt.step()\n",
            target="cuda", lines=(4,),
        ),
        Invalid(
            "import torch as T\n"
            "def fit(net, loader, optimizer):\n"
            "    for batch in loader:\n"
            "        loss = net(batch)\n"
            "        loss.backward()\n"
            "        norm = T.nn.utils.clip_grad_norm_(net.parameters(), 1.0)\n"
            "        if args.check and not T.isfinite(norm).all():\n"
            "            optimizer.zero_grad()\n"
            "        optimizer.step()\n"
            "        assert loss.abs() < 1e6, 'diverged'\n"
            "        best = loss if loss < best else best\n",
            target="npu", lines=(7, 10, 11),
        ),
        Invalid(
            "while loss > tol:\n    loss = loss_fn(model(x), y)\n    loss.backward()\n    opt.step()\n",
            target="cuda", lines=(1,),
        ),
        Valid(
            "import torch\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    if torch.isnan(loss):\n"
            "        continue\n"
            "    loss.backward()\n"
            "    opt.step()\n",
            target="cpu",
        ),
        Valid(
            "import torch\n"
            "for step, (x, y) in enumerate(loader):\n"
            "    out = model(x)\n"
            "    if out.aux is not None and model.training and step > warmup:\n"
            "        loss = out.loss + out.aux\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    if step % 100 == 0 and torch.isnan(loss):\n"
            "        break\n"
            "    if step % log_every == 0:\n"
            "        assert torch.isfinite(loss)\n"
            "    if torch.isnan(loss):  # noqa: AX303\n"
            "        break\n",
            target="cuda",
        ),
        Valid(
            "import torch\n"
            "for x, y in val_loader:\n"
            "    with torch.no_grad():\n"
            "        loss = criterion(model(x), y)\n"
            "    if loss < best:\n"
            "        best = loss\n",
            target="cuda",
        ),
        Valid(
            "import torch\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    def is_bad(v):\n"
            "        return bool(torch.isnan(v))\n"
            "    keep = [p for p in params if p.grad is not None]\n",
            target="cuda",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        test: ast.AST = node.test  # type: ignore[attr-defined]
        loop = ctx.training_loop(node, test)
        if loop is None or T.rarely_run(ctx, loop, node, test):
            return
        tensors = T.tensors_at(ctx)
        culprit = next((atom for atom in _atoms(test) if tensors.is_tensor(atom)), None)
        if culprit is None:
            return
        keyword = KEYWORD[type(node)]
        yield ctx.finding(
            self,
            culprit,
            f"`{keyword} {T.describe(ctx, culprit)}` branches on a tensor inside the training loop: "
            f"Python reads the value to the host, and {T.sync_cost(ctx.target)}; keep the decision "
            "on the device (torch.where, a mask) or accumulate the condition and check it every N steps",
            replacement="bad |= ~torch.isfinite(loss)  # test `bad` every N steps",
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
        )


def _atoms(test: ast.AST) -> Iterator[ast.AST]:
    """The parts of a condition whose truth Python asks for, in evaluation order,
    stopping after a ``step % N == 0`` guard that makes the rest run rarely."""
    if isinstance(test, ast.BoolOp):
        for value in test.values:
            yield from _atoms(value)
            if isinstance(test.op, ast.And) and T.modulo_guard(value) == "body":
                return
    elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        yield from _atoms(test.operand)
    elif isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id in ("any", "all") \
            and len(test.args) == 1 and isinstance(test.args[0], (ast.GeneratorExp, ast.ListComp)):
        # ``any(not torch.isfinite(p.grad).all() for p in params)``: one read per element
        yield from _atoms(test.args[0].elt)
    else:
        yield test
