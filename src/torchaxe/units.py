"""Durations, rates and sizes written for people, the same way in every report and command."""

from __future__ import annotations

import math
import os
from typing import Sequence


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


def flop_rate(flops_per_second: float | None, *, missing: str = "n/a") -> str:
    """FLOP/s as text with a decimal prefix: ``85.3 GFLOP/s``, ``412 TFLOP/s``."""
    return _decimal(flops_per_second, "FLOP/s", missing)


def flop_count(flops: float | None, *, missing: str = "n/a") -> str:
    """A number of floating-point operations: ``3.42 GFLOP``."""
    return _decimal(flops, "FLOP", missing)


def _decimal(value: float | None, unit: str, missing: str) -> str:
    if value is None or math.isnan(value):
        return missing
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            scaled = value / size
            return f"{scaled:.3g} {prefix}{unit}" if scaled < 100 else f"{scaled:.0f} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1: "1 core", "2 cores"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def counted(names: Sequence[str], joiner: str = ", ") -> str:
    """Names each once, in the order first seen, with how many times each came:
    ``counted(["Encoder", "Block", "Block"], " and ")`` is "Encoder and Block x2"."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return joiner.join(name if n == 1 else f"{name} x{n}" for name, n in counts.items())


def bytes_text(count: int | None) -> str:
    """A number of bytes with a binary prefix: ``1.5 GiB``, ``512.0 MiB``, ``12 B``."""
    if count is None:
        return "n/a"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def mfu_sentence(table: float | None, measured: float | None) -> str | None:
    """``MFU 41.2% of table peak, 63.0% of measured peak`` (either part may be
    missing: ``table peak unknown``); None when neither is known."""
    if table is None and measured is None:
        return None
    first = f"{100 * table:.1f}% of table peak" if table is not None else "table peak unknown"
    second = f"{100 * measured:.1f}% of measured peak" if measured is not None else "measured peak unknown"
    return f"MFU {first}, {second}"


#: Folders of installed packages, whose files are shown from the package down.
PACKAGE_FOLDERS = ("/site-packages/", "/dist-packages/")


def package_path(location: str) -> str:
    """A file (or ``file:line``) of an installed package shown from the package's folder
    down (``torchvision/datasets/coco.py:43``); any other location as it is."""
    for folder in PACKAGE_FOLDERS:
        if folder in location:
            return location.rsplit(folder, 1)[1]
    if os.path.isabs(location):  # pip install --target FOLDER, whatever its name
        from torchaxe.installs import install_folder

        path, sep, line = location.rpartition(":")
        if not (sep and line.isdigit()):
            path, line = location, ""
        root = install_folder(path)
        if root is not None:
            shown = os.path.relpath(os.path.realpath(path), root)
            return f"{shown}:{line}" if line else shown
    return location
