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
from dataclasses import dataclass, field
from typing import Any, Sequence

from torchaxe.errors import TorchaxeError

#: torchaxe's options in ``torchaxe launch``: name -> takes a value.
OWN_OPTIONS = {"--bind": True, "--cpus": True, "--loader-cores": True, "--target": True, "--sysfs-root": True,
               "--dry-run": False, "--json": False}
#: torchrun options that say how to run the script; torchaxe's bootstrap takes over.
_HOW_FLAGS = {"-m": "module", "--module": "module", "--no-python": "exec", "--no_python": "exec",
              "--run-path": "script", "--run_path": "script"}


@dataclass
class LaunchArgs:
    own: dict[str, Any] = field(default_factory=lambda: {"cpus": []})
    torchrun: list[str] = field(default_factory=list)
    script: str = ""
    script_args: list[str] = field(default_factory=list)
    how: str = "script"


def torchrun_parser():
    """torchrun's own argument parser, so that ``launch`` accepts exactly its options."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str):
        raise TorchaxeError(f"torchrun option: {message}")

    parser.error = error  # type: ignore[method-assign]
    return parser


def split_args(tokens: Sequence[str], parser=None) -> LaunchArgs:
    """Separate torchaxe's options, torchrun's options, the script and its arguments.
    torchrun's parser says which of its options take a value, so the script is the
    first token that is neither an option nor an option's value."""
    parser = parser or torchrun_parser()
    takes_value = {opt: action.nargs != 0 for action in parser._actions for opt in action.option_strings}
    out = LaunchArgs()
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, inline = token.partition("=")
        if name in OWN_OPTIONS:
            if OWN_OPTIONS[name]:
                if eq:
                    value = inline
                    i += 1
                elif i + 1 < len(tokens):
                    value = tokens[i + 1]
                    i += 2
                else:
                    raise TorchaxeError(f"{name} needs a value")
                key = name[2:].replace("-", "_")
                if key == "cpus":
                    out.own["cpus"].append(value)
                elif key in out.own:
                    raise TorchaxeError(f"{name} given twice")
                else:
                    out.own[key] = value
            else:
                out.own[name[2:].replace("-", "_")] = True
                i += 1
            continue
        if token == "--":
            i += 1
            break
        if token.startswith("-") and token != "-":
            if name in ("--numa-binding", "--numa_binding"):
                raise TorchaxeError("--numa-binding is torchrun's binding (CUDA only, needs numactl): "
                                    "use torchaxe's --bind MODE instead")
            if name in _HOW_FLAGS:
                out.how = _HOW_FLAGS[name]
                i += 1
                continue
            if name not in takes_value:
                raise TorchaxeError(f"unknown option {name} (not a torchaxe or torchrun option; "
                                    "options for the script go after it)")
            out.torchrun.append(token)
            if takes_value[name] and not eq:
                if i + 1 >= len(tokens):
                    raise TorchaxeError(f"torchrun option {name} needs a value")
                out.torchrun.append(tokens[i + 1])
                i += 2
            else:
                i += 1
            continue
        break
    if i >= len(tokens):
        raise TorchaxeError("no training script: `torchaxe launch [options] train.py ARGS`")
    out.script = tokens[i]
    out.script_args = tokens[i + 1:]
    return out


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
