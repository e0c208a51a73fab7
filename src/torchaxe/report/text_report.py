"""The terminal report: findings grouped by file, each with a small code frame, its
replacement and fix, then the diagnostics and a summary.

Every user string (paths, snippets, messages) goes to rich as a ``Text``, never as
markup, and control characters are made visible first: a scanned file that holds an
escape sequence must not be able to colour, move or clear the user's terminal.

The helpers below (grouping, counting, code frames) know nothing of rich; the HTML
report uses them too.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from torchaxe.findings import Applicability, Finding, ScanResult
from torchaxe.units import plural

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

#: Width of plain (non-terminal) output, so files and tests see the same layout.
PLAIN_WIDTH = 100
#: Lines of a multi-line snippet shown before the frame is cut short.
FRAME_LINES = 6
TAB = "    "

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

_FIX_STYLE = {
    Applicability.SAFE: "green",
    Applicability.UNSAFE: "yellow",
    Applicability.DISPLAY_ONLY: "cyan",
}


# ------------------------------------------------------------------ shared helpers
def visible(text: str) -> str:
    """``text`` with control characters (escape, carriage return, ...) written as
    ``\\x1b``-style escapes; tabs and newlines are kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def group_by_file(findings: list[Finding]) -> dict[str, list[Finding]]:
    """Findings by path, files in order of first appearance, findings sorted."""
    groups: dict[str, list[Finding]] = {}
    for f in findings:
        groups.setdefault(f.path, []).append(f)
    return {path: sorted(items, key=lambda f: f.sort_key) for path, items in groups.items()}


@dataclass(frozen=True)
class Counts:
    """What the summary of any report says."""

    by_code: dict[str, int]
    by_category: dict[str, int]
    files_with_findings: int
    #: Findings ``torchaxe fix`` applies as they are.
    safe_fixes: int
    #: Findings whose fix needs ``--unsafe-fixes``.
    unsafe_fixes: int
    #: Findings whose fix is advice only.
    display_only: int


def count(result: ScanResult) -> Counts:
    by_code = Counter(f.code for f in result.findings)
    by_category = Counter(f.category for f in result.findings)
    applicable = [f.fix.applicability for f in result.findings if f.fix and f.fix.edits]
    return Counts(
        by_code=dict(sorted(by_code.items())),
        by_category=dict(sorted(by_category.items(), key=lambda kv: (-kv[1], kv[0]))),
        files_with_findings=len({f.path for f in result.findings}),
        safe_fixes=applicable.count(Applicability.SAFE),
        unsafe_fixes=applicable.count(Applicability.UNSAFE),
        display_only=sum(
            1 for f in result.findings if f.fix and (f.fix.applicability is Applicability.DISPLAY_ONLY or not f.fix.edits)
        ),
    )


def fix_hint(counts: Counts) -> str | None:
    """The line that tells how many findings ``torchaxe fix`` can fix."""
    if not counts.safe_fixes and not counts.unsafe_fixes:
        return None
    hint = f"{counts.safe_fixes} fixable with `torchaxe fix`"
    if counts.unsafe_fixes:
        hint += f" ({counts.unsafe_fixes} more with --unsafe-fixes)"
    return hint


def fix_label(finding: Finding) -> str:
    """safe / unsafe / display-only (a fix without edits is advice only) / none."""
    if finding.fix is None:
        return "none"
    if not finding.fix.edits:
        return Applicability.DISPLAY_ONLY.value
    return finding.fix.applicability.value


@dataclass(frozen=True)
class FrameLine:
    """One line of a code frame, split around the finding's column range."""

    number: int
    before: str
    marked: str
    after: str


def frame(finding: Finding, max_lines: int = FRAME_LINES) -> tuple[list[FrameLine], int]:
    """The snippet's lines split around the finding's range, and how many lines were
    left off. The snippet holds whole source lines from ``finding.line`` on."""
    lines = finding.snippet.splitlines() or [""]
    shown = lines[:max_lines]
    out = []
    for i, text in enumerate(shown):
        number = finding.line + i
        indent = len(text) - len(text.lstrip())
        start = finding.col - 1 if number == finding.line else indent
        end = finding.end_col - 1 if number == finding.end_line else len(text)
        start = min(max(start, 0), len(text))
        end = min(max(end, start), len(text))
        out.append(FrameLine(number, visible(text[:start]), visible(text[start:end]), visible(text[end:])))
    return out, len(lines) - len(shown)


# ------------------------------------------------------------------ rendering
def render(result: ScanResult, stream: TextIO, color: bool = False, width: int | None = None, **_: Any) -> None:
    """Write the report; ``color`` turns on styles (plain output has no ANSI escapes)."""
    from rich.console import Console

    console = Console(
        file=stream,
        force_terminal=color,
        no_color=not color,
        color_system="auto" if color else None,
        width=width or (None if color else PLAIN_WIDTH),
        highlight=False,
        emoji=False,
        markup=False,
        soft_wrap=False,
    )
    counts = count(result)
    for path, findings in group_by_file(result.findings).items():
        _file_header(console, path, len(findings))
        for f in findings:
            _finding(console, f)
    if result.diagnostics:
        _diagnostics(console, result)
    _summary(console, result, counts)


def _text(*parts: str | tuple[str, str]) -> Text:
    """A rich Text from plain strings and (string, style) pairs; never parses markup."""
    from rich.text import Text

    text = Text()
    for part in parts:
        if isinstance(part, tuple):
            text.append(visible(part[0]), style=part[1])
        else:
            text.append(visible(part))
    return text


def _file_header(console: Console, path: str, n: int) -> None:
    console.print(_text((path, "bold underline"), f"  ({plural(n, 'finding')})"), soft_wrap=True)
    console.print()


def _finding(console: Console, f: Finding) -> None:
    console.print(
        _text((f"{f.path}:{f.line}:{f.col}", "bold"), " ", (f.code, "bold red"), " ", f.message),
        soft_wrap=True,
    )
    _code_frame(console, f)
    if f.replacement:
        console.print(_text("  replacement: ", (f.replacement, "green")))
    label = fix_label(f)
    if f.fix is None:
        console.print(_text("  fix: ", ("none", "dim")))
    else:
        style = _FIX_STYLE.get(Applicability(label), "")
        parts: list[str | tuple[str, str]] = ["  fix (", (label, style), ")"]
        if f.fix.title:
            parts += [": ", f.fix.title]
        if f.fix.imports:
            parts += [("  [adds: " + "; ".join(f.fix.imports) + "]", "dim")]
        console.print(_text(*parts))
    console.print()


def _code_frame(console: Console, f: Finding) -> None:
    from rich.cells import cell_len

    lines, left_off = frame(f)
    if not any(line.before or line.marked or line.after for line in lines):
        return
    gutter = max(len(str(line.number)) for line in lines) + 1
    for i, line in enumerate(lines):
        console.print(
            _text(
                (f"{line.number:>{gutter}} | ", "blue"),
                line.before.replace("\t", TAB),
                (line.marked.replace("\t", TAB), "bold"),
                line.after.replace("\t", TAB),
            ),
            crop=True,
            no_wrap=True,
        )
        if i == 0:
            pad = cell_len(line.before.replace("\t", TAB))
            carets = "^" * max(1, cell_len(line.marked.replace("\t", TAB)))
            console.print(_text((f"{'':>{gutter}} | ", "blue"), " " * pad, (carets, "red")), crop=True, no_wrap=True)
    if left_off:
        console.print(_text((f"{'':>{gutter}} | ... ({plural(left_off, 'more line')})", "dim")))


def _diagnostics(console: Console, result: ScanResult) -> None:
    console.print(_text((f"Diagnostics ({len(result.diagnostics)})", "bold")))
    for d in result.diagnostics:
        where = f"{d.path}:{d.line}" if d.line else d.path
        console.print(_text("  ", (d.code, "bold magenta"), " ", where, ": ", d.message), soft_wrap=True)
    console.print()


def _summary(console: Console, result: ScanResult, counts: Counts) -> None:
    stats = result.stats
    files = (
        f"{plural(stats.files_scanned, 'file')} scanned, {stats.files_skipped} skipped "
        f"(nothing a rule looks for) in {stats.seconds:.2f} s"
    )
    if not result.findings:
        console.print(_text(("No findings", "bold green"), f" for target {result.target}: {files}."))
        if result.diagnostics:
            console.print(_text((f"{plural(len(result.diagnostics), 'file problem')} listed above.", "magenta")))
        return
    console.print(_text(("Summary", "bold")))
    console.print(
        _text(
            "  ",
            (plural(len(result.findings), "finding"), "bold"),
            f" in {plural(counts.files_with_findings, 'file')} for target {result.target}",
        )
    )
    width = max(len(k) for k in (*counts.by_code, *counts.by_category))
    console.print(_text("  by code:"))
    for code, n in counts.by_code.items():
        console.print(_text(f"    {code:<{width}}  {n}"))
    console.print(_text("  by category:"))
    for category, n in counts.by_category.items():
        console.print(_text(f"    {category:<{width}}  {n}"))
    console.print(_text(f"  {files}"))
    if result.diagnostics:
        console.print(_text("  ", (plural(len(result.diagnostics), "diagnostic"), "magenta"), " (see above)"))
    hint = fix_hint(counts)
    if hint:
        console.print(_text(("  " + hint, "bold")))
    if counts.display_only:
        console.print(_text(f"  {counts.display_only} with advice only (display-only: change by hand)"))
