"""``torchaxe data``: is the run waiting for data, why, and which loader settings fix it."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import click

from torchaxe.backends import TARGET_CHOICES
from torchaxe.console import CONTEXT, progress_printer, writable_path
from torchaxe.runtime.torchrun import in_ranks, rank_exit_code
from torchaxe.errors import TorchaxeError

EPILOG = """\b
Exit codes:
  0    measured: not data-bound (data wait under 2% of the step)
  1    measured: data-bound or partly (2% or more of the step spent waiting for data)
  2    usage error (bad option, script not found, bad --images path)
  3    the script raised (its traceback is shown; what was measured is still reported)
  4    the script called sys.exit with a non-zero code
  5    --timeout ran out (a hung loader)
  6    no step was seen
  130  interrupted
Under torchrun (`torchaxe data -- torchrun ...`) every rank is measured: rank 0
prints the report, each other rank its verdict in one line on stderr, and --out FILE
keeps every rank's report (FILE.rankN.json). A verdict exits 0 there (torchrun would
take 1 for a failed rank); the exit code is torchrun's.
"""

EXIT_NOT_BOUND = 0
EXIT_BOUND = 1


@click.command("data", context_settings=CONTEXT, epilog=EPILOG)
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Measured steps, after the warmup; then the script is stopped.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Steps left out first.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              metavar="SECONDS", help="Wall-clock limit of the measured run (a loader that hangs ends here).")
@click.option("--target", type=click.Choice(TARGET_CHOICES, case_sensitive=False), default=None,
              help="Device backend synchronised at step boundaries (auto: what this machine has).")
@click.option("--samples", type=click.IntRange(min=0), default=24, show_default=True,
              help="Samples of each loader's dataset timed in-process, stage by stage (0: none).")
@click.option("--sample-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              metavar="SECONDS", help="A sample that takes longer ends the sampling (a hung __getitem__).")
@click.option("--images", "images", metavar="PATH",
              help="Benchmark the decoders on image files under PATH (default: the files the samples opened).")
@click.option("--decode-files", type=click.IntRange(min=1), default=24, show_default=True,
              help="Image files the decoder benchmark uses.")
@click.option("--decode-repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Decodes per file and decoder.")
@click.option("--no-decoders", is_flag=True, help="Skip the decoder benchmark.")
@click.option("--no-scan", is_flag=True, help="Do not join the scanner's AX4xx findings.")
@click.option("--tune", is_flag=True, help="Search loader settings with trials on the real script, and store the best.")
@click.option("--grid", is_flag=True, help="With --tune: measure the full grid instead of searching (slow).")
@click.option("--trial-steps", type=click.IntRange(min=1), default=8, show_default=True,
              help="Measured steps per tuning trial.")
@click.option("--trial-warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Warmup steps per tuning trial.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs per tuning point.")
@click.option("--max-trials", type=click.IntRange(min=2), default=12, show_default=True,
              help="Most trial runs the search may use.")
@click.option("--trial-timeout", type=click.FloatRange(min=0, min_open=True), default=180.0, show_default=True,
              metavar="SECONDS", help="Per-trial limit.")
@click.option("--kb", "kb_path", metavar="FILE", help="Knowledge base file (default $TORCHAXE_HOME/kb.sqlite).")
@click.option("--no-store", is_flag=True, help="With --tune: do not store the result in the knowledge base.")
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", show_default=True,
              help="text: the report for people; json: schema torchaxe.data/1, on stdout.")
@click.option("--out", "-o", metavar="FILE", help="Also write the JSON report to FILE (atomically).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def data(steps, warmup, timeout, target, samples, sample_timeout, images, decode_files, decode_repeats, no_decoders,
         no_scan, tune, grid, trial_steps, trial_warmup, repeats, max_trials, trial_timeout, kb_path, no_store, fmt,
         out, command):
    """Measure whether training waits for data, find why, and tune the DataLoader.

    Runs the script unmodified under the profile harness and reports, per step, the
    time blocked on the DataLoader against the compute; per loader its settings,
    worker start-ups and how busy its workers were; host-to-device copy and pinning
    time; then times a few samples of each loader's dataset in-process, split into
    file read, decode, transforms and collate, benchmarks the image decoders (PIL,
    OpenCV, torchvision.io where installed) on your own image files, and joins the
    scanner's AX4xx findings with what was measured. The verdict says whether the run
    is data-bound and why. --tune searches num_workers, prefetch_factor,
    persistent_workers, pin_memory and the start method with trial runs and stores
    the best in the knowledge base. Progress goes to stderr, the report to stdout.

    \b
    Examples:
      torchaxe data -- python train.py
      torchaxe data --tune -- python train.py --epochs 1
      torchaxe data --format json --images data/train -- python -m mypkg.train
    """
    from torchaxe.config import find_config
    from torchaxe.data.run import DataOptions, analyse

    if grid and not tune:
        raise TorchaxeError("--grid needs --tune")
    if images is not None and not Path(images).exists():
        raise TorchaxeError(f"--images {images}: no such file or folder")
    if out:
        writable_path(out, "--out")
    options = DataOptions(
        steps=steps, warmup=warmup, timeout=timeout, target=target or find_config().get("target") or "auto",
        samples=samples, sample_timeout=sample_timeout, images=images, decode_files=decode_files,
        decode_repeats=decode_repeats, decoders=not no_decoders, scan=not no_scan, tune=tune, grid=grid,
        trial_steps=trial_steps, trial_warmup=trial_warmup, repeats=repeats, max_trials=max_trials,
        trial_timeout=trial_timeout, kb_path=kb_path, store=not no_store,
    )
    threads_before = set(threading.enumerate())
    in_ranks(command)
    from torchaxe.runtime.harness import distributed_identity
    from torchaxe.runtime.profile import rank_path

    rank, _, world = distributed_identity()
    ranked = rank is not None and world is not None and world > 1
    report, code = analyse(list(command), options,
                           progress=progress_printer(f"data [rank {rank}]" if ranked else "data"))
    if out:
        from torchaxe.atomic import write_text_atomic

        write_text_atomic(rank_path(out, rank, world), _json(report))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if ranked and rank != 0:
        # Under torchrun rank 0 prints the report; the others their verdict, one line
        # each, so that the reports do not interleave (--out keeps every rank's).
        headline = report.verdict.headline if report.verdict is not None else f"{report.status}: {report.detail}"
        sys.stderr.write(f"torchaxe data [rank {rank} of {world}]: {headline}\n")
    elif fmt == "json":
        sys.stdout.write(_json(report))
    else:
        from torchaxe.data.render import render_data_report

        render_data_report(report, sys.stdout, rank=(rank, world) if ranked else None)
    sys.stdout.flush()
    if code is None:
        code = EXIT_BOUND if report.verdict is not None and report.verdict.data_bound else EXIT_NOT_BOUND
    _leave(threads_before, rank_exit_code(code, (EXIT_BOUND,)))


def _json(report) -> str:
    import json

    return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"


def _leave(before: set, code: int) -> None:
    """A stopped script (or a hung sample) can leave threads behind that would keep
    the process alive: give them a moment, then exit without them. A daemon thread
    the run left running (a hung sample) is not waited for, but the interpreter's
    shutdown is skipped too: torch aborts the process ("terminate called without an
    active exception") when one of its threads is torn down mid-call."""
    started = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    lingering = [t for t in started if not t.daemon]
    for thread in lingering:
        thread.join(timeout=2.0 / len(lingering))
    if any(t.is_alive() for t in started):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
