"""Whole runs that take turns: several commands run at once, but only one computes at a
time; the others are stopped (``SIGSTOP`` to their process group) until their turn.

A shared machine's speed swings over seconds, so two runs made one after another can
land 30% apart for no reason of their own. Taking turns of a second or so puts every
run through the same swings. Unlike ``advise --turns``, which pauses runs at step
boundaries through torchaxe's harness, this works on any command (the original script
under plain ``python`` included): the pause can fall inside a step, so a log line is
judged only when the previous log line of the same run came in the same turn (the time
it reports then lies wholly inside one turn).

Each run first warms up alone (compilation, caches) until it has logged ``warm_lines``
lines that ``is_log(line)`` accepts, while the others wait; then the warm runs take
turns, each turn long enough for several log lines. A line is "paired" when another run
was still alive during its turn: the comparison uses paired lines, so that a run that
outlives the other is not judged in a quieter (or busier) stretch of its own.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

#: Shortest turn; a turn also spans at least LINES_PER_TURN log lines of the run.
TURN_SECONDS = 1.0
LINES_PER_TURN = 8
#: Time left after stopping a run for its last lines to be read before another resumes.
DRAIN_SECONDS = 0.05


@dataclass
class Line:
    text: str
    turn: int  # -1: during its warm-up
    paired: bool  # another run was alive during this turn
    clean: bool  # a log line whose previous log line came in the same turn


@dataclass
class TurnedRun:
    argv: list[str]
    returncode: int | None = None
    killed: bool = False
    lines: list[Line] = field(default_factory=list)
    #: seconds this run was allowed to compute (its warm-up and its turns)
    seconds: float = 0.0
    turns: int = 0

    @property
    def output(self) -> str:
        return "\n".join(line.text for line in self.lines)

    def judged(self) -> list[str]:
        """The log lines to judge: clean, in a turn, paired when any are."""
        clean = [line for line in self.lines if line.clean and line.turn >= 0]
        paired = [line for line in clean if line.paired]
        return [line.text for line in (paired or clean)]


class _Run:
    def __init__(self, argv: Sequence[str], cwd: Path, env: dict[str, str] | None,
                 is_log: Callable[[str], bool]) -> None:
        self.result = TurnedRun(list(argv))
        self.is_log = is_log
        self.turn = -1
        self.paired = False
        self.logs = 0
        self.log_times: list[float] = []
        self._last_log_turn: int | None = None
        self._lock = threading.Lock()
        self.process = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace",
                                        start_new_session=True)
        self.signal(signal.SIGSTOP)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            text = raw.rstrip("\n")
            with self._lock:
                is_log = self.is_log(text)
                clean = is_log and self._last_log_turn == self.turn
                if is_log:
                    self._last_log_turn = self.turn
                    self.logs += 1
                    self.log_times.append(time.perf_counter())
                self.result.lines.append(Line(text, self.turn, self.paired, clean))

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def set_turn(self, turn: int, paired: bool) -> None:
        with self._lock:
            self.turn, self.paired = turn, paired

    def alive(self) -> bool:
        return self.process.poll() is None

    def compute(self, seconds: float, until_logs: int | None = None) -> None:
        """Let the run compute for ``seconds`` (or until it has logged ``until_logs``
        lines, or ended), then stop it."""
        self.signal(signal.SIGCONT)
        started = time.perf_counter()
        deadline = started + seconds
        while True:
            now = time.perf_counter()
            if now >= deadline or not self.alive():
                break
            if until_logs is not None and self.logs >= until_logs:
                break
            try:
                self.process.wait(timeout=min(0.02, deadline - now))
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            self.signal(signal.SIGSTOP)
        self.result.seconds += time.perf_counter() - started
        time.sleep(DRAIN_SECONDS)

    def line_gap(self) -> float:
        """The median time between this run's log lines during its warm-up."""
        times = self.log_times
        gaps = [b - a for a, b in zip(times, times[1:])]
        return statistics.median(gaps) if gaps else 0.0

    def finish(self, killed: bool) -> TurnedRun:
        if killed and self.alive():
            self.signal(signal.SIGKILL)
            self.signal(signal.SIGCONT)
            self.result.killed = True
        self.result.returncode = self.process.wait()
        self.reader.join(timeout=5)
        return self.result


def run_in_turns(commands: Sequence[tuple[Sequence[str], Path, dict[str, str] | None]],
                 is_log: Callable[[str], bool], *, warm_lines: int = 10, timeout: float = 900.0,
                 turn_seconds: float | None = None,
                 progress: Callable[[str], None] | None = None) -> list[TurnedRun]:
    """Run ``commands`` (argv, cwd, env) taking turns; a run that computes longer than
    ``timeout`` seconds in all is killed. The runs come back in the order given."""
    runs = [_Run(argv, cwd, env, is_log) for argv, cwd, env in commands]
    killed = False
    try:
        for n, run in enumerate(runs):
            if progress:
                progress(f"warming up run {n + 1}/{len(runs)}")
            while run.alive() and run.logs < warm_lines and run.result.seconds < timeout:
                run.compute(min(5.0, timeout - run.result.seconds), until_logs=warm_lines)
        gap = max((r.line_gap() for r in runs), default=0.0)
        turn = turn_seconds or max(TURN_SECONDS, LINES_PER_TURN * gap)
        if progress:
            progress(f"taking turns of {turn:.1f} s")
        number = 0
        while any(r.alive() for r in runs):
            for run in runs:
                if not run.alive():
                    continue
                if run.result.seconds >= timeout:
                    killed = True
                    run.finish(killed=True)
                    continue
                others = any(r.alive() for r in runs if r is not run)
                run.set_turn(number, paired=others)
                run.result.turns += 1
                number += 1
                run.compute(turn)
    except BaseException:
        killed = True
        raise
    finally:
        results = [run.finish(killed=killed and run.alive()) for run in runs]
    return results


#: How long a command ended early gets to end its own runs before it is killed.
END_GRACE_SECONDS = 30.0


def run_to_end(argv: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)``, except that a command
    ended early (its timeout, Ctrl-C or SIGTERM to the benchmark) is first asked to stop
    with SIGTERM and given ``END_GRACE_SECONDS``: ``torchaxe advise`` then ends the runs it
    started in sessions of their own, where a SIGKILL would leave them running."""
    process = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, errors="replace")
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException:
        process.terminate()
        try:
            process.communicate(timeout=END_GRACE_SECONDS)
        except BaseException:
            process.kill()
            process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
