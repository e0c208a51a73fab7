"""The rule interface.

One rule is one class in one file. The class carries its code, category, message, fix
title and safety, its documentation (the docstring, under fixed headings) and its own
examples: ``Valid`` code it must leave alone and ``Invalid`` code it must flag, with the
source expected after its fix. The test suite turns every example into a test, and
``torchaxe rules`` renders the documentation from the classes.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Protocol

from torchaxe.backends import TARGETS
from torchaxe.findings import Applicability, Finding

if TYPE_CHECKING:
    from torchaxe.scan.context import FileContext

DOC_SECTIONS = ("What it does", "Why is this bad?", "Example", "Use instead", "Fix safety", "References")


class TextSearch(Protocol):
    """What :attr:`Rule.requires_pattern` holds: a compiled regex, or any object whose
    ``search(text)`` is truthy when the text can hold what the rule reports."""

    def search(self, text: str) -> Any: ...


@dataclass(frozen=True)
class Valid:
    """Code the rule must not flag on ``target``."""

    code: str
    target: str = "cpu"


@dataclass(frozen=True)
class Invalid:
    """Code the rule must flag on ``target``, once on each of ``lines`` (1-based; a line
    listed twice is flagged twice).

    ``fixed`` is the whole source after applying this rule's fixes (unsafe ones
    included); ``None`` means the rule offers no applicable fix for it. ``message``,
    when set, is text every finding's message must contain (for rules whose message
    depends on the case).
    """

    code: str
    target: str = "cpu"
    fixed: str | None = None
    lines: tuple[int, ...] = ()
    message: str | None = None


class Rule:
    """Base class of every rule. Subclasses set the class attributes and implement
    ``visit`` (called for each node of ``node_types``) and/or ``check_module``."""

    code: ClassVar[str] = ""
    #: Kebab-case, named after the bad pattern.
    name: ClassVar[str] = ""
    #: The JSON ``category`` of the findings.
    category: ClassVar[str] = ""
    #: What is wrong, in one sentence (a finding may give a more specific one).
    message: ClassVar[str] = ""
    #: What the fix does, or None when the rule has no fix.
    fix_title: ClassVar[str | None] = None
    #: The applicability of the rule's usual fix.
    fix_safety: ClassVar[Applicability | None] = None
    #: Targets on which the rule reports anything.
    targets: ClassVar[tuple[str, ...]] = TARGETS
    #: The file is only visited when its text contains one of these (cheap prefilter).
    requires_text: ClassVar[tuple[str, ...]] = ()
    #: And, when set, also one of these: a second cheap prefilter, for rules whose
    #: first word is common (``optim`` is in every file that says "optimize").
    also_requires_text: ClassVar[tuple[str, ...]] = ()
    #: And, when set, a match of this pattern: run only on files that passed the
    #: substring tests, for rules that look for a few exact definitions. Anything
    #: with a regex's ``search(text)`` (truthy when found) will do. Python's regex
    #: engine is fast only where a pattern starts with literal text: a pattern that
    #: starts with ``\b`` or a look-behind is tried at every character of the file.
    requires_pattern: ClassVar[TextSearch | None] = None
    #: A file whose text contains one of these is visited whatever the tests above
    #: say (AX601 records what a DDP-building file imports even when it has no loop).
    sufficient_text: ClassVar[tuple[str, ...]] = ()
    #: A file whose text contains one of these is parsed for :meth:`export` even when
    #: no rule looks for findings in it (a model file that defines what another
    #: file's finding needs).
    export_text: ClassVar[tuple[str, ...]] = ()
    #: The rule also reads files that never say "torch" (which the scan skips for every
    #: other rule): a helper module that averages tensors handed to it, say.
    reads_files_without_torch: ClassVar[bool] = False
    #: The rule reads formula matches (so a parallel scan starts an evaluator for it).
    uses_formulas: ClassVar[bool] = False
    node_types: ClassVar[tuple[type[ast.AST], ...]] = ()
    references: ClassVar[tuple[str, ...]] = ()
    examples: ClassVar[tuple[Valid | Invalid, ...]] = ()

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        return ()

    def check_module(self, ctx: FileContext) -> Iterable[Finding]:
        """Whole-file checks (formula recognition works on function bodies)."""
        return ()

    def export(self, ctx: FileContext) -> Iterable[Finding]:
        """For files holding one of ``export_text``: record in ``ctx.exports`` what
        other files' findings may need of this one (and in ``ctx.needs`` findings of
        this file that need others); findings returned are kept as any."""
        return ()

    # ------------------------------------------------------------ metadata
    @classmethod
    def docs(cls) -> dict[str, str]:
        """The documentation sections parsed from the class docstring, with the
        References section made from ``references`` (its one source: the docstring
        does not repeat it, so the two cannot drift apart)."""
        sections = parse_doc_sections(inspect.getdoc(cls) or "")
        if cls.references:
            sections["References"] = "\n".join(f"- {ref}" for ref in cls.references)
        return sections

    @classmethod
    def has_fix(cls) -> bool:
        """Derived from the examples: a rule has a fix when an example shows one."""
        return any(isinstance(e, Invalid) and e.fixed is not None for e in cls.examples)

    @classmethod
    def summary(cls) -> dict[str, object]:
        return {
            "code": cls.code,
            "name": cls.name,
            "category": cls.category,
            "message": cls.message,
            "fix_title": cls.fix_title,
            "fix_safety": cls.fix_safety.value if cls.fix_safety else None,
            "has_fix": cls.has_fix(),
            "targets": list(cls.targets),
            "references": list(cls.references),
        }


_HEADING = re.compile(r"^##\s+(.+?)\s*$", re.MULTILINE)


def parse_doc_sections(doc: str) -> dict[str, str]:
    """Split a docstring written with ``## Heading`` lines into sections."""
    sections: dict[str, str] = {}
    matches = list(_HEADING.finditer(doc))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(doc)
        sections[m.group(1)] = doc[m.end() : end].strip("\n")
    return sections
