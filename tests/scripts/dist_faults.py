"""A small DDP training script (gloo, CPU) that can misbehave on one rank, for the
tests of measured runs under torchrun.

--fault kill:  rank --fault-rank kills itself (SIGKILL) at step --fault-step;
--fault raise: it raises there;
--fault hang:  it ignores Ctrl-C and sleeps forever there (a hung rank).
--note DIR:    every rank writes what it saw of the knob's variable to DIR/rankN.txt.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault", choices=("none", "kill", "raise", "hang"), default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--note", default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.note:
        with open(os.path.join(args.note, f"rank{rank}.txt"), "w") as f:
            f.write(os.environ.get("TORCHAXE_TEST_KNOB", "unset"))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                        torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        if rank == args.fault_rank and step == args.fault_step:
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.fault == "raise":
                raise RuntimeError(f"rank {rank} broke at step {step}")
            elif args.fault == "hang":
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                while True:
                    time.sleep(1)
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
