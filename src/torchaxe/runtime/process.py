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
from typing import IO, Sequence

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


def run_tree(argv: Sequence[str], *, env: dict[str, str] | None, stdout: int | IO | None,
             stderr: int | IO | None, limit: float | None) -> tuple[int, bool]:
    """Run ``argv`` in a session of its own to its end, or for ``limit`` seconds;
    (exit code, whether it was killed for the limit). An interrupt (Ctrl-C) ends the
    whole tree before it is passed on."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
                            start_new_session=True)
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
    return returncode, killed
