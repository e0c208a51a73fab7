"""Data-parallel training (DistributedDataParallel) with gradient accumulation.

This script is DELIBERATELY UNTUNED. It is written the way data-parallel training
code is commonly written by hand, so that torchaxe has something real to find on the
distributed axis. Do not "fix" it: the slow patterns are the point.

What is slow on purpose:

* gradient accumulation over ``--accum`` micro-batches where every micro-batch's
  ``backward()`` all-reduces the gradients (no ``model.no_sync()`` on the micro-batches
  before the last), so the gradients cross the network ``--accum`` times per step
  instead of once;
* ``find_unused_parameters=True`` although every parameter is used, which walks the
  autograd graph after every forward;
* DDP's default bucket size and ``gradient_as_bucket_view=False`` (a copy of every
  gradient into its bucket);
* an ``all_reduce`` of the loss every step, only to print it.

The data is a fixed random regression task generated from the seed, so nothing is
downloaded and the loss goes down. Run it with torchrun (gloo on CPU, nccl on CUDA)::

    torchrun --nproc-per-node 2 examples/ddp/train.py
    torchrun --nproc-per-node 2 examples/ddp/train.py --steps 50 --accum 8
    torchaxe advise -- torchrun --nproc-per-node 2 examples/ddp/train.py
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps to run (default: 30)")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches accumulated per optimizer step")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per micro-batch and rank")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--num-samples", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return parser.parse_args(argv)


class MLP(nn.Module):
    def __init__(self, features: int, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(features, width), nn.LayerNorm(width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def synthetic_data(args: argparse.Namespace) -> TensorDataset:
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.num_samples, args.features, generator=g)
    w = torch.randn(args.features, generator=g) / args.features ** 0.5
    y = torch.tanh(x @ w) + 0.05 * torch.randn(args.num_samples, generator=g)
    return TensorDataset(x, y)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)

    model = MLP(args.features, args.width, args.depth).to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    dataset = synthetic_data(args)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step = 0
    epoch = 0
    started = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            loss = loss_fn(model(x), y) / args.accum
            loss.backward()
            if (i + 1) % args.accum == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                reported = loss.detach() * args.accum
                dist.all_reduce(reported)
                if rank == 0 and step % args.log_every == 0:
                    print(f"step {step:4d}  loss {reported.item() / world:.4f}", flush=True)
                if step >= args.steps:
                    break
        epoch += 1
    if rank == 0:
        seconds = time.perf_counter() - started
        print(f"{step} steps on {world} rank(s) in {seconds:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
