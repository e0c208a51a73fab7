"""Findings are data: what a rule saw, where, and the edits that would fix it.

Everything here is plain, immutable and JSON-serialisable so that renderers, the
fixer and (later) the advisor can share one form. Lines are 1-based; columns are
1-based and counted in characters (not UTF-8 bytes, which is what ``ast`` reports).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Applicability(str, Enum):
    """How trustworthy a fix is.

    ``safe`` keeps the numerics and behaviour; ``unsafe`` may change numerics or fail
    for some programs and needs the user's consent; ``display-only`` is shown as advice
    and never applied.
    """

    SAFE = "safe"
    UNSAFE = "unsafe"
    DISPLAY_ONLY = "display-only"


@dataclass(frozen=True, order=True)
class Position:
    """A place in a source file: 1-based line, 1-based character column."""

    line: int
    col: int


@dataclass(frozen=True)
class Edit:
    """Replace the text between ``start`` and ``end`` (exclusive) with ``content``."""

    start: Position
    end: Position
    content: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "line": self.start.line,
            "col": self.start.col,
            "end_line": self.end.line,
            "end_col": self.end.col,
            "content": self.content,
        }


@dataclass(frozen=True)
class Fix:
    """A list of edits plus the imports the new code needs, with its applicability."""

    applicability: Applicability
    title: str
    edits: tuple[Edit, ...]
    imports: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "applicability": self.applicability.value,
            "title": self.title,
            "edits": [e.to_dict() for e in self.edits],
            "imports": list(self.imports),
        }


@dataclass(frozen=True)
class Finding:
    """One place in the user's code with a faster alternative."""

    code: str
    category: str
    message: str
    path: str
    line: int
    col: int
    end_line: int
    end_col: int
    snippet: str
    target: str
    replacement: str | None = None
    fix: Fix | None = None
    references: tuple[str, ...] = ()

    @property
    def sort_key(self) -> tuple[str, int, int, str]:
        return (self.path, self.line, self.col, self.code)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "category": self.category,
            "message": self.message,
            "path": self.path,
            "line": self.line,
            "end_line": self.end_line,
            "col": self.col,
            "end_col": self.end_col,
            "snippet": self.snippet,
            "target": self.target,
            "replacement": self.replacement,
            "fix": self.fix.to_dict() if self.fix else None,
            "references": list(self.references),
        }


@dataclass(frozen=True)
class Diagnostic:
    """A problem with the scan itself (unparsable file, unreadable file, ...).

    Codes are AX9xx; a diagnostic never stops the scan.
    """

    code: str
    message: str
    path: str
    line: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "path": self.path, "line": self.line}


@dataclass
class ScanStats:
    files_scanned: int = 0
    files_skipped: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "files_scanned": self.files_scanned,
            "files_skipped": self.files_skipped,
            "seconds": round(self.seconds, 4),
        }


@dataclass
class ScanResult:
    """Everything one scan produced; the input of every renderer."""

    target: str
    findings: list[Finding] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    stats: ScanStats = field(default_factory=ScanStats)

    @property
    def exit_code(self) -> int:
        """Bit flags: 1 when there are findings, 2 when there were errors."""
        return (1 if self.findings else 0) | (2 if self.diagnostics else 0)

    def to_dict(self) -> dict[str, Any]:
        from torchaxe import __version__

        return {
            "version": __version__,
            "target": self.target,
            "findings": [f.to_dict() for f in self.findings],
            "diagnostics": [d.to_dict() for d in self.diagnostics],
            "stats": self.stats.to_dict(),
        }
