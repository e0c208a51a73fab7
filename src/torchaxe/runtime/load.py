"""How busy the machine is: the 1-minute load average against the cores this process
may use. Runs on a busy machine are slowed unevenly by other processes; profile and
advise say so beside their figures."""

from __future__ import annotations

import os

#: Load per usable core above which the machine counts as busy: the measured run
#: itself loads about one core's worth per core; half again as much is someone else's.
BUSY_LOAD = 1.5


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def usable_cores() -> int | None:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def busy(load: float | None, cores: int | None) -> bool:
    """Whether ``load`` on ``cores`` says other processes kept the machine busy."""
    return load is not None and bool(cores) and load > BUSY_LOAD * cores
