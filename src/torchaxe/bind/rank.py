"""The per-rank bootstrap: apply this rank's part of a binding plan, then run the
training command in this same process (a Python script or module) or exec it (any
other program).

    python -m torchaxe.bind.rank --plan PLAN.json [--local-rank N] [--module | --exec] [--] CMD ARGS

``torchaxe launch`` has torchrun start this module for every local rank;
``torchaxe bind --rank-from-env`` does the same for other launchers. The local rank
comes from ``--local-rank`` or the launcher's variables (``LOCAL_RANK``,
``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``, ``SLURM_LOCALID``, ...).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

from torchaxe.bind.apply import apply_binding, describe, install_loader_affinity, local_rank_from_env
from torchaxe.bind.plan import BindingPlan
from torchaxe.errors import TorchaxeError


def load_plan(path: str) -> BindingPlan:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise TorchaxeError(f"binding plan {path} not found") from None
    except (OSError, ValueError) as exc:
        raise TorchaxeError(f"binding plan {path}: cannot read: {exc}") from None
    return BindingPlan.from_dict(data, path)


def run_bound(plan: BindingPlan, local_rank: int, command: Sequence[str], how: str = "auto") -> int:
    """Bind this process as ``plan`` says for ``local_rank``, then run ``command``:
    ``how`` is ``script`` (``[SCRIPT, ARGS]``), ``module`` (``[MODULE, ARGS]``),
    ``exec`` (any program), or ``auto`` (in-process when it is ``python ...``)."""
    from torchaxe.runtime.command import parse_command

    rank = plan.rank(local_rank)
    command = list(command)
    if not command:
        raise TorchaxeError("nothing to run: give the training command after --")
    script = None
    if how == "script":
        script = parse_command(["python", *command])
    elif how == "module":
        script = parse_command(["python", "-m", *command])
    elif how == "auto":
        from torchaxe.runtime.command import is_python

        if is_python(command[0]):
            try:
                script = parse_command(command)
            except TorchaxeError:
                script = None  # interpreter options torchaxe does not run in-process: exec it
    done = apply_binding(plan, rank)
    sys.stderr.write(f"torchaxe bind: {describe(plan, rank, done)}\n")
    sys.stderr.flush()
    if script is None:
        try:
            os.execvp(command[0], command)
        except FileNotFoundError:
            raise TorchaxeError(f"command not found: {command[0]}") from None
        except OSError as exc:
            raise TorchaxeError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
    if rank.loader_cpus and done.get("affinity") is not None:
        install_loader_affinity(rank.loader_cpus)
    from torchaxe.runtime.command import run_command

    run_command(script)  # the script's own exceptions and sys.exit propagate, as under python
    return 0


def _parse(argv: list[str]) -> tuple[dict, list[str]]:
    """Options up to the command (an optional ``--`` ends them). Hand-parsed so that
    the command's own options are never touched, on every Python version."""
    opts: dict = {"plan": None, "local_rank": None, "how": "script"}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return opts, argv[i + 1:]
        if token in ("--plan", "--local-rank"):
            if i + 1 >= len(argv):
                raise TorchaxeError(f"{token} needs a value")
            value = argv[i + 1]
            if token == "--local-rank":
                if not value.isdigit():
                    raise TorchaxeError(f"--local-rank {value!r}: expected a number")
                opts["local_rank"] = int(value)
            else:
                opts["plan"] = value
            i += 2
        elif token in ("--module", "--exec"):
            opts["how"] = token[2:]
            i += 1
        else:
            return opts, argv[i:]
    return opts, []


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, command = _parse(argv)
        if opts["plan"] is None:
            raise TorchaxeError("usage: python -m torchaxe.bind.rank --plan PLAN.json [--local-rank N] "
                                "[--module | --exec] [--] CMD ARGS")
        plan = load_plan(opts["plan"])
        local_rank = opts["local_rank"]
        if local_rank is None:
            found = local_rank_from_env()
            if found is None:
                raise TorchaxeError("no local rank: none of LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, "
                                    "SLURM_LOCALID is set (give --local-rank)")
            local_rank = found[0]
        return run_bound(plan, local_rank, command, opts["how"])
    except TorchaxeError as exc:
        sys.stderr.write(f"torchaxe bind: error: {exc.message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
