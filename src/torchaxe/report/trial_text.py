"""The text table of a trial report: one row per knob set, baseline first."""

from __future__ import annotations

from typing import TextIO

from torchaxe.runtime.stats import Samples
from torchaxe.runtime.trials import TrialReport
from torchaxe.units import duration

#: Runs of one knob set whose median steps lie this many times apart: the note says
#: something else slowed some of them.
RUNS_APART = 1.5


def _ratio_text(result, is_baseline: bool) -> str:
    if is_baseline:
        return "1.00 (baseline)"
    if result.ratio is None:
        return "n/a"
    s = result.ratio.samples
    return f"{s.median:.3f} ({s.min:.3f}..{s.max:.3f})"


def render_trial_report(report: TrialReport, out: TextIO) -> None:
    """Per knob set: median and p90 step time, spread, step samples and the ratio to
    the baseline (median of per-repeat ratios, min..max); failures with their error."""
    o = report.options
    out.write(f"trial: {' '.join(report.command)}\n")
    out.write(f"  {o.repeats} repeat{'s' if o.repeats != 1 else ''} interleaved, {o.warmup} warmup + {o.steps} "
              f"measured steps per run; ratio = step time / baseline's, per repeat (below 1 is faster)\n\n")
    rows = [("knob set", "status", "median", "p90", "spread", "steps", "ratio (min..max)")]
    for i, r in enumerate(report.results):
        s = r.samples
        spread = f"{100 * s.relative_spread:.1f}%" if s.relative_spread is not None else "n/a"
        rows.append((r.name, "ok" if r.ok else "FAILED", duration(s.median), duration(s.p90), spread,
                     str(len(s)), _ratio_text(r, i == 0) if r.ok else "n/a"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        out.write("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
    notes = []
    baseline = report.baseline
    for i, r in enumerate(report.results):
        if r.ok and r.samples.is_noisy():
            notes.append(f"{r.name}: step time varies (interquartile range "
                         f"{100 * (r.samples.relative_spread or 0):.0f}% of the median)")
        medians = [m for m in (Samples.of(run.step_seconds).median for run in r.runs if run.ok) if m]
        if len(medians) >= 2 and max(medians) > RUNS_APART * min(medians):
            notes.append(f"{r.name}: its runs' median steps lay {duration(min(medians))} to {duration(max(medians))} "
                         f"apart ({max(medians) / min(medians):.1f}x): something else slowed some of them (a busy "
                         "machine, more threads than cores); run again, or with --turns")
        if i and r.ratio is not None and r.ratio.samples.min <= 1.0 <= r.ratio.samples.max:
            notes.append(f"{r.name}: the ratio's range crosses 1.00: not distinguishable from {baseline.name} "
                         "with these repeats")
    if not baseline.ok:
        notes.append(f"the baseline {baseline.name} failed: no ratios")
    for r in report.failed:
        failed = r.failed_run
        if failed is None:
            continue
        notes.append(f"{r.name} failed (repeat {failed.repeat}): {failed.error}")
        if failed.stderr_tail:
            notes.extend("    | " + line for line in failed.stderr_tail.splitlines())
    if notes:
        out.write("\n")
        for note in notes:
            out.write((note if note.startswith("    |") else f"  note: {note}") + "\n")
