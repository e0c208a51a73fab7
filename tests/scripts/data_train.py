"""A tiny training script for the data tests: its loader is the bottleneck on purpose.

Each sample sleeps --sample-ms (the "decoding"), each step --compute-ms on top of a
small model; --bad-index makes __getitem__ raise for that index, --hang-index makes it
block. The DataLoader is built without workers (what AX401 flags)."""

import argparse
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--sample-ms", type=float, default=3.0)
parser.add_argument("--compute-ms", type=float, default=2.0)
parser.add_argument("--bad-index", type=int, default=-1)
parser.add_argument("--hang-index", type=int, default=-1)
args = parser.parse_args()


class SlowSamples(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == args.bad_index:
            raise ValueError(f"sample {i} is corrupt")
        if i == args.hang_index:
            threading.Event().wait()
        time.sleep(args.sample_ms / 1000.0)
        return torch.full((8,), float(i % 5)), i % 2


torch.manual_seed(0)
loader = DataLoader(SlowSamples(args.samples), batch_size=args.batch_size, shuffle=False)
model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while step < args.steps:
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.compute_ms / 1000.0)
        step += 1
        if step >= args.steps:
            break
print("done", flush=True)
