"""One rank of the distributed tuning test: tune a model of four distinct layers
under a gloo process group and write what this rank measured and applied.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tune_dist.py OUT_FOLDER
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from torchaxe.tune import tune
from torchaxe.kb import KnowledgeBase


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 24)
        self.c = nn.Linear(24, 32)
        self.d = nn.Linear(32, 8)

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))))


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model()
    kb = os.path.join(out, f"kb-{rank}.sqlite")  # one file per rank: only the exchange can fill it
    report = tune(model, torch.randn(4, 8, requires_grad=True), kb=kb, compile_backend="eager", repeats=2,
                  min_sample_seconds=0.0, strategies=("eager", "compile"), target="cpu", min_gain=0.0,
                  whole_model=False)
    with KnowledgeBase.open(kb) as base:
        stored = sorted({r.signature for r in base.tuned()})
    result = {"rank": rank, "world": report.world_size,
              "measured": sorted({s.signature for s in report.subgraphs if s.records}),
              "statuses": {s.names[0]: s.status for s in report.subgraphs},
              "choices": {s.names[0]: s.winner for s in report.subgraphs},
              "applied": report.applied, "stored": stored,
              "compiled": {n: getattr(m, "_compiled_call_impl", None) is not None
                           for n, m in model.named_children()}}
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
