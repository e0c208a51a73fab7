"""benchmarks/alternate.py runs whole commands side by side, one computing at a time: the
lines it judges hold no time of another run's turn, a run that ends or crashes does not
hold the other, and a run over its time is killed."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import benchmark_module


#: A run that logs each step's wall-clock start and end (time.time()) and takes STEP_S.
CHILD = """
import sys, time
steps, step_s, fail_at = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
print("starting", flush=True)
for n in range(steps):
    if n == fail_at:
        sys.exit(3)
    start = time.time()
    end = start + step_s
    while time.time() < end:
        pass
    print(f"step {n}: start {start:.6f} end {time.time():.6f}", flush=True)
"""
STEP = re.compile(r"^step (\d+): start ([0-9.]+) end ([0-9.]+)")


@pytest.fixture(scope="module")
def alternate():
    with benchmark_module("alternate") as module:
        yield module


def child(tmp_path: Path, steps: int, step_s: float = 0.01, fail_at: int = -1):
    script = tmp_path / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    return [sys.executable, str(script), str(steps), str(step_s), str(fail_at)], tmp_path, None


def spans(run) -> list[tuple[float, float]]:
    return [(float(m.group(2)), float(m.group(3))) for m in map(STEP.match, run.judged()) if m]


def test_judged_steps_of_two_runs_never_overlap(alternate, tmp_path):
    a, b = alternate.run_in_turns([child(tmp_path, 60), child(tmp_path, 60)], lambda s: bool(STEP.match(s)),
                                  warm_lines=3, turn_seconds=0.15, timeout=60)
    assert a.returncode == b.returncode == 0 and not a.killed and not b.killed
    assert a.turns >= 2 and b.turns >= 2
    first, second = spans(a), spans(b)
    assert len(first) >= 20 and len(second) >= 20
    # Both ran in the same stretch of time, yet no judged step of one overlaps one of the other.
    assert min(e for _, e in first) < max(s for s, _ in second)
    for start, end in first:
        assert all(end <= s or e <= start for s, e in second)
    # The warm-up lines and the first line of each turn are left out; the output keeps them all.
    assert sum(1 for line in a.lines if STEP.match(line.text)) == 60
    assert "starting" in a.output


def test_a_run_that_ends_early_leaves_the_other_alone_and_unpaired(alternate, tmp_path):
    short, long = alternate.run_in_turns([child(tmp_path, 30), child(tmp_path, 120)], lambda s: bool(STEP.match(s)),
                                         warm_lines=2, turn_seconds=0.1, timeout=60)
    assert short.returncode == long.returncode == 0
    alone = [line for line in long.lines if line.turn >= 0 and not line.paired]
    assert alone, "the long run went on alone after the short one ended"
    # The comparison keeps the lines made while both ran, as long as there are any.
    judged = set(long.judged())
    assert judged and all(line.paired for line in long.lines if line.text in judged)


def test_a_crashing_run_does_not_hold_the_other(alternate, tmp_path):
    crashed, fine = alternate.run_in_turns([child(tmp_path, 50, fail_at=5), child(tmp_path, 30)],
                                           lambda s: bool(STEP.match(s)), warm_lines=2, turn_seconds=0.1,
                                           timeout=60)
    assert crashed.returncode == 3 and fine.returncode == 0
    assert sum(1 for line in fine.lines if STEP.match(line.text)) == 30


def test_a_run_over_its_time_is_killed(alternate, tmp_path):
    slow, quick = alternate.run_in_turns([child(tmp_path, 1000, step_s=0.05), child(tmp_path, 5)],
                                         lambda s: bool(STEP.match(s)), warm_lines=2, turn_seconds=0.2,
                                         timeout=1.0)
    assert slow.killed and slow.returncode != 0
    assert quick.returncode == 0 and not quick.killed
    assert slow.seconds < 3.0


#: A command that says when it starts, and when SIGTERM ends it (unless told to ignore it).
TERMINATED = """
import signal, sys, time
from pathlib import Path
mark = Path(sys.argv[1])
def ended(signum, frame):
    mark.write_text("ended by SIGTERM")
    sys.exit(143)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "ignore" else ended)
print("started", flush=True)
time.sleep(60)
"""


def test_a_command_past_its_timeout_is_asked_to_stop_before_it_is_killed(alternate, tmp_path):
    # advise ends the runs it started only when it gets the chance: SIGTERM first.
    script, mark = tmp_path / "term.py", tmp_path / "mark"
    script.write_text(TERMINATED, encoding="utf-8")
    with pytest.raises(subprocess.TimeoutExpired):
        alternate.run_to_end([sys.executable, str(script), str(mark), "handle"], cwd=tmp_path, timeout=2.0)
    assert mark.read_text() == "ended by SIGTERM"


def test_a_command_deaf_to_sigterm_is_killed_after_the_grace(alternate, tmp_path, monkeypatch):
    script, mark = tmp_path / "term.py", tmp_path / "mark"
    script.write_text(TERMINATED, encoding="utf-8")
    monkeypatch.setattr(alternate, "END_GRACE_SECONDS", 1.0)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        alternate.run_to_end([sys.executable, str(script), str(mark), "ignore"], cwd=tmp_path, timeout=2.0)
    assert time.monotonic() - started < 20 and not mark.exists()


def test_a_command_that_ends_gives_its_output(alternate, tmp_path):
    done = alternate.run_to_end([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                                cwd=tmp_path, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n")


#: A benchmark that runs two commands taking turns and writes their process ids.
TAKING_TURNS = """
import sys
from pathlib import Path
sys.path.insert(0, {benchmarks!r}); sys.path.insert(0, {src!r})
from alternate import run_in_turns
from torchaxe.runtime.process import ended_with_this_process
child = [sys.executable, "-c", "import os, time\\nprint(os.getpid(), flush=True)\\nwhile True: time.sleep(0.01); print('step', flush=True)"]
with ended_with_this_process():
    run_in_turns([(child, Path("."), None)] * 2, lambda s: s == "step", warm_lines=2, turn_seconds=0.2,
                 progress=lambda s: print(s, flush=True))
"""


def test_sigterm_to_a_benchmark_ends_its_runs_stopped_between_turns(tmp_path):
    import psutil

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "bench.py"
    script.write_text(TAKING_TURNS.format(benchmarks=str(root / "benchmarks"), src=str(root / "src")),
                      encoding="utf-8")
    bench = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    for line in bench.stdout:
        if line.startswith("taking turns"):
            break
    kids = psutil.Process(bench.pid).children()
    assert len(kids) == 2 and any(k.status() == psutil.STATUS_STOPPED for k in kids)
    bench.send_signal(signal.SIGTERM)
    bench.communicate(timeout=30)
    gone, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, [k.status() for k in alive]
