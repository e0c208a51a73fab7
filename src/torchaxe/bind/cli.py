"""``torchaxe topo``, ``torchaxe launch``, ``torchaxe bind`` (and ``bind check``)."""

from __future__ import annotations

import sys

import click

from torchaxe.console import CONTEXT
from torchaxe.errors import TorchaxeError

TARGETS = ("auto", "cpu", "cuda", "npu")
BIND_MODES = ("exclusive", "node", "socket", "core-complex", "none")


def _topology(sysfs_root: str | None, target: str, for_ranks: bool = False):
    from torchaxe.bind.topology import read_topology

    return read_topology(sysfs_root or "/", target=target)


# ------------------------------------------------------------------------- topo


@click.command("topo", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Print the topology as JSON (schema torchaxe.topo/1).")
@click.option("--target", type=click.Choice(TARGETS, case_sensitive=False), default="auto", show_default=True,
              help="Which devices to locate: auto finds NPUs, else CUDA GPUs; cpu lists none.")
@click.option("--sysfs-root", metavar="DIR", default=None,
              help="Read sys/ and proc/ below DIR instead of / (a saved tree, e.g. tests/data/sysfs/xeon-2s-smt).")
def topo(as_json, target, sysfs_root):
    """Show the CPU topology core binding works with.

    Sockets, NUMA nodes, physical cores and SMT siblings, L3 groups, the CPUs this
    process may use (affinity mask and cgroup cpuset, as in a container started with
    --cpuset-cpus) and the NUMA node of every accelerator (from its PCI address).

    \b
    Examples:
      torchaxe topo
      torchaxe topo --json | jq '.devices'
    """
    t = _topology(sysfs_root, target.lower())
    if as_json:
        import json

        sys.stdout.write(json.dumps(t.to_dict(), indent=2) + "\n")
        return
    from torchaxe.bind.render import render_topology

    render_topology(t, sys.stdout)


# ----------------------------------------------------------------------- launch

LAUNCH_HELP = """Run torchrun with every local rank bound to the cores near its device.

\b
torchaxe launch [--bind MODE] [--cpus LIST]... [--loader-cores N|auto] [--target T]
                [--dry-run] [--json] [torchrun options] train.py ARGS

torch.distributed.run starts the ranks (so rendezvous, --nnodes, --standalone and
the other torchrun options work as usual); before the script starts, each rank sets
its CPU affinity, OMP_NUM_THREADS/MKL_NUM_THREADS (unless you set them) and the
affinity of its DataLoader workers. The plan is printed as a table on stderr, then
the command that runs.

\b
--bind MODE        exclusive (default): the device's node's physical cores, split
                   among its ranks; node; socket; core-complex (whole L3 groups);
                   none (no binding).
--cpus LIST        explicit CPUs per rank: repeat it (--cpus 0-7 --cpus 8-15) or
                   "0-7;8-15". Replaces --bind.
--loader-cores N   cores of each rank kept for DataLoader workers (auto: a quarter
                   of the rank's cores from 4 cores up, else none).
--target T         auto|cpu|cuda|npu: which devices the ranks use (auto: what is found).
--dry-run          print the plan and the command; run nothing.
--json             with --dry-run: print the plan as JSON on stdout.

\b
Examples:
  torchaxe launch --nproc-per-node 8 train.py --epochs 3
  torchaxe launch --bind core-complex --nnodes 2 --rdzv-endpoint host:29400 train.py
  torchaxe launch --dry-run --json --nproc-per-node 4 train.py
"""


@click.command("launch", context_settings={**CONTEXT, "ignore_unknown_options": True,
                                           "allow_interspersed_args": False},
               help=LAUNCH_HELP, add_help_option=False)
@click.option("-h", "--help", "show_help", is_flag=True, help="Show this message and exit.")
@click.argument("tokens", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def launch(ctx, show_help, tokens):
    if show_help or not tokens:
        click.echo(ctx.get_help())
        if not tokens:
            ctx.exit(0 if show_help else 2)
        return
    from torchaxe.bind import launcher
    from torchaxe.bind.plan import parse_loader_cores, plan_binding

    parser = launcher.torchrun_parser()
    args = launcher.split_args(tokens, parser)
    own = args.own
    mode = own.get("bind", "exclusive")
    if mode not in BIND_MODES:
        raise TorchaxeError(f"--bind {mode!r}: choose one of {', '.join(BIND_MODES)}")
    target = own.get("target", "auto").lower()
    if target not in TARGETS:
        raise TorchaxeError(f"--target {target!r}: choose one of {', '.join(TARGETS)}")
    nproc, _ = launcher.local_world_size(args, parser)
    topology = _topology(own.get("sysfs_root"), target)
    plan = plan_binding(topology, nproc, mode, own["cpus"] or None, parse_loader_cores(own.get("loader_cores")))
    from torchaxe.bind.render import render_plan

    dry = bool(own.get("dry_run"))
    if own.get("json") and not dry:
        raise TorchaxeError("--json prints the plan instead of running: use it with --dry-run")
    folder = None if plan.mode == "none" or dry else launcher.make_plan_folder()
    try:
        plan_path = launcher.write_plan(plan, folder) if folder else ("PLAN.json" if plan.mode != "none" else None)
        command = launcher.torchrun_command(args, plan_path)
        if dry and own.get("json"):
            import json

            data = plan.to_dict()
            data["command"] = command
            sys.stdout.write(json.dumps(data, indent=2) + "\n")
            return
        render_plan(plan, sys.stdout if dry else sys.stderr)
        stream = sys.stdout if dry else sys.stderr
        stream.write(f"torchaxe launch: {'would run' if dry else 'running'}: {launcher.display(command)}\n")
        stream.flush()
        if dry:
            return
        code = launcher.run_command(command, launcher.torchrun_env(plan))
    finally:
        launcher.cleanup(folder)
    sys.exit(code)


# ------------------------------------------------------------------------- bind

BIND_HELP = """Bind this rank under another launcher, or check a running process.

\b
torchaxe bind --rank-from-env [--bind MODE] [--cpus LIST]... [--nproc N]
              [--loader-cores N|auto] [--target T] -- CMD ARGS
torchaxe bind check [PID | -- CMD ARGS]      (see `torchaxe bind check --help`)

With --rank-from-env, the local rank and the number of local ranks come from the
launcher's variables (LOCAL_RANK / LOCAL_WORLD_SIZE for torchrun and deepspeed,
OMPI_COMM_WORLD_LOCAL_RANK / _SIZE for Open MPI, MPI_LOCALRANKID / MPI_LOCALNRANKS for
MPICH and Intel MPI, SLURM_LOCALID / SLURM_NTASKS_PER_NODE for srun). Every rank
makes the same plan over the container's CPUs (the cgroup cpuset; a binding the
launcher made is replaced), binds itself, and runs CMD: a `python ...` command runs
in this process (so DataLoader workers get their own cores), anything else is exec'd.

\b
Examples:
  mpirun -np 8 torchaxe bind --rank-from-env -- python train.py
  srun --ntasks-per-node 4 torchaxe bind --rank-from-env --bind node -- python train.py
  deepspeed --no_python --no_local_rank torchaxe bind --rank-from-env -- python train.py
"""


@click.command("bind", context_settings={**CONTEXT, "ignore_unknown_options": True,
                                         "allow_interspersed_args": False}, help=BIND_HELP)
@click.option("--rank-from-env", is_flag=True, help="Take the local rank from the launcher's environment.")
@click.option("--bind", "mode", type=click.Choice(BIND_MODES), default="exclusive", show_default=True)
@click.option("--cpus", multiple=True, metavar="LIST", help="Explicit CPUs per local rank (repeat, or \"0-7;8-15\").")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Local ranks on this machine (default: from the launcher's variables).")
@click.option("--loader-cores", default="auto", show_default=True, metavar="N|auto")
@click.option("--target", type=click.Choice(TARGETS, case_sensitive=False), default="auto", show_default=True)
@click.option("--sysfs-root", metavar="DIR", default=None, hidden=True)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bind(ctx, rank_from_env, mode, cpus, nproc, loader_cores, target, sysfs_root, command):
    if command and command[0] == "check":
        from torchaxe.bind.check_cli import check

        sub = check.make_context("check", list(command[1:]), parent=ctx)
        with sub:
            return check.invoke(sub)
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not rank_from_env:
        raise TorchaxeError("say where the rank comes from: `torchaxe bind --rank-from-env -- CMD`, "
                            "or check a process: `torchaxe bind check PID`")
    if not command:
        raise TorchaxeError("nothing to run: `torchaxe bind --rank-from-env -- python train.py`")
    from torchaxe.bind.apply import local_rank_from_env, local_size_from_env
    from torchaxe.bind.plan import parse_loader_cores, plan_binding
    from torchaxe.bind.rank import run_bound

    found = local_rank_from_env()
    if found is None:
        raise TorchaxeError("no local rank in the environment: none of LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, "
                            "MPI_LOCALRANKID, MV2_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID is set")
    local_rank, _ = found
    if nproc is None:
        size = local_size_from_env()
        if size is None:
            raise TorchaxeError("the number of local ranks is not in the environment (LOCAL_WORLD_SIZE, "
                                "OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE): give --nproc")
        nproc = size[0]
    if local_rank >= nproc:
        raise TorchaxeError(f"local rank {local_rank} but only {nproc} local ranks: give the right --nproc")
    topology = _topology(sysfs_root, target.lower())
    widen_to_cgroup(topology)
    plan = plan_binding(topology, nproc, mode, list(cpus) or None, parse_loader_cores(loader_cores))
    if local_rank == 0:
        from torchaxe.bind.render import render_plan

        render_plan(plan, sys.stderr)
    sys.exit(run_bound(plan, local_rank, command, "auto"))


def widen_to_cgroup(topology) -> None:
    """Under mpirun or srun each rank may already be bound to a core or a socket of
    the launcher's choosing, so ranks see different affinity masks. Plan over the
    cgroup's cpuset instead, which every rank shares (and which sched_setaffinity
    may widen to)."""
    if topology.cgroup_cpus is None:
        return
    online = set(topology.cpus)
    wider = tuple(sorted(set(topology.cgroup_cpus) & online))
    if wider and set(topology.allowed) < set(wider):
        from torchaxe.cpulist import format_cpulist

        topology.warnings.append(f"this process was bound to {format_cpulist(topology.affinity)} by its launcher: "
                                 f"planning over the cgroup's CPUs {format_cpulist(wider)} instead")
        topology.allowed = wider
