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

_RANDOM_SAMPLERS = frozenset({"torch.utils.data.RandomSampler", "torch.utils.data.sampler.RandomSampler"})

#: A sampler drawing at least this many samples is taken for endless: its one pass is
#: the whole run (minGPT's ``RandomSampler(..., replacement=True, num_samples=int(1e10))``).
ENDLESS_SAMPLES = 10**8


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
    `*args`/`**kwargs` or a non-literal `persistent_workers` are not flagged, nor is
    a loader whose sampler draws with replacement a literal `num_samples` of 10^8 or
    more (an endless stream iterated once, as minGPT's trainer builds it).
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
            fixed="import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=8, persistent_workers=True)\n", lines=(2,),
        ),
        Invalid(
            "from torch.utils.data import DataLoader as DL\nloader = DL(ds, num_workers=args.workers)\n",
            target="cuda",
            fixed="from torch.utils.data import DataLoader as DL\nloader = DL(ds, num_workers=args.workers, persistent_workers=args.workers > 0)\n", lines=(2,),
        ),
        Invalid(
            "from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=n or 2, persistent_workers=False)\n",
            target="npu",
            fixed="from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=n or 2, persistent_workers=(n or 2) > 0)\n", lines=(2,),
        ),
        Invalid(
            "import torch.utils.data as tud\nloader = tud.DataLoader(\n    ds,\n    num_workers=4,\n)\n",
            fixed="import torch.utils.data as tud\nloader = tud.DataLoader(\n    ds,\n    num_workers=4,\n    persistent_workers=True,\n)\n", lines=(2,),
        ),
        Invalid(
            "from torch.utils.data import DataLoader\nloader = DataLoader(ds, 32, True, None, None, 6)\n",
            fixed="from torch.utils.data import DataLoader\nloader = DataLoader(ds, 32, True, None, None, 6, persistent_workers=True)\n", lines=(2,),
        ),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=4, persistent_workers=True)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=4, persistent_workers=keep)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=0)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=4, **extra)\n"),
        Valid("from somewhere import DataLoader\nloader = DataLoader(ds, num_workers=4)\n"),
        Valid(
            "import torch\n"
            "from torch.utils.data import DataLoader\n"
            "sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=int(1e10))\n"
            "loader = DataLoader(ds, sampler=sampler, num_workers=4)\n"
        ),
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
        if _endless_sampler(ctx, loader.argument("sampler")):
            return  # one pass is the whole run: nothing restarts
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


def _endless_sampler(ctx: FileContext, node: ast.expr | None) -> bool:
    """Whether ``node`` builds (or names a single assignment that builds) a
    ``RandomSampler(..., replacement=True, num_samples=N)`` with N of at least
    :data:`ENDLESS_SAMPLES`."""
    if isinstance(node, ast.Name):
        node = ctx.single_assignments().get(node.id)
    if not isinstance(node, ast.Call) or ctx.call_name(node) not in _RANDOM_SAMPLERS:
        return False
    keywords = {k.arg: k.value for k in node.keywords}
    replacement = keywords.get("replacement", node.args[1] if len(node.args) > 1 else None)
    samples = keywords.get("num_samples", node.args[2] if len(node.args) > 2 else None)
    if not (isinstance(replacement, ast.Constant) and replacement.value is True) or samples is None:
        return False
    count = _number(samples)
    return count is not None and count >= ENDLESS_SAMPLES


def _number(node: ast.expr) -> float | None:
    """The value of a constant number written as a literal, ``int(...)``/``float(...)``
    of one, or a product or power of them (``int(1e10)``, ``10**9``); None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("int", "float"):
        if len(node.args) == 1 and not node.keywords:
            return _number(node.args[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Pow)):
        left, right = _number(node.left), _number(node.right)
        if left is None or right is None or (isinstance(node.op, ast.Pow) and right > 64):
            return None
        return left * right if isinstance(node.op, ast.Mult) else left**right
    return None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
