"""The ``aoe`` strategy: Ascend's own operator auto-tuning, through torch_npu.

During tuning, the subgraph runs once with torch_npu dumping its graphs
(``torch_npu.npu.set_aoe``), then the CANN ``aoe`` tool tunes the dumped operators
(``aoe --job_type=2``) into its custom knowledge base; the candidate is then timed
like any other, and the operator compiler picks the tuned kernels up from that
knowledge base. Applying the winner needs nothing more than that knowledge base
(``TUNE_BANK_PATH``, or AOE's default folder), whose location the notes give. Every
torch_npu call is in ``torchaxe.backends.npu``. Unverified on Ascend hardware.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from torchaxe.errors import TorchaxeError


def _dump_folder() -> Path:
    from torchaxe.config import home

    root = home() / "aoe"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="dump-", dir=root))


def apply(module: nn.Module, ctx: Any) -> list[str]:
    from torchaxe.backends import npu

    bank = npu.aoe_knowledge_base()
    run_example = getattr(ctx, "run_example", None)
    if run_example is None:
        # Applying a winner: the tuned kernels are in AOE's knowledge base already.
        return [f"AOE-tuned operators come from its knowledge base at {bank}"]
    folder = _dump_folder()
    npu.aoe_dump(str(folder))
    run_example(module)
    dumped = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    if not dumped:
        raise TorchaxeError(f"aoe: torch_npu dumped no graph into {folder}")
    done = npu.run_aoe(str(folder), runner=ctx.aoe_runner)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()
        raise TorchaxeError(f"aoe exited with {done.returncode}: {tail[-1] if tail else 'no output'}")
    os.environ.setdefault("TUNE_BANK_PATH", bank)
    return [f"AOE tuned {len(dumped)} dumped graph file(s) from {folder}; its knowledge base: {bank} "
            "(unverified on Ascend hardware)"]
