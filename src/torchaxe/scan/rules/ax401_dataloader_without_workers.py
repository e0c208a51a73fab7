"""AX401: a DataLoader that loads every batch in the training process."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules._dataloader import (MISSING, builds_tensor_dataset, dataset_moving_to_device,
                                             is_tensor_dataset, loader_call, set_argument, unsharded_iterable_dataset)
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Workers the fix asks for at most: enough to hide decoding and augmentation behind
#: a step on most models, few enough not to crowd a shared machine. Tune it by measuring.
SUGGESTED_WORKERS = 4


def suggested_workers(cpus: int | None, target: str) -> int:
    """The fix's worker count: :data:`SUGGESTED_WORKERS`, never more than the CPUs
    the process may use, and on a cpu target one fewer (training computes there too)."""
    if not cpus:
        return SUGGESTED_WORKERS
    room = cpus - 1 if target == "cpu" else cpus
    return max(1, min(SUGGESTED_WORKERS, room))

_UNSAFE_BECAUSE = (
    "unsafe: the dataset must pickle to reach the workers, each worker seeds its own "
    "random state, an IterableDataset yields its data once per worker unless it shards "
    "by get_worker_info(), and spawn-start platforms need an `if __name__ == '__main__':` guard"
)


class DataLoaderWithoutWorkers(Rule):
    """
    ## What it does
    Flags a `torch.utils.data.DataLoader` built without worker processes
    (`num_workers` missing or the literal `0`), through any import alias, and
    PyTorch Geometric's `torch_geometric.loader.DataLoader`, which passes the
    setting on to it (read by its own positions: `dataset, batch_size, shuffle,
    follow_batch, exclude_keys`).

    ## Why is this bad?
    With no workers the training process itself runs the dataset's `__getitem__`
    and the collate function for every batch between two steps, and the device
    idles meanwhile. Worker processes prepare the next batches in parallel while the
    current step runs. That pays off when a batch costs time to make (files read,
    images decoded, augmentation); over tensors already in memory (a `TensorDataset`)
    a batch is indexing and stacking, and workers usually do not help.

    ## Example
    ```python
    loader = DataLoader(train_set, batch_size=64, shuffle=True)
    ```

    ## Use instead
    ```python
    loader = DataLoader(train_set, batch_size=64, shuffle=True, num_workers=4)
    ```

    ## Fix safety
    Unsafe. The fix asks for 4 workers, a conservative start to tune by measuring,
    and never more than the CPUs the scanning process may use (its affinity mask;
    one fewer on a CPU target, where training computes on the same cores).
    The dataset must be picklable, each worker has its own random state (seed numpy
    and `random` in a `worker_init_fn`), an `IterableDataset` yields its data once per
    worker unless it shards with `get_worker_info()`, and platforms that start workers
    with `spawn` need the training code under `if __name__ == "__main__":`. On a CPU
    target the workers share cores with the training threads. Loaders over a
    `TensorDataset` built in the same file (data already in memory: the name passed
    is bound only to `TensorDataset(...)` calls, or a function of the file that
    returns one builds it) and calls with
    `*args`/`**kwargs` or a non-literal `num_workers` are not flagged. A loader over an
    `IterableDataset` defined in the same file that never calls `get_worker_info()`
    gets advice only: with workers, each would yield the whole data set. So does a
    loader over a dataset class of the same file whose `__getitem__` (or `__iter__`)
    moves tensors to a device (`.cuda()`, `.to(device)`): CUDA cannot be initialised
    in a forked worker.
    """

    code = "AX401"
    name = "dataloader-without-workers"
    category = "dataloader_config"
    message = "DataLoader loads every batch in the training process (no worker processes)"
    fix_title = "load batches in worker processes"
    fix_safety = Applicability.UNSAFE
    requires_text = ("DataLoader",)
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/data.html#single-and-multi-process-data-loading",
        "https://pytorch.org/docs/stable/notes/randomness.html#dataloader",
    )
    examples = (
        Invalid(
            "import torch\nloader = torch.utils.data.DataLoader(train_set, batch_size=64)\n",
            fixed="import torch\nloader = torch.utils.data.DataLoader(train_set, batch_size=64, num_workers=4)\n", lines=(2,),
        ),
        Invalid(
            "from torch.utils.data import DataLoader as DL\nloader = DL(ds, batch_size=8, num_workers=0)\n",
            target="cuda",
            fixed="from torch.utils.data import DataLoader as DL\nloader = DL(ds, batch_size=8, num_workers=4)\n", lines=(2,), message="(num_workers=0)",
        ),
        Invalid(
            "import torch.utils.data as tud\nloader = tud.DataLoader(\n    ds,\n    batch_size=8,\n    shuffle=True,\n)\n",
            target="npu",
            fixed=(
                "import torch.utils.data as tud\nloader = tud.DataLoader(\n    ds,\n    batch_size=8,\n"
                "    shuffle=True,\n    num_workers=4,\n)\n"
            ), lines=(2,),
        ),
        Invalid(
            "from torch.utils.data import DataLoader\nloader = DataLoader(ds, 32, True, None, None, 0)\n",
            fixed="from torch.utils.data import DataLoader\nloader = DataLoader(ds, 32, True, None, None, 4)\n", lines=(2,),
        ),
        Invalid(
            "from torch.utils import data\nloader = data.DataLoader(ds)\n",
            fixed="from torch.utils import data\nloader = data.DataLoader(ds, num_workers=4)\n", lines=(2,),
        ),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64, num_workers=8)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, num_workers=args.workers)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, **loader_kwargs)\n"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(*loader_args)\n"),
        Valid("from mylib.data import DataLoader\nloader = DataLoader(ds, batch_size=64)\n"),
        Valid("import torch\nloader = torch.utils.data.DataLoader(ds)  # noqa: AX401\n"),
        Invalid(
            "from torch.utils.data import DataLoader, IterableDataset\n\n\nclass Stream(IterableDataset):\n"
            "    def __iter__(self):\n        yield from range(8)\n\n\nloader = DataLoader(Stream(), batch_size=4)\n", lines=(9,),
        ),
        Invalid(
            "import torch\n\n\nclass Shards(torch.utils.data.IterableDataset):\n    def __iter__(self):\n"
            "        info = torch.utils.data.get_worker_info()\n        yield from range(info.id if info else 0, 8, 2)\n\n\n"
            "loader = torch.utils.data.DataLoader(Shards(), batch_size=4)\n",
            fixed="import torch\n\n\nclass Shards(torch.utils.data.IterableDataset):\n    def __iter__(self):\n"
            "        info = torch.utils.data.get_worker_info()\n        yield from range(info.id if info else 0, 8, 2)\n\n\n"
            "loader = torch.utils.data.DataLoader(Shards(), batch_size=4, num_workers=4)\n", lines=(10,),
        ),
        Invalid(
            "import torch\nfrom torch.utils.data import DataLoader, Dataset\n\n\nclass Pairs(Dataset):\n"
            "    def __len__(self):\n        return 64\n\n    def __getitem__(self, i):\n"
            "        return torch.randn(8).to(device), i\n\n\nloader = DataLoader(Pairs(), batch_size=8)\n", lines=(13,),
        ),
        Invalid(
            "import torch\nfrom torch.utils.data import DataLoader, Dataset\n\n\nclass Pairs(Dataset):\n"
            "    def __len__(self):\n        return 64\n\n    def __getitem__(self, i):\n"
            "        return torch.randn(8).to(torch.float16), i\n\n\ntrain = Pairs()\n"
            "loader = DataLoader(train, batch_size=8)\n",
            fixed="import torch\nfrom torch.utils.data import DataLoader, Dataset\n\n\nclass Pairs(Dataset):\n"
            "    def __len__(self):\n        return 64\n\n    def __getitem__(self, i):\n"
            "        return torch.randn(8).to(torch.float16), i\n\n\ntrain = Pairs()\n"
            "loader = DataLoader(train, batch_size=8, num_workers=4)\n", lines=(14,),
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
            "train_set = TensorDataset(x, y)\nloader = DataLoader(train_set, batch_size=64)\n"
        ),
        Valid(
            "from torch.utils.data import DataLoader, TensorDataset\nif small:\n    ds = TensorDataset(x[:8], y[:8])\n"
            "else:\n    ds = TensorDataset(x, y)\nloader = DataLoader(ds, batch_size=64)\n"
        ),
        Valid(
            "import torch\n\n\ndef make_data(n):\n    x = torch.randn(n, 4)\n    data = torch.utils.data.TensorDataset(x, x)\n"
            "    return data\n\n\nloader = torch.utils.data.DataLoader(make_data(64), batch_size=8)\n"
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        loader = loader_call(node, ctx)
        if loader is None:
            return
        workers = loader.literal("num_workers")
        if workers is not MISSING and (isinstance(workers, bool) or workers != 0):
            return  # workers already, or a value only known at run time
        if is_tensor_dataset(ctx, loader):
            return  # in-memory tensors: workers would only add copies between processes
        why = "num_workers=0" if workers == 0 else "num_workers defaults to 0"
        cpus = ctx.capabilities.get("cpus")
        count = suggested_workers(cpus, ctx.target)
        bound = f", within the {cpus} CPUs this process may use" if cpus else ""
        cpu_note = (
            "; on a CPU target the workers share cores with the training threads, so set "
            "torch.set_num_threads() to the cores left over"
            if ctx.target == "cpu"
            else ""
        )
        waiting = "the step waits" if ctx.target == "cpu" else f"the {ctx.target} device waits"
        in_memory = (
            " This file builds a TensorDataset: if this loader reads it, its batches are tensors in memory "
            "already and workers usually do not help; measure before changing it."
            if builds_tensor_dataset(ctx) else ""
        )
        message = (
            f"DataLoader loads every batch in the training process ({why}): {waiting} while the dataset's "
            f"__getitem__ and the collate function make each batch; worker processes make batches in the "
            f"background while steps run, which pays off when that costs time (reading files, decoding, "
            f"augmenting), and usually not over tensors already in memory (a TensorDataset). num_workers={count} is a start (tune the count by measuring{bound}{cpu_note}).{in_memory}"
            f" Fix is {_UNSAFE_BECAUSE}"
        )
        edits = set_argument(ctx, loader, "num_workers", str(count))
        applicability = None
        unsharded = unsharded_iterable_dataset(ctx, loader)
        if unsharded is not None:
            # Each worker would run the whole iterator: every sample once per worker.
            message += (f". No automatic fix: {unsharded} is an IterableDataset that does not shard with "
                        "torch.utils.data.get_worker_info(), so each worker would yield all of it; split its "
                        "iteration by worker id first")
            edits, applicability = [], Applicability.DISPLAY_ONLY
        moving = dataset_moving_to_device(ctx, loader)
        if moving is not None and unsharded is None:
            # CUDA cannot start in a forked worker; each worker would hold a device context otherwise.
            cls, line = moving
            message += (f". No automatic fix: {cls} moves tensors to the device in the samples it makes (line "
                        f"{line}), which fails in worker processes (CUDA cannot be initialised in a forked "
                        "process) or gives each worker a device context of its own; move the transfer into the "
                        "training loop (batch.to(device, non_blocking=True), with pin_memory=True) first")
            edits, applicability = [], Applicability.DISPLAY_ONLY
        yield ctx.finding(
            self,
            node,
            message,
            replacement=f"DataLoader(..., num_workers={count})",
            fix=ctx.fix(self, edits, applicability=applicability),
        )
