"""AX301: a tensor read back to the host (.item(), .cpu(), .numpy(), .tolist()) on
every training step."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext, Need
from torchaxe.scan.rules import _tensors as T
from torchaxe.scan.rules.base import Invalid, Rule, Valid

READ_METHODS = frozenset({"item", "cpu", "numpy", "tolist"})
#: What a file tells others: its module-level functions that read a tensor they are
#: given back to the host on every call (``FileContext.exports``).
HOST_READING_FUNCTIONS = "host-reading-functions"
#: Modules whose functions are never the project's helpers.
_LIBRARY_ROOTS = frozenset({"torch", "numpy", "math", "os", "sys", "time", "random", "json", "logging", "re",
                            "itertools", "functools", "collections", "typing", "copy", "wandb", "tqdm"})


def _is_read(ctx: FileContext, node: ast.AST) -> bool:
    """A call that copies a tensor to host memory: ``.item()``, ``.cpu()``,
    ``.numpy(force=True)``, ``.tolist()``, or a blocking ``.to("cpu")``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    attr = node.func.attr
    if attr == "numpy":
        # ``t.numpy()`` raises on a device tensor: unless ``force=True`` copies it, the
        # tensor is on the host already (a copy before it, ``t.cpu().numpy()``, is the read).
        return T.is_true(getattr(T.keyword(node, "force"), "value", None))
    if attr in READ_METHODS:
        return True
    if attr == "to" and not T.is_true(getattr(T.keyword(node, "non_blocking"), "value", None)):
        device = T.keyword(node, "device")
        device = device.value if device is not None else (node.args[0] if node.args else None)
        return device is not None and T.is_cpu_device(ctx, device)
    return False


#: Calls that move what they are given to the device.
_MOVES = ("cuda", "to_cuda", "to_device", "to_gpu", "npu")


def _moved_after(ctx: FileContext, read: ast.Call, receiver: ast.AST) -> bool:
    """Whether the tensor read is moved to the device later in the same function,
    its name bound again from the move (XLM: ``pred_mask.sum().item()`` before ``x,
    pred_mask = to_cuda(x, pred_mask)``): until then it is on the host."""
    root = receiver
    while isinstance(root, (ast.Call, ast.Attribute, ast.Subscript)):
        root = root.func if isinstance(root, ast.Call) else root.value
    if not isinstance(root, ast.Name):
        return False
    function = next((p for p in reversed(ctx.parents) if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef))),
                    None)
    if function is None:
        return False
    end = read.end_lineno or read.lineno
    for stmt in ast.walk(function):
        if not (isinstance(stmt, ast.Assign) and stmt.lineno > end and isinstance(stmt.value, ast.Call)):
            continue
        if root.id not in {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}:
            continue
        func = stmt.value.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        moved = [func.value] if isinstance(func, ast.Attribute) and name in ("cuda", "npu", "to") else \
            list(stmt.value.args) if name in _MOVES else []
        if any(isinstance(m, ast.Name) and m.id == root.id for m in moved):
            return True
    return False


def _is_scale_read(node: ast.Call) -> bool:
    """``scaler.get_scale()`` on something named a scaler (``torch.amp.GradScaler``)."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "get_scale") or node.args or node.keywords:
        return False
    receiver = func.value
    name = receiver.attr if isinstance(receiver, ast.Attribute) else receiver.id if isinstance(receiver, ast.Name) \
        else ""
    return "scaler" in name.lower()


class HostReadInTrainingLoop(Rule):
    """
    ## What it does
    Flags `.item()`, `.cpu()`, `.numpy(force=True)`, `.tolist()`, a blocking
    `.to("cpu")` and a gradient scaler's `get_scale()` inside a training loop (a loop whose own body calls `backward()` or an
    optimizer's `step()`, or the body of a step function that does, such as `def
    train_step(batch)`, that the file calls in a loop or from another step function, or
    that runs a whole update (a backward pass and an optimizer's step) and is never called
    in the file, its loop being in another one (an RL agent's `learn()`), or of a helper
    such a loop or step function calls outside any branch (a loss function returning its
    parts with `.item()`); a loss scaler called with the
    loss and the optimizer, `scaler.step(opt)`, `accelerator.backward(loss)` and a
    Lightning `training_step` that steps by hand count as steps), on the GPU and NPU targets.
    A training loop's call, every step, of a function of another file of the project
    that reads a tensor it is given back to the host outside any branch (VITS's
    `commons.clip_grad_value_`) is reported at the call when that file is scanned too.

    ## Why is this bad?
    The device runs kernels asynchronously: the host queues the next step's work while
    the device is still busy with this one. Reading a value back makes the host wait
    until every kernel queued so far has finished, every step, so the device idles
    while the host prepares the next step. The loss is largest where the host is the
    bottleneck: small models, many small kernels, and NPUs, whose operators are
    dispatched through a task queue that the read drains.

    Not reported on the `cpu` target, where a tensor already lives in host memory and
    there is no queue to drain, nor for `t.numpy()` alone: it raises on a device tensor,
    so where it runs the tensor is on the host already (the copy before it, as in
    `t.cpu().numpy()`, is the read reported). Not reported when the read runs on a few steps only:
    inside an `if step % N == 0:` branch (N a literal of 10 or more, or a name the file
    does not set only to smaller literals: `log_interval = 1` reads every step; a branch
    that holds the loop's only optimizer step, `if (step + 1) % accumulation == 0:`, is
    the update and runs every step), an `except` handler or a `raise`; that is the
    remedy, not the problem. Evaluation
    loops (no `backward()`/`step()` in their own body) are not reported, even inside
    an epoch loop, nor are functions defined in the loop. Receivers known to be host
    values (numpy arrays, batches straight from a DataLoader) are skipped.

    ## Example
    ```python
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        total += loss.item()
    ```

    ## Use instead
    ```python
    total = torch.zeros((), device=device)
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        total += loss.detach()       # stays on the device, no wait
    print(total.item())              # one read per epoch
    ```

    ## Fix safety
    Display-only: moving the read changes what the program prints and when; the
    finding shows the replacement, a person makes it.
    """

    code = "AX301"
    name = "host-read-in-training-loop"
    category = "host_sync_in_loop"
    message = "a tensor is read back to the host on every training step"
    fix_title = "keep the value on the device and read it every N steps or once per epoch"
    fix_safety = Applicability.DISPLAY_ONLY
    targets = ("cuda", "npu")
    # ``backward(``/``step(``: a training loop may read the host only through a helper
    # of another file (see ``_helper_of_another_file``).
    requires_text = ("item(", "cpu", "numpy(", "tolist(", "backward(", "step(")
    export_text = ("item(", ".cpu(", "tolist(")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution",
        "https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#avoid-unnecessary-cpu-gpu-synchronization",
    )
    examples = (
        Invalid(
            "import torch\n\n\ndef train_step(x, y):\n    loss = criterion(model(x), y)\n    loss.backward()\n"
            "    opt.step()\n    return loss.item()\n\n\ndef evaluate(x, y):\n    return criterion(model(x), y).item()\n\n\n"
            "for x, y in loader:\n    print(train_step(x, y))\nprint(evaluate(x, y))\n",
            target="cuda", lines=(8,),
        ),
        Invalid(
            "import torch\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    total += loss.item()\n",
            target="cuda", lines=(6,),
        ),
        Invalid(
            "def train(model, loader, optimizer):\n"
            "    for batch in loader:\n"
            "        out = model(batch)\n"
            "        out.loss.backward()\n"
            "        optimizer.step()\n"
            "        preds = out.logits.argmax(-1).cpu().numpy()\n"
            "        losses.append(out.loss.detach().cpu())\n",
            target="npu", lines=(6, 7),
        ),
        Invalid(
            "import torch as T\n"
            "while True:\n"
            "    loss = T.nn.functional.mse_loss(net(x), y)\n"
            "    T.autograd.backward(loss)\n"
            "    history.append(loss.tolist())\n",
            target="cuda", lines=(5,),
        ),
        Invalid(
            "for step, batch in enumerate(loader):\n"
            "    loss = model(batch)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    for name, value in metrics.items():\n"
            "        log[name] = value.item()\n"
            "    if step % 2 == 0:\n"
            "        print(loss.to('cpu'))\n",
            target="cuda", lines=(6, 8),
        ),
        Invalid(
            # The update of accumulated gradients runs under the modulo guard: a read
            # there runs on every optimizer step (ViT-pytorch's train.py).
            "from apex import amp\n"
            "for step, (x, y) in enumerate(loader):\n"
            "    loss = model(x, y)\n"
            "    with amp.scale_loss(loss, optimizer) as scaled_loss:\n"
            "        scaled_loss.backward()\n"
            "    if (step + 1) % args.gradient_accumulation_steps == 0:\n"
            "        losses.update(loss.item())\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad()\n",
            target="cuda", lines=(7,),
        ),
        Invalid(
            # A whole update in a method the file never calls: its loop is in another
            # file (a loss object that also steps, an RL agent's learn()).
            "class LossCompute:\n"
            "    def __call__(self, logits, y):\n"
            "        loss = self.criterion(logits, y).sum()\n"
            "        loss.backward()\n"
            "        self.opt.step()\n"
            "        self.opt.zero_grad()\n"
            "        return loss.item()\n",
            target="cuda", lines=(7,),
        ),
        Valid(
            # The same update called once by the file: not a step of a loop.
            "def fit_once(model, opt, x, y):\n"
            "    loss = model(x, y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    return loss.item()\n\n\n"
            "print(fit_once(model, opt, x, y))\n",
            target="cuda",
        ),
        Valid(
            # A second backward and step every 16 iterations beside the main ones (lazy
            # regularisation): rarer than the steps.
            "for i, (x, y) in enumerate(loader):\n"
            "    loss = model(x, y)\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
            "    if i % 16 == 0:\n"
            "        reg = penalty(model)\n"
            "        reg.backward()\n"
            "        optimizer.step()\n"
            "        log['reg'] = reg.item()\n",
            target="cuda",
        ),
        Valid(
            "import torch\n\n\ndef train_step(x, y):\n    loss = criterion(model(x), y)\n    loss.backward()\n"
            "    opt.step()\n    return loss.item()\n\n\ntrain_step(x, y)  # once, not in a loop\n",
            target="cuda",
        ),
        Valid(
            "for x, y in loader:\n"
            "    loss = model(x, y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    total += loss.item()\n",
            target="cpu",
        ),
        Valid(
            "import torch\n"
            "for epoch in range(10):\n"
            "    for x, y in train_loader:\n"
            "        loss = model(x, y)\n"
            "        loss.backward()\n"
            "        opt.step()\n"
            "    for x, y in val_loader:\n"
            "        correct += (model(x).argmax(1) == y).sum().item()\n"
            "    print(loss.item())\n",
            target="cuda",
        ),
        Valid(
            "for step, (x, y) in enumerate(loader):\n"
            "    loss = model(x, y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    if step % args.log_every == 0:\n"
            "        print(loss.item())\n"
            "    if not (step % 100):\n"
            "        writer.add_scalar('loss', loss.item(), step)\n",
            target="cuda",
        ),
        Valid(
            # llm.c: evaluate every N steps and after the last one.
            "for step in range(args.num_iterations + 1):\n"
            "    last_step = step == args.num_iterations\n"
            "    if (args.val_every > 0 and (step % args.val_every == 0 or last_step)) and val_loader is not None:\n"
            "        with torch.no_grad():\n"
            "            val_loss += model(*val_loader.next_batch()).item()\n"
            "    loss = model(x, y)\n"
            "    loss.backward()\n"
            "    opt.step()\n",
            target="cuda",
        ),
        Valid(
            "for x, y in loader:\n"
            "    loss = model(x, y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    def report():\n"
            "        return loss.item()\n"
            "    total += loss.item()  # noqa: AX301\n",
            target="cuda",
        ),
        Valid(
            "import numpy as np\n"
            "for x, y in loader:\n"
            "    counts = np.bincount(y.numpy())\n"
            "    loss = model(x.cuda(), y.cuda())\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    seen.extend(counts.tolist())\n"
            "    copy = loss.detach().to('cpu', non_blocking=True)\n",
            target="cuda",
        ),
        Valid(
            "with torch.no_grad():\n"
            "    for x, y in loader:\n"
            "        acc += (model(x).argmax(1) == y).float().mean().item()\n",
            target="npu",
        ),
        # ``.numpy()`` raises on a device tensor: one that runs is on the host already.
        Valid(
            "for x, y in loader:\n"
            "    loss = model(x.cuda(), y.cuda())\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    state, reward, done, _ = env.step(action.numpy())\n",
            target="cuda",
        ),
        Invalid(
            "for x, y in loader:\n"
            "    loss = model(x.cuda(), y.cuda())\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    losses.append(loss.detach().numpy(force=True))\n",
            target="cuda", lines=(5,), message="total += loss.detach()",
        ),
    )

    def export(self, ctx: FileContext) -> Iterable[Finding]:
        """The file's module-level functions that read a tensor derived from their
        arguments back to the host outside any branch (VITS's
        ``commons.clip_grad_value_``: ``param_norm.item()`` for every parameter), for
        the training loops of other files that call them."""
        for function in ctx.tree.body:
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and _reads_arguments(ctx, function):
                ctx.exports.setdefault(HOST_READING_FUNCTIONS, []).append(function.name)
        return ()

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        if _is_scale_read(node):
            loop = ctx.training_loop(node)
            if loop is not None and not T.rarely_run(ctx, loop, node):
                yield ctx.finding(
                    self, node,
                    f"`{ctx.text(node)}` reads the gradient scaler's scale back to the host (torch documents that "
                    f"it incurs a CPU-GPU sync) inside the training loop: {T.sync_cost(ctx.target)}; to tell a "
                    "skipped step, compare the scale on the device, or read it every N steps",
                    fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
            return
        if not _is_read(ctx, node):
            self._helper_of_another_file(node, ctx)
            return
        receiver = node.func.value  # type: ignore[attr-defined]
        if _chain_has_read(ctx, receiver):
            return  # x.cpu().numpy(): the first read in the chain is the one reported
        loop = ctx.training_loop(node)
        if loop is None or T.rarely_run(ctx, loop, node):
            return
        tensors = T.tensors_at(ctx)
        if tensors.is_host(receiver) or _moved_after(ctx, node, receiver):
            return
        what = T.describe(ctx, node)
        # The tensor read, as written (``output.mean()``), when it is short enough to show.
        text = ctx.text(receiver).removesuffix(".detach()")
        value = text if len(text) <= 40 and "\n" not in text else "loss"
        consumer = T.needed_now(ctx, node, loop)
        if consumer is not None:
            yield ctx.finding(
                self,
                node,
                f"`{what}` reads a tensor back to the host inside the training loop for {consumer}, which needs "
                f"it before the next step: {T.sync_cost(ctx.target)}; it cannot wait, so make it rarer: compute "
                "several steps' values per read (vectorised environments, a batch of decisions), or, for a small "
                "network that only decides, run that forward on a CPU copy of the model",
                fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY,
                            title="read once for several steps' values, or decide on the CPU"),
            )
            return
        yield ctx.finding(
            self,
            node,
            f"`{what}` reads a tensor back to the host inside the training loop: {T.sync_cost(ctx.target)}; "
            f"accumulate on the device (`total += {value}.detach()`) and read it every N steps or once per epoch",
            replacement=f"total += {value}.detach()  # read total.item() every N steps or after the loop",
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
        )


    def _helper_of_another_file(self, node: ast.Call, ctx: FileContext) -> None:
        """A training loop's call, every step, of a function another module of the
        project defines: reported, at the call, when that file is scanned too and its
        function reads a tensor back to the host on every call."""
        origin = ctx.imported_from(node.func)
        if origin is None or origin[0].split(".", 1)[0] in _LIBRARY_ROOTS or not node.args:
            return
        loop = ctx.training_loop(node)
        if loop is None or T.rarely_run(ctx, loop, node):
            return
        module, level, name = origin
        finding = ctx.finding(
            self, node,
            f"`{name}()` (module {'.' * level}{module}) reads a tensor back to the host on every call, and the "
            f"training loop calls it every step: {T.sync_cost(ctx.target)}; keep its result on the device and read "
            "it every N steps or once per epoch (or call it every N steps)",
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
        ctx.needs.append(((Need("exports", HOST_READING_FUNCTIONS, name, module, level),), finding))


def _reads_arguments(ctx: FileContext, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``function`` reads back to the host, outside any ``if``/``try``, a value
    made from its parameters (through its own assignments and loops over them)."""
    args = function.args
    tainted = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)} - {"self", "cls"}
    if not tainted:
        return False

    def mentions(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in tainted for n in ast.walk(node))

    def visit(stmts: list[ast.stmt]) -> bool:
        for stmt in stmts:
            if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and stmt.value is not None \
                    and mentions(stmt.value):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                tainted.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            if isinstance(stmt, (ast.For, ast.AsyncFor)) and mentions(stmt.iter):
                tainted.update(n.id for n in ast.walk(stmt.target) if isinstance(n, ast.Name))
            if isinstance(stmt, (ast.If, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.While)):
                continue  # a branch, a guarded block, or code that runs elsewhere
            if isinstance(stmt, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
                heads: list[ast.AST] = [stmt.iter] if isinstance(stmt, (ast.For, ast.AsyncFor)) else \
                    [item.context_expr for item in stmt.items]
                if any(_reads(ctx, head, mentions) for head in heads) or visit(stmt.body):
                    return True
                continue
            if _reads(ctx, stmt, mentions):
                return True
        return False

    return visit(function.body)


def _reads(ctx: FileContext, node: ast.AST, mentions) -> bool:
    """Whether ``node`` holds a host read of a value ``mentions`` accepts (lambdas and
    conditional expressions, which may not run, left out)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.Lambda, ast.IfExp, ast.BoolOp)):
            continue
        if isinstance(n, ast.Call) and _is_read(ctx, n) and mentions(n.func.value):  # type: ignore[attr-defined]
            return True
        stack.extend(ast.iter_child_nodes(n))
    return False


def _chain_has_read(ctx: FileContext, node: ast.AST) -> bool:
    while True:
        if isinstance(node, ast.Call):
            if _is_read(ctx, node):
                return True
            node = node.func
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        else:
            return False
