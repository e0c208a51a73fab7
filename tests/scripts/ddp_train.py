"""A tiny data-parallel training script for the distributed `torchaxe profile` test.

Run under torchrun (gloo, CPU): every rank trains a small MLP on its own shard of
random data, with DistributedDataParallel averaging the gradients. Rank 1 sleeps a
little in every step so that it is the slowest rank.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--slow-rank-sleep", type=float, default=0.02)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    while step < args.steps:
        for inputs, labels in loader:
            if rank == 1:
                time.sleep(args.slow_rank_sleep)
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:
                break
    print(f"rank {rank} pid {os.getpid()} done: {step} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
