"""Runs measured in turns: the arms of one round are in memory side by side; they warm
up one after another, then take turns, a few steps each, so that only one computes at
a time.

A shared machine's speed swings by tens of percent over seconds (other tenants of
the host). Runs made one after another land in different swings: two runs of the
same script can differ by 30%. Runs that take turns every half second share the same
swings, and each arm's median step is then comparable with the others' of its round.

The coordinator (:func:`run_in_turns`, the advise side) listens on a Unix socket
whose path it gives each run in ``TORCHAXE_TURNS`` with the steps of a turn and the
run's number. The run's side (:class:`TurnClient`, in the harness) connects at the
end of its warm-up and, at every turn's end, says ``wait`` and blocks until told
``go``; after its last measured step it says ``end``. The time spent waiting is not
in any step. When the coordinator is gone (its socket closed), a run goes on alone.
"""

from __future__ import annotations

import os
import selectors
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from torchaxe.runtime.knobs import KnobSet
    from torchaxe.runtime.trials import TrialOptions, TrialRun

#: The variable that puts a run in turns: ``PATH;STEPS;NUMBER``.
ENV = "TORCHAXE_TURNS"
#: The seconds from the start of training a run's warm-up may take (what its round
#: leaves it beyond the measured steps), when its round has a deadline.
ENV_WARM = "TORCHAXE_TURNS_WARM"
#: Seconds of steps a turn lasts: short enough that neighbouring turns see the same
#: machine, long enough that switching (caches refilled) is a small part of it.
TURN_SECONDS = 0.5
#: How often the coordinator looks at runs that have not connected yet.
POLL_SECONDS = 0.1
#: The least --timeout a run of a round is given, however little of the round's is left.
LEAST_TIMEOUT = 1.0


@dataclass(frozen=True)
class TurnPlan:
    """Where to connect, how many steps a turn has, and which run this is."""

    path: str
    steps: int
    number: int

    def to_env(self) -> str:
        return f"{self.path};{self.steps};{self.number}"

    @classmethod
    def from_env(cls, text: str | None) -> "TurnPlan | None":
        if not text:
            return None
        try:
            path, steps, number = text.rsplit(";", 2)
            plan = cls(path, int(steps), int(number))
        except ValueError:
            return None
        return plan if plan.steps >= 1 else None


#: A run's measured steps are cut into at least this many turns.
MIN_TURNS = 4


def steps_per_turn(step_seconds: float | None, steps: int) -> int:
    """The steps of a turn for a script whose steps take ``step_seconds`` and whose
    runs measure ``steps``: about ``TURN_SECONDS`` of them, and at least
    ``MIN_TURNS`` turns a run where the steps allow."""
    most = max(1, steps // MIN_TURNS)
    if not step_seconds or step_seconds <= 0:
        return most
    return max(1, min(most, round(TURN_SECONDS / step_seconds)))


class TurnClient:
    """The run's side: ``wait()`` at a turn's end (the first at the end of the
    warm-up), ``end()`` after the last measured step. Any socket error makes it stop
    taking turns: the run goes on alone rather than fail."""

    def __init__(self, plan: TurnPlan, warm_limit: float | None = None) -> None:
        self.plan = plan
        #: Seconds from the start of training by which the warm-up must end (None: any).
        self.warm_limit = warm_limit
        self._socket: socket.socket | None = None
        self._reader = None
        self.measured = 0

    @classmethod
    def from_environment(cls) -> "TurnClient | None":
        # Not for the script's own subprocesses: this process takes the turns.
        plan = TurnPlan.from_env(os.environ.pop(ENV, None))
        try:
            limit: float | None = float(os.environ.pop(ENV_WARM, ""))
        except ValueError:
            limit = None
        if limit is not None and not limit > 0:
            limit = None
        return cls(plan, limit) if plan is not None else None

    def _send(self, word: str) -> bool:
        if self._socket is None:
            return False
        try:
            self._socket.sendall(word.encode() + b"\n")
            return True
        except OSError:
            self.close()
            return False

    def _connect(self) -> None:
        if self._socket is not None or self.plan is None:
            return
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.plan.path)
        except OSError:
            self.plan = None  # type: ignore[assignment]  # no coordinator: alone from now on
            return
        self._socket = sock
        self._reader = sock.makefile("rb")
        self._send(f"hello {self.plan.number}")

    def wait(self) -> None:
        """Give the turn away and block until it comes back. The run's own child
        processes (its DataLoader workers, a compiler's workers) are stopped meanwhile:
        only one run computes at a time, and workers that went on filling their queue
        through the other runs' turns made a loader with two workers measure 3.30x
        where it ran slower applied."""
        self._connect()
        if self._socket is None:
            return
        paused = suspend_children()
        try:
            if not self._send("wait"):
                return
            try:
                line = self._reader.readline() if self._reader is not None else b""
            except OSError:
                line = b""
            if line.strip() != b"go":
                self.close()
        finally:
            resume(paused)

    def step_measured(self) -> None:
        """One measured step ended (not the last): a turn ends every ``steps`` of them."""
        self.measured += 1
        if self.plan is not None and self.measured % self.plan.steps == 0:
            self.wait()

    def end(self) -> None:
        """The last measured step ended: the others may go on without this run."""
        self._send("end")
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            try:
                self._socket.close()
            except OSError:
                pass
        self._socket = None
        self._reader = None
        self.plan = None  # type: ignore[assignment]


def suspend_children() -> list:
    """Stop every process below this one (SIGSTOP, through psutil); the ones stopped."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    stopped = []
    for child in children:
        try:
            child.suspend()
            stopped.append(child)
        except psutil.Error:  # ended meanwhile
            continue
    return stopped


def resume(processes: Sequence) -> None:
    """Let processes stopped by :func:`suspend_children` go on."""
    import psutil

    for child in processes:
        try:
            child.resume()
        except psutil.Error:
            continue


#: ``(knobs, command, options, repeat, env)``: one run with extra environment variables.
TurnRunner = Callable[["KnobSet", Sequence[str], "TrialOptions", int, dict[str, str]], "TrialRun"]
#: :func:`run_in_turns`'s signature: ``(knob_sets, command, options, repeat, *, turn_steps)``.
TurnsRunner = Callable[..., "list[TrialRun]"]


class _Coordinator:
    """Hands the turn round the runs that are waiting, in a fixed order."""

    def __init__(self, server: socket.socket, count: int, alive: Callable[[int], bool]) -> None:
        self.server = server
        self.count = count
        self.alive = alive
        self.selector = selectors.DefaultSelector()
        self.selector.register(server, selectors.EVENT_READ, None)
        self.connections: dict[int, socket.socket] = {}
        self.buffers: dict[int, bytes] = {}
        self.waiting: set[int] = set()
        self.ended: set[int] = set()
        #: Turns given to each run.
        self.given = [0] * count
        self._orphans: dict[socket.socket, bytes] = {}

    def _finish(self, number: int) -> None:
        self.ended.add(number)
        self.waiting.discard(number)
        conn = self.connections.pop(number, None)
        if conn is not None:
            try:
                self.selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()

    def _words(self, number: int, data: bytes) -> None:
        self.buffers[number] = self.buffers.get(number, b"") + data
        *lines, self.buffers[number] = self.buffers[number].split(b"\n")
        for line in lines:
            word = line.strip()
            if word == b"wait":
                self.waiting.add(number)
            elif word == b"end":
                self._finish(number)
                return

    def _poll(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self.server:
                conn, _ = self.server.accept()
                self._orphans[conn] = b""
                self.selector.register(conn, selectors.EVENT_READ, "new")
                continue
            conn = key.fileobj
            try:
                data = conn.recv(4096)
            except OSError:
                data = b""
            if key.data == "new":
                if not data:
                    self.selector.unregister(conn)
                    self._orphans.pop(conn, None)
                    conn.close()
                    continue
                text = self._orphans[conn] + data
                head, sep, rest = text.partition(b"\n")
                if not sep:
                    self._orphans[conn] = text
                    continue
                self._orphans.pop(conn, None)
                parts = head.split()
                if len(parts) != 2 or parts[0] != b"hello" or not parts[1].isdigit() \
                        or int(parts[1]) >= self.count:
                    self.selector.unregister(conn)
                    conn.close()
                    continue
                number = int(parts[1])
                self.selector.modify(conn, selectors.EVENT_READ, number)
                self.connections[number] = conn
                if rest:
                    self._words(number, rest)
                continue
            number = key.data
            if not data:
                self._finish(number)
            else:
                self._words(number, data)

    def _settled(self, number: int) -> bool:
        if number in self.waiting or number in self.ended:
            return True
        if number not in self.connections and not self.alive(number):
            self.ended.add(number)  # it ended (or failed) before taking a turn
            return True
        return False

    def ready(self, number: int) -> None:
        """Until run ``number`` waits for its first turn or has ended."""
        while not self._settled(number):
            self._poll(POLL_SECONDS)

    def cycle(self, order: Sequence[int]) -> None:
        """Turns in ``order`` until every run has ended."""
        while len(self.ended) < self.count:
            progressed = False
            for number in order:
                if number not in self.waiting:
                    continue
                self.waiting.discard(number)
                conn = self.connections[number]
                try:
                    conn.sendall(b"go\n")
                except OSError:
                    self._finish(number)
                    continue
                progressed = True
                self.given[number] += 1
                while number not in self.waiting and number not in self.ended:
                    self._poll(5 * POLL_SECONDS)
                    if number not in self.waiting and number not in self.ended and not self.alive(number):
                        self._poll(0)  # its last words, if any
                        if number not in self.waiting:
                            self._finish(number)
            if not progressed:
                # Nobody waits: the runs left are between turns or gone.
                for number in range(self.count):
                    if number not in self.ended and number not in self.connections and not self.alive(number):
                        self.ended.add(number)
                self._poll(POLL_SECONDS)

    def close(self) -> None:
        for number in list(self.connections):
            self._finish(number)
        for conn in list(self._orphans):
            conn.close()
        self.selector.close()


def run_in_turns(knob_sets: Sequence["KnobSet"], command: Sequence[str], options: "TrialOptions", repeat: int, *,
                 turn_steps: int, runner: TurnRunner | None = None, one_deadline: bool = False,
                 measure_seconds: float | None = None) -> list["TrialRun"]:
    """One run of each knob set, side by side, taking turns of ``turn_steps``
    measured steps once warm, in the order given (callers rotate it by round). Each
    run's limit grows with the others' share of the time; with ``one_deadline`` (a
    budget that must hold, as advise's) that limit counts from the round's start for
    every run, so that a run started once the others have warmed up still ends with
    the round.

    Runs warm up one at a time, those that pay once (a compile) last. With
    ``one_deadline`` and ``measure_seconds`` (about how long one run's measured steps
    take), a run's warm-up may take only what the round's limit leaves beyond the
    measured steps of the runs warm before it and its own: a first compile longer than
    that is stopped (a run cut by the deadline, ``status`` "timeout"), and a run with
    no such time left is not started, so that the runs warm already are measured
    rather than all cut together at the round's end.

    The runs share one write guard (``runtime/protect.py``), and the files the script
    writes are put back once all of them have ended: with a guard each, a run would
    back up a file another had already rewritten, and put that back."""
    from functools import partial

    from torchaxe.runtime.protect import restore
    from torchaxe.runtime.trials import run_in_subprocess

    count = len(knob_sets)
    if options.timeout is not None:
        options = replace(options, timeout=options.timeout * max(count, 1))
    results: list["TrialRun | None"] = [None] * count
    errors: list[BaseException | None] = [None] * count
    with tempfile.TemporaryDirectory(prefix="torchaxe-turns-") as tmp:
        guard = Path(tmp) / "writes"
        run = runner or partial(run_in_subprocess, guard=guard)
        try:
            _run_round(run, knob_sets, command, options, repeat, turn_steps, tmp, results, errors, one_deadline,
                       measure_seconds)
        finally:
            restore(guard)  # the files the script wrote, as they were before the round
    for exc in errors:
        if exc is not None:
            raise exc
    out = []
    for result in results:
        assert result is not None
        out.append(result)
    return out


def _run_round(run: TurnRunner, knob_sets: Sequence["KnobSet"], command: Sequence[str], options: "TrialOptions",
               repeat: int, turn_steps: int, tmp: str, results: list["TrialRun | None"],
               errors: list[BaseException | None], one_deadline: bool = False,
               measure_seconds: float | None = None) -> None:
    """The runs of :func:`run_in_turns`, their results and errors put in ``results``
    and ``errors``; each run's ``seconds`` is its share of the round's wall time."""
    from torchaxe.runtime.knobs import pays_once
    from torchaxe.runtime.trials import TrialRun

    count = len(knob_sets)
    path = str(Path(tmp) / "turns.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(count)
    server.setblocking(False)

    started = time.perf_counter()
    # Warm-ups in the order given, but those that pay once (a first compile) last: a
    # long one then holds back no cheap run.
    # The original (no knobs) first: without it the round measures nothing.
    warm_order = sorted(range(count), key=lambda n: (pays_once(knob_sets[n].values), bool(knob_sets[n].values)))
    bounded = one_deadline and options.timeout is not None

    def one(number: int, warm_limit: float | None) -> None:
        env = {ENV: TurnPlan(path, turn_steps, number).to_env()}
        if warm_limit is not None:
            env[ENV_WARM] = f"{warm_limit:.3f}"
        own = options
        if bounded:
            # The round's limit counts from the round's start: a run started once the
            # runs before it have warmed up has what is left of it.
            own = replace(options, timeout=max(options.timeout - (time.perf_counter() - started), LEAST_TIMEOUT))
        try:
            result = run(knob_sets[number], command, own, repeat, env)
            if warm_limit is not None and result.status == "stopped" and not result.step_seconds:
                # Stopped in its warm-up (by the harness, at ENV_WARM) for the time the
                # others' measured steps need.
                result.status = "timeout"
                result.error = f"timeout: not warm within the {warm_limit:.0f} s the round left for its warm-up"
            results[number] = result
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors[number] = exc

    threads: list[threading.Thread | None] = [None] * count
    coordinator = _Coordinator(server, count, lambda n: threads[n] is not None and threads[n].is_alive())
    try:
        # One warms up at a time (start-up, compilation): only one run computes at
        # any moment, the others wait, as in their turns.
        for warmed, number in enumerate(warm_order):
            warm_limit = None
            if bounded and measure_seconds:
                left = options.timeout - (time.perf_counter() - started)
                warm_limit = left - (warmed + 1) * measure_seconds
                if warm_limit < LEAST_TIMEOUT and warmed > 0:
                    results[number] = TrialRun(knobs=knob_sets[number].name, repeat=repeat, ok=False,
                                               status="timeout",
                                               error="timeout: the round had no time left for its warm-up")
                    coordinator.ended.add(number)
                    continue
                warm_limit = max(warm_limit, LEAST_TIMEOUT)
            thread = threading.Thread(target=one, args=(number, warm_limit), daemon=True)
            threads[number] = thread
            thread.start()
            coordinator.ready(number)
        coordinator.cycle(range(count))
    except BaseException:
        # Interrupted: the runs' threads wait on them, which the interrupt does not reach.
        from torchaxe.runtime.process import end_all

        end_all()
        raise
    finally:
        coordinator.close()
        server.close()
        for thread in threads:
            if thread is not None:
                thread.join()
    made = [n for n, result in enumerate(results) if result is not None and threads[n] is not None]
    seconds = round_shares(time.perf_counter() - started, count,
                           {n: results[n].warmup_seconds for n in made},  # type: ignore[union-attr]
                           {n for n in made if pays_once(knob_sets[n].values)})
    for number in made:
        result = results[number]
        assert result is not None
        result.seconds = seconds[number]  # its share of the round's wall time: what one more arm costs
        result.turns = coordinator.given[number]


def round_shares(wall: float, count: int, warmups: dict[int, float | None], once: set[int]) -> dict[int, float]:
    """Each run's share of a round's ``wall`` seconds (``count`` runs): an equal part,
    and on top, for a run that pays once (``once``: a first compile), what its warm-up
    took beyond the others' (median; ``warmups`` by run number), which the round
    spent on it alone (warm-ups go one at a time). The shares add up to ``wall``."""
    from torchaxe.runtime.stats import Samples

    typical = Samples.of([w for n, w in warmups.items() if w is not None and n not in once]).median
    extra = {n: max(0.0, (warmups.get(n) or 0.0) - typical) if typical is not None and n in once else 0.0
             for n in warmups}
    extra_total = min(sum(extra.values()), wall)
    scale = extra_total / sum(extra.values()) if sum(extra.values()) > 0 else 0.0
    base = (wall - extra_total) / max(count, 1)
    return {n: base + scale * extra[n] for n in warmups}
