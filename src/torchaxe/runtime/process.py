"""Run a measured command and end it whole: its process, torchrun's ranks, their workers.

torchrun starts every rank in a session of its own, so ending torchrun's process
group is not enough to end a job: :func:`end_tree` asks the top process to stop
(torchrun then stops its ranks), waits a little, and kills whatever of the tree is
still there, ranks and DataLoader workers included. Nothing is left running after a
run that timed out or was interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from typing import IO, Iterator, Sequence

#: How long the top process gets to stop its children after SIGTERM.
TERM_GRACE_SECONDS = 10.0


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def end_tree(proc: subprocess.Popen, grace: float = TERM_GRACE_SECONDS) -> None:
    """Stop ``proc`` and every process below it: SIGTERM to the top process and its
    group, ``grace`` seconds to finish, then SIGKILL to everything still alive."""
    import psutil

    family = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        try:
            proc.terminate()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    family += [p for p in _descendants(proc.pid) if p not in family]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in family:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=5.0)
    if proc.poll() is None:
        proc.kill()


#: The trees :func:`run_tree` has running now (from any thread), for :func:`end_all`.
_LIVE: set = set()
_LIVE_LOCK = threading.Lock()


def end_all(grace: float = 2.0) -> None:
    """End every tree :func:`run_tree` has running now: the runs side by side of a
    round are waited for in threads, which an interrupt of the main thread does not
    reach."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        if proc.poll() is None:
            end_tree(proc, grace=grace)


@contextmanager
def ended_with_this_process() -> Iterator[None]:
    """While measuring: SIGTERM or SIGHUP to this process (a job scheduler, a closed
    terminal) is taken as Ctrl-C, so that the runs it started end with it. They run in
    sessions of their own (so that a run is ended whole), and would otherwise be left
    running. From the main thread only; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) in (signal.SIG_DFL, None):
            previous[number] = signal.signal(number, interrupt)
    try:
        yield
    except BaseException:
        end_all()
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def run_tree(argv: Sequence[str], *, env: dict[str, str] | None, stdout: int | IO | None,
             stderr: int | IO | None, limit: float | None) -> tuple[int, bool]:
    """Run ``argv`` in a session of its own to its end, or for ``limit`` seconds;
    (exit code, whether it was killed for the limit). An interrupt (Ctrl-C) ends the
    whole tree before it is passed on."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
                            start_new_session=True)
    with _LIVE_LOCK:
        _LIVE.add(proc)
    killed = False
    try:
        returncode = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        killed = True
        end_tree(proc)
        returncode = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted while waiting: take the run down with us
            end_tree(proc, grace=2.0)
            proc.wait()
        with _LIVE_LOCK:
            _LIVE.discard(proc)
    return returncode, killed
