"""``torchaxe launch``: torch.distributed.run (torchrun) with every local rank bound
to the cores its plan gives it.

torchrun itself starts the ranks, so multi-node rendezvous, restarts, ``--standalone``
and every other torchrun option work as users know them; torchaxe only puts its
per-rank bootstrap (``python -m torchaxe.bind.rank``) in front of the training
script. The plan is made once, here, for the whole node, and handed to the ranks as
a JSON file. torchaxe's own options may stand anywhere before the script.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from torchaxe.errors import TorchaxeError
from torchaxe.runtime import torchrun
from torchaxe.runtime.torchrun import LaunchArgs, torchrun_parser

#: torchaxe's options in ``torchaxe launch``: name -> takes a value.
OWN_OPTIONS = {"--bind": True, "--cpus": True, "--loader-cores": True, "--target": True, "--sysfs-root": True,
               "--dry-run": False, "--json": False}


def split_args(tokens: Sequence[str], parser=None) -> LaunchArgs:
    """Separate torchaxe's options, torchrun's options, the script and its arguments."""
    return torchrun.split_args(tokens, parser, OWN_OPTIONS)


def local_world_size(args: LaunchArgs, parser=None) -> tuple[int, Any]:
    """The number of local ranks torchrun will start (its own rule, for
    ``--nproc-per-node`` given as a number, cpu, gpu or auto, or by PET_NPROC_PER_NODE)."""
    from torch.distributed.run import determine_local_world_size

    parser = parser or torchrun_parser()
    namespace = parser.parse_args([*args.torchrun, "torchaxe-placeholder.py"])
    try:
        return int(determine_local_world_size(namespace.nproc_per_node)), namespace
    except ValueError as exc:
        raise TorchaxeError(f"--nproc-per-node {namespace.nproc_per_node}: {exc}") from None


def torchrun_command(args: LaunchArgs, plan_path: str | None) -> list[str]:
    """The command torchaxe runs: torchrun with the per-rank bootstrap in front of the
    script (or, without a plan, the script as the user gave it)."""
    head = [sys.executable, "-m", "torch.distributed.run", *args.torchrun]
    if plan_path is None:
        flag = {"module": ["--module"], "exec": ["--no-python"], "script": []}[args.how]
        return [*head, *flag, args.script, *args.script_args]
    how = {"module": ["--module"], "exec": ["--exec"], "script": []}[args.how]
    return [*head, "--module", "torchaxe.bind.rank", "--plan", plan_path, *how, "--", args.script, *args.script_args]


def write_plan(plan, folder: str) -> str:
    path = os.path.join(folder, "plan.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(plan.to_json())
    return path


def run_command(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run torchrun in the foreground; Ctrl-C reaches it (same process group) and
    torchaxe waits for it to stop its ranks."""
    try:
        process = subprocess.Popen(argv, env=env)
    except OSError as exc:
        raise TorchaxeError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            continue


def cleanup(folder: str | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def make_plan_folder() -> str:
    return tempfile.mkdtemp(prefix="torchaxe-bind-")


def display(argv: list[str]) -> str:
    return shlex.join(argv)


def torchrun_env(plan, environ=None) -> dict[str, str]:
    """The launcher's environment for torchrun. Where the user did not set
    OMP_NUM_THREADS, torchrun would set it to 1 and print a banner about it; every
    rank sets its own from the plan anyway, so torchrun is given the first rank's."""
    env = dict(os.environ if environ is None else environ)
    if plan is not None and plan.mode != "none" and "OMP_NUM_THREADS" not in env:
        threads = [r.threads for r in plan.ranks if r.threads is not None]
        if threads:
            env["OMP_NUM_THREADS"] = str(threads[0])
    return env
