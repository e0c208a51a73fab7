"""A standalone HTML page: summary counts, findings grouped by file with their code
frame, replacement and fix safety, and the diagnostics.

The page loads nothing (inline CSS, no script, a Content-Security-Policy that forbids
both) and is rendered with autoescaping on, so a path, snippet or message from the
scanned code is always shown as text, never run as markup.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, TextIO

from torchaxe import __version__
from torchaxe.findings import ScanResult
from torchaxe.report.text_report import count, fix_hint, fix_label, frame, group_by_file
from torchaxe.units import plural

TEMPLATE = "scan.html.j2"


def render(result: ScanResult, stream: TextIO, now: datetime | None = None, **_: Any) -> None:
    """Write the page; ``now`` (for reproducible output) defaults to the current time."""
    template = _environment().get_template(TEMPLATE)
    stream.write(template.render(**_context(result, now or datetime.now(timezone.utc))))


def _environment() -> Any:
    from jinja2 import Environment, PackageLoader, StrictUndefined

    return Environment(
        loader=PackageLoader("torchaxe.report", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def _context(result: ScanResult, now: datetime) -> dict[str, Any]:
    counts = count(result)
    files = []
    for path, findings in group_by_file(result.findings).items():
        items = []
        for f in findings:
            lines, left_off = frame(f)
            items.append(
                {
                    "finding": f,
                    "lines": lines,
                    "left_off": left_off,
                    "fix_label": fix_label(f),
                }
            )
        files.append({"path": path, "entries": items, "count": plural(len(findings), "finding")})
    return {
        "result": result,
        "version": __version__,
        "generated": _timestamp(now),
        "counts": counts,
        "hint": fix_hint(counts),
        "files": files,
        "plural": plural,
    }


def _timestamp(now: datetime) -> str:
    if now.tzinfo is None:
        return now.strftime("%Y-%m-%d %H:%M")
    return now.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
