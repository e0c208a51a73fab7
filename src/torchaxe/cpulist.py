"""CPU list strings as the kernel writes them (``0-3,8,10-11``), read and written;
the number of CPUs this process may use."""

from __future__ import annotations

import os
from typing import Any, Iterable

from torchaxe.errors import TorchaxeError


def parse_cpulist(text: str, what: str = "CPU list") -> tuple[int, ...]:
    """``"0-3,8"`` -> ``(0, 1, 2, 3, 8)``, sorted and without repeats. An empty string
    is the empty set (an offline node's ``cpulist``). Stride ranges (``0-7:2``,
    accepted by cgroup files) are understood too."""
    cpus: set[int] = set()
    for part in text.strip().replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        stride = 1
        if ":" in part:
            part, _, step = part.partition(":")
            stride = _int(step, text, what)
            if stride < 1:
                raise TorchaxeError(f"{what} {text.strip()!r}: a stride must be at least 1")
        if "-" in part:
            low_text, _, high_text = part.partition("-")
            low, high = _int(low_text, text, what), _int(high_text, text, what)
            if high < low:
                raise TorchaxeError(f"{what} {text.strip()!r}: range {low}-{high} runs backwards")
            cpus.update(range(low, high + 1, stride))
        else:
            cpus.add(_int(part, text, what))
    return tuple(sorted(cpus))


def _int(token: str, text: str, what: str) -> int:
    token = token.strip()
    if not token.isdigit():
        raise TorchaxeError(f"{what} {text.strip()!r}: {token!r} is not a CPU number (expected e.g. 0-3,8)")
    return int(token)


def format_cpulist(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (empty -> ``""``)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = None
    for cpu in ordered:
        if start is None:
            start = prev = cpu
        elif cpu == prev + 1:
            prev = cpu
        else:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = cpu
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def usable_cpus() -> int:
    """How many CPUs this process may run on: its affinity mask (a container's or
    ``taskset``'s limit), else the machine's count; at least 1."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return os.cpu_count() or 1


def local_ranks(environ: Any = None) -> int:
    """How many processes torchrun (or another launcher setting ``LOCAL_WORLD_SIZE``)
    runs on this node; 1 without one, or for a value that is not a number."""
    environ = os.environ if environ is None else environ
    try:
        return max(1, int(environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        return 1


def cores_per_rank(cpus: int, environ: Any = None) -> int:
    """This rank's share of ``cpus``, which the node's local ranks share alike; at least 1."""
    return max(1, cpus // local_ranks(environ))
