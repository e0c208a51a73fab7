"""The rule reference, generated from the rule classes: one rule's documentation
(``torchaxe rules AX201``) and the table of all rules (``torchaxe rules``).

On a terminal the documentation is rendered with rich; anywhere else it is written as
plain Markdown, so ``torchaxe rules AX201 > AX201.md`` gives a usable page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, TextIO

from torchaxe.findings import Applicability
from torchaxe.scan.rules.base import DOC_SECTIONS

if TYPE_CHECKING:
    from torchaxe.scan.rules.base import Rule

#: Width of the table when it is not written to a terminal.
PLAIN_WIDTH = 120


def fix_label(rule_cls: type[Rule]) -> str:
    """safe / unsafe when the rule's examples show an applied fix, display-only when
    it only advises, none when it has no fix at all."""
    if rule_cls.has_fix():
        # A rule that applies fixes without declaring their safety is not called safe.
        return rule_cls.fix_safety.value if rule_cls.fix_safety else Applicability.UNSAFE.value
    if rule_cls.fix_title or rule_cls.fix_safety is not None:
        return Applicability.DISPLAY_ONLY.value
    return "none"


def ordered_sections(rule_cls: type[Rule]) -> list[tuple[str, str]]:
    """The documentation sections, the standard headings first in their usual order."""
    docs = rule_cls.docs()
    known = [(h, docs[h]) for h in DOC_SECTIONS if h in docs]
    extra = [(h, body) for h, body in docs.items() if h not in DOC_SECTIONS]
    return known + extra


def _is_terminal(stream: TextIO, color: bool | None) -> bool:
    if color is not None:
        return color
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _facts(rule_cls: type[Rule]) -> list[tuple[str, str]]:
    fix = fix_label(rule_cls)
    if rule_cls.fix_title and fix != "none":
        fix = f"{fix} ({rule_cls.fix_title})"
    return [
        ("category", rule_cls.category),
        ("fix", fix),
        ("targets", ", ".join(rule_cls.targets)),
        ("message", rule_cls.message),
    ]


def render_rule(rule_cls: type[Rule], stream: TextIO, color: bool | None = None) -> None:
    """Write one rule's documentation: code, name, category, fix safety, targets, then
    its sections (What it does, Why is this bad?, Example, Use instead, ...)."""
    if not _is_terminal(stream, color):
        stream.write(_markdown(rule_cls))
        return
    from rich.console import Console
    from rich.markdown import Markdown
    from rich.text import Text

    console = Console(file=stream, force_terminal=True, highlight=False, emoji=False)
    console.print(Text.assemble((rule_cls.code, "bold red"), " ", (rule_cls.name, "bold")))
    for key, value in _facts(rule_cls):
        console.print(Text.assemble((f"{key + ':':<10}", "dim"), value))
    sections = ordered_sections(rule_cls)
    if not sections:
        console.print(Text("\n(no documentation)", style="dim"))
    for heading, body in sections:
        console.print()
        console.print(Text(heading, style="bold underline"))
        console.print(Markdown(body, code_theme="ansi_dark"))


def _markdown(rule_cls: type[Rule], level: int = 1) -> str:
    top, sub = "#" * level, "#" * (level + 1)
    parts = [f"{top} {rule_cls.code} {rule_cls.name}", "\n".join(f"- {k}: {v}" for k, v in _facts(rule_cls))]
    sections = ordered_sections(rule_cls)
    parts += [f"{sub} {heading}\n{body}" for heading, body in sections] or ["(no documentation)"]
    return "\n\n".join(parts) + "\n"


def render_rule_table(rule_classes: Iterable[type[Rule]], stream: TextIO, color: bool | None = None) -> None:
    """Write a table of the rules: code, name, category, fix, message."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    terminal = _is_terminal(stream, color)
    console = Console(
        file=stream,
        force_terminal=terminal,
        no_color=not terminal,
        color_system="auto" if terminal else None,
        width=None if terminal else PLAIN_WIDTH,
        highlight=False,
        emoji=False,
    )
    rules = list(rule_classes)
    table = Table(box=box.SIMPLE_HEAD if terminal else box.ASCII2, show_edge=terminal, pad_edge=False)
    table.add_column("code", style="bold red" if terminal else None, no_wrap=True)
    table.add_column("name", overflow="fold")
    # A narrow terminal cannot hold every column without cutting messages short.
    wide = console.width >= 100
    if wide:
        table.add_column("category", overflow="fold")
    table.add_column("fix", no_wrap=True)
    table.add_column("message", overflow="fold", ratio=1, min_width=30)
    styles = {"safe": "green", "unsafe": "yellow", "display-only": "cyan", "none": "dim"}
    for rule in rules:
        fix = fix_label(rule)
        cells = [Text(rule.code), Text(rule.name)]
        if wide:
            cells.append(Text(rule.category))
        cells += [Text(fix, style=styles[fix] if terminal else ""), Text(rule.message)]
        table.add_row(*cells)
    console.print(table)
    fixable = sum(1 for r in rules if fix_label(r) in ("safe", "unsafe"))
    console.print(Text(f"{len(rules)} rule{'s' if len(rules) != 1 else ''}, {fixable} with an automatic fix; "
                       "`torchaxe rules CODE` explains one."))


def render_reference(rule_classes: Iterable[type[Rule]], stream: TextIO) -> None:
    """The Markdown rule reference (docs/rules.md), generated from the rule classes."""
    rules = list(rule_classes)
    stream.write("# torchaxe rule reference\n\n")
    stream.write("Generated by `torchaxe rules --format markdown` from the rule classes; do not edit by hand.\n")
    stream.write("NPU replacements follow torch_npu's documented signatures but are unverified on Ascend hardware.\n\n")
    for rule in rules:
        stream.write(f"- [{rule.code} {rule.name}](#{rule.code.lower()}-{rule.name}): {rule.message}\n")
    for rule in rules:
        stream.write("\n")
        stream.write(_markdown(rule, level=2))
