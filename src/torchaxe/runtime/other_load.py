"""How busy other processes kept the machine while a run was measured.

A run measured beside another busy process is slower and noisier than the same run
on an idle machine, by far more than its share of the cores suggests: torch's
OpenMP kernels wait at every barrier for a thread the scheduler has parked (on two
cores shared with one busy process, a small LayerNorm took 6 ms instead of 0.02).
Figures taken then mislead the budget and the comparison alike, and nothing in the
step times says why. :class:`OtherLoadWatch` samples, every ``interval`` seconds,
the CPU time of every process that is neither this one nor started by it (the runs
it measures, their ranks and DataLoader workers), and gives the average number of
cores they kept busy over the watch, with the busiest of them named.

Processes that end between two samples lose their last interval (the figure errs
low, never high); processes started during the watch count from their start.
Where the run may use only some of the machine's cores, load that fits on the
others is not counted against it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

#: Seconds between samples: a few milliseconds each (75 processes: 4 ms), so a
#: sample a second costs well under 1% of a core.
SAMPLE_INTERVAL = 1.0
#: A run counts as measured on a busy machine when others kept this many of its
#: cores busy on average, and at least :data:`BUSY_MIN_SHARE` of them.
BUSY_MIN_CORES = 0.5
BUSY_MIN_SHARE = 0.1

#: One sample: pid -> (name, CPU seconds so far, start time).
Snapshot = Mapping[int, tuple[str, float, float]]


@dataclass(frozen=True)
class OtherLoad:
    """What other processes used over a watch: ``cores`` busy on average (of the
    ``usable`` cores the run may use), over ``seconds``; ``busiest``, the top users
    as (name, pid, cores)."""

    cores: float
    usable: int
    seconds: float
    busiest: tuple[tuple[str, int, float], ...] = ()

    @property
    def busy(self) -> bool:
        """Whether the run shared its cores enough for its times to mislead."""
        return self.cores >= max(BUSY_MIN_CORES, BUSY_MIN_SHARE * self.usable)

    def describe(self) -> str:
        """``python (pid 123)``: the busiest other process, for a note."""
        if not self.busiest:
            return "processes that ended before they could be named"
        name, pid, _ = self.busiest[0]
        return f"{name} (pid {pid})"

    def to_dict(self) -> dict[str, Any]:
        return {"cores": round(self.cores, 3), "usable": self.usable, "seconds": round(self.seconds, 3),
                "busiest": [{"name": n, "pid": p, "cores": round(c, 3)} for n, p, c in self.busiest]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OtherLoad":
        return cls(float(data["cores"]), int(data["usable"]), float(data["seconds"]),
                   tuple((str(b["name"]), int(b["pid"]), float(b["cores"])) for b in data.get("busiest") or ()))


def all_processes() -> dict[int, tuple[str, float, float]]:
    """Every process this user can read: its name, CPU seconds (user + system) and
    start time."""
    import psutil

    out: dict[int, tuple[str, float, float]] = {}
    for proc in psutil.process_iter(["name", "cpu_times", "create_time"]):
        info = proc.info
        times = info.get("cpu_times")
        if times is None:
            continue
        out[proc.pid] = (info.get("name") or "?", times.user + times.system, info.get("create_time") or 0.0)
    return out


def own_family(environ: Mapping[str, str] | None = None) -> set[int]:
    """This process and every process below it; for a rank that torchrun started
    (``TORCHELASTIC_RUN_ID`` in its environment), the launcher and everything below it:
    the job's other ranks and their loader workers are the job, not other load."""
    import psutil

    environ = os.environ if environ is None else environ
    try:
        root = psutil.Process(os.getpid())
        if environ.get("TORCHELASTIC_RUN_ID") and root.parent() is not None:
            root = root.parent()
        return {root.pid, *(child.pid for child in root.children(recursive=True))}
    except psutil.Error:
        return {os.getpid()}


def machine_cores() -> int:
    return os.cpu_count() or 1


class OtherLoadWatch:
    """Samples other processes' CPU time from :meth:`start` to :meth:`stop`, in a
    thread of its own. ``snapshot``, ``family``, ``clock``, ``cores`` and ``usable``
    stand in for the machine in tests (``clock`` in the same epoch as the start
    times ``snapshot`` gives)."""

    def __init__(self, interval: float | None = SAMPLE_INTERVAL, *,
                 snapshot: Callable[[], Snapshot] | None = None, family: Callable[[], set[int]] | None = None,
                 clock: Callable[[], float] = time.time, cores: int | None = None,
                 usable: int | None = None) -> None:
        from torchaxe.cpulist import usable_cpus

        self.interval = interval
        self.snapshot = snapshot if snapshot is not None else all_processes
        self.family = family if family is not None else own_family
        self.clock = clock
        self.cores = cores if cores is not None else machine_cores()
        self.usable = usable if usable is not None else usable_cpus()
        self._used: dict[int, float] = {}  # pid -> CPU seconds counted so far
        self._names: dict[int, str] = {}
        self._last: Snapshot = {}
        self._last_time = 0.0
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def sample(self) -> None:
        """Take one sample and add what other processes used since the last one."""
        try:
            now_snapshot = self.snapshot()
            mine = self.family()
        except Exception:  # noqa: BLE001 - a watch that cannot read the machine says nothing
            self._failed = True
            return
        now = self.clock()
        for pid, (name, cpu, created) in now_snapshot.items():
            if pid in mine:
                continue
            before = self._last.get(pid)
            if before is not None and abs(before[2] - created) < 1.0:
                used = cpu - before[1]
            elif created >= self._last_time:
                used = cpu  # started since the last sample: all of it falls in the watch
            else:
                continue  # first seen now, but older than the last sample: a pid read late
            if used > 0:
                self._used[pid] = self._used.get(pid, 0.0) + used
                self._names[pid] = name
        self._last, self._last_time = now_snapshot, now

    def start(self) -> "OtherLoadWatch":
        """Take the first sample and, with an ``interval``, sample in a thread until
        :meth:`stop` (without one, :meth:`stop` takes the only other sample: no thread
        in the measured process, and processes that start and end between the two are
        not seen)."""
        self._last_time = self.clock()
        self.sample()
        self._used.clear()  # the first sample only sets where counting starts
        self._started = self._last_time
        if self.interval is None:
            return self
        interval = self.interval

        def loop() -> None:
            while not self._stop.wait(interval):
                self.sample()

        self._thread = threading.Thread(target=loop, name="torchaxe-other-load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> OtherLoad | None:
        """End the watch: what others used over it, or None when the machine could not
        be read or the watch was too short to say."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        seconds = self.clock() - self._started
        if self._failed or seconds <= 0:
            return None
        total = sum(self._used.values()) / seconds
        # Load that the cores the run may not use can hold does not touch it.
        outside = max(self.cores - self.usable, 0)
        cores = max(total - outside, 0.0)
        ranked = sorted(self._used.items(), key=lambda item: -item[1])[:3]
        busiest = tuple((self._names[pid], pid, used / seconds) for pid, used in ranked)
        return OtherLoad(cores=cores, usable=self.usable, seconds=seconds, busiest=busiest)


def busy_note(loads: list[OtherLoad | None], what: str = "run") -> str | None:
    """One line for a report when other processes kept the cores busy during some of
    the runs measured (None when they did not, or nothing was watched)."""
    watched = [load for load in loads if load is not None]
    busy = [load for load in watched if load.busy]
    if not busy:
        return None
    worst = max(busy, key=lambda load: load.cores)
    return (f"other processes kept {worst.cores:.1f} of the {worst.usable} usable cores busy during "
            f"{len(busy)} of the {len(watched)} {what}s measured (busiest: {worst.describe()}): step times on "
            "shared cores are slower and noisier, by far more than the share taken (threads wait for one "
            "another); measure again on an idle machine, or with the run's cores kept for it, for figures "
            "to rely on")
