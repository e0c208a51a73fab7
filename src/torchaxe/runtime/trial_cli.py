"""``torchaxe trial``: compare knob sets on the user's real training run."""

from __future__ import annotations

import sys

import click

from torchaxe.backends import TARGET_CHOICES
from torchaxe.console import CONTEXT, progress_printer

EPILOG = """\b
Exit codes:
  0    every knob set ran and was measured
  1    at least one knob set failed (its error is in the report; the others were measured)
  2    usage error: bad option, bad knob file, script not found
"""

EXIT_OK = 0
EXIT_SOME_FAILED = 1


@click.command("trial", context_settings=CONTEXT, epilog=EPILOG)
@click.option("--knobs", "knob_files", multiple=True, required=True, metavar="FILE",
              help="A knob-set JSON file (docs/trial.md). Repeat for each set; the first is the baseline.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds; each round runs every knob set once, in order (A B A B ...).")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Measured steps per run, after the warmup; then the script is stopped.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Steps run first in every run and discarded.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Per-run wall-clock limit; a run that exceeds it fails its knob set.")
@click.option("--target", type=click.Choice(TARGET_CHOICES, case_sensitive=False), default="auto",
              show_default=True, help="Device backend the harness synchronises at step boundaries.")
@click.option("--turns", is_flag=True,
              help="Run the knob sets of a round side by side, taking turns of a quarter of --steps once all "
                   "are warm, so that a shared machine's swings in speed fall on all of them alike (docs/advise.md). "
                   "Every run of a round is in memory at once. One process only: not under torchrun.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema torchaxe.trial/1).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def trial(knob_files, repeats, steps, warmup, timeout, target, turns, as_json, command):
    """Run a training script under several knob sets and compare their step times.

    Each run is a fresh subprocess (`python -m torchaxe.runtime.bootstrap`) that
    applies one knob set (environment, torch settings, torch.compile of the model,
    DataLoader keywords, CPU affinity, npu compile mode), runs the unmodified script
    under the profile harness and stops it after --warmup + --steps steps. Runs are
    interleaved A B A B ... for --repeats rounds. The report gives each set's median
    and p90 step time and the ratio to the first set (median of the per-round ratios,
    min..max; a round compares each run's mean step, its fastest and slowest tenth set
    aside). Progress goes to stderr, the report to stdout.

    \b
    Examples:
      torchaxe trial --knobs base.json --knobs threads2.json -- python train.py
      torchaxe trial --knobs a.json --knobs b.json --repeats 5 --steps 20 --json -- python -m pkg.train
      torchaxe trial --knobs a.json --knobs b.json -- torchrun --nproc-per-node 2 train.py

    Under torchrun every rank runs the knob set and is measured; a step's time is
    the slowest rank's, and a rank that fails or hangs fails the run.
    """
    from torchaxe.errors import TorchaxeError
    from torchaxe.runtime.command import check_module
    from torchaxe.runtime.knobs import load_knob_set
    from torchaxe.runtime.torchrun import parse_script
    from torchaxe.runtime.trials import TrialOptions, run_trials

    knob_sets = [load_knob_set(path) for path in knob_files]
    job, script = parse_script(command)
    check_module(script)  # one-line errors before any run
    if turns and job.distributed:
        raise TorchaxeError("--turns: runs take turns one process each; a torchrun job runs one by one "
                            "(leave --turns out)")
    options = TrialOptions(repeats=repeats, steps=steps, warmup=warmup, timeout=timeout, target=target.lower())

    from torchaxe.runtime.turns import steps_per_turn

    report = run_trials(knob_sets, list(command), options, progress=progress_printer("trial"),
                        turn_steps=steps_per_turn(None, steps) if turns else None)
    if as_json:
        sys.stdout.write(report.to_json())
    else:
        from torchaxe.report.trial_text import render_trial_report

        render_trial_report(report, sys.stdout)
    sys.stdout.flush()
    sys.exit(EXIT_SOME_FAILED if report.failed else EXIT_OK)
