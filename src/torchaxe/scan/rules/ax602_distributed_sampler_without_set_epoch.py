"""AX602: a shuffling DistributedSampler whose set_epoch is never called."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules._distributed import call_leaf, helper_of_another_module
from torchaxe.scan.rules.base import Invalid, Rule, Valid

_SAMPLERS = frozenset({"torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler"})
#: ``DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)``
_SHUFFLE_POSITION = 3

_TRAIN = "for x in loader:\n    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n"


class DistributedSamplerWithoutSetEpoch(Rule):
    """
    ## What it does
    Flags a shuffling `torch.utils.data.DistributedSampler` in a file that trains
    (calls `backward()` or an optimizer's `step()`) and never calls `set_epoch`; also
    a call of another module's sampler helper told whether the run is distributed,
    with `shuffle=True` (`dist.data_sampler(ds, shuffle=True, distributed=...)`).

    ## Why is this bad?
    A `DistributedSampler` shuffles with a generator seeded from `seed + epoch`, and
    the epoch only changes through `set_epoch(epoch)`. Without it every epoch visits
    the samples in the same order, and each rank sees the same shard of the data
    every epoch: the run trains on a fixed order, which usually costs accuracy and
    makes more epochs worth less. It is a correctness problem more than a speed one.

    ## Example
    ```python
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, sampler=sampler, batch_size=64)
    for epoch in range(epochs):
        for x, y in loader:
            ...
    ```

    ## Use instead
    ```python
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...
    ```

    ## Fix safety
    No automatic fix: where the epoch loop is, and which number counts epochs, is
    not certain. Calling `set_epoch` changes the data order from the second epoch
    on, so results change (as intended). Samplers built with `shuffle=False`, and
    files that call `set_epoch` anywhere (on the sampler, the loader's
    `.sampler`, or a wrapper), are not flagged; nor is a file that only builds the
    sampler and trains elsewhere.
    """

    code = "AX602"
    name = "sampler-without-set-epoch"
    category = "sampler_epoch"
    message = "DistributedSampler.set_epoch is never called: every epoch sees the same order"
    requires_text = ("DistributedSampler", "distributed=")
    node_types = (ast.Call,)
    references = ("https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler",)
    examples = (
        Invalid(
            "from torch.utils.data import DataLoader, DistributedSampler\n"
            "sampler = DistributedSampler(train_set)\nloader = DataLoader(train_set, sampler=sampler)\n"
            "for epoch in range(10):\n" + "\n".join("    " + line for line in _TRAIN.splitlines()) + "\n", lines=(2,),
        ),
        Invalid(
            "import torch\nsampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True)\n" + _TRAIN,
            target="cuda", lines=(2,),
        ),
        Valid(
            "from torch.utils.data import DistributedSampler\nsampler = DistributedSampler(train_set)\n"
            "for epoch in range(10):\n    sampler.set_epoch(epoch)\n"
            + "\n".join("    " + line for line in _TRAIN.splitlines()) + "\n"
        ),
        Valid(
            "from torch.utils.data import DistributedSampler\nsampler = DistributedSampler(train_set)\n"
            "for epoch in range(10):\n    loader.sampler.set_epoch(epoch)\n"
            + "\n".join("    " + line for line in _TRAIN.splitlines()) + "\n"
        ),
        Valid("from torch.utils.data import DistributedSampler\nsampler = DistributedSampler(val_set, shuffle=False)\n"
              + _TRAIN),
        Valid("from torch.utils.data import DistributedSampler\nsampler = DistributedSampler(ds, 2, 0, False)\n"
              + _TRAIN),
        Valid("from torch.utils.data import DistributedSampler\n\ndef make(ds):\n"
              "    return DistributedSampler(ds)\n"),
        Valid("from mylib import DistributedSampler\nsampler = DistributedSampler(ds)\n" + _TRAIN),
        Invalid("import torch\nimport distributed as dist\n"
                "sampler = dist.data_sampler(ds, shuffle=True, distributed=args.distributed)\n" + _TRAIN, lines=(3,)),
        Valid("import torch\nimport distributed as dist\n"
              "sampler = dist.data_sampler(ds, shuffle=False, distributed=args.distributed)\n" + _TRAIN),
        Valid("from torch.utils.data import DistributedSampler\nsampler = DistributedSampler(ds)  # noqa: AX602\n"
              + _TRAIN),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        helper = ctx.call_name(node) not in _SAMPLERS
        if helper and not _sampler_helper(ctx, node):
            return
        shuffle = next((k.value for k in node.keywords if k.arg == "shuffle"), None)
        if shuffle is None and len(node.args) > _SHUFFLE_POSITION and not helper:
            shuffle = node.args[_SHUFFLE_POSITION]
        if (shuffle is not None or helper) and not (isinstance(shuffle, ast.Constant) and shuffle.value is True):
            return  # shuffle=False, or decided at run time (a helper: unless it says shuffle=True)
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return
        if not _trains_without_set_epoch(ctx):
            return
        built = (f"`{ctx.text(node.func)}(..., shuffle=True, distributed=...)` builds a DistributedSampler when the "
                 "run is distributed; it") if helper else "DistributedSampler"
        message = (
            f"{built} shuffles with seed + epoch, and nothing in this file calls set_epoch: every epoch "
            "sees the same order and each rank the same shard, which usually costs accuracy (a correctness bug, "
            "not a speed one); call sampler.set_epoch(epoch) at the start of each epoch, before iterating the "
            "loader. Advice only"
        )
        yield ctx.finding(self, node, message, replacement="sampler.set_epoch(epoch) at the start of each epoch",
                          fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))


def _sampler_helper(ctx: FileContext, call: ast.Call) -> bool:
    """A sampler-making helper of another module told whether the run is distributed
    (``dist.data_sampler(dataset, shuffle=True, distributed=args.distributed)``, as
    rosinality's stylegan2 and vq-vae-2 write it): it returns a DistributedSampler
    then. One this file defines is read where it builds the sampler."""
    if "sampler" not in call_leaf(call).lower() or not any(k.arg == "distributed" for k in call.keywords):
        return False
    return helper_of_another_module(ctx, call)


def _trains_without_set_epoch(ctx: FileContext) -> bool:
    key = "ax602.trains_without_set_epoch"
    if key not in ctx.cache:
        set_epoch = trains = False
        for node in ctx.nodes(ast.Attribute, ast.Call):
            if isinstance(node, ast.Attribute) and node.attr == "set_epoch":
                set_epoch = True
                break
            if not trains and isinstance(node, ast.Call) and ctx.is_training_call(node):
                trains = True
        ctx.cache[key] = trains and not set_epoch
    return ctx.cache[key]
