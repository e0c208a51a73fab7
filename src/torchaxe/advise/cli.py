"""``torchaxe advise``, ``torchaxe apply`` and ``torchaxe run``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import click

from torchaxe.advise.stats import LOSS_TOLERANCE
from torchaxe.backends import TARGET_CHOICES
from torchaxe.console import CONTEXT, progress_printer
from torchaxe.errors import TorchaxeError

DEFAULT_ADVICE = "torchaxe-advice.json"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)?\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``1.5h`` -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise TorchaxeError(f"--budget {text!r}: expected a duration such as 90s, 10m or 1h")
    value = float(match.group(1))
    unit = (match.group(2) or "s").lower()
    seconds = value * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[unit]
    if seconds <= 0:
        raise TorchaxeError(f"--budget {text!r}: must be more than zero")
    return seconds


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
               "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def parse_size(text: str, option: str = "--memory-limit") -> int:
    """``20GiB``, ``512MiB``, ``16GB``, ``2e9``, ``1073741824`` -> bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise TorchaxeError(f"{option} {text!r}: expected a size such as 20GiB, 512MiB, 16GB, 2e9 or a number "
                            "of bytes")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise TorchaxeError(f"{option} {text!r}: must be more than zero bytes")
    return size


def parse_fraction(text: str, option: str) -> float:
    """``2%`` or ``0.02`` -> 0.02: a fraction from 0 up to (not including) 1."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1] if percent else raw)
    except ValueError:
        raise TorchaxeError(f"{option} {text!r}: expected a fraction such as 0.02 or a percentage such as 2%") \
            from None
    value = value / 100 if percent else value
    if not 0.0 <= value < 1.0:
        raise TorchaxeError(f"{option} {text!r}: must be from 0 up to 1 (0.02), or a percentage below 100% (2%)")
    return value


@click.command("advise", context_settings=CONTEXT)
@click.option("--budget", default="10m", show_default=True, metavar="DURATION",
              help="Wall-clock time for profiling and measuring (90s, 10m, 1h). A run starts only when the "
                   "runs so far say it ends in time, and is stopped early enough to have ended by the "
                   "budget's end (a first compile longer than expected is stopped there and listed as not "
                   "measured); changes that do not fit are listed unmeasured.")
@click.option("--target", type=click.Choice(TARGET_CHOICES, case_sensitive=False), default="auto",
              show_default=True, help="Device backend; auto picks what this machine has.")
@click.option("--format", "fmt", type=click.Choice(("text", "json", "html")), default="text", show_default=True,
              help="What goes to stdout (or to --out).")
@click.option("-o", "--out", type=click.Path(dir_okay=False), default=None,
              help="Write the report (in --format) to this file instead of stdout, atomically.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also write the self-contained HTML report here (whatever --format prints).")
@click.option("--save", type=click.Path(dir_okay=False), default=DEFAULT_ADVICE, show_default=True,
              help="Where the advice is kept as JSON for `torchaxe apply`.")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Interleaved rounds per change (original, change, original, change ...).")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Measured steps per run, after the warmup. Default: 8, or more for short steps (enough for "
                   "half a second of steps, two seconds when runs take turns; at most 64).")
@click.option("--turns/--no-turns", default=True, show_default=True,
              help="On a cpu, hold the original and the changes of a round side by side: they warm up one after "
                   "another, then take turns every half second of steps, so that a shared machine's swings in speed "
                   "fall on all of them alike (runs one after another on a busy host can land 30% apart). Needs "
                   "memory for every run of a round at once; rounds that do not fit run one by one, as do all with "
                   "--no-turns.")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True,
              help="Steps discarded at the start of every run: torch.compile compiles at the first step and "
                   "keeps compiling in the background for several more.")
@click.option("--check-accuracy/--no-check-accuracy", default=True, show_default=True,
              help="Record the training loss of every run (no extra run, no device sync per step) and compare "
                   "the mean loss of each change that may alter the numerics (mixed precision, compile, unsafe "
                   "fixes) with the original's. --no-check-accuracy records nothing: mixed precision and TF32 are "
                   "then measured but never chosen.")
@click.option("--loss-tolerance", default=f"{LOSS_TOLERANCE:.0%}", show_default=True, metavar="FRACTION",
              help="A change whose mean training loss differs from the original's by more than the run-to-run "
                   "loss noise plus this (2% or 0.02) is never chosen: it is listed with its speed and loss "
                   "difference for you to decide (`torchaxe apply --only KEY`).")
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="Peak memory no chosen change may exceed (20GiB, 512MiB, 2e9 bytes): the device allocator's "
                   "peak where the run has a device, else the process's peak resident memory. A change that "
                   "exceeds it is held back, a combination that exceeds it is not chosen, and activation "
                   "checkpointing of the repeated blocks is tried too.")
@click.option("--job-steps", type=int, default=None, metavar="N",
              help="How many steps your real training job runs. A change with a one-time cost (compiling) that "
                   "its measured saving per step does not pay back within N steps is held back: listed with its "
                   "cost, not chosen. Default: the length the command states (--max-steps N, --max_iters=N, "
                   "--max_train_steps N, ..., or --epochs N times the training loader's batches an epoch), else "
                   "no limit (a long job).")
@click.option("--allow-batch-change", is_flag=True,
              help="Also try a larger micro-batch (the DataLoader's batch size doubled), ranked by samples per "
                   "second, when memory allows. It changes the optimisation (fewer steps per epoch): marked so "
                   "wherever it is shown.")
@click.option("--no-installed", is_flag=True, help="Scan only your code (the script's folder and the project files "
              "the run imported), not the installed packages it imported.")
@click.option("--step-marker", default=None, metavar="MODULE:FUNCTION",
              help="End a step whenever this function returns, instead of at each optimizer step or backward pass.")
@click.option("--first-step-timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              metavar="SECONDS",
              help="Give up when the first run shows no step this long after training started. 0: no limit.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Per-run limit (default: 10x the first run, at least 120 s).")
@click.option("--skip", multiple=True, metavar="KEY",
              help="Do not try changes whose key starts with this (knob:compile, knob:autocast, code:AX201, env:). "
                   "Repeatable.")
@click.option("--control", metavar="HOST:PORT", default=None,
              help="A torchrun job across nodes: where this node listens for `torchaxe follow` on the others "
                   "(default: torchrun's --rdzv-endpoint host, its port + 1).")
@click.option("--flops/--no-flops", default=True, show_default=True,
              help="Count one step's FLOPs in the profiled run (its last warm-up step), for the model FLOPs "
                   "utilisation; --no-flops leaves PyTorch's FLOP counter out of the run.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def advise(budget, target, fmt, out, html_out, save, repeats, steps, turns, warmup, check_accuracy, loss_tolerance,
           memory_limit, job_steps, allow_batch_change, no_installed, step_marker, first_step_timeout, timeout, skip,
           control, flops, quiet, command):
    """Find, measure and rank everything that would make a training script faster.

    Profiles a few steps of the unchanged script, scans its folder, the files of its
    project and the installed packages it imported, checks the environment, then
    measures each candidate change on this machine -- code fixes (without touching
    your files), formulas of installed packages swapped at run time, torch.compile,
    mixed precision, DataLoader settings, environment variables -- interleaved with
    the original, within --budget. Recommendations are ranked by measured time saved
    per step, each with its accuracy cost; the clearly faster ones are measured
    together. A change that may alter the numerics is chosen only when its mean
    training loss is within the run-to-run loss noise plus --loss-tolerance (2%) of
    the original's. Nothing of yours is changed: `torchaxe apply` does that.

    \b
    Examples:
      torchaxe advise -- python train.py --lr 3e-4
      torchaxe advise --budget 3m --html report.html -- python train.py
      torchaxe advise --loss-tolerance 0.5% -- python -m mypkg.train
      torchaxe advise --memory-limit 20GiB --allow-batch-change -- python train.py
      torchaxe advise -- torchrun --nproc-per-node 8 train.py

    \b
    Under torchrun every run is a torchrun job: the changes are applied in every
    rank, a step takes the slowest rank's time, and the advice shows where each
    rank's step goes (compute, communication and its exposed part, data wait) and
    which rank the others wait for. Across nodes, run `torchaxe follow` with the
    same command on the other nodes (docs/distributed.md).
    \b
    Exit codes: 0 advice made (partial advice too), 2 usage error or a script that fails.
    """
    from torchaxe.advise.pipeline import AdviseOptions, advise as run_advise
    from torchaxe.atomic import write_text_atomic

    options = AdviseOptions(target=target, budget=parse_duration(budget), repeats=repeats, steps=steps,
                            warmup=warmup, check_accuracy=check_accuracy,
                            loss_tolerance=parse_fraction(loss_tolerance, "--loss-tolerance"),
                            scan_installed=not no_installed, step_marker=step_marker,
                            first_step_timeout=first_step_timeout or None, timeout=timeout, skip=tuple(skip),
                            memory_limit=parse_size(memory_limit) if memory_limit is not None else None,
                            allow_batch_change=allow_batch_change, turns=turns, job_steps=job_steps, flops=flops)
    for option, path in (("--out", out), ("--html", html_out), ("--save", save)):
        if path and str(path).startswith("--"):
            # `--save -- python train.py` took the separator for the file's name.
            raise TorchaxeError(f"{option} takes a file name, not {path!r}: give one (`{option} advice.json`) "
                                f"or leave {option} out; the command goes after `--`")
        if path and not Path(path).resolve().parent.is_dir():
            raise TorchaxeError(f"{option} {path}: folder does not exist")
    from torchaxe.runtime.nodes import leading
    from torchaxe.runtime.torchrun import parse_job

    progress = progress_printer("advise", quiet)
    with leading(parse_job(command), progress, control):
        result = run_advise(list(command), options, progress=progress)
    kept = not (result.partial and not result.recommendations and Path(save).exists())
    if kept:
        write_text_atomic(save, result.to_json())
    else:  # interrupted before anything was found: the earlier advice is worth more
        click.echo(f"torchaxe advise: interrupted before any recommendation; {save} left as it was", err=True)
    if html_out:
        write_text_atomic(html_out, _render(result, "html"))
        if not quiet:
            click.echo(f"torchaxe advise: HTML report written to {html_out}", err=True)
    text = _render(result, fmt, to_terminal=not out)
    if out:
        write_text_atomic(out, text)
        click.echo(f"torchaxe advise: report written to {out}", err=True)
    else:
        click.echo(text, nl=False)
    if kept and not quiet:
        click.echo(f"torchaxe advise: advice kept in {save} (for `torchaxe apply`)", err=True)


def _render(result, fmt: str, to_terminal: bool = False) -> str:
    """The report as text; ``to_terminal``: it goes to standard output, whose width
    the text takes when that is a terminal (a file or a pipe gets the fixed width)."""
    import io

    if fmt == "json":
        return result.to_json()
    if fmt == "html":
        from torchaxe.report.advice_html import render_advice_html

        return render_advice_html(result)
    from torchaxe.report.advice_text import render_advice_text, report_width

    buffer = io.StringIO()
    render_advice_text(result, buffer, width=report_width(sys.stdout) if to_terminal else None)
    return buffer.getvalue()


class NothingApplied(TorchaxeError):
    """``apply`` was asked for changes and could apply none of them."""

    exit_code = 1


@click.command("apply", context_settings=CONTEXT)
@click.option("--advice", "advice_path", type=click.Path(dir_okay=False), default=DEFAULT_ADVICE, show_default=True,
              help="The advice file `torchaxe advise` wrote.")
@click.option("--unsafe-fixes", is_flag=True,
              help="Also apply code fixes that may change numerics (marked unsafe) whose training loss advise did "
                   "not check; those it chose with their loss within the noise and tolerance are applied anyway.")
@click.option("--only", "keys", multiple=True, metavar="KEY",
              help="Apply these recommendations (their `key`, e.g. code:AX110 or knob:compile) instead of the "
                   "chosen ones; an unsafe code fix advise did not choose also needs --unsafe-fixes. Repeatable.")
@click.option("--diff", is_flag=True, help="Show the code changes and the knobs; change nothing.")
def apply(advice_path, unsafe_fixes, keys, diff):
    """Apply the changes `torchaxe advise` chose: code fixes and runtime knobs.

    Code fixes are written to your files atomically (safe ones by default); the
    files as they were are kept under $TORCHAXE_HOME/originals so that the next
    `torchaxe advise` measures the gain achieved against them, and says where it
    came from (the phases and operators that changed most). Runtime knobs
    (torch.compile, mixed precision, DataLoader settings, environment variables) go
    to the `run` table of torchaxe.toml, which `torchaxe run` applies with no code
    change.

    Exits 0 when it applied the changes, or when advise chose none; 1 when it was
    asked for changes and could apply none of them (unsafe without --unsafe-fixes,
    already applied, or only in installed packages); 2 for a usage error.

    \b
    Examples:
      torchaxe apply --diff
      torchaxe apply --unsafe-fixes
      torchaxe apply --only knob:compile
    """
    from torchaxe.advise.apply import apply_advice, check_made_here, load_advice

    advice = load_advice(advice_path)
    copy = check_made_here(advice, Path.cwd(), keys)
    result = apply_advice(advice, unsafe=unsafe_fixes, keys=keys, write=not diff, knobs_folder=copy)
    for text in result.diffs:
        if diff:
            click.echo(text, nl=False)
    verb = "would change" if diff else "changed"
    if result.changed_files:
        click.echo(f"torchaxe apply: {verb} {len(result.changed_files)} file(s): {', '.join(result.changed_files)}",
                   err=True)
    if result.originals is not None:
        click.echo(f"torchaxe apply: the original files are kept in {result.originals}", err=True)
    if result.slower:
        click.echo(f"torchaxe apply: warning: advise measured these slower than the original: "
                   f"{', '.join(result.slower)}", err=True)
    if result.held_back:
        click.echo(f"torchaxe apply: warning: advise held these back: {'; '.join(result.held_back)}", err=True)
    if result.changes_optimisation:
        click.echo(f"torchaxe apply: warning: these change the optimisation (a larger micro-batch: fewer steps per "
                   f"epoch; check convergence and the learning rate): {', '.join(result.changes_optimisation)}",
                   err=True)
    if result.checked_unsafe:
        click.echo(f"torchaxe apply: {'would apply' if diff else 'applied'} unsafe fixes advise chose with their "
                   f"training loss checked on your run (within the noise and tolerance): "
                   f"{', '.join(result.checked_unsafe)}", err=True)
    if result.skipped_unsafe:
        click.echo(f"torchaxe apply: left out (unsafe, add --unsafe-fixes): {', '.join(result.skipped_unsafe)}",
                   err=True)
    if result.skipped_outside:
        click.echo("torchaxe apply: left out (outside your project: installed packages are not edited): "
                   + ", ".join(sorted(set(result.skipped_outside))), err=True)
    if result.knobs:
        import json

        click.echo(f"torchaxe apply: {'would write' if diff else 'wrote'} run knobs to {result.config}: "
                   f"{json.dumps(result.knobs, sort_keys=True)}", err=True)
        if not diff:
            click.echo("torchaxe apply: run them with `torchaxe run -- " + " ".join(advice["command"]) + "`", err=True)
    if not result.changed_files and not result.knobs:
        if not result.asked:
            click.echo("torchaxe apply: nothing to apply: advise chose no change (its table lists what it measured; "
                       "`--only KEY` applies one of them)", err=True)
            return
        if result.skipped_unsafe:
            codes = sorted({k.split(":", 1)[1] for k in result.skipped_unsafe if k.startswith("code:")})
            why = ("it may change numerics or behaviour"
                   + (f"; `torchaxe rules {codes[0]}` says how" if len(codes) == 1 else ""))
            reason = (f"every chosen change is unsafe ({why}); add --unsafe-fixes to apply it"
                      if not keys else f"--only {' '.join(keys)} is unsafe ({why}); add --unsafe-fixes")
        elif result.skipped_outside and not any(not k.startswith("code:") for k in result.asked):
            reason = "the chosen fixes are in installed packages, which are not edited"
        else:
            reason = (f"the fixes of {', '.join(result.asked)} find nothing left to change in the files "
                      "(already applied, or the code changed since advise)")
        raise NothingApplied(f"nothing applied: {reason}")


@click.command("run", context_settings=CONTEXT)
@click.option("--target", type=click.Choice(TARGET_CHOICES, case_sensitive=False), default="auto",
              show_default=True, help="Device backend.")
@click.option("--show", is_flag=True, help="Print the knobs that would be applied, and run nothing.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(target, show, command):
    """Run a training script to its end with the knobs from torchaxe.toml applied.

    The `run` table (written by `torchaxe apply`, or by hand: the knob-set format
    of docs/trial.md) is read from the nearest torchaxe.toml above the script, then
    above the working folder. The script itself is not changed. Its exit code is
    torchaxe run's.

    \b
    Examples:
      torchaxe run -- python train.py --epochs 10
      torchaxe run --show -- python train.py
    """
    import json

    from torchaxe.advise.apply import read_run_knobs
    from torchaxe.runtime.command import check_module
    from torchaxe.runtime.knobs import knob_set_from_dict
    from torchaxe.runtime.trials import child_environment
    from torchaxe.runtime.torchrun import parse_script

    job, script = parse_script(command)
    check_module(script)
    raw, source = read_run_knobs(script.folder)
    loader_note = None
    if "dataloader" not in raw:
        # A loader setting `torchaxe data --tune` measured for this very command.
        from torchaxe.data.tuning import stored_loader_knobs

        try:
            stored = stored_loader_knobs(list(command))
        except TorchaxeError as exc:
            click.echo(f"torchaxe run: warning: knowledge base not read ({exc}); no tuned loader setting", err=True)
            stored = None
        if stored:
            raw = {**raw, "dataloader": stored["dataloader"]}
            loader_note = f"tuned DataLoader setting from the knowledge base: {stored['dataloader']}"
    knobs = knob_set_from_dict({"name": "run", **raw}, str(source or "torchaxe.toml"))
    if loader_note:
        click.echo(f"torchaxe run: {loader_note}", err=True)
    if source is None and not loader_note:
        doing = "the script would run" if show else "running the script"
        click.echo(f"torchaxe run: no `run` knobs found (torchaxe.toml): {doing} as it is", err=True)
    elif source is not None and not show:
        click.echo(f"torchaxe run: knobs from {source}: {knobs.summary}", err=True)
    if show:
        click.echo(json.dumps(knobs.to_dict(), indent=2, sort_keys=True))
        return
    with tempfile.TemporaryDirectory(prefix="torchaxe-run-") as tmp:
        path = Path(tmp) / "knobs.json"
        path.write_text(json.dumps(knobs.to_dict()), encoding="utf-8")
        argv = job.launch(["torchaxe.runtime.bootstrap", str(path), "--out", str(Path(tmp) / "p.json"),
                           "--steps", "all", "--warmup", "0", "--target", target, "--quiet"])
        code = subprocess.call(argv, env=child_environment(knobs))
        line = _tune_line(Path(tmp) / "p.json", command) if knobs.values.get("tune") is not None else None
        code = _script_exit_code(Path(tmp) / "p.json", code)
    if line:
        click.echo(f"torchaxe run: {line}", err=True)
    sys.exit(code)


def tune_line(record: dict | None, command: Sequence[str]) -> str:
    """What the ``tune`` knob swapped into the model, from the run's record of it."""
    if not isinstance(record, dict):
        return "tune: the script built no model torchaxe could see; nothing tuned was applied"
    kb = record.get("kb") or "default"
    applied = record.get("applied") or []
    module = record.get("module") or "the model"
    if "subgraphs" not in record:
        return f"tune: {module} was found but never finished a forward pass; nothing tuned was applied"
    if applied:
        shown = ", ".join(f"{a.get('name')} ({a.get('strategy')})" for a in applied[:6])
        more = f" and {len(applied) - 6} more" if len(applied) > 6 else ""
        return f"tune: swapped into {module} from the knowledge base {kb}: {shown}{more}"
    unknown, eager = record.get("unknown") or 0, record.get("eager") or 0
    why = []
    if unknown:
        why.append(f"{unknown} of its {record.get('subgraphs')} module shapes were never tuned "
                   f"(run `torchaxe tune -- {shlex.join(command)}` first)")
    if eager:
        why.append(f"for {eager} of its {record.get('subgraphs')} module shapes the stored winner is eager "
                   "(the module as it is)")
    return f"tune: nothing swapped into {module} (knowledge base {kb}): " + ("; ".join(why) or "no stored winner")


def _tune_line(profile_path: Path, command: Sequence[str]) -> str | None:
    """:func:`tune_line` of the run's first rank, None when it left no record."""
    import json

    from torchaxe.runtime.bootstrap import OPTIONS_KEY
    from torchaxe.runtime.ranks import rank_files

    for path in rank_files(profile_path).values():
        try:
            knobs = json.loads(path.read_text(encoding="utf-8"))["run"]["options"][OPTIONS_KEY]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return tune_line(knobs.get("tune") if isinstance(knobs, dict) else None, command)
    return None


def _script_exit_code(profile_path: Path, bootstrap_code: int) -> int:
    """The script's own exit code, as `python train.py` would have returned it: the
    bootstrap's codes describe the harness (docs/trial.md), not the script."""
    import json

    from torchaxe.runtime.ranks import rank_files

    profiles = []
    for path in rank_files(profile_path).values():
        try:
            profiles.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    if not profiles:
        return bootstrap_code
    # Under torchrun: the first rank that did not end well speaks for the job.
    profile = next((p for p in profiles if p.get("exit_code") or p.get("status") in ("error", "interrupted")),
                   profiles[0])
    if profile.get("exit_code") is not None:
        return int(profile["exit_code"])
    if profile.get("status") == "error":
        return 1
    if profile.get("status") == "interrupted":
        return 130
    if profile.get("status") == "completed":
        return 0  # ran to its end: whether torchaxe saw any step is not the script's exit code
    return bootstrap_code
