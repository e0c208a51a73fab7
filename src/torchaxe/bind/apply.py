"""Applying one rank's binding inside its own process, before the training script
starts: thread variables, the process's CPU affinity (threads started later inherit
it), and the DataLoader workers' affinity through a wrapped ``worker_init_fn``.

This module imports neither torch nor anything heavy at import time: it runs before
torch is imported so that ``OMP_NUM_THREADS`` and the affinity mask size torch's
thread pools.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable, MutableMapping

from torchaxe.bind.plan import BindingPlan, RankBinding
from torchaxe.cpulist import format_cpulist
from torchaxe.runtime.loader_patch import LoaderPatch

#: Environment variables, most specific first, that carry the local rank / the
#: number of local ranks under common launchers: torchrun and deepspeed, Open MPI,
#: MPICH and Intel MPI (hydra), MVAPICH2, Slurm's srun.
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                   "SLURM_LOCALID")
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE",
                   "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def local_rank_from_env(environ: MutableMapping[str, str] | None = None) -> tuple[int, str] | None:
    """(local rank, the variable it came from), or None when no launcher set one."""
    environ = os.environ if environ is None else environ
    for var in LOCAL_RANK_VARS:
        value = environ.get(var, "").strip()
        if value.isdigit():
            return int(value), var
    return None


def local_size_from_env(environ: MutableMapping[str, str] | None = None) -> tuple[int, str] | None:
    """(number of local ranks, variable), or None. Slurm's ``4(x2),3`` form is read
    when every node has the same count."""
    environ = os.environ if environ is None else environ
    for var in LOCAL_SIZE_VARS:
        value = environ.get(var, "").strip()
        if not value:
            continue
        if value.isdigit():
            return int(value), var
        counts = {part.split("(")[0] for part in value.split(",")}
        if len(counts) == 1 and next(iter(counts)).isdigit():
            return int(next(iter(counts))), var
    return None


def apply_binding(plan: BindingPlan, rank: RankBinding, environ: MutableMapping[str, str] | None = None,
                  warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Set the rank's thread variables (never one the user set) and its CPU affinity.
    A mask the kernel refuses (CPUs outside this cgroup) leaves the process unbound
    with a warning: training still runs. Returns what was done."""
    environ = os.environ if environ is None else environ
    warn = warn or (lambda line: sys.stderr.write(f"torchaxe bind: warning: {line}\n"))
    done: dict[str, Any] = {"local_rank": rank.local_rank, "env": {}, "affinity": None}
    for var, value in rank.env.items():
        if var in plan.user_env:
            continue
        environ[var] = value
        done["env"][var] = value
    if plan.mode == "none" or not rank.compute_cpus:
        return done
    if not hasattr(os, "sched_setaffinity"):
        warn("this platform has no sched_setaffinity: the process is not bound")
        return done
    try:
        os.sched_setaffinity(0, set(rank.compute_cpus))
    except (OSError, ValueError) as exc:
        warn(f"local rank {rank.local_rank}: cannot bind to CPUs {format_cpulist(rank.compute_cpus)} "
             f"({getattr(exc, 'strerror', None) or exc}): running unbound")
        return done
    done["affinity"] = sorted(os.sched_getaffinity(0))
    return done


class LoaderAffinity:
    """A DataLoader ``worker_init_fn`` that pins the worker to the loader CPUs, then
    calls the script's own ``worker_init_fn``. A class rather than a closure so it
    pickles for the ``spawn`` and ``forkserver`` start methods."""

    def __init__(self, cpus: tuple[int, ...], inner: Callable[[int], Any] | None = None) -> None:
        self.cpus = tuple(cpus)
        self.inner = inner

    def __call__(self, worker_id: int) -> Any:
        try:
            os.sched_setaffinity(0, set(self.cpus))
        except (OSError, ValueError, AttributeError):
            pass  # a worker that cannot be pinned still loads data
        if self.inner is not None:
            return self.inner(worker_id)
        return None


def install_loader_affinity(cpus: tuple[int, ...]) -> Callable[[], None]:
    """Wrap ``DataLoader.__init__`` so that every loader's workers start on ``cpus``
    (whether the script passes ``worker_init_fn`` by name, by position or not at
    all). Returns a function that undoes it. Imports torch."""

    def edit(arguments: dict, signature: inspect.Signature) -> None:
        inner = arguments.get("worker_init_fn")
        if not isinstance(inner, LoaderAffinity):
            arguments["worker_init_fn"] = LoaderAffinity(cpus, inner)

    return LoaderPatch(edit).install().uninstall


def describe(plan: BindingPlan, rank: RankBinding, done: dict[str, Any]) -> str:
    """One line for stderr: what this rank runs on."""
    nodes = ",".join(map(str, plan.rank_nodes(rank))) or "?"
    where = f"{plan.device_kind}:{rank.device}" if rank.device is not None else "cpu"
    parts = [f"local rank {rank.local_rank} ({where}): "]
    if done.get("affinity") is None:
        parts.append("not bound")
    else:
        parts.append(f"CPUs {format_cpulist(done['affinity'])} (node {nodes})")
    if rank.loader_cpus:
        parts.append(f", loader workers on {format_cpulist(rank.loader_cpus)}")
    threads = {var: os.environ.get(var) for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    parts.append(", " + " ".join(f"{k}={v}" for k, v in threads.items() if v is not None))
    return "".join(parts).rstrip(", ")
