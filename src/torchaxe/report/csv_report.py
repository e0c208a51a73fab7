"""CSV with the columns a pytorch_analyse.sh user knows (File, Start Line, End Line,
Category, Call, Replacement), followed by torchaxe's own."""

from __future__ import annotations

import csv
from typing import Any, TextIO

from torchaxe.findings import ScanResult

COLUMNS = ("File", "Start Line", "End Line", "Category", "Call", "Replacement", "Code", "Message", "Fix")


def render(result: ScanResult, stream: TextIO, **_: Any) -> None:
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(COLUMNS)
    for f in result.findings:
        writer.writerow(
            (
                f.path,
                f.line,
                f.end_line,
                f.category,
                _first_line(f.snippet).strip(),
                f.replacement or "",
                f.code,
                f.message,
                f.fix.applicability.value if f.fix else "",
            )
        )


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""
