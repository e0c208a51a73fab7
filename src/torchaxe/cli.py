"""The command line: parse, call the API, render, set the exit code.

Exit codes are bit flags: 0 clean, 1 findings, 2 errors. Every error reaches the
user as one line on stderr; tracebacks only with TORCHAXE_DEBUG=1.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import click

from torchaxe import __version__
from torchaxe.backends import TARGET_CHOICES
from torchaxe.console import CONTEXT, RAW_ARGS, write_output
from torchaxe.errors import TorchaxeError
from torchaxe.report import FORMATS


def _split(values: tuple[str, ...]) -> tuple[str, ...]:
    """Accept both ``--select AX2 --select AX3`` and ``--select AX2,AX3``."""
    return tuple(p.strip() for v in values for p in v.split(",") if p.strip())


#: Commands that live beside their own package, imported only when used so that
#: `torchaxe --help` and `torchaxe scan` stay fast (several of them import torch).
#: name -> ("module:attribute", the first sentence of its help, shown by --help
#: without importing it; a test keeps the two the same).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "verify": ("torchaxe.scan.formulas.verify_cli:verify",
               "Measure each formula rule's fix: hand-written form against replacement."),
    "profile": ("torchaxe.runtime.profile_cli:profile", "Run a training script unmodified and measure its steps."),
    "trial": ("torchaxe.runtime.trial_cli:trial",
              "Run a training script under several knob sets and compare their step times."),
    "shapes": ("torchaxe.shapes.cli:shapes",
               "Find out whether the model's shapes are static or dynamic, and which compile mode fits."),
    "tune": ("torchaxe.tune.cli:tune", "Auto-tune the model's fixed-shape subgraphs and keep the winners."),
    "kb": ("torchaxe.kb.cli:kb", "Look after the knowledge base of tuned subgraphs and measured settings."),
    "topo": ("torchaxe.bind.cli:topo", "Show the CPU topology core binding works with."),
    "launch": ("torchaxe.bind.cli:launch", "Run torchrun with every local rank bound to the cores near its device."),
    "bind": ("torchaxe.bind.cli:bind", "Bind this rank under another launcher, or check a running process."),
    "data": ("torchaxe.data.cli:data",
             "Measure whether training waits for data, find why, and tune the DataLoader."),
    "advise": ("torchaxe.advise.cli:advise",
               "Find, measure and rank everything that would make a training script faster."),
    "apply": ("torchaxe.advise.cli:apply", "Apply the changes `torchaxe advise` chose: code fixes and runtime knobs."),
    "run": ("torchaxe.advise.cli:run", "Run a training script to its end with the knobs from torchaxe.toml applied."),
    "follow": ("torchaxe.runtime.follow_cli:follow",
               "On the other nodes of a multi-node job: make the runs `torchaxe advise` asks for."),
    "compare": ("torchaxe.compare.cli:compare", "Compare two runs: where each spent its step time, and what changed."),
}


class LazyGroup(click.Group):
    """A click group whose extra commands are imported on first use (``--help`` lists
    them from :data:`LAZY_COMMANDS` without importing them); a command whose module is
    not there (yet) is simply not offered."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        import importlib.util

        names = set(super().list_commands(ctx))
        for name, (target, _) in LAZY_COMMANDS.items():
            module = target.split(":", 1)[0]
            try:
                if importlib.util.find_spec(module) is not None:
                    names.add(name)
            except ImportError:
                continue
        return sorted(names)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # The verb's arguments as typed: a verb given a torchrun command runs itself
        # in every rank with them (runtime/torchrun.py ``run_verb_in_ranks``).
        ctx.meta[RAW_ARGS] = list(args)
        return super().parse_args(ctx, args)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None or name not in LAZY_COMMANDS:
            return command
        import importlib

        module, attribute = LAZY_COMMANDS[name][0].split(":", 1)
        try:
            return getattr(importlib.import_module(module), attribute)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                return None
            raise

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in LAZY_COMMANDS and name not in self.commands:
                # A stand-in command shortens the stored sentence as click shortens help.
                rows.append((name, click.Command(name, help=LAZY_COMMANDS[name][1]).get_short_help_str(limit)))
                continue
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="torchaxe")
def cli() -> None:
    """torchaxe: find, measure and fix what makes PyTorch training slow,
    on Ascend NPU, NVIDIA GPU and CPU.

    \b
    Start with:
      torchaxe advise -- python train.py   measure every candidate change on your run, ranked
      torchaxe apply                       apply what advise chose (code fixes, torchaxe.toml knobs)
      torchaxe run -- python train.py      run with the chosen knobs, no code change
      torchaxe scan train.py               find code with faster fused replacements (no run)
      torchaxe rules                       list what torchaxe looks for
    """


def _scan_options(f: Callable) -> Callable:
    options = [
        click.option("--target", type=click.Choice(TARGET_CHOICES, case_sensitive=False), default=None,
                     help="Device to optimise for. auto (default) picks what this machine has: npu, cuda, else cpu."),
        click.option("--select", multiple=True, metavar="CODES",
                     help="Only rules whose code starts with one of these (e.g. AX2, AX301). Repeatable or comma-separated."),
        click.option("--ignore", multiple=True, metavar="CODES", help="Skip rules whose code starts with one of these."),
        click.option("--exclude", multiple=True, metavar="GLOB",
                     help="Skip files and folders matching this pattern (added to .git, .venv, build, ...)."),
        click.option("--jobs", "-j", type=click.IntRange(min=0), default=None,
                     help="Worker processes, at most (0 = choose from the number of files and cores). A scan "
                          "of under 4 MB whose formula results are stored from an earlier scan runs in one "
                          "process: starting workers would cost more than they save."),
        click.option("--package", "packages", multiple=True, metavar="NAME",
                     help="Also scan the sources of an installed distribution (third-party code). Repeatable."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _build_options(target, select, ignore, exclude, jobs):
    from torchaxe.backends import resolve_target
    from torchaxe.config import find_config
    from torchaxe.scan.engine import ScanOptions

    config = find_config()
    return ScanOptions(
        target=resolve_target(target or config.get("target") or "auto", import_torch=False),
        select=_split(select) or tuple(config.get("select", ())),
        ignore=_split(ignore) or tuple(config.get("ignore", ())),
        exclude=_split(exclude) + tuple(config.get("exclude", ())),
        jobs=jobs if jobs is not None else int(config.get("jobs", 0)),
    ), config


def _gather_paths(paths: tuple[str, ...], packages: tuple[str, ...]) -> list[str | Path]:
    from torchaxe.scan.discover import package_paths

    gathered: list[str | Path] = list(paths)
    for name in packages:
        gathered.extend(package_paths(name))
    if not gathered:
        raise TorchaxeError("nothing to scan: give a file or folder (e.g. `torchaxe scan .`) or --package NAME")
    return gathered


@contextlib.contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr when it is a terminal; nothing otherwise."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rich.console import Console

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@cli.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@_scan_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format (default text). json, sarif and csv are for machines; html is a standalone page.")
@click.option("--output", "-o", metavar="FILE", help="Write the report to FILE (atomically) instead of stdout.")
def scan(paths, target, select, ignore, exclude, jobs, packages, fmt, output):
    """Find code with faster fused ("affinity") replacements.

    Reads Python files and folders (recursively) without importing or running them,
    and reports each place with a faster alternative on the target device: unfused
    optimizers, host-device syncs in training loops, slow data loading, and APIs with
    fused NPU/GPU equivalents. Exit code: 0 clean, 1 findings, 2 errors (bit flags).

    \b
    Examples:
      torchaxe scan train.py
      torchaxe scan --target npu --format csv -o report.csv src/
      torchaxe scan --select AX2,AX3 --package transformers .
    """
    from torchaxe.report import render
    from torchaxe.scan.engine import scan_paths

    options, config = _build_options(target, select, ignore, exclude, jobs)
    fmt = fmt or config.get("format") or "text"
    if fmt not in FORMATS:
        raise TorchaxeError(f"format {fmt!r} from {config.source}: choose one of {', '.join(FORMATS)}")
    all_paths = _gather_paths(paths, packages)
    with _progress("scanning") as progress:
        result = scan_paths(all_paths, options, progress=progress)
    buffer = io.StringIO()
    color = fmt == "text" and output is None and sys.stdout.isatty()
    render(result, fmt, buffer, color=color)
    write_output(buffer.getvalue(), output)
    sys.exit(result.exit_code)


@cli.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@_scan_options
@click.option("--unsafe-fixes", is_flag=True, help="Also apply fixes that may change numerics or behaviour.")
@click.option("--diff", is_flag=True, help="Print a unified diff of the changes and write nothing.")
def fix(paths, target, select, ignore, exclude, jobs, packages, unsafe_fixes, diff):
    """Apply the fixes the scan proposes.

    Safe fixes (same numerics) by default; --unsafe-fixes adds those that change
    numerics or can fail for some programs. Each file is replaced atomically and only
    if the result still parses. Exit code: 0 nothing left to report, 1 findings remain
    (or, with --diff, changes would be made), 2 errors.

    \b
    Examples:
      torchaxe fix --diff train.py
      torchaxe fix --unsafe-fixes --target npu src/
    """
    from torchaxe.scan.fix import fix_paths

    options, _ = _build_options(target, select, ignore, exclude, jobs)
    all_paths = _gather_paths(paths, packages)
    with _progress("fixing") as progress:
        result = fix_paths(all_paths, options, unsafe=unsafe_fixes, write=not diff, progress=progress)
    changed = [f for f in result.files if f.changed]
    if diff:
        for f in changed:
            sys.stdout.write(f.diff())
    err = sys.stderr
    for d in result.diagnostics:
        err.write(f"{d.path}{':' + str(d.line) if d.line else ''}: {d.code} {d.message}\n")
    verb = "Would fix" if diff else "Fixed"
    err.write(f"{verb} {result.applied} finding(s) in {len(changed)} file(s); {result.remaining} remaining.\n")
    hidden = sum(1 for f in result.files for g in f.remaining if g.fix and g.fix.edits and g.fix.applicability.value == "unsafe")
    if hidden and not unsafe_fixes:
        err.write(f"{hidden} more can be fixed with --unsafe-fixes (they may change numerics; review them).\n")
    code = (1 if result.remaining or (diff and changed) else 0) | (2 if result.diagnostics else 0)
    sys.exit(code)


@cli.command(context_settings=CONTEXT)
@click.argument("code", required=False)
@click.option("--format", "fmt", type=click.Choice(("text", "json", "markdown")), default="text",
              help="Output format; markdown prints the full reference of every rule (docs/rules.md).")
def rules(code, fmt):
    """List the rules, or explain one.

    \b
    Examples:
      torchaxe rules
      torchaxe rules AX201
      torchaxe rules --format markdown > docs/rules.md
    """
    import json

    from torchaxe.scan.rules import all_rules, get_rule

    if fmt == "markdown":
        from torchaxe.report.rule_docs import render_reference

        render_reference([get_rule(code)] if code else all_rules(), sys.stdout)
        return

    if code:
        rule = get_rule(code)
        if fmt == "json":
            click.echo(json.dumps({**rule.summary(), "docs": rule.docs()}, indent=2))
            return
        from torchaxe.report.rule_docs import render_rule

        render_rule(rule, sys.stdout)
        return
    if fmt == "json":
        click.echo(json.dumps([r.summary() for r in all_rules()], indent=2))
        return
    from torchaxe.report.rule_docs import render_rule_table

    render_rule_table(all_rules(), sys.stdout)


#: Commands that start measured runs of the user's script in processes of their own.
MEASURING_COMMANDS = frozenset({"advise", "trial", "tune", "shapes", "data", "verify"})


def main(argv: list[str] | None = None) -> int:
    """Console entry point: one line on stderr for any error, never a traceback."""
    debug = bool(os.environ.get("TORCHAXE_DEBUG"))
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), None)
    # The commands that start measured runs end them when stopped; those that run the
    # user's job in this process (run, profile) or hand it on (launch, follow, bind)
    # keep the job's own signal handling.
    measuring = command in MEASURING_COMMANDS
    try:
        if measuring:
            from torchaxe.runtime.process import ended_with_this_process

            with ended_with_this_process():
                cli.main(args=argv, prog_name="torchaxe", standalone_mode=False)
        else:
            cli.main(args=argv, prog_name="torchaxe", standalone_mode=False)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except click.exceptions.Abort:
        sys.stderr.write("torchaxe: interrupted\n")
        return 130
    except click.exceptions.ClickException as exc:
        hint = ""
        ctx = getattr(exc, "ctx", None)
        if ctx is not None:
            hint = f" (see `{ctx.command_path} --help`)"
        sys.stderr.write(f"torchaxe: error: {exc.format_message()}{hint}\n")
        return 2
    except TorchaxeError as exc:
        sys.stderr.write(f"torchaxe: error: {exc.message}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("torchaxe: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # pragma: no cover - last resort
        if debug:
            raise
        sys.stderr.write(f"torchaxe: internal error: {type(exc).__name__}: {exc} (set TORCHAXE_DEBUG=1 for the traceback)\n")
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
