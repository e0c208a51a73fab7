"""The ``torchaxe advise`` report as one self-contained HTML page.

Plots are inline SVG computed here (no script, no network: the page's
Content-Security-Policy forbids both); every string from the user's run or code is
escaped by the template's autoescaping.
"""

from __future__ import annotations

from datetime import datetime, timezone
from functools import partial
from typing import Any

from torchaxe import __version__
from torchaxe.advise.recommendation import AXIS_TITLES, Advice
from torchaxe.report.advice_text import change_once_text, chosen_once_text, job_text
from torchaxe.runtime.candidate import MEMORY_KINDS
from torchaxe.units import bytes_text, duration

TEMPLATE = "advice.html.j2"
COLORS = {"data_wait": "#cf222e", "forward_and_rest": "#0969da", "backward": "#8250df", "gc": "#9a6700"}
LABELS = {"data_wait": "data wait", "forward_and_rest": "forward, loss, optimizer", "backward": "backward",
          "gc": "garbage collection"}


def hbars(items: list[tuple[str, float, str]], width: int = 640, row: int = 22, label_width: int = 260) -> dict:
    """Horizontal bars: (label, value in seconds, colour) -> drawable rows."""
    top = max((v for _, v, _ in items), default=0.0) or 1.0
    span = width - label_width - 90
    rows = []
    for n, (label, value, color) in enumerate(items):
        length = max(span * max(value, 0.0) / top, 1.0 if value > 0 else 0.0)
        rows.append({"y": n * row, "label": label if len(label) <= 40 else label[:39] + "…", "full": label,
                     "x": label_width, "w": round(length, 1), "color": color, "value": duration(value, 2),
                     "tx": round(label_width + length + 6, 1)})
    return {"width": width, "height": max(len(items) * row, row), "rows": rows, "label_width": label_width}


def stacked(parts: dict[str, float], width: int = 640) -> dict:
    total = sum(v for v in parts.values() if v > 0) or 1.0
    x = 0.0
    segs = []
    for key, value in parts.items():
        if value <= 0:
            continue
        w = width * value / total
        segs.append({"x": round(x, 1), "w": round(w, 1), "color": COLORS.get(key, "#59636e"),
                     "label": LABELS.get(key, key), "value": duration(value, 2), "share": f"{value / total:.0%}"})
        x += w
    return {"width": width, "segs": segs}


def columns(steps: list[float], waits: list[float], width: int = 640, height: int = 120) -> dict:
    n = len(steps)
    top = max(steps, default=0.0) or 1.0
    bar = width / max(n, 1)
    cols = []
    for i, (s, w) in enumerate(zip(steps, waits)):
        hs = height * s / top
        hw = height * min(w, s) / top
        cols.append({"x": round(i * bar + 1, 1), "w": round(max(bar - 2, 1), 1), "hs": round(hs, 1),
                     "ys": round(height - hs, 1), "hw": round(hw, 1), "yw": round(height - hw, 1),
                     "title": f"step {i + 1}: {duration(s, 2)}, data wait {duration(w, 2)}"})
    return {"width": width, "height": height, "cols": cols}


def render_advice_html(advice: Advice, now: datetime | None = None) -> str:
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(loader=PackageLoader("torchaxe.report", "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    ranked = advice.ranked()
    plots = advice.profile or {}
    gains = [(r.title, r.measured_seconds_saved_per_step or 0.0, "#1a7f37" if r.selected else "#59636e")
             for r in ranked if r.status == "measured" and (r.measured_seconds_saved_per_step or 0) > 0]
    top_ops = [(o["name"], o["seconds_per_step"], "#0969da") for o in plots.get("top_ops") or []]
    context: dict[str, Any] = {
        "advice": advice, "ranked": ranked, "axis_titles": AXIS_TITLES, "ms": partial(duration, digits=2),
        "version": __version__, "pct": lambda v: "n/a" if v is None else f"{100 * v:.1f}%",
        "now": (now or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M UTC"),
        "breakdown": stacked(plots.get("breakdown") or {}),
        "waits": columns(plots.get("step_seconds") or [], plots.get("data_wait_per_step") or []),
        "ops": hbars(top_ops), "gains": hbars(gains[:12]),
        "installed": advice.scanned.get("installed_findings") or [],
        "bytes": bytes_text, "memory_kinds": MEMORY_KINDS, "once": change_once_text,
        "combined_once": chosen_once_text(advice),
        "job": job_text(advice) if (advice.combined or {}).get("status") == "measured" else None,
    }
    return env.get_template(TEMPLATE).render(**context)
