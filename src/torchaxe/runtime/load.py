"""How busy the machine is: the 1-minute load average against the cores this process
may use. Runs on a busy machine are slowed unevenly by other processes; profile and
advise say so beside their figures."""

from __future__ import annotations

import os

from torchaxe.units import plural

#: Load per usable core above which the machine counts as busy: the measured run
#: itself loads about one core's worth per core; half again as much is someone else's.
BUSY_LOAD = 1.5


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy(load: float | None, cores: int | None) -> bool:
    """Whether ``load`` on ``cores`` says other processes kept the machine busy."""
    return load is not None and bool(cores) and load > BUSY_LOAD * cores


def busy_text(load: float, cores: int) -> str:
    """``1-minute load 3.1 on 2 cores``, as the busy notes say it."""
    return f"1-minute load {load:.1f} on {plural(cores, 'core')}"
