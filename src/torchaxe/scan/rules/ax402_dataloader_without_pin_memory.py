"""AX402: a DataLoader feeding an accelerator from pageable host memory."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules._dataloader import MISSING, holds_device_tensors, loader_call, set_argument
from torchaxe.scan.rules.base import Invalid, Rule, Valid


class DataLoaderWithoutPinMemory(Rule):
    """
    ## What it does
    On an accelerator target (cuda, npu), flags a `torch.utils.data.DataLoader` built
    without `pin_memory=True` (missing or the literal `False`).

    ## Why is this bad?
    A batch in ordinary (pageable) host memory cannot be copied to the device
    directly: the driver first copies it into a page-locked staging buffer, and the
    copy blocks the host even with `non_blocking=True`. With `pin_memory=True` the
    loader places batches in page-locked memory, so the host-to-device copy is a
    single DMA transfer that can overlap the step running on the device.

    ## Example
    ```python
    loader = DataLoader(train_set, batch_size=64, num_workers=4)
    for x, y in loader:
        x = x.to("cuda")
    ```

    ## Use instead
    ```python
    loader = DataLoader(train_set, batch_size=64, num_workers=4, pin_memory=True)
    for x, y in loader:
        x = x.to("cuda", non_blocking=True)
    ```

    ## Fix safety
    Safe: the batches hold the same values, only the memory they live in changes. It
    costs page-locked host memory (a few batches' worth) and a pinning thread in the
    training process. A dataset that already yields device tensors cannot be pinned
    (the loader raises); a `TensorDataset` of tensors moved to a device in the same
    file is therefore not flagged, nor are calls with `*args`/`**kwargs` or a
    non-literal `pin_memory`. On npu, pinning goes through torch_npu and is
    unverified on Ascend hardware.
    """

    code = "AX402"
    name = "dataloader-without-pin-memory"
    category = "dataloader_config"
    message = "DataLoader feeds the device from pageable host memory (pin_memory is off)"
    fix_title = "pass pin_memory=True"
    fix_safety = Applicability.SAFE
    targets = ("cuda", "npu")
    requires_text = ("DataLoader",)
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/data.html#memory-pinning",
        "https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html",
    )
    examples = (
        Invalid(
            "import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=4)\n",
            target="cuda",
            fixed="import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=4, pin_memory=True)\n", lines=(2,),
        ),
        Invalid(
            "from torch.utils.data import DataLoader as DL\nloader = DL(ds, num_workers=2, pin_memory=False)\n",
            target="npu",
            fixed="from torch.utils.data import DataLoader as DL\nloader = DL(ds, num_workers=2, pin_memory=True)\n", lines=(2,),
        ),
        Invalid(
            "import torch.utils.data as tud\nloader = tud.DataLoader(\n    ds,\n    batch_size=8,\n)\n",
            target="cuda",
            fixed="import torch.utils.data as tud\nloader = tud.DataLoader(\n    ds,\n    batch_size=8,\n    pin_memory=True,\n)\n", lines=(2,),
        ),
        Invalid(
            "from torch.utils.data import DataLoader\nloader = DataLoader(ds, 32, True, None, None, 4, None, False)\n",
            target="cuda",
            fixed="from torch.utils.data import DataLoader\nloader = DataLoader(ds, 32, True, None, None, 4, None, True)\n", lines=(2,),
        ),
        Valid("import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=64)\n", target="cpu"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, pin_memory=True)\n", target="cuda"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, pin_memory=args.pin)\n", target="cuda"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds, **cfg)\n", target="npu"),
        Valid("from mylib import DataLoader\nloader = DataLoader(ds)\n", target="cuda"),
        Valid("from torch.utils.data import DataLoader\nloader = DataLoader(ds)  # noqa: AX402\n", target="cuda"),
        Valid(
            "from torch.utils.data import DataLoader, TensorDataset\n"
            "ds = TensorDataset(x.cuda(), y.cuda())\nloader = DataLoader(ds, batch_size=64)\n",
            target="cuda",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        loader = loader_call(node, ctx)
        if loader is None:
            return
        pinned = loader.literal("pin_memory")
        if pinned is not MISSING and pinned is not False:
            return  # pinned already, or decided at run time
        if holds_device_tensors(ctx, loader):
            return  # device tensors cannot be pinned
        device = "NPU" if ctx.target == "npu" else "GPU"
        why = "pin_memory=False" if pinned is False else "pin_memory defaults to False"
        npu_note = " (torch_npu pinning is unverified on Ascend hardware)" if ctx.target == "npu" else ""
        message = (
            f"DataLoader hands out batches in pageable host memory ({why}): every copy to the {device} "
            f"is staged through a driver buffer and blocks the host; pin_memory=True lets the copy run "
            f"as one DMA transfer that overlaps compute when made with .to(device, non_blocking=True)"
            f"{npu_note}. Fix is safe: same values, at the cost of some page-locked host memory"
        )
        yield ctx.finding(
            self,
            node,
            message,
            replacement="DataLoader(..., pin_memory=True)",
            fix=ctx.fix(self, set_argument(ctx, loader, "pin_memory", "True")),
        )
