"""``torchaxe compare`` as text: the two runs, their phases, the operators that changed."""

from __future__ import annotations

from typing import TextIO

from torchaxe.compare.model import PHASES, Comparison, OperatorRow
from torchaxe.units import duration, mfu_sentence

#: Operator rows shown in the text (the JSON and HTML have more).
TOP = 12


def _ms(seconds: float | None) -> str:
    return duration(seconds, 2, missing="-")


def _calls(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None else ""


def _kernel_list(kernels: list[dict], limit: int) -> str:
    more = f" and {len(kernels) - limit} more" if len(kernels) > limit else ""
    return ", ".join(f"{k['name'][:40]} ({_ms(k['seconds_per_step'])})" for k in kernels[:limit]) + more


def _row(row: OperatorRow) -> str:
    return (f"  {row.name[:38]:<38} {_ms(row.a_seconds_per_step):>11} {_calls(row.a_calls_per_step):>6}  "
            f"{_ms(row.b_seconds_per_step):>11} {_calls(row.b_calls_per_step):>6}  {row.change * 1e3:+10.2f} ms")


def render_comparison(comparison: Comparison, out: TextIO) -> None:
    a, b = comparison.a, comparison.b
    out.write(f"A  {a.path}  ({a.source}, {a.target}, {a.steps_measured} measured steps)\n")
    out.write(f"B  {b.path}  ({b.source}, {b.target}, {b.steps_measured} measured steps)\n")
    ratio = comparison.step_ratio
    verdict = ""
    if ratio is not None:
        verdict = f": B is {1 / ratio:.2f}x as fast as A" if ratio <= 1 else f": B is {ratio:.2f}x as slow as A"
    out.write(f"step time   A {_ms(a.step_seconds_median)}, B {_ms(b.step_seconds_median)}{verdict}\n")
    for side in (a, b):
        sentence = mfu_sentence(side.mfu_table, side.mfu_measured)
        if sentence is not None:
            out.write(f"{side.label}: {sentence}\n")
    out.write(f"\n{'per step':<44} {'A':>11}  {'B':>11}  {'B/A':>6}\n")
    for key, title in PHASES:
        va, vb = a.phases.get(key), b.phases.get(key)
        if va is None and vb is None:
            continue
        out.write(f"  {title:<42} {_ms(va):>11}  {_ms(vb):>11}  {_ratio(va, vb):>6}\n")
    if a.host_syncs_per_step is not None or b.host_syncs_per_step is not None:
        out.write(f"  {'host syncs (count)':<42} {_calls(a.host_syncs_per_step):>11}  "
                  f"{_calls(b.host_syncs_per_step):>11}\n")
    if comparison.operators:
        out.write(f"\noperators whose time per step changed most ({a.operator_time} time in A, "
                  f"{b.operator_time} time in B)\n")
        out.write(f"  {'operator':<38} {'A ms/step':>11} {'calls':>6}  {'B ms/step':>11} {'calls':>6}  "
                  f"{'change':>13}\n")
        for row in comparison.operators[:TOP]:
            out.write(_row(row) + "\n")
            for label, kernels in (("A", row.a_kernels), ("B", row.b_kernels)):
                if kernels:
                    out.write(f"      {label} kernels: {_kernel_list(kernels, 3)}\n")
    for label, rows, seconds in (("A", comparison.only_in_a, "a_seconds_per_step"),
                                 ("B", comparison.only_in_b, "b_seconds_per_step")):
        if rows:
            listed = ", ".join(f"{r.name} ({_ms(getattr(r, seconds))})" for r in rows[:8])
            more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
            out.write(f"only in {label}: {listed}{more}\n")
    for side in (a, b):
        if side.dynamic_modules:
            out.write(f"{side.label}: dynamic shapes in {len(side.dynamic_modules)} modules "
                      f"({', '.join(side.dynamic_modules[:4])})\n")
        for finding in side.findings:
            if finding["kind"] in ("dynamic-shape", "online-compile"):
                out.write(f"{side.label}: {finding['message']}\n")
        if side.kernels_linked:
            if side.unlinked_kernels:
                out.write(f"{side.label} kernels linked to no operator: {_kernel_list(side.unlinked_kernels, 5)}\n")
        elif side.kernels:
            out.write(f"{side.label} kernels: {_kernel_list(side.kernels, 5)}\n")
    for note in comparison.notes:
        out.write(f"note: {note}\n")
