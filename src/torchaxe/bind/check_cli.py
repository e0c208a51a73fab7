"""``torchaxe bind check [PID | -- CMD]``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import click

from torchaxe.console import CONTEXT
from torchaxe.errors import TorchaxeError


@click.command("check", context_settings={**CONTEXT, "ignore_unknown_options": True})
@click.option("--duration", type=click.FloatRange(min=0.2), default=5.0, show_default=True, metavar="S",
              help="Seconds to watch.")
@click.option("--interval", type=click.FloatRange(min=0.01), default=0.1, show_default=True, metavar="S",
              help="Seconds between samples of each thread's CPU.")
@click.option("--delay", type=click.FloatRange(min=0), default=3.0, show_default=True, metavar="S",
              help="With -- CMD: seconds to let the command start before watching.")
@click.option("--no-children", is_flag=True, help="Only the process itself, not its descendants.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema torchaxe.bind-check/1).")
@click.argument("target", nargs=-1, type=click.UNPROCESSED)
def check(duration, interval, delay, no_children, as_json, target):
    """Measure a running training process: would binding help?

    \b
    torchaxe bind check PID            watch a running process (and its children)
    torchaxe bind check -- CMD ARGS    start CMD, watch it, then stop it

    For every thread: CPU use, migrations between CPUs and context switches per
    second (/proc/PID/task/*/stat, status, sched), and how often it ran off the node
    that holds its process's memory. The verdict says whether binding is likely to
    help; the table lists the busiest threads.
    """
    from torchaxe.bind.check import measure, render_check

    # click drops the `--` itself: one number is a process id, anything else a command.
    target = [t for t in target] if not (target and target[0] == "--") else list(target[1:])
    process = None
    if len(target) == 1 and target[0].isdigit():
        pid = int(target[0])
    elif target:
        try:
            process = subprocess.Popen(target)
        except OSError as exc:
            raise TorchaxeError(f"cannot start {target[0]}: {exc.strerror or exc}") from None
        sys.stderr.write(f"torchaxe bind check: started {target[0]} (pid {process.pid}); watching in {delay:g} s\n")
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        if process.poll() is not None:
            raise TorchaxeError(f"{target[0]} exited (code {process.returncode}) before it could be watched: "
                                "lower --delay")
        pid = process.pid
    else:
        raise TorchaxeError("give a process id (`torchaxe bind check 1234`) or a command "
                            "(`torchaxe bind check -- python train.py`)")
    try:
        report = measure(pid, duration=duration, interval=interval, children=not no_children,
                         alive=(lambda: process.poll() is None) if process is not None else None)
    finally:
        if process is not None:
            _stop(process)
    if as_json:
        import json

        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        render_check(report, sys.stdout)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    sys.stderr.write(f"torchaxe bind check: stopped pid {process.pid} after measuring\n")
