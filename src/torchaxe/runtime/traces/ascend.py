"""The tables torch_npu.profiler writes next to its timeline.

``kernel_details.csv`` has one row per device task (Step Id, Name, Type, OP State
in newer versions, Duration(us), Input Shapes, ...); ``op_statistic.csv`` one row per
operator type (OP Type, Count, Total Time(us), ...). Shapes are written as
``"81920,4096;8192,512"``: inputs separated by ``;``, dimensions by ``,``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from torchaxe.runtime.traces.events import TraceFormatError


@dataclass
class KernelRow:
    """One device task of ``kernel_details.csv``; durations in microseconds."""

    name: str
    type: str
    step: int | None
    dur_us: float
    input_shapes: tuple[tuple[int, ...] | None, ...] | None
    #: ``static`` or ``dynamic`` (the ``OP State`` column), None when not recorded.
    state: str | None


@dataclass
class OpTypeRow:
    """One operator type of ``op_statistic.csv``."""

    type: str
    count: int
    total_us: float


def parse_shapes(text: str | None) -> tuple[tuple[int, ...] | None, ...] | None:
    """``"8,16;16"`` -> ((8, 16), (16,)); an input that is not a list of integers is
    None; the whole is None when nothing was recorded (``N/A``, empty)."""
    text = (text or "").strip().strip('"').strip()
    if not text or text.upper() == "N/A":
        return None
    shapes: list[tuple[int, ...] | None] = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            shapes.append(())
            continue
        try:
            shapes.append(tuple(int(d) for d in part.split(",")))
        except ValueError:
            shapes.append(None)
    return tuple(shapes)


def _rows(path: Path, needed: tuple[str, ...]) -> list[dict[str, str]]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in needed if c not in header]
            if not header:
                raise TraceFormatError(f"{path}: empty file, not a torch_npu profiler table")
            if missing:
                raise TraceFormatError(f"{path}: not a torch_npu profiler table (no column {', '.join(missing)})")
            return [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in reader]
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such file or folder") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceFormatError(f"{path}: cannot read as CSV: {exc}") from None


def _float(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def read_kernel_details(path: Path) -> list[KernelRow]:
    rows = []
    for row in _rows(path, ("Name", "Type", "Duration(us)")):
        dur = _float(row.get("Duration(us)", ""))
        if dur is None:
            continue
        step = row.get("Step Id", "")
        state = (row.get("OP State") or "").lower() or None
        rows.append(KernelRow(
            name=row["Name"], type=row["Type"], step=int(step) if step.isdigit() else None, dur_us=dur,
            input_shapes=parse_shapes(row.get("Input Shapes")),
            state=state if state in ("static", "dynamic") else None,
        ))
    return rows


def read_op_statistic(path: Path) -> list[OpTypeRow]:
    rows = []
    for row in _rows(path, ("OP Type", "Count", "Total Time(us)")):
        total = _float(row["Total Time(us)"])
        count = row["Count"]
        if total is None or not count.isdigit():
            continue
        rows.append(OpTypeRow(type=row["OP Type"], count=int(count), total_us=total))
    return rows
