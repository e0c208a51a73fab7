"""``torchaxe follow``: this node's part in a multi-node ``torchaxe advise``."""

from __future__ import annotations

import sys

import click

from torchaxe.console import CONTEXT, progress_printer
from torchaxe.errors import TorchaxeError


@click.command("follow", context_settings=CONTEXT)
@click.option("--control", metavar="HOST:PORT", default=None,
              help="Where the leading node's torchaxe listens (default: torchrun's --rdzv-endpoint host, its "
                   "port + 1; give the same value to `torchaxe advise --control`).")
@click.option("--wait", "wait_seconds", type=click.FloatRange(min=1), default=600.0, show_default=True,
              metavar="SECONDS", help="How long to wait for the leader to start, and for each next run.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def follow(control, wait_seconds, command):
    """On the other nodes of a multi-node job: make the runs `torchaxe advise` asks for.

    A job across nodes is one torchrun agent per node, meeting in torchrun's own
    rendezvous. Run `torchaxe advise` with the job's command on one node, and
    `torchaxe follow` with the same command on each of the others: for every run
    advise measures (the profile, every arm of every round), each follower starts
    its torchrun agent under the same knobs, and sends its ranks' profiles back, so
    that advise sees every rank of the job. The follower ends when advise does.

    \b
    Example (two nodes, eight ranks each):
      node0$ torchaxe advise -- torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
                 --rdzv-endpoint node0:29400 train.py
      node1$ torchaxe follow -- torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
                 --rdzv-endpoint node0:29400 train.py
    """
    from torchaxe.runtime.command import check_module
    from torchaxe.runtime.nodes import follow as follow_leader
    from torchaxe.runtime.torchrun import parse_script
    from torchaxe.runtime.trials import follower_run

    job, script = parse_script(command)
    if job.torchrun is None or job.nnodes <= 1:
        raise TorchaxeError("follow is for a torchrun job across nodes: give the same `torchrun --nnodes N ...` "
                            "command as the leading node's `torchaxe advise`")
    check_module(script)
    progress = progress_printer("follow")
    runs = follow_leader(job, lambda message: follower_run(message, list(command)), progress, control, wait_seconds)
    progress(f"{runs} run(s) made")
    sys.exit(0)
