"""AX306: a batch from a pinned-memory DataLoader copied to the device without
``non_blocking=True``."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext, walk_scope
from torchaxe.scan.rules import _tensors as T
from torchaxe.scan.rules._dataloader import POSITIONS, is_dataloader_call
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: torch DataLoader's positional index of pin_memory.
PIN_MEMORY_POSITION = POSITIONS.index("pin_memory")

WHOLE, ITEM = "whole", "item"


def _pins_memory(ctx: FileContext) -> bool:
    """Whether the file builds a loader with pinned memory: a call passing
    ``pin_memory=`` anything but False/None (``pin_memory=args.pin`` counts: adding
    ``non_blocking=True`` is harmless when it turns out off), a DataLoader with
    pin_memory passed by position, or a ``{"pin_memory": ...}`` dict of loader
    arguments."""
    key = "ax306.pins"
    if key not in ctx.cache:
        found = False
        for node in ctx.nodes(ast.Call, ast.Dict):
            value = None
            if isinstance(node, ast.Call):
                kw = T.keyword(node, "pin_memory")
                value = kw.value if kw is not None else None
                if value is None and is_dataloader_call(ctx, node) and len(node.args) > PIN_MEMORY_POSITION:
                    value = node.args[PIN_MEMORY_POSITION]
            elif isinstance(node, ast.Dict):  # loader_kwargs = {"pin_memory": True}
                value = next(
                    (
                        v
                        for k, v in zip(node.keys, node.values)
                        if isinstance(k, ast.Constant) and k.value == "pin_memory"
                    ),
                    None,
                )
            if value is not None and not (isinstance(value, ast.Constant) and value.value in (False, None, 0)):
                found = True
                break
        ctx.cache[key] = found
    return ctx.cache[key]


def _batch_names(ctx: FileContext, scope: ast.AST) -> dict[str, str]:
    """Names in one scope that hold a batch from a loader (``WHOLE``: the batch
    object as yielded; ``ITEM``: a tensor unpacked or indexed from it)."""
    key = ("ax306.batches", id(scope))
    if key in ctx.cache:
        return ctx.cache[key]
    names: dict[str, str] = {}

    def bind(target: ast.AST, kind: str) -> None:
        if isinstance(target, ast.Name):
            if names.get(target.id) != WHOLE:
                names[target.id] = kind
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                bind(elt.value if isinstance(elt, ast.Starred) else elt, ITEM)

    nodes = list(walk_scope(scope))
    iterators = _loader_iterators(ctx)
    for node in nodes:
        if isinstance(node, (ast.For, ast.AsyncFor)):
            is_loader, enumerated = T.loader_of_iterable(ctx, node.iter)
            if not is_loader:
                continue
            target = node.target
            if enumerated and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                target = target.elts[1]  # the first is the step index
            bind(target, WHOLE if isinstance(target, ast.Name) else ITEM)
        elif isinstance(node, ast.Assign) and _is_next_batch(ctx, node.value, iterators):
            for t in node.targets:
                bind(t, WHOLE if isinstance(t, ast.Name) else ITEM)
    # Names unpacked or indexed from a batch: `x, y = batch`, `ids = batch["ids"]`,
    # and comprehension variables over one: `{k: v.to(d) for k, v in batch.items()}`.
    for _ in range(3):
        before = dict(names)
        for node in nodes:
            if isinstance(node, ast.Assign):
                kind = _kind(names, node.value)
                if kind:
                    for t in node.targets:
                        bind(t, kind if isinstance(t, ast.Name) else ITEM)
            elif isinstance(node, ast.comprehension):
                source = node.iter
                if (
                    isinstance(source, ast.Call)
                    and isinstance(source.func, ast.Attribute)
                    and source.func.attr in ("items", "values")
                ):
                    if _kind(names, source.func.value):
                        target = node.target
                        if source.func.attr == "items" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                            target = target.elts[1]
                        bind(target, ITEM)
                elif _kind(names, source):
                    bind(node.target, ITEM)
        if names == before:
            break
    ctx.cache[key] = names
    return names


def _loader_iterators(ctx: FileContext) -> frozenset[str]:
    """Names assigned an iterator over a loader anywhere in the file: a call whose
    first argument is a loader (``iter(loader)``, ``itertools.cycle(loader)``, a
    user's ``infinite(loader)`` generator)."""
    key = "ax306.iterators"
    if key not in ctx.cache:
        names = set()
        for node in ctx.nodes(ast.Assign):
            if _wraps_loader(ctx, node.value):
                names.update(_target_name(t) for t in node.targets)
        ctx.cache[key] = frozenset(names - {""})
    return ctx.cache[key]


def _wraps_loader(ctx: FileContext, node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and not is_dataloader_call(ctx, node)
        and bool(node.args)
        and T.is_loader(ctx, node.args[0])
    )


def _target_name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _is_next_batch(ctx: FileContext, value: ast.AST, iterators: frozenset[str]) -> bool:
    """``next(it)`` where ``it`` is a loader, wraps one (``iter(loader)``), is a name
    assigned such a wrapper, or is named like a batch iterator (``data_iter``,
    ``batches``)."""
    if not (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "next" and value.args
    ):
        return False
    source = value.args[0]
    if _wraps_loader(ctx, source) or T.is_loader(ctx, source):
        return True
    name = _target_name(source)
    return name in iterators or any(word in name.lower() for word in ("iter", "batches"))


def _kind(names: dict[str, str], node: ast.AST) -> str | None:
    """``WHOLE``, ``ITEM`` or None for an expression, given the scope's batch names:
    an index into a batch is a tensor (``batch["ids"]``, ``batch[0]``); an attribute
    may be anything (``batch.input_ids``, a custom object)."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    root = node
    while isinstance(root, (ast.Subscript, ast.Attribute)):
        root = root.value
    if not (isinstance(root, ast.Name) and root.id in names):
        return None
    return ITEM if isinstance(node, ast.Subscript) else WHOLE if isinstance(node, ast.Attribute) else None


def _batch_kind(ctx: FileContext, node: ast.AST) -> str | None:
    scope = next((p for p in reversed(ctx.parents) if isinstance(p, T.FUNCTION_TYPES)), ctx.tree)
    return _kind(_batch_names(ctx, scope), node)


class BlockingBatchCopy(Rule):
    """
    ## What it does
    Flags `.to(device)`, `.cuda()` and `.npu()` of a batch without `non_blocking=True`
    inside a training loop (a loop whose own body calls `backward()` or an optimizer's
    `step()`, or the body of a step function that does, such as `def train_step(batch)`,
    that the file calls in a loop or from another step function; a loss scaler called with the
    loss and the optimizer, `scaler.step(opt)`, `accelerator.backward(loss)` and a
    Lightning `training_step` that steps by hand count as steps), when the file builds a DataLoader with
    `pin_memory=True`. A batch is the for-loop variable over a loader (through
    `enumerate`, `tqdm`, ...), a `next()` of an iterator over one, or a tensor unpacked
    or indexed from it (`x, y = batch`, `batch["ids"]`,
    `{k: v.to(d) for k, v in batch.items()}`).

    ## Why is this bad?
    `pin_memory=True` puts each batch in page-locked memory precisely so that the copy
    to the device can run asynchronously. Without `non_blocking=True` the host still
    waits for every copy to finish before it goes on to queue the step's kernels, so
    the pinning buys little. With it, the copy is queued on the stream like a kernel,
    the host runs ahead, and the kernels that use the batch still wait for it.

    Not reported on the `cpu` target (a move to the CPU copies nothing, and a
    non-blocking copy *to* the host would be unsafe), nor for moves that already say
    `non_blocking=` (either way), or pass `**kwargs`.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=8, pin_memory=True)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
    ```

    ## Use instead
    ```python
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    ```

    ## Fix safety
    Safe for tensors unpacked or indexed from a batch: a host-to-device copy with
    `non_blocking=True` is ordered on the stream before the kernels that read it, and
    the pinned buffer is not reused until the copy is done. Unsafe for the batch object
    itself or its attributes (`batch.to(device)`): it may be a custom class whose
    `.to()` takes no `non_blocking` (older Hugging Face `BatchEncoding`).
    """

    code = "AX306"
    name = "blocking-batch-copy"
    category = "host_tensor_to_device"
    message = "a pinned batch is copied to the device without non_blocking=True"
    fix_title = "pass non_blocking=True"
    fix_safety = Applicability.SAFE
    targets = ("cuda", "npu")
    requires_text = ("pin_memory", "DataLoader")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers",
        "https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html",
    )
    examples = (
        Invalid(
            "from torch.utils.data import DataLoader\n"
            "loader = DataLoader(ds, batch_size=64, pin_memory=True)\n"
            "for x, y in loader:\n"
            "    x, y = x.to(device), y.cuda()\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n",
            target="cuda",
            fixed="from torch.utils.data import DataLoader\n"
            "loader = DataLoader(ds, batch_size=64, pin_memory=True)\n"
            "for x, y in loader:\n"
            "    x, y = x.to(device, non_blocking=True), y.cuda(non_blocking=True)\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()\n", lines=(4, 4),
        ),
        Invalid(
            "import torch\n"
            "train_loader = torch.utils.data.DataLoader(ds, pin_memory=args.pin)\n"
            "def train(model, train_loader, optimizer):\n"
            "    for step, batch in enumerate(tqdm(train_loader)):\n"
            "        batch = {k: v.npu() for k, v in batch.items()}\n"
            "        ids = batch['input_ids'].to(\n"
            "            args.device,\n"
            "        )\n"
            "        model(**batch).loss.backward()\n"
            "        optimizer.step()\n",
            target="npu",
            fixed="import torch\n"
            "train_loader = torch.utils.data.DataLoader(ds, pin_memory=args.pin)\n"
            "def train(model, train_loader, optimizer):\n"
            "    for step, batch in enumerate(tqdm(train_loader)):\n"
            "        batch = {k: v.npu(non_blocking=True) for k, v in batch.items()}\n"
            "        ids = batch['input_ids'].to(\n"
            "            args.device,\n"
            "            non_blocking=True,\n"
            "        )\n"
            "        model(**batch).loss.backward()\n"
            "        optimizer.step()\n", lines=(5, 6),
        ),
        Invalid(
            "import torch as T\n"
            "dl = T.utils.data.DataLoader(ds, 32, True, None, None, 4, None, True)\n"
            "it = iter(dl)\n"
            "while True:\n"
            "    batch = next(it)\n"
            "    batch = batch.to(local_rank)\n"
            "    model(batch).backward()\n"
            "    opt.step()\n",
            target="cuda",
            fixed="import torch as T\n"
            "dl = T.utils.data.DataLoader(ds, 32, True, None, None, 4, None, True)\n"
            "it = iter(dl)\n"
            "while True:\n"
            "    batch = next(it)\n"
            "    batch = batch.to(local_rank, non_blocking=True)\n"
            "    model(batch).backward()\n"
            "    opt.step()\n", lines=(6,),
        ),
        Valid(
            "from torch.utils.data import DataLoader\n"
            "loader = DataLoader(ds, pin_memory=True)\n"
            "for x, y in loader:\n"
            "    x = x.to(device)\n"
            "    model(x, y).backward()\n"
            "    opt.step()\n",
            target="cpu",
        ),
        Valid(
            "from torch.utils.data import DataLoader\n"
            "loader = DataLoader(ds, pin_memory=False)\n"
            "for x, y in loader:\n"
            "    x = x.to(device)\n"
            "    model(x, y).backward()\n"
            "    opt.step()\n",
            target="cuda",
        ),
        Valid(
            "from torch.utils.data import DataLoader\n"
            "loader = DataLoader(ds, pin_memory=True)\n"
            "for x, y in val_loader:\n"
            "    with torch.no_grad():\n"
            "        model(x.to(device))\n"
            "for step, (x, y) in enumerate(loader):\n"
            "    x = x.to(device, non_blocking=True)\n"
            "    y = y.to(device, non_blocking=False)\n"
            "    step.to(device)\n"
            "    z = x.to(torch.float16)\n"
            "    h = y.to('cpu')\n"
            "    w = weights.to(device)\n"
            "    m = y.cuda(**opts)\n"
            "    t = x.to(device)  # noqa: AX306\n"
            "    def move(b):\n"
            "        return b.to(device)\n"
            "    model(x, y).backward()\n"
            "    opt.step()\n",
            target="cuda",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        func = node.func
        if not isinstance(func, ast.Attribute) or func.attr not in ("to", "cuda", "npu"):
            return
        if T.keyword(node, "non_blocking") is not None or T.has_double_star(node):
            return
        if T.move_device(ctx, node) is False or not _pins_memory(ctx):
            return
        kind = _batch_kind(ctx, func.value)
        if kind is None or ctx.training_loop(node) is None:
            return
        dev = T.DEVICE_WORD[ctx.target]
        safety = Applicability.SAFE if kind == ITEM else Applicability.UNSAFE
        note = "" if kind == ITEM else " (check that the batch object's .to() accepts non_blocking)"
        yield ctx.finding(
            self,
            node,
            f"`{T.describe(ctx, node)}` copies a batch from pinned memory without non_blocking=True: the host "
            f"waits for each copy before it queues the step's kernels; with non_blocking=True the copy is queued "
            f"on the {dev} stream and the host runs ahead{note}",
            replacement=f"{T.describe(ctx, func.value)}.{func.attr}(..., non_blocking=True)",
            fix=ctx.fix(self, ctx.add_keyword(node, "non_blocking=True"), applicability=safety),
        )
