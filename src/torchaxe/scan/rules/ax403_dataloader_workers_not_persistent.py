"""AX403: DataLoader workers that are started again for every epoch."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules._dataloader import MISSING, NOT_LITERAL, loader_call, set_argument
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Expressions that can take ``> 0`` without parentheses.
_ATOMS = (ast.Name, ast.Attribute, ast.Subscript, ast.Call, ast.Constant, ast.BinOp)


class DataLoaderWorkersNotPersistent(Rule):
    """
    ## What it does
    Flags a `torch.utils.data.DataLoader` with worker processes (`num_workers` a
    literal above 0, or an expression) that does not pass `persistent_workers=True`.

    ## Why is this bad?
    Without it, every `iter(loader)` (every epoch, every validation pass) shuts the
    workers down and starts new ones: each new worker re-imports or forks the
    process, unpickles the dataset, reruns `worker_init_fn` and refills the prefetch
    queue, and the device waits for the first batches of every epoch.

    ## Example
    ```python
    loader = DataLoader(train_set, batch_size=64, num_workers=8)
    ```

    ## Use instead
    ```python
    loader = DataLoader(train_set, batch_size=64, num_workers=8, persistent_workers=True)
    ```

    ## Fix safety
    Unsafe. Persistent workers keep their copy of the dataset for the loader's whole
    life, so changes the training code makes to the dataset object between epochs
    (a new curriculum, resampling, `dataset.set_epoch(...)`) no longer reach them
    (changes to the sampler still do); `worker_init_fn` runs once instead of once per
    epoch; and the workers' memory stays held between passes. When `num_workers` is
    an expression the fix writes `persistent_workers=<num_workers> > 0`, because
    the loader refuses `persistent_workers=True` with zero workers. Calls with
    `*args`/`**kwargs` or a non-literal `persistent_workers` are not flagged.

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.DataLoader
    """

    code = "AX403"
    name = "dataloader-workers-not-persistent"
    category = "dataloader_config"
    message = "DataLoader workers are shut down and restarted for every pass over the data"
    fix_title = "pass persistent_workers=True"
    fix_safety = Applicability.UNSAFE
    requires_text = ("DataLoader",)
    node_types = (ast.Call,)
    references = ("https://pytorch.org/docs/stable/data.html#torch.utils.data.DataLoader",)
    examples = (
        Invalid(
            "import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=8)\n",
            fixed="import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=8, persistent_workers=True)\n",
        ),
        Invalid(
            "from torch.utils.data import DataLoader as DL\nloader = DL(ds, num_workers=args.workers)\n",
            target="cuda",
            fixed="from torch.utils.data import DataLoader as DL\nloader = DL(ds, num_workers=args.workers, persistent_workers=args.workers > 0)\n",
        ),
        Invalid(
            "from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=n or 2, persistent_workers=False)\n",
            target="npu",
            fixed="from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=n or 2, persistent_workers=(n or 2) > 0)\n",
        ),
        Invalid(
            "import torch.utils.data as tud\nloader = tud.DataLoader(\n    ds,\n    num_workers=4,\n)\n",
            fixed="import torch.utils.data as tud\nloader = tud.DataLoader(\n    ds,\n    num_workers=4,\n    persistent_workers=True,\n)\n",
        ),
        Invalid(
            "from torch.utils.data import DataLoader\nloader = DataLoader(ds, 32, True, None, None, 6)\n",
            fixed="from torch.utils.data import DataLoader\nloader = DataLoader(ds, 32, True, None, None, 6, persistent_workers=True)\n",
        ),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=4, persistent_workers=True)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=4, persistent_workers=keep)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=0)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=4, **extra)\n"),
        Valid("from somewhere import DataLoader\nloader = DataLoader(ds, num_workers=4)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=4)  # noqa: AX403\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        loader = loader_call(node, ctx)
        if loader is None:
            return
        workers = loader.literal("num_workers")
        if workers is MISSING or (workers is not NOT_LITERAL and not _positive_int(workers)):
            return  # no workers: AX401's business
        persistent = loader.literal("persistent_workers")
        if persistent is not MISSING and persistent is not False:
            return
        if workers is NOT_LITERAL:
            expr = loader.argument("num_workers")
            assert expr is not None
            text = ctx.text(expr)
            if not isinstance(expr, _ATOMS):
                text = f"({text})"
            value = f"{text} > 0"
            count = f"num_workers={ctx.text(expr)}"
        else:
            value = "True"
            count = f"{workers} workers"
        waiting = "training waits" if ctx.target == "cpu" else f"the {ctx.target} device waits"
        message = (
            f"DataLoader restarts its workers ({count}) at every iter(loader), i.e. every epoch and every "
            f"evaluation pass: each restart re-creates the processes, unpickles the dataset and refills the "
            f"prefetch queue while {waiting}; persistent_workers=True keeps them alive. "
            "Fix is unsafe: dataset changes made between epochs no longer reach the workers, worker_init_fn "
            "runs once, and worker memory stays held"
        )
        yield ctx.finding(
            self,
            node,
            message,
            replacement=f"DataLoader(..., persistent_workers={value})",
            fix=ctx.fix(
                self,
                set_argument(ctx, loader, "persistent_workers", value),
                title=f"pass persistent_workers={value}",
            ),
        )


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
