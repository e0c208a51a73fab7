"""The harness: run the user's unmodified training script with probes, step by step.

``Harness(options).run(command)`` runs the script in this interpreter (see
``command.py``) after installing the probes (``probes.py``), cuts the run into steps
(``steps.py``: at every optimizer step, else at the backward pass that follows an
update, or at every return of a ``--step-marker`` function), and stops it by raising
:class:`StopProfiling` from the step boundary once warmup + op-profiling + measured
steps are done, or once ``first_step_timeout`` seconds of training pass without a
step. Whatever ends the script (the stop, its own end, ``sys.exit``, an
exception, a timeout, Ctrl-C), the run yields a :class:`Profile` of what was
measured, with a status that says how it ended.

Step ``k`` lasts from the end of step ``k-1`` to the end of step ``k``; step 1 starts
at the first sign of training (the first DataLoader fetch, module call or backward
pass). The device
is synchronised at step boundaries only, through the backend.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from torchaxe import __version__
from torchaxe.errors import TorchaxeError, first_line
from torchaxe.runtime.command import ScriptCommand, check_module, run_command
from torchaxe.runtime.profile import ErrorInfo, FlopCount, Profile, RunInfo, ShapeReport, StepRecord
from torchaxe.runtime.steps import BackwardStepProbe, OptimizerStepProbe, StepMarker

#: Exit codes of ``torchaxe profile``, by status (see docs/profile.md).
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SCRIPT_ERROR = 3
EXIT_SCRIPT_EXIT = 4
EXIT_TIMEOUT = 5
EXIT_NO_STEPS = 6
EXIT_INTERRUPTED = 130

#: Frames of the user's traceback shown when their script raises.
TRACEBACK_FRAMES = 8
#: Seconds of training (from its first sign) without a single step after which the
#: commands that watch steps stop the script (``--first-step-timeout``).
DEFAULT_FIRST_STEP_TIMEOUT = 120.0


class StopProfiling(BaseException):
    """Raised from a step boundary to end the script once enough steps are measured.

    A BaseException, so that the user's ``except Exception`` does not swallow it; a
    script that swallows it anyway gets it again at the next step boundary or
    DataLoader fetch."""


#: The phase of the step the running harness is in ("warmup", "ops", "measured"),
#: None before its first step boundary: what the loss recorder tags each loss with.
_PHASE: list[str | None] = [None]


def current_phase() -> str | None:
    """The phase of the step in progress in this process (see ``_PHASE``)."""
    return _PHASE[0]


#: The most time a script is given to stop after its --timeout before it is abandoned.
GRACE_MAX_SECONDS = 10.0


@dataclass(frozen=True)
class HarnessOptions:
    """What to measure. ``steps=None`` lets the script run to its end."""

    steps: int | None = 10
    warmup: int = 2
    ops: bool = False
    ops_steps: int = 3
    shapes: bool = False
    timeout: float | None = None
    #: After a timeout, how long the script gets to unwind before the profile is
    #: written without it (a script stuck in C code never sees the interrupt);
    #: default half the timeout (else the first-step timeout), between 1 and 10 seconds.
    grace: float | None = None
    step_marker: str | None = None
    target: str | None = "auto"
    #: Stop the script when no step has ended this many seconds after the first sign
    #: of training (None: wait for the end of the script).
    first_step_timeout: float | None = None
    #: Count one step's FLOPs (on the last warm-up step) and measure the device's
    #: peak, for model FLOPs utilisation (``runtime/flops.py``).
    flops: bool = False

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise TorchaxeError(f"--steps {self.steps}: must be at least 1 (or `all`)")
        if self.warmup < 0:
            raise TorchaxeError(f"--warmup {self.warmup}: must be 0 or more")
        if self.ops_steps < 1:
            raise TorchaxeError(f"--ops-steps {self.ops_steps}: must be at least 1")
        if self.timeout is not None and self.timeout <= 0:
            raise TorchaxeError(f"--timeout {self.timeout}: must be a positive number of seconds")
        if self.first_step_timeout is not None and self.first_step_timeout <= 0:
            raise TorchaxeError(f"--first-step-timeout {self.first_step_timeout}: must be a positive number of seconds")
        if self.step_marker is not None:
            StepMarker.parse(self.step_marker)

    @property
    def grace_seconds(self) -> float:
        if self.grace is not None:
            return self.grace
        return min(GRACE_MAX_SECONDS, max(1.0, 0.5 * (self.timeout or self.first_step_timeout or 0.0)))

    @property
    def steps_before_measuring(self) -> int:
        return self.warmup + (self.ops_steps if self.ops else 0)

    def phase(self, index: int) -> str:
        """The phase of step ``index`` (1-based): warmup, then ops, then measured."""
        if index <= self.warmup:
            return "warmup"
        if self.ops and index <= self.warmup + self.ops_steps:
            return "ops"
        return "measured"

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps if self.steps is not None else "all",
            "warmup": self.warmup,
            "ops": self.ops,
            "ops_steps": self.ops_steps if self.ops else 0,
            "shapes": self.shapes,
            "timeout": self.timeout,
            "step_marker": self.step_marker,
            "first_step_timeout": self.first_step_timeout,
            "flops": self.flops,
        }


# --------------------------------------------------------------------- recorder


class StepRecorder:
    """Cuts the run into steps and accumulates what each step spent its time on.

    The probes report into it (data wait, syncs, gc); step boundaries come from the
    step sources of ``steps.py`` (``step_end``). ``training`` is set at the first sign
    of training, ``stepped`` at the first step boundary and ``warmed`` when the first
    measured step begins (the watchdog waits on them).
    """

    def __init__(self, options: HarnessOptions, backend: Any, clock: Callable[[], float],
                 rss: Callable[[], int | None] = lambda: None) -> None:
        self.options = options
        self.backend = backend
        self.clock = clock
        self.rss = rss
        self.origin = clock()
        self.steps: list[StepRecord] = []
        self.measured = 0
        self.stop_requested = False
        self.window: Any = None  # an OpWindow when --ops
        #: The source of the last step boundary: optimizer, backward or marker.
        self.source: str | None = None
        self.training = threading.Event()
        self.stepped = threading.Event()
        self.warmed = threading.Event()
        self.flop_window: Any = None  # a FlopWindow when FLOPs are counted
        self.python_calls: Any = None  # a PythonCallCounter over the last warm-up step, with --ops
        self.on_device_ready: Callable[[], None] = lambda: None
        self.backward_calls = 0
        #: Taking turns with runs side by side (a TurnClient), when the run was started so.
        self.turns: Any = None
        #: What other processes use of the cores over the measured steps (an
        #: OtherLoadWatch, started when the first measured step begins).
        self.other_load: Any = None
        self._device_ready = False
        self._start: float | None = None
        self._reset()

    def _reset(self) -> None:
        self._backward = 0.0
        self._wait = 0.0
        self._batches = 0
        self._syncs = 0
        self._gc = 0.0
        self._gc_count = 0
        self._comm: float | None = None
        self._no_grad = 0.0
        self._no_grad_passes = 0
        self._optimizer: float | None = None

    # -- what the probes report

    def add_data_wait(self, seconds: float, batches: int) -> None:
        self._wait += seconds
        self._batches += batches

    def add_backward(self, seconds: float) -> None:
        self._backward += seconds
        self.backward_calls += 1

    def add_sync(self) -> None:
        self._syncs += 1

    def add_gc(self, seconds: float) -> None:
        self._gc += seconds
        self._gc_count += 1

    def add_comm(self, seconds: float) -> None:
        self._comm = (self._comm or 0.0) + seconds

    def add_no_grad(self, seconds: float) -> None:
        self._no_grad += seconds
        self._no_grad_passes += 1

    def add_optimizer(self, seconds: float) -> None:
        self._optimizer = (self._optimizer or 0.0) + seconds

    def measuring(self) -> bool:
        """Whether the step under way is a measured one."""
        return self._start is not None and self.options.phase(len(self.steps) + 1) == "measured"

    def measured_step(self) -> int | None:
        """The index of the measured step under way, None outside the measured steps."""
        return len(self.steps) + 1 if self.measuring() else None

    def check_stop(self) -> None:
        if self.stop_requested:
            raise StopProfiling("torchaxe: the steps asked for are measured")

    # -- boundaries

    @property
    def started(self) -> bool:
        return self._start is not None

    def _synchronized_now(self) -> float:
        backend = self.backend
        if backend.is_initialized():
            backend.synchronize()
            if not self._device_ready:
                self._device_ready = True
                backend.reset_peak_memory()
                self.on_device_ready()
        return self.clock()

    def activity(self) -> None:
        """The first sign of training (a DataLoader fetch, a module call): step 1 starts."""
        if self._start is None and not self.stop_requested:
            self.training.set()
            self._begin(self._synchronized_now(), 1)

    def _begin(self, now: float, index: int) -> None:
        _PHASE[0] = self.options.phase(index)
        if _PHASE[0] == "measured":
            self.warmed.set()
        turns = self.turns
        if index == 1 and turns is not None and self.options.steps is not None \
                and self.options.phase(1) == "measured":
            # No warm-up: the run's turn comes before its first step, as after a warm-up.
            turns.wait()
            now = self.clock()
        window = self.window
        if window is not None and not window.started and self.options.phase(index) == "ops":
            window.start()
            now = self.clock()  # the profiler's start-up is not the step's time
        flops = self.flop_window
        if flops is not None and index == flops.step:
            flops.start()
            now = self.clock()
        if window is not None and index == self.options.warmup:
            # The last warm-up step says how many Python calls the op window's tracer would
            # record (not the first: it starts at the first model call or batch, after the
            # Python work that precedes it).
            from torchaxe.runtime.opstats import PythonCallCounter

            self.python_calls = PythonCallCounter()
            self.python_calls.start()
        self._start = now
        self._reset()

    def step_end(self, source: str) -> None:
        """The end of a step, seen by ``source``: record it, and stop the script when
        enough are measured."""
        self.check_stop()
        self.source = source
        if not self.stepped.is_set():
            self.training.set()
            self.stepped.set()
            from torchaxe.runtime.first_model import release_all

            release_all()  # a model not called from the loop by the first step's end never will be
        now = self._synchronized_now()
        if self._start is None:
            self._begin(now, 1)
            return
        index = len(self.steps) + 1
        phase = self.options.phase(index)
        if self.flop_window is not None and self.flop_window.active:
            self.flop_window.stop()
        memory = None
        if self._device_ready:
            memory = self.backend.peak_memory_bytes()
            self.backend.reset_peak_memory()
        self.steps.append(StepRecord(
            index=index,
            phase=phase,
            seconds=now - self._start,
            data_wait_seconds=self._wait,
            batches=self._batches,
            backward_seconds=self._backward,
            host_syncs=self._syncs,
            gc_seconds=self._gc,
            gc_collections=self._gc_count,
            peak_device_memory_bytes=memory,
            host_rss_bytes=self.rss(),
            start_seconds=self._start - self.origin,
            comm_seconds=self._comm,
            no_grad_seconds=self._no_grad,
            no_grad_passes=self._no_grad_passes,
            optimizer_seconds=self._optimizer,
        ))
        window = self.window
        counter = self.python_calls
        if counter is not None and index == self.options.warmup:
            counter.stop()
            flops = self.flop_window
            operators = flops.operators if flops is not None and flops.step == index else None
            if counter.calls is not None or operators is not None:
                planned = window.plan(counter.calls, self.options.ops_steps, operators)
                if planned == 0:  # too many operators to record: no op window
                    self.options = dataclasses.replace(self.options, ops=False)
                elif planned != self.options.ops_steps:
                    self.options = dataclasses.replace(self.options, ops_steps=planned)
        if phase == "ops" and window is not None:
            window.steps.append(index)
        turns = self.turns
        if phase == "measured":
            self.measured += 1
            if self.options.steps is not None and self.measured >= self.options.steps:
                self.stop_requested = True
                self._start = None
                if turns is not None:
                    turns.end()
                raise StopProfiling("torchaxe: the steps asked for are measured")
        if phase == "ops" and self.options.phase(index + 1) != "ops":
            window.settle()
            now = self.clock()  # nor is its shutdown, nor reading its events back
        if phase != "measured" and self.options.phase(index + 1) == "measured" and self.other_load is None:
            from torchaxe.runtime.other_load import OtherLoadWatch

            # What other processes use of the cores while the steps are measured: one
            # sample now and one at the end, taken outside any step's time.
            self.other_load = OtherLoadWatch(interval=None).start()
            now = self.clock()
        if turns is not None and self.options.steps is not None:
            # Runs side by side take turns (runtime/turns.py): the first once warm, then
            # every few measured steps. Waiting for the turn is no step's time.
            if phase == "measured":
                turns.step_measured()
                now = self.clock()
            elif self.options.phase(index + 1) == "measured":
                turns.wait()
                now = self.clock()
        self._begin(now, index + 1)


# --------------------------------------------------------------------- watchdog


class Watchdog:
    """``--timeout`` and ``--first-step-timeout``: interrupts the script (a signal to
    the thread running it) when ``timeout`` seconds have passed since the start, or
    when ``first_step`` seconds have passed since ``recorder`` saw training start
    without a single step ending, or ``warm_up`` seconds without the warm-up ending (a
    run taking turns, given what its round left it: ``runtime/turns.py``). The timeout
    unwinds the script like Ctrl-C; the others raise :class:`StopProfiling`, which the
    script's ``except KeyboardInterrupt`` does not catch. If the script has not ended
    ``grace`` seconds later, calls ``abandon`` (the CLI writes the profile from there
    and exits). ``fired`` says which ran out: ``timeout``, ``first-step``, ``warm-up``
    or None."""

    #: How often the first-step watch looks at the recorder, in seconds.
    POLL = 0.05

    def __init__(self, timeout: float | None, grace: float, abandon: Callable[[], None] | None = None, *,
                 first_step: float | None = None, recorder: StepRecorder | None = None,
                 warm_up: float | None = None) -> None:
        self.timeout = timeout
        self.grace = grace
        self.abandon = abandon
        self.first_step = first_step if recorder is not None else None
        self.warm_up = warm_up if recorder is not None else None
        self.recorder = recorder
        self.fired: str | None = None
        self._done = threading.Event()
        self._delivered = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._target = threading.get_ident()
        self._previous: Any = None
        self._handling = False

    def start(self) -> None:
        self._target = threading.get_ident()
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._handling = True
        self._thread = threading.Thread(target=self._watch, name="torchaxe-watchdog", daemon=True)
        self._thread.start()

    def _on_sigint(self, signum, frame) -> None:
        self._delivered.set()
        if not self._done.is_set():
            if self.fired == "first-step":
                raise StopProfiling("torchaxe: no step was seen within --first-step-timeout")
            if self.fired == "warm-up":
                raise StopProfiling("torchaxe: the warm-up did not end in the time its round left it")
            raise KeyboardInterrupt

    def _expired(self) -> str | None:
        """Wait until a limit runs out (its name) or the run ends (None)."""
        start = time.monotonic()
        began: float | None = None
        recorder = self.recorder
        while True:
            now = time.monotonic()
            if self.timeout is not None and now - start >= self.timeout:
                return "timeout"
            wait = None if self.timeout is None else start + self.timeout - now
            if recorder is not None and began is None and recorder.training.is_set():
                began = now
            if self.first_step is not None and recorder is not None and not recorder.stepped.is_set():
                if began is not None and now - began >= self.first_step:
                    return "first-step"
                wait = self.POLL if wait is None else min(wait, self.POLL)
            if self.warm_up is not None and recorder is not None and not recorder.warmed.is_set():
                if began is not None and now - began >= self.warm_up:
                    return "warm-up"
                wait = self.POLL if wait is None else min(wait, self.POLL)
            if self._done.wait(wait):
                return None

    def _watch(self) -> None:
        reason = self._expired()
        if reason is None:
            return
        with self._lock:
            if self._done.is_set():
                return
            self.fired = reason
            if reason in ("first-step", "warm-up") and self.recorder is not None:
                self.recorder.stop_requested = True  # also raised at the next DataLoader fetch or backward pass
            if self._handling and hasattr(signal, "pthread_kill"):
                signal.pthread_kill(self._target, signal.SIGINT)
            elif self._handling:  # pragma: no cover - no POSIX thread signals (Windows)
                import _thread

                _thread.interrupt_main()
            # Off the main thread there is no way to interrupt the script: it is
            # left to finish (status timeout) or to be abandoned after the grace.
        if self._done.wait(self.grace):
            return
        if self.abandon is not None:
            self.abandon()

    def finish(self) -> None:
        """The run is over: stop watching, and absorb an interrupt that was sent but
        has not been delivered yet."""
        with self._lock:
            self._done.set()
        if self.fired and self._handling:
            self._delivered.wait(1.0)
        if self._handling:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._handling = False


# ----------------------------------------------------------------------- harness


def _exit_code_of(exc: SystemExit) -> tuple[int, str | None]:
    code = exc.code
    if code is None:
        return 0, None
    if isinstance(code, bool) or not isinstance(code, int):
        return 1, str(code)
    return code, None


#: torchaxe's code that changes the user's computation while a knob is installed
#: (wrappers around torch functions, fused kernels, replaced modules, compiled
#: callers, patched loaders), relative to the package: an error raised through it is
#: reported with its frame. The harness's probes only watch, and are left out.
CHANGE_CODE = ("runtime/knob_specs.py", "runtime/compile_module.py", "runtime/loader_patch.py",
               "runtime/instance_forward.py", "kernels/", "memory/", "precision/", "tune/", "shapes/bucketing.py",
               "shapes/knob.py", "data/knob.py", "data/prefetch.py", "distributed/knob.py")


#: Functions in the change code that only observe (``(file, function)``): an error
#: raised through them passed no change of torchaxe's.
OBSERVING_FRAMES = (("runtime/knob_specs.py", "loss_recording_backward"),)


def _torchaxe_file(filename: str) -> bool:
    torchaxe_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return filename.startswith(torchaxe_dir + os.sep)


def _change_file(filename: str, function: str | None = None) -> bool:
    torchaxe_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not filename.startswith(torchaxe_dir + os.sep):
        return False
    inside = filename[len(torchaxe_dir) + 1:].replace(os.sep, "/")
    if (inside, function) in OBSERVING_FRAMES:
        return False
    return any(inside == c or (c.endswith("/") and inside.startswith(c)) for c in CHANGE_CODE)


def _harness_file(filename: str) -> bool:
    import runpy

    return _torchaxe_file(filename) or filename == runpy.__file__ or filename.startswith("<frozen runpy")


def error_info(exc: BaseException, codes: Any) -> ErrorInfo:
    """The user's exception with their traceback (torchaxe's and runpy's frames left
    out, the last few frames only). torchaxe's frames below the user's last one stay:
    there the error passed through a change torchaxe made (a knob's wrapper around a
    torch function), which the user must see to tell its failure from their own."""
    every = traceback.extract_tb(exc.__traceback__)
    user_at = max((i for i, f in enumerate(every) if not _harness_file(f.filename)
                   and codes.kind(f.filename) == "user"), default=-1)
    frames = [f for i, f in enumerate(every) if not _harness_file(f.filename)
              or (user_at >= 0 and i > user_at and _change_file(f.filename, f.name))]
    user = [f for f in frames if not _torchaxe_file(f.filename) and codes.kind(f.filename) == "user"]
    where = user[-1] if user else (frames[-1] if frames else None)
    ours = [f for f in frames if _torchaxe_file(f.filename)]
    through = None
    if ours:
        torchaxe_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        through = f"{ours[-1].name} ({os.path.relpath(ours[-1].filename, torchaxe_dir)}:{ours[-1].lineno})"
    shown = frames[-TRACEBACK_FRAMES:]
    lines = ["Traceback (most recent call last):\n"]
    if len(frames) > len(shown):
        lines.append(f"  ... {len(frames) - len(shown)} earlier frame(s)\n")
    lines += traceback.format_list(shown)
    lines += traceback.format_exception_only(type(exc), exc)
    return ErrorInfo(
        type=type(exc).__qualname__ if type(exc).__module__ in ("builtins", "__main__") else f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        file=codes.show(where.filename) if where else None,
        line=where.lineno if where else None,
        traceback="".join(lines),
        through=through,
    )


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def distributed_identity() -> tuple[int | None, int | None, int | None]:
    """(rank, local rank, world size): from torch.distributed when a process group
    is up, else from the variables torchrun sets."""
    rank, local, world = _int_env("RANK"), _int_env("LOCAL_RANK"), _int_env("WORLD_SIZE")
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # a half-torn-down group: keep what the environment says
        pass
    return rank, local, world


def _collect_stopped_loaders() -> None:
    """Collect the stopped script's garbage, its DataLoader iterators shutting their
    workers down at once. torch joins each worker with a 5 s timeout, and a worker of
    a loop stopped mid-way can wait that long for its last signal: seconds added to
    every stopped run, for each worker (and all of them when ``advise`` measures)."""
    dataloader = sys.modules.get("torch.utils.data.dataloader")
    owner = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    if owner is None:
        gc.collect()
        return
    original = owner._shutdown_workers
    signals = dataloader._utils.signal_handling  # type: ignore[union-attr]

    def at_once(self: Any) -> None:
        if not getattr(self, "_shutdown", True):
            if getattr(self, "_worker_pids_set", False):
                # Its SIGCHLD check would take the workers' end for a crash.
                signals._remove_worker_pids(id(self))
                self._worker_pids_set = False
            for worker in getattr(self, "_workers", ()):
                if worker.is_alive():
                    worker.terminate()
        original(self)

    owner._shutdown_workers = at_once
    try:
        gc.collect()
    finally:
        owner._shutdown_workers = original


def _close_process_group() -> None:
    """The script was stopped before it could tear down its process group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def no_step_hint(backwards: int) -> str:
    """Why no step was seen, and what the user can do, in one line."""
    if backwards:
        seen = (f"no torch.optim optimizer stepped, and the gradients of the {backwards} backward "
                f"pass{'es' if backwards != 1 else ''} were never cleared between them (zero_grad() or p.grad = None "
                "after an update)")
    else:
        seen = "no torch.optim optimizer stepped and no backward pass ran"
    return (f"no step was seen: {seen}; if one call of a function of yours is one training step, pass "
            "--step-marker MODULE:FUNCTION naming it")


def flop_count(window: Any, backend: Any, warmup: int) -> FlopCount:
    """The counted FLOPs, the device's name and its two peaks for the run's dtype."""
    from torchaxe.backends.peaks import table_peak
    from torchaxe.runtime.flops import float32_uses_tf32, measure_peak

    if window is None:
        return FlopCount(note="FLOPs are counted on the last warm-up step, and this run has none (--warmup 0)")
    if window.flops is None:
        note = window.error or f"FLOPs are counted on step {window.step}, which did not end"
        return FlopCount(note=note)
    dtype = window.dtype or "float32"
    name = None
    try:
        name = backend.device_name() if backend.is_initialized() else None
    except Exception:  # a runtime that cannot name its device: the table peak is unknown
        name = None
    tf32 = dtype == "float32" and float32_uses_tf32(backend.name)
    peak = table_peak(name, dtype, tf32)
    measured = measure_peak(backend.name, dtype, backend.synchronize) if window.flops else None
    notes = []
    if peak is None:
        notes.append(f"no published peak for {name or 'this device'} in {dtype}: only the measured peak applies")
    if not window.flops:
        notes.append("the counted step ran no operation with a FLOP formula (matrix products, convolutions, "
                     "attention)")
    if window.evaluation_flops:
        notes.append(f"{window.evaluation_flops / 1e9:.3g} GFLOP of step {window.step} ran with gradients off outside "
                     "the backward pass (an evaluation or generation pass) and are not counted as the step's")
    return FlopCount(
        flops_per_step=window.flops,
        counted_step=window.step,
        dtype=dtype,
        device_name=name,
        peak_flops_per_second_table=peak.flops_per_second if peak else None,
        peak_table_source=peak.source if peak else None,
        peak_flops_per_second_measured=measured,
        activation_bytes=window.activation_bytes,
        note="; ".join(notes) or None,
    )


def exit_code_for(profile: Profile) -> int:
    """What ``torchaxe profile`` exits with for a profile (docs/profile.md)."""
    status = profile.status
    if status == "error":
        return EXIT_SCRIPT_ERROR
    if status == "timeout":
        return EXIT_TIMEOUT
    if status == "interrupted":
        return EXIT_INTERRUPTED
    if status == "exited" and profile.exit_code:
        return EXIT_SCRIPT_EXIT
    if not profile.steps:
        return EXIT_NO_STEPS
    return EXIT_OK


class Harness:
    """Runs one command under the probes and returns its Profile.

    ``backend`` and ``clock`` are injectable (tests use a fake clock); ``abandon``
    receives the profile when a timed-out script ignores the interrupt. ``probes``
    are extra probes for other analyses (the data axis): each is called with the
    step recorder and returns an object with ``install()``/``uninstall()``, installed
    after the harness's own probes and removed before them.
    """

    def __init__(self, options: HarnessOptions | None = None, *, backend: Any = None,
                 clock: Callable[[], float] = time.perf_counter,
                 abandon: Callable[[Profile], None] | None = None,
                 probes: Sequence[Callable[[StepRecorder], Any]] = ()) -> None:
        self.options = options or HarnessOptions()
        self.backend = backend
        self.clock = clock
        self.abandon = abandon
        self.extra_probes = tuple(probes)

    def run(self, command: ScriptCommand) -> Profile:
        from torchaxe.backends import get_backend
        from torchaxe.runtime.probes import (
            BackwardProbe, ChildProcessProbe, CodeMap, DataWaitProbe, FirstForwardProbe, GcProbe, HostMemory,
            HostSyncProbe, ModuleShapeProbe, NoGradPassProbe, ShapeTallier,
        )

        options = self.options
        check_module(command)
        import torch

        backend = self.backend or get_backend(options.target)
        codes = CodeMap()
        memory = HostMemory()
        clock = self.clock
        recorder = StepRecorder(options, backend, clock, memory.rss_bytes)
        from torchaxe.runtime.turns import TurnClient

        recorder.turns = TurnClient.from_environment()
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")

        syncs = HostSyncProbe(recorder, codes, count_host_tensors=backend.name == "cpu")
        recorder.on_device_ready = lambda: syncs.watch_sync_warnings(backend.enable_sync_warnings)
        batch_shapes = ShapeTallier(torch.Tensor) if options.shapes else None
        module_shapes = ModuleShapeProbe(recorder.steps) if options.shapes else None
        if options.ops:
            from torchaxe.runtime.opstats import OpWindow

            recorder.window = OpWindow(backend.profiler_activities(), record_shapes=options.shapes)
        if options.flops:
            from torchaxe.runtime.flops import FlopWindow

            recorder.flop_window = FlopWindow(options.warmup) if options.warmup >= 1 else None
        marker = StepMarker.parse(options.step_marker) if options.step_marker else None
        # Step sources: the marker alone when given; else the optimizer, with the
        # backward pass as the fallback (wrapped outside BackwardProbe's timing).
        optimizer_steps = None if marker else OptimizerStepProbe(recorder, recorder.clock)
        backward_steps = None if marker else BackwardStepProbe(recorder)
        from torchaxe.runtime.comm import CommProbe

        comm = CommProbe(recorder, clock, recorder.measured_step)
        data_wait = DataWaitProbe(recorder, clock, batch_shapes)
        children = ChildProcessProbe()
        probes: list[Any] = [data_wait, BackwardProbe(recorder, clock), syncs,
                             GcProbe(recorder, clock), FirstForwardProbe(recorder), comm, children,
                             NoGradPassProbe(recorder, clock)]
        if module_shapes is not None:
            probes.append(module_shapes)
        if optimizer_steps is not None and backward_steps is not None:
            probes += [optimizer_steps, backward_steps]
        probes.extend(make(recorder) for make in self.extra_probes)

        state: dict[str, Any] = {"status": "completed", "error": None, "exit_code": None, "message": None,
                                 "children": children.started}

        def snapshot(final: bool) -> Profile:
            if final:
                data_wait.settle_batches()
            return self._profile(command, backend, recorder, codes, memory, syncs, module_shapes, batch_shapes,
                                 marker, backward_steps, state, started_at, final, comm)

        watchdog = None
        warm_up = getattr(recorder.turns, "warm_limit", None)
        if options.timeout is not None or options.first_step_timeout is not None or warm_up is not None:
            abandon = None
            if self.abandon is not None:
                def abandon() -> None:
                    limit = {"timeout": "timeout", "warm-up": "warm-up limit"}.get(watchdog.fired,
                                                                                  "first-step timeout")
                    state["status"] = "timeout" if watchdog.fired == "timeout" else "stopped"
                    state["message"] = f"did not stop within {options.grace_seconds:g} s of the {limit}"
                    self.abandon(snapshot(final=False))
            watchdog = Watchdog(options.timeout, options.grace_seconds, abandon,
                                first_step=options.first_step_timeout, recorder=recorder, warm_up=warm_up)

        installed: list[Any] = []
        try:
            for probe in probes:
                probe.install()
                installed.append(probe)
            if marker is not None:
                marker.install(recorder, command)
                installed.append(marker)
            if watchdog is not None:
                watchdog.start()
            try:
                run_command(command)
            except StopProfiling:
                state["status"] = "stopped"
            except SystemExit as exc:
                state["status"] = "exited"
                state["exit_code"], state["message"] = _exit_code_of(exc)
            except KeyboardInterrupt:
                state["status"] = "interrupted"
            except BaseException as exc:  # the user's bug, reported in the profile
                state["status"] = "error"
                state["error"] = error_info(exc, codes)
            finally:
                if watchdog is not None:
                    watchdog.finish()
        finally:
            if recorder.flop_window is not None:
                recorder.flop_window.stop()  # the script ended inside the counted step
            if recorder.python_calls is not None:
                recorder.python_calls.stop()
            for probe in reversed(installed):
                probe.uninstall()
        if options.flops:
            state["flops"] = flop_count(recorder.flop_window, backend, options.warmup)
        if watchdog is not None and watchdog.fired == "first-step":
            state["first_step_timeout"] = True
        if watchdog is not None and watchdog.fired == "warm-up":
            state["warm_up_limit"] = warm_up
        if watchdog is not None and watchdog.fired == "timeout" and state["status"] != "stopped":
            state["status"] = "timeout"
        elif recorder.stop_requested and state["status"] not in ("stopped", "interrupted"):
            # The script caught the stop and ended some other way.
            state["caught_stop"] = True
            if state["status"] == "error":
                state["swallowed"] = state["error"]
                state["error"] = None
            state["status"] = "stopped"
            state["exit_code"] = None
        profile = snapshot(final=True)
        if profile.status != "completed":
            if profile.status != "exited":
                _close_process_group()
            _collect_stopped_loaders()
        memory.close()
        return profile

    def _profile(self, command, backend, recorder, codes, memory, syncs, module_shapes, batch_shapes, marker,
                 backward_steps, state, started_at, final, comm) -> Profile:
        options = recorder.options  # the op window may have been cut down
        import torch

        ops, ops_steps, ops_failure = [], [], None
        if final and recorder.window is not None:
            from torchaxe.runtime.opstats import NO_OP_TABLE, OpTableError

            try:
                ops = recorder.window.table(codes)
                ops_steps = list(recorder.window.steps)
            except OpTableError as exc:
                ops_failure = f"{NO_OP_TABLE}{exc}"
        shapes = None
        if final and (module_shapes is not None or batch_shapes is not None):
            shapes = ShapeReport(
                modules=module_shapes.tallies() if module_shapes is not None else [],
                batches=batch_shapes.tally("DataLoader", "batch") if batch_shapes is not None and batch_shapes.calls else None,
            )
        rank, local_rank, world = distributed_identity()
        steps = list(recorder.steps)
        status = state["status"]
        warnings = self._warnings(steps, status, marker, backward_steps, recorder, state)
        if ops_failure:
            warnings.append(ops_failure)
        if recorder.window is not None and recorder.window.note:
            warnings.append(recorder.window.note)
        profile = Profile(
            status=status,
            run=RunInfo(
                command=list(command.typed) or [command.target, *command.args],
                target=backend.name,
                source="harness",
                started_at=started_at,
                torchaxe_version=__version__,
                torch_version=torch.__version__,
                python_version=platform.python_version(),
                hostname=socket.gethostname(),
                pid=os.getpid(),
                rank=rank,
                local_rank=local_rank,
                world_size=world,
                options=options.to_dict(),
            ),
            steps=steps,
            host_syncs=syncs.sites(),
            ops=ops,
            ops_steps=ops_steps,
            shapes=shapes,
            error=state["error"],
            exit_code=state["exit_code"],
            warnings=warnings,
            seconds=self.clock() - recorder.origin,
            host_rss_peak_bytes=memory.peak_rss_bytes(),
            step_source=recorder.source if steps else None,
            flops=state.get("flops"),
            distributed=comm.info([s.index for s in steps if s.phase == "measured"],
                                  [s.comm_seconds for s in steps if s.phase == "measured"]),
        )
        profile.detail = self._detail(profile, command, state)
        mfu = profile.summary.mfu_measured if profile.flops is not None else None
        if mfu is not None and mfu > 1.0:
            profile.warnings.append(
                f"the FLOPs counted on step {profile.flops.counted_step} make {100 * mfu:.0f}% of the measured peak at "
                "the median step time: that step held work a typical step does not, or the counter counted work "
                "the step did not do (an operator whose FLOP formula reads only shapes); the MFU figures are not "
                "reliable")
        return profile

    def _detail(self, profile: Profile, command: ScriptCommand, state: dict) -> str:
        n = len(profile.measured_steps)
        steps = f"{n} measured step{'s' if n != 1 else ''}"
        status = profile.status
        if status == "completed":
            return f"the script ran to its end; {steps}"
        if status == "stopped" and state.get("first_step_timeout") and not profile.steps:
            extra = f" ({state['message']})" if state.get("message") else ""
            return (f"stopped: no step within {self.options.first_step_timeout:g} s of the start of training "
                    f"(--first-step-timeout){extra}")
        if status == "stopped" and state.get("warm_up_limit") and not profile.measured_steps:
            extra = f" ({state['message']})" if state.get("message") else ""
            return (f"stopped: not warm within {state['warm_up_limit']:.3g} s of the start of training (what its "
                    f"round of runs taking turns left it){extra}")
        if status == "stopped":
            return f"stopped after {steps}" + (" (the script caught the stop and went on)" if state.get("caught_stop") else "")
        if status == "exited":
            extra = f": {state['message']}" if state.get("message") else ""
            return f"the script called sys.exit({profile.exit_code}){extra}; {steps}"
        if status == "error" and profile.error is not None:
            where = f" at {profile.error.location}" if profile.error.location else ""
            if profile.error.through:
                where += f", through torchaxe's {profile.error.through} (a change under trial)"
            return f"the script raised {profile.error.type}{where}: {first_line(profile.error.message)}; {steps}"
        if status == "timeout":
            extra = f" ({state['message']})" if state.get("message") else ""
            return f"stopped by --timeout {self.options.timeout:g} s{extra}; {steps}"
        return f"interrupted (Ctrl-C); {steps}"

    def _warnings(self, steps: list[StepRecord], status: str, marker: StepMarker | None,
                  backward_steps: BackwardStepProbe | None, recorder: StepRecorder, state: dict) -> list[str]:
        options = recorder.options
        out = []
        if not steps:
            if marker is not None:
                out.append(f"no step was seen: --step-marker {marker.module}:{marker.qualname} "
                           f"{'was never called' if not marker.calls else 'returned only once'}")
            elif recorder.stepped.is_set():
                out.append(f"no step was seen: the script ended at its first step boundary ({recorder.source}); "
                           "a step lasts from one boundary to the next")
            elif status in ("error", "exited") and not (backward_steps is not None and backward_steps.backwards):
                # The script stopped before it trained (a usage error, a failed import): no
                # --step-marker would have helped.
                out.append(f"no step was seen: the script {'raised' if status == 'error' else 'exited'} "
                           "before any backward pass (see above)")
            elif state.get("children") and not (backward_steps is not None and backward_steps.backwards):
                # Hogwild, mp.spawn: the training ran in processes the harness does not watch.
                names = sorted(set(state["children"]))
                out.append(f"no step was seen in this process: the script started {len(state['children'])} "
                           f"process(es) ({', '.join(names[:3])}) and trained in them, which torchaxe does not "
                           "watch; run the training in the main process, or one process per rank with torchrun")
            elif backward_steps is not None and (backward_steps.backwards or not state.get("first_step_timeout")):
                # Stopped by the timeout before any backward pass counted (a first step still under
                # way, an LBFGS step's closures): "no backward pass ran" would mislead.
                out.append(no_step_hint(backward_steps.backwards))
            if state.get("first_step_timeout"):
                out.append(f"if the first step takes longer than {options.first_step_timeout:g} s (a long compilation, "
                           "many accumulated micro-batches), give a larger --first-step-timeout (0: no limit)")
        measured = sum(1 for s in steps if s.phase == "measured")
        wanted = options.steps
        if status == "completed" and wanted is not None and measured < wanted:
            out.append(f"the script ended after {len(steps)} steps: {measured} measured of the {wanted} asked for "
                       f"(after {options.steps_before_measuring} warmup/op-profiling steps)")
        if steps and not measured:
            out.append("no measured steps: every step was warmup or op profiling, so the summary is empty; "
                       "lower --warmup or raise the script's step count")
        elif 0 < measured < 5:
            out.append(f"only {measured} measured step{'s' if measured != 1 else ''}: the median is rough")
        from torchaxe.runtime.stats import Samples

        times = Samples.of(s.seconds for s in steps if s.phase == "measured")
        if times.is_noisy():
            out.append(f"step time varies: interquartile range {100 * (times.relative_spread or 0):.0f}% of the median")
        from torchaxe import cpulist
        from torchaxe.runtime import load as machine

        watch = recorder.other_load
        others = watch.stop() if watch is not None and measured else None
        if others is not None and others.busy:
            out.append(f"other processes kept {others.cores:.1f} of the {others.usable} usable cores busy while "
                       f"the steps were measured (busiest: {others.describe()}): steps on shared cores are "
                       "slower and noisier, by far more than the share taken; profile again on an idle machine "
                       "to confirm the figures")
            return self._swallowed(out, state)
        # The watch samples the processes at the start and the end of the measured steps
        # only: processes that came and went between (a test run's workers) show in the
        # load average.
        load, cores = machine.load_average(), cpulist.usable_cpus()
        if measured and load is not None and machine.busy(load, cores):
            out.append(f"the machine was busy ({machine.busy_text(load, cores)} at the end): other "
                       "processes slow steps unevenly; profile again when it is quieter to confirm the figures")
        return self._swallowed(out, state)

    @staticmethod
    def _swallowed(out: list[str], state: dict) -> list[str]:
        if state.get("swallowed") is not None:
            err = state["swallowed"]
            out.append(f"after the stop the script raised {err.type}: {first_line(err.message)}")
        return out
