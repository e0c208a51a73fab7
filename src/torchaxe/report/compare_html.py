"""``torchaxe compare`` as one self-contained HTML page: the two runs side by side.

Bars are inline SVG computed here (the page loads nothing and runs no script: its
Content-Security-Policy forbids both); every string from the runs is escaped by the
template's autoescaping.
"""

from __future__ import annotations

from datetime import datetime, timezone
from functools import partial
from typing import Any

from torchaxe import __version__
from torchaxe.compare.model import PHASES, Comparison
from torchaxe.units import duration, mfu_sentence

TEMPLATE = "compare.html.j2"
COLOR_A, COLOR_B = "#0969da", "#bf3989"


def paired_bars(rows: list[tuple[str, float | None, float | None]], width: int = 760, label_width: int = 300,
                row: int = 30) -> dict[str, Any]:
    """Two bars per row (A above B), on one scale."""
    top = max((v or 0.0 for _, a, b in rows for v in (a, b)), default=0.0) or 1.0
    span = width - label_width - 100
    out = []
    for n, (label, a, b) in enumerate(rows):
        y = n * row
        bars = []
        for k, (value, color) in enumerate(((a, COLOR_A), (b, COLOR_B))):
            length = span * max(value or 0.0, 0.0) / top
            bars.append({"y": y + 2 + k * 12, "w": round(max(length, 1.0 if value else 0.0), 1), "color": color,
                         "text": duration(value, 2, missing="-"), "tx": round(label_width + length + 6, 1)})
        out.append({"label": label if len(label) <= 44 else label[:43] + "…", "full": label, "y": y + 15,
                    "bars": bars})
    return {"width": width, "height": max(len(rows) * row, row), "label_width": label_width, "rows": out}


def render_comparison_html(comparison: Comparison, now: datetime | None = None) -> str:
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(loader=PackageLoader("torchaxe.report", "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    a, b = comparison.a, comparison.b
    phases = [(title, a.phases.get(key), b.phases.get(key)) for key, title in PHASES
              if a.phases.get(key) is not None or b.phases.get(key) is not None]
    operators = [(row.name, row.a_seconds_per_step, row.b_seconds_per_step) for row in comparison.operators[:20]]
    context: dict[str, Any] = {
        "c": comparison, "a": a, "b": b, "ms": partial(duration, digits=2, missing="-"),
        "mfu": {side.label: mfu_sentence(side.mfu_table, side.mfu_measured) for side in (a, b)},
        "phase_bars": paired_bars(phases), "operator_bars": paired_bars(operators),
        "color_a": COLOR_A, "color_b": COLOR_B, "version": __version__,
        "now": (now or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M UTC"),
    }
    return env.get_template(TEMPLATE).render(**context)
