"""``torchaxe profile``: watch a real training run; ``torchaxe profile merge``: compare ranks.

``profile`` is a click group whose own invocation runs the training command and
whose one subcommand is ``merge``: the first word after ``profile`` picks the
subcommand only when it is ``merge`` itself, so ``torchaxe profile -- python
merge.py`` and ``torchaxe profile python train.py`` both run scripts.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import click

from torchaxe.backends import TARGET_CHOICES
from torchaxe.console import CONTEXT, writable_path
from torchaxe.runtime.torchrun import in_ranks
from torchaxe.errors import TorchaxeError

_SUBCOMMAND = "torchaxe.profile.subcommand"

EPILOG = """\b
Exit codes:
  0    the run was measured: it completed, was stopped after the steps, or exited with 0
  2    torchaxe could not start (bad option, script or module not found, bad file)
  3    the script raised an exception (its traceback is shown; the profile has status "error")
  4    the script called sys.exit with a non-zero code (status "exited")
  5    --timeout ran out (status "timeout")
  6    the run ended without a single step, or none came within --first-step-timeout
  130  interrupted with Ctrl-C (status "interrupted")
"""


class StepCount(click.ParamType):
    """A positive number of steps, or ``all``."""

    name = "N|all"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        if str(value).lower() == "all":
            return None
        try:
            steps = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a number of steps or `all`", param, ctx)
        if steps < 1:
            self.fail(f"{steps} is not a positive number of steps", param, ctx)
        return steps


class CommandArgument(click.Argument):
    """The training command. Its usage is written by the group (so that it does not
    appear in ``torchaxe profile merge``'s usage line too)."""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return []


class ProfileGroup(click.Group):
    """Runs the training command given as arguments, unless the first argument
    names a subcommand."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            ctx.meta[_SUBCOMMAND] = (args[0], list(args[1:]))
            return click.Command.parse_args(self, ctx, [])
        return click.Command.parse_args(self, ctx, args)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [self.options_metavar, "-- python SCRIPT [ARGS]...", "| merge PROFILE..."]

    def invoke(self, ctx: click.Context):
        chosen = ctx.meta.pop(_SUBCOMMAND, None)
        if chosen is None:
            return click.Command.invoke(self, ctx)
        name, rest = chosen
        command = self.commands[name]
        with command.make_context(name, rest, parent=ctx) as sub_ctx:
            return command.invoke(sub_ctx)


@click.group(cls=ProfileGroup, invoke_without_command=True, no_args_is_help=False, context_settings=CONTEXT,
             epilog=EPILOG)
@click.option("--steps", type=StepCount(), default="10", show_default=True,
              help="Measured steps, after the warmup (and --ops) steps; then the script is stopped. "
                   "`all` lets it run to its end.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Steps run first and left out of the summary (lazy initialisation, autotuning).")
@click.option("--out", "-o", default="torchaxe-profile.json", show_default=True, metavar="FILE",
              help="Where to write the Profile JSON (atomically). Under torchrun each rank writes "
                   "FILE with .rankN before the extension.")
@click.option("--target", type=click.Choice(TARGET_CHOICES, case_sensitive=False), default=None,
              help="Device backend used to synchronise and read device memory at step boundaries. "
                   "auto (default) picks what this machine has.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop the run after this many seconds (status timeout); the profile keeps what was measured.")
@click.option("--first-step-timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              metavar="SECONDS",
              help="Stop the script when no step has ended this long after training started (the first module "
                   "call, DataLoader batch or backward pass): exit code 6. 0 waits for the script's end.")
@click.option("--step-marker", metavar="MODULE:FUNCTION",
              help="End a step whenever this function returns (its outermost call when it calls itself), "
                   "instead of at each optimizer step or backward pass "
                   "(e.g. train:train_step, or __main__:train_step for a function of the script).")
@click.option("--ops", is_flag=True,
              help="Also record an op-level breakdown with torch.profiler over --ops-steps steps after warmup "
                   "(those steps are left out of the step-time summary).")
@click.option("--ops-steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Steps recorded by --ops.")
@click.option("--shapes", is_flag=True,
              help="Record the input shapes of every module and batch (and, with --ops, of every op).")
@click.option("--from-trace", "from_trace", metavar="PATH",
              help="Do not run anything: read a torch.profiler Chrome trace (.json, .json.gz) or torch_npu.profiler "
                   "output (a *_ascend_pt folder, its ASCEND_PROFILER_OUTPUT, trace_view.json, kernel_details.csv, "
                   "op_statistic.csv) into a Profile, with findings.")
@click.option("--flops/--no-flops", default=True, show_default=True,
              help="Count one step's FLOPs (on the last warm-up step, which it slows) and measure the device's "
                   "peak with a half-second matrix-product probe after the run, for model FLOPs utilisation.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, cls=CommandArgument)
def profile(steps, warmup, out, target, timeout, first_step_timeout, step_marker, ops, ops_steps, shapes, flops,
            from_trace, command):
    """Run a training script unmodified and measure its steps.

    The script runs in torchaxe's own interpreter, as `python SCRIPT ARGS` would run
    it, with probes installed first: each step's wall time (the device synchronised
    at step boundaries only), time blocked waiting for the DataLoader, host-device
    syncs with the line that made them, garbage-collection time, peak device memory
    and host RSS, and the FLOPs of one step against the device's peak (MFU). After --warmup + --steps steps the script is stopped and a Profile
    (JSON, schema torchaxe.profile/1, see docs/profile.md) is written to --out; a
    summary goes to stderr.

    \b
    Examples:
      torchaxe profile -- python train.py --lr 3e-4
      torchaxe profile --steps 20 --ops --shapes -- python -m mypkg.train
      torchaxe profile -- torchrun --nproc-per-node 4 train.py   (every rank, FILE.rankN.json)
      torchaxe profile merge torchaxe-profile.rank*.json
      torchaxe profile --from-trace run_ascend_pt/ --out npu-profile.json
    """
    if from_trace is not None:
        if command:
            raise TorchaxeError("--from-trace reads a trace: give it no training command")
        _import_trace(from_trace, Path(out))
        return
    from torchaxe.config import find_config
    from torchaxe.runtime.command import parse_command
    from torchaxe.runtime.harness import Harness, HarnessOptions, distributed_identity, exit_code_for
    from torchaxe.runtime.profile import rank_path

    in_ranks(command)
    script = parse_command(command)
    options = HarnessOptions(
        steps=steps,
        warmup=warmup,
        ops=ops,
        ops_steps=ops_steps,
        shapes=shapes,
        timeout=timeout,
        first_step_timeout=first_step_timeout or None,
        step_marker=step_marker,
        target=target or find_config().get("target") or "auto",
        flops=flops,
    )
    rank, _, world = distributed_identity()
    path = writable_path(rank_path(out, rank, world), "--out", shown=str(out))
    threads_before = set(threading.enumerate())

    def abandon(measured) -> None:
        # The watchdog's thread: the script ignores the interrupt, so write what
        # there is and leave without it.
        _report(measured, path)
        os._exit(exit_code_for(measured))

    result = Harness(options, abandon=abandon).run(script)
    _report(result, path)
    code = exit_code_for(result)
    if result.status in ("stopped", "timeout", "interrupted"):
        _leave_if_threads_linger(threads_before, code)
    sys.exit(code)


def _import_trace(trace: str, path: Path) -> None:
    """``--from-trace``: read the trace, write the profile, print the summary."""
    from torchaxe.report.profile_text import render_profile_summary
    from torchaxe.runtime.profile import save_profile
    from torchaxe.runtime.traces import load_trace

    writable_path(path, "--out")
    result = load_trace(trace)
    save_profile(result, path)
    render_profile_summary(result, str(path), sys.stderr)


def _report(result, path: Path) -> None:
    """Write the profile, then tell the user: their traceback first, if they have one."""
    from torchaxe.report.profile_text import render_profile_summary
    from torchaxe.runtime.profile import save_profile

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    save_profile(result, path)
    err = sys.stderr
    if result.error is not None and result.error.traceback:
        err.write(result.error.traceback)
    run = result.run
    if run.rank and (run.world_size or 0) > 1:
        median = result.summary.step_seconds_median
        from torchaxe.units import duration

        err.write(f"torchaxe profile [rank {run.rank}/{run.world_size}]: {result.status}: median step "
                  f"{duration(median)}; profile written to {path}\n")
    else:
        render_profile_summary(result, str(path), err)
    err.flush()


def _leave_if_threads_linger(before: set[threading.Thread], code: int) -> None:
    """A stopped script can leave non-daemon threads behind (a prefetcher waiting on
    its queue) that would keep the process alive forever: give them two seconds,
    then exit without waiting for them."""
    lingering = [t for t in threading.enumerate() if t not in before and not t.daemon and t.is_alive()]
    for thread in lingering:
        thread.join(timeout=2.0 / len(lingering))
    if any(t.is_alive() for t in lingering):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@profile.command("merge", context_settings=CONTEXT)
@click.argument("files", nargs=-1, required=True, metavar="PROFILE...")
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", show_default=True,
              help="text: a table of the ranks; json: the merged report (schema torchaxe.profile-merge/1).")
@click.option("--out", "-o", metavar="FILE", help="Also write the merged report as JSON to FILE (atomically).")
def merge(files, fmt, out):
    """Compare the per-rank profiles of one distributed run.

    Prints each rank's median and p90 step time, data wait and host syncs, then the
    slowest rank and how far its median is above the median rank's; every step of a
    data-parallel run waits for the slowest rank.

    \b
    Example:
      torchaxe profile merge torchaxe-profile.rank0.json torchaxe-profile.rank1.json
    """
    from torchaxe.atomic import write_text_atomic
    from torchaxe.report.profile_text import render_merge
    from torchaxe.runtime.merge import merge_profiles
    from torchaxe.runtime.profile import load_profile

    report = merge_profiles([(f, load_profile(f)) for f in files])
    if out:
        target = Path(out)
        if target.is_dir() or not target.parent.exists():
            raise TorchaxeError(f"--out {out}: {'is a folder' if target.is_dir() else 'folder does not exist'}")
        write_text_atomic(target, report.to_json())
    if fmt == "json":
        sys.stdout.write(report.to_json())
    else:
        render_merge(report, sys.stdout)
