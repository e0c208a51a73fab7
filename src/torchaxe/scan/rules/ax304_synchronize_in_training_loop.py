"""AX304: an explicit device synchronize on every training step."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules import _tensors as T
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Functions that wait for the whole device.
DEVICE_SYNCS = frozenset(
    {
        "torch.cuda.synchronize",
        "torch.npu.synchronize",
        "torch_npu.npu.synchronize",
        "torch.accelerator.synchronize",
    }
)
#: Calls that return a stream or an event, whose ``.synchronize()`` waits for it.
_STREAM_OR_EVENT = frozenset(
    f"{module}.{name}"
    for module in ("torch.cuda", "torch.npu", "torch_npu.npu")
    for name in ("current_stream", "default_stream", "Stream", "Event")
) | {"torch.Event", "torch.Stream", "torch.accelerator.current_stream"}


def _waited_object(ctx: FileContext, receiver: ast.AST) -> str | None:
    """``"event"`` or ``"stream"`` when ``receiver`` is one (a call that makes it, or
    a name or attribute assigned one in this file); None otherwise."""
    if isinstance(receiver, ast.Call):
        name = ctx.call_name(receiver) or ""
        if name in _STREAM_OR_EVENT:
            return "event" if name.endswith("Event") else "stream"
        return None
    key = (
        receiver.id
        if isinstance(receiver, ast.Name)
        else receiver.attr
        if isinstance(receiver, ast.Attribute)
        else None
    )
    return _bound_streams(ctx).get(key) if key else None


def _bound_streams(ctx: FileContext) -> dict[str, str]:
    cache_key = "ax304.streams"
    if cache_key not in ctx.cache:
        bound: dict[str, str] = {}
        for node in ctx.nodes(ast.Assign):
            if isinstance(node.value, ast.Call):
                kind = _waited_object(ctx, node.value)
                if kind is None:
                    continue
                for t in node.targets:
                    elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
                    for e in elts:
                        if isinstance(e, ast.Name):
                            bound[e.id] = kind
                        elif isinstance(e, ast.Attribute):
                            bound[e.attr] = kind
        ctx.cache[cache_key] = bound
    return ctx.cache[cache_key]


class SynchronizeInTrainingLoop(Rule):
    """
    ## What it does
    Flags `torch.cuda.synchronize()`, `torch.npu.synchronize()`,
    `torch.accelerator.synchronize()`, `torch.cuda.current_stream().synchronize()` and
    `.synchronize()` on a stream or event made in the file, inside a training loop (a
    loop whose own body calls `backward()` or an optimizer's `step()`, or the body of a
    step function that does, such as `def train_step(batch)`, that the file calls in a loop or from another step function; a loss scaler called with the
    loss and the optimizer, `scaler.step(opt)`, `accelerator.backward(loss)` and a
    Lightning `training_step` that steps by hand count as steps).

    ## Why is this bad?
    The host normally runs ahead of the device, queuing the next kernels while the
    current ones execute. A synchronize makes the host wait until the device has
    drained its queue, every step, so the device then idles while the host queues the
    next step. It is usually left over from timing code; time steps with device events
    read once after the loop, or with `torch.profiler`, instead.

    Not reported on the `cpu` target (nothing to drain), in evaluation loops, in
    functions defined inside the loop, or inside an `if step % N == 0:` branch (N a
    name, or a literal of 10 or more), where it waits once every N steps.

    ## Example
    ```python
    for x, y in loader:
        t0 = time.perf_counter()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ```

    ## Use instead
    ```python
    events = []
    for x, y in loader:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()                       # once, after the loop
    times = [s.elapsed_time(e) for s, e in events]
    ```

    ## Fix safety
    Display-only: code after a synchronize may rely on it (reading a tensor copied to
    the host with `non_blocking=True`, timing), so removing it is the user's call.
    """

    code = "AX304"
    name = "synchronize-in-training-loop"
    category = "host_sync_in_loop"
    message = "the host waits for the device on every training step"
    fix_title = "remove the synchronize; time with device events read after the loop"
    fix_safety = Applicability.DISPLAY_ONLY
    targets = ("cuda", "npu")
    requires_text = ("synchronize",)
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution",
        "https://pytorch.org/docs/stable/generated/torch.cuda.Event.html",
    )
    examples = (
        Invalid(
            "import torch\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    torch.cuda.synchronize()\n",
            target="cuda", lines=(6,),
        ),
        Invalid(
            "import torch\n"
            "import torch_npu\n"
            "def train(model, loader, optimizer):\n"
            "    for batch in loader:\n"
            "        model(batch).backward()\n"
            "        optimizer.step()\n"
            "        torch.npu.synchronize()\n"
            "        torch_npu.npu.current_stream().synchronize()\n",
            target="npu", lines=(7, 8),
        ),
        Invalid(
            "import torch as T\n"
            "from torch.cuda import synchronize\n"
            "end = T.cuda.Event(enable_timing=True)\n"
            "while True:\n"
            "    loss = model(next(it))\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    end.record()\n"
            "    end.synchronize()\n"
            "    synchronize()\n",
            target="cuda", lines=(9, 10),
        ),
        Valid(
            "import torch\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    torch.cuda.synchronize()\n",
            target="cpu",
        ),
        Valid(
            "import torch\n"
            "for step, (x, y) in enumerate(loader):\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    if step % 100 == 0:\n"
            "        torch.cuda.synchronize()\n"
            "    torch.cuda.synchronize()  # noqa: AX304\n"
            "torch.cuda.synchronize()\n",
            target="cuda",
        ),
        Valid(
            "import torch\n"
            "for x in val_loader:\n"
            "    with torch.no_grad():\n"
            "        model(x)\n"
            "    torch.cuda.synchronize()\n"
            "for x in loader:\n"
            "    model(x).backward()\n"
            "    opt.step()\n"
            "    def wait():\n"
            "        torch.cuda.synchronize()\n"
            "    barrier.synchronize()\n",
            target="cuda",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        name = ctx.call_name(node)
        if name in DEVICE_SYNCS:
            kind = "device"
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "synchronize":
            kind = _waited_object(ctx, node.func.value)
            if kind is None:
                return
        else:
            return
        loop = ctx.training_loop(node)
        if loop is None or T.rarely_run(ctx, loop, node):
            return
        dev = T.DEVICE_WORD[ctx.target]
        module = T.DEVICE_MODULE[ctx.target]
        waits = {
            "device": f"waits until the {dev} has drained its queue",
            "stream": f"waits until the {dev} stream has drained",
            "event": f"waits until the {dev} reaches the event",
        }[kind]
        yield ctx.finding(
            self,
            node,
            f"`{T.describe(ctx, node)}` {waits}, on every training step: the host cannot queue the next "
            f"step while the {dev} is busy, so the {dev} idles in turn; remove it, and to time steps "
            f"record {module}.Event(enable_timing=True) pairs and read elapsed_time() once after the loop",
            replacement=f"{module}.Event(enable_timing=True).record()  # read elapsed_time() after the loop",
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
        )
