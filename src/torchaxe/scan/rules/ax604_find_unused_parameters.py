"""AX604: DistributedDataParallel given find_unused_parameters=True as a constant."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules._distributed import wrapper_kind
from torchaxe.scan.rules.base import Invalid, Rule, Valid


#: Classes that hand their keywords to the DDP a framework builds: accelerate's kwargs
#: handler and Lightning's DDP strategy.
DDP_SETTINGS = frozenset({
    "accelerate.DistributedDataParallelKwargs", "accelerate.utils.DistributedDataParallelKwargs",
    "accelerate.utils.dataclasses.DistributedDataParallelKwargs",
    "lightning.pytorch.strategies.DDPStrategy", "pytorch_lightning.strategies.DDPStrategy",
    "lightning.pytorch.strategies.ddp.DDPStrategy", "pytorch_lightning.strategies.ddp.DDPStrategy",
})


class FindUnusedParameters(Rule):
    """
    ## What it does
    Flags `DistributedDataParallel(..., find_unused_parameters=True)` where the
    `True` is written in the code (not read from a setting), and the same keyword given
    to the DDP a framework builds: accelerate's `DistributedDataParallelKwargs` and
    Lightning's `DDPStrategy`.

    ## Why is this bad?
    With it, DDP walks the autograd graph from the forward's outputs after every
    forward pass to find the parameters that will get no gradient, and marks them
    ready for reduction early. The walk costs host time every step (more for big
    graphs), and it stops DDP from starting bucket all-reduces as early as it could.
    Most models use every parameter in every step and do not need it; torch prints a
    warning at the first backward when it found no unused parameter.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    ```

    ## Use instead
    ```python
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    Advice only: whether some parameter goes unused in some step (a branch of the
    model, a frozen head, a mixture of experts) depends on the data. Measure the
    run without the flag: when a parameter does go unused, DDP stops with an error
    at the next iteration instead of giving wrong results, so the test is safe. If
    the set of used parameters never changes, `static_graph=True` keeps the
    correctness and drops most of the cost.
    """

    code = "AX604"
    name = "ddp-find-unused-parameters"
    category = "ddp_find_unused"
    message = "find_unused_parameters=True walks the autograd graph after every forward pass"
    requires_text = ("find_unused_parameters",)
    node_types = (ast.Call,)
    references = ("https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html",)
    examples = (
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                "model = DDP(model, device_ids=[rank], find_unused_parameters=True)\n", lines=(2,)),
        Invalid("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(\n    model,\n"
                "    find_unused_parameters=True,\n)\n", target="cuda", lines=(4,)),
        Invalid("from accelerate import Accelerator, DistributedDataParallelKwargs\n"
                "ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)\n"
                "accelerator = Accelerator(kwargs_handlers=[ddp_kwargs])\n", lines=(2,)),
        Valid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(model)\n"),
        Valid("from torch.nn.parallel import DistributedDataParallel as DDP\n"
              "model = DDP(model, find_unused_parameters=args.find_unused)\n"),
        Valid("from torch.nn.parallel import DistributedDataParallel as DDP\n"
              "model = DDP(model, find_unused_parameters=False)\n"),
        Valid("from mylib import DistributedDataParallel as DDP\nmodel = DDP(model, find_unused_parameters=True)\n"),
        Valid("from torch.nn.parallel import DistributedDataParallel as DDP\n"
              "model = DDP(model, find_unused_parameters=True)  # noqa: AX604\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        if wrapper_kind(ctx, node) != "ddp" and ctx.call_name(node) not in DDP_SETTINGS:
            return
        flag = next((k for k in node.keywords if k.arg == "find_unused_parameters"), None)
        if flag is None or not (isinstance(flag.value, ast.Constant) and flag.value.value is True):
            return
        message = (
            "find_unused_parameters=True makes DDP walk the autograd graph after every forward pass to find "
            "parameters that get no gradient, host time every step that also delays the first bucket's "
            "all-reduce; most models use every parameter. Measure the run without it (DDP stops with an error, "
            "not wrong results, if a parameter does go unused; static_graph=True is the cheap alternative when "
            "the unused set never changes). Advice only"
        )
        yield ctx.finding(self, flag, message, replacement="DistributedDataParallel(...) without find_unused_parameters",
                          fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
