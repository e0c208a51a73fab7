"""Train a small MLP regressor with Hugging Face ``accelerate`` and gradient
accumulation (an optimizer step every ``--accumulate`` batches).

Each optimizer step prints ``step N: loss X, time Y ms`` (the time of its
``--accumulate`` batches).

    python accelerate_accumulation.py --steps 100
"""

import argparse
import time

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=True)
    torch.manual_seed(args.seed)
    inputs = torch.randn(args.steps * args.accumulate * args.batch_size, 64)
    targets = inputs[:, :8].sum(dim=1, keepdim=True).sin()
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(64, args.width), nn.GELU(), nn.Linear(args.width, args.width), nn.GELU(),
                          nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    step, started = 0, time.perf_counter()
    for batch, (x, y) in enumerate(loader, start=1):
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            elapsed = time.perf_counter() - started
            accelerator.print(f"step {step}: loss {loss.item():.4f}, time {elapsed * 1e3:.2f} ms")
            started = time.perf_counter()


if __name__ == "__main__":
    main()
