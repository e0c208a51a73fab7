"""AX302: a tensor turned into a Python value (float(), int(), print, an f-string...)
on every training step."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules import _tensors as T
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Builtins that convert their first argument through Tensor.__float__/__str__/...
CONVERTERS = frozenset({"float", "int", "bool", "complex", "str", "repr", "format"})
#: Logger methods and the position of the value they read: TensorBoard's
#: SummaryWriter.add_scalar copies a tensor value to the host (tqdm's set_postfix,
#: which formats its keyword values with str(), is handled separately).
SCALAR_LOGGERS = {"add_scalar": 1}


class TensorToPythonInTrainingLoop(Rule):
    """
    ## What it does
    Flags, inside a training loop (a loop whose own body calls `backward()` or an
    optimizer's `step()`, or the body of a step function that does, such as
    `def train_step(batch)`, that the file calls in a loop or from another step function; a loss scaler called with the
    loss and the optimizer, `scaler.step(opt)`, `accelerator.backward(loss)` and a
    Lightning `training_step` that steps by hand count as steps), code that turns a tensor
    into a Python value: `float(t)`, `int(t)`, `bool(t)`, `str(t)`, `print(t)`,
    `f"{t}"`, `"%f" % t`, `"{}".format(t)`, `math.exp(t)`, `writer.add_scalar(tag, t)`,
    tqdm's `set_postfix(loss=t)` and `torch.tensor([t1, t2])` (each tensor of the list
    read as a Python number). Only expressions that plausibly hold a tensor
    count: the result of a model or loss call, of a torch op, of a tensor method such as
    `.sum()` or `.mean()`, or a name that receives `.backward()`; `float(args.lr)` or
    `print(f"epoch {epoch}")` are left alone.

    ## Why is this bad?
    Converting a tensor to a Python number or string needs its value on the host: the
    host blocks until the device has finished every kernel queued so far, every step,
    and cannot queue the next step meanwhile. It is the same wait as `.item()`, hidden
    inside a conversion.

    Not reported on the `cpu` target (no device queue to drain), in evaluation loops,
    in functions defined inside the loop, or where the conversion runs on a few steps
    only: inside an `if step % N == 0:` branch (N a name, or a literal of 10 or more),
    an `except` handler, a `raise` or an `assert` message.

    ## Example
    ```python
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        print(f"loss {loss:.4f}")
    ```

    ## Use instead
    ```python
    for step, (x, y) in enumerate(loader):
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        running += loss.detach()
        if step % 100 == 0:
            print(f"loss {running.item() / 100:.4f}")
            running.zero_()
    ```

    ## Fix safety
    Display-only: where and how often to log is the user's decision.
    """

    code = "AX302"
    name = "tensor-to-python-in-training-loop"
    category = "host_sync_in_loop"
    message = "a tensor is converted to a Python value on every training step"
    fix_title = "log `loss.detach()` on the device and convert it every N steps or once per epoch"
    fix_safety = Applicability.DISPLAY_ONLY
    targets = ("cuda", "npu")
    requires_text = ("backward", "step(")
    node_types = (ast.Call, ast.FormattedValue, ast.BinOp)
    references = (
        "https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution",
        "https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#avoid-unnecessary-cpu-gpu-synchronization",
    )
    examples = (
        # A tensor made of a list of losses: each is read back one number at a time.
        Invalid(
            "import torch\n"
            "for x, y in loader:\n"
            "    loss_box, loss_cls = criterion(model(x.cuda()), y.cuda())\n"
            "    loss = loss_box + loss_cls\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    items = torch.tensor([loss_box, loss_cls, loss])\n"
            "    bounds = torch.tensor([0.0, 1.0])\n",
            target="cuda", lines=(7,), message="torch.stack",
        ),
        # A progress line built of repeated formats, a tensor's elements unpacked into it.
        Invalid(
            "import torch\n"
            "mloss = torch.zeros(3, device='cuda')\n"
            "for i, (x, y) in enumerate(loader):\n"
            "    loss, items = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    mloss = (mloss * i + items) / (i + 1)\n"
            "    pbar.set_description(('%10s' + '%10.4g' * 3) % (f'{i}', *mloss))\n",
            target="cuda", lines=(8,),
        ),
        Invalid(
            "import torch\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    print(f'loss {loss:.4f}')\n",
            target="cuda", lines=(6,),
        ),
        Invalid(
            "import math\n"
            "import torch.nn.functional as F\n"
            "def train(model, loader, opt):\n"
            "    for step, (x, y) in enumerate(loader):\n"
            "        logits = model(x)\n"
            "        loss = F.cross_entropy(logits, y)\n"
            "        loss.backward()\n"
            "        opt.step()\n"
            "        total += float(loss)\n"
            "        correct += int((logits.argmax(1) == y).sum())\n"
            "        print('ppl', math.exp(loss), step)\n",
            target="npu", lines=(9, 10, 11),
        ),
        Invalid(
            "import torch as T\n"
            "for batch in loader:\n"
            "    out = net(batch)\n"
            "    out.loss.backward()\n"
            "    optimizer.step()\n"
            "    grad_norm = T.nn.utils.clip_grad_norm_(net.parameters(), 1.0)\n"
            "    writer.add_scalar('grad_norm', grad_norm, step)\n"
            "    pbar.set_postfix(loss=out.loss)\n"
            "    log('loss %.3f' % out.loss)\n"
            "    log('{} {}'.format(epoch, out.loss))\n",
            target="cuda", lines=(7, 8, 9, 10),
        ),
        Invalid(
            "while True:\n"
            "    l = loss_fn(model(x), y)\n"
            "    l.backward()\n"
            "    opt.step()\n"
            "    if step % 5 == 0:\n"
            "        print(l)\n",
            target="cuda", lines=(6,),
        ),
        Valid(
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    print(f'loss {loss:.4f}')\n",
            target="cpu",
        ),
        Valid(
            "import torch\n"
            "for epoch in range(args.epochs):\n"
            "    lr = float(args.lr) * 0.9 ** epoch\n"
            "    for x, y in loader:\n"
            "        loss = criterion(model(x), y)\n"
            "        loss.backward()\n"
            "        opt.step()\n"
            "        print(f'epoch {epoch} lr {lr}', int(x.shape[0]), len(loader))\n"
            "        print(model, loss.dtype, f'{loss.item():.3f}')\n"
            "    print(f'epoch {epoch} loss {loss}')\n",
            target="cuda",
        ),
        Valid(
            "for x, y in loader:\n"
            "    with torch.no_grad():\n"
            "        loss = criterion(model(x), y)\n"
            "    print(float(loss))\n",
            target="cuda",
        ),
        Valid(
            "for i, (x, y) in enumerate(loader):\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    if i % args.log_interval == 0:\n"
            "        print(f'{i} loss {loss}')\n"
            "    if not torch.isfinite(loss).all():\n"
            "        raise RuntimeError(f'loss diverged: {loss}')\n"
            "    log = lambda: float(loss)\n"
            "    print(float(loss))  # noqa: AX302\n",
            target="cuda",
        ),
        Valid(
            "for x, y in loader:\n"
            "    loss = step_fn(x, y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    running = running + loss.item()\n"
            "    print(running, float(running), str(x.device), int(y[0].numel()))\n",
            target="cuda",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        candidates = self._converted(node, ctx)
        if not candidates:
            return
        loop = ctx.training_loop(node)
        if loop is None or T.rarely_run(ctx, loop, node):
            return
        tensors = T.tensors_at(ctx)
        # `*t` unpacks a tensor into its elements, each converted alike.
        culprit = next((c for c in candidates if tensors.is_tensor(c.value if isinstance(c, ast.Starred) else c)),
                       None)
        if isinstance(culprit, ast.Starred):
            culprit = culprit.value
        if culprit is None:
            return
        if isinstance(node, ast.FormattedValue):
            what = f"`{{{T.describe(ctx, culprit)}}}` in an f-string"
        else:
            what = f"`{T.describe(ctx, node)}`"
        value = culprit.id if isinstance(culprit, ast.Name) else "loss"
        if isinstance(node, ast.Call) and ctx.call_name(node) in _TENSOR_FROM_LIST:
            yield ctx.finding(
                self,
                node,
                f"{what} reads each tensor of the list back to the host, one Python number at a time, inside "
                f"the training loop: {T.sync_cost(ctx.target)}; `torch.stack` of the tensors keeps them on "
                "the device",
                replacement="torch.stack([...])  # of the same tensors, detached where they are only logged",
                fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
            )
            return
        yield ctx.finding(
            self,
            culprit if isinstance(node, ast.FormattedValue) else node,
            f"{what} converts a tensor to a Python value inside the training loop: "
            f"{T.sync_cost(ctx.target)}; accumulate `{value}.detach()` on the device "
            "and convert it every N steps or once per epoch",
            replacement=f"total += {value}.detach()  # convert total every N steps or after the loop",
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
        )

    def _converted(self, node: ast.AST, ctx: FileContext) -> list[ast.AST]:
        """The expressions whose tensor value ``node`` would convert, if any."""
        if isinstance(node, ast.FormattedValue):
            return [node.value]
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Mod) and _text(node.left):
                return list(node.right.elts) if isinstance(node.right, ast.Tuple) else [node.right]
            return []
        assert isinstance(node, ast.Call)
        func = node.func
        if isinstance(func, ast.Name) and ctx.qualified_name(func) is None:
            if func.id in CONVERTERS and node.args:
                return [node.args[0]]
            if func.id == "print":
                return list(node.args)
            return []
        if isinstance(func, ast.Attribute):
            if func.attr == "format" and isinstance(func.value, ast.Constant) and isinstance(func.value.value, str):
                return [*node.args, *(k.value for k in node.keywords)]
            if func.attr in SCALAR_LOGGERS:
                value = T.keyword(node, "scalar_value")
                index = SCALAR_LOGGERS[func.attr]
                return [value.value] if value is not None else node.args[index : index + 1]
            if func.attr == "set_postfix":
                return [*node.args, *(k.value for k in node.keywords if k.arg is not None)]
        if (ctx.call_name(node) or "").startswith("math.") and node.args:
            return [node.args[0]]
        if ctx.call_name(node) in _TENSOR_FROM_LIST and node.args:
            return _listed(node.args[0])
        return []


#: Constructors that read a list of tensors one Python number at a time.
_TENSOR_FROM_LIST = frozenset({"torch.tensor", "torch.as_tensor", "torch.Tensor", "torch.FloatTensor"})


def _listed(node: ast.AST) -> list[ast.AST]:
    """The elements of a list or tuple written out, or a comprehension's element."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e for e in node.elts if not isinstance(e, ast.Starred)]
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
        return [node.elt]
    return []


def _text(node: ast.AST) -> bool:
    """A string written out: ``"%.3f"``, or built of such (``"%11s" * 2 + "%11.4g" * 5``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) and _text(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return (_text(node.left) and not _text(node.right)) or (_text(node.right) and not _text(node.left))
    return False
