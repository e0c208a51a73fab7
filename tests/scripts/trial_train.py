"""A tiny training script for the trial tests: a few ms per step.

Environment knobs: SLOW_MS sleeps that long in every step; FAIL_AT=K raises at step K.
It prints the settings the trial knobs change (loader, threads, precision, compile)."""

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
# batch_size and shuffle by position, num_workers by name: the override must cope.
loader = DataLoader(data, 8, True, num_workers=0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
slow = float(os.environ.get("SLOW_MS", "0")) / 1000.0
fail_at = int(os.environ.get("FAIL_AT", "0"))

print(f"loader num_workers={loader.num_workers} pin_memory={loader.pin_memory} "
      f"persistent_workers={loader.persistent_workers} prefetch_factor={loader.prefetch_factor}", flush=True)
print(f"torch num_threads={torch.get_num_threads()} matmul_precision={torch.get_float32_matmul_precision()} "
      f"cudnn_benchmark={torch.backends.cudnn.benchmark}", flush=True)

step = 0
while step < args.steps:
    for x, y in loader:
        step += 1
        if fail_at and step == fail_at:
            raise RuntimeError(f"FAIL_AT reached at step {step}")
        loss = loss_fn(model(x), y)
        if step == 1:
            import sys

            dynamo = sys.modules.get("torch._dynamo.utils")  # graphs torch.compile captured so far
            graphs = dynamo.counters["stats"]["unique_graphs"] if dynamo is not None else 0
            print(f"compiled={graphs > 0}", flush=True)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if slow:
            time.sleep(slow)
        if step >= args.steps:
            break
print("done", flush=True)
