"""Durations written for people, the same way in every report and command."""

from __future__ import annotations

import math


def duration(seconds: float | None, digits: int | None = None, *, missing: str = "n/a",
             in_seconds: bool = True) -> str:
    """A duration given in seconds, as text.

    With ``digits``, always milliseconds with that many decimals (``12.35 ms``), for
    columns that are compared with each other. Without, the precision follows the
    size: ``3.45 ms``, ``123.4 ms``, then ``1.23 s`` and ``12.3 s`` (or milliseconds
    all the way when not ``in_seconds``). ``None`` and NaN are written as ``missing``."""
    if seconds is None or math.isnan(seconds):
        return missing
    if digits is not None:
        return f"{seconds * 1e3:.{digits}f} ms"
    if in_seconds and seconds >= 10:
        return f"{seconds:.1f} s"
    if in_seconds and seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 0.01:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e3:.2f} ms"
