"""SARIF 2.1.0: the format code-scanning services (GitHub, GitLab, IDE viewers) read.

One run; ``tool.driver.rules`` holds the rules that have results, each with its
documentation; results carry their location, their fix as replacements and, in their
property bag, torchaxe's category and fix applicability. Problems with the scan
itself (AX9xx diagnostics) are tool execution notifications, not results.

Columns are 1-based character counts (``columnKind: unicodeCodePoints``), the end
column exclusive, exactly as ``torchaxe.findings`` defines them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, TextIO
from urllib.parse import quote

from torchaxe import __version__
from torchaxe.findings import Applicability, Diagnostic, Finding, ScanResult

SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
SARIF_VERSION = "2.1.0"
INFORMATION_URI = "https://pypi.org/project/torchaxe/"

_URL = re.compile(r"^https?://\S+$")

_FIX_NOTE = {
    Applicability.SAFE: "safe: keeps numerics and behaviour",
    Applicability.UNSAFE: "unsafe: may change numerics or fail for some programs; review before applying",
    Applicability.DISPLAY_ONLY: "display-only: advice, never applied automatically",
}


def render(result: ScanResult, stream: TextIO, **_: Any) -> None:
    json.dump(to_sarif(result), stream, indent=2, ensure_ascii=False)
    stream.write("\n")


def to_sarif(result: ScanResult) -> dict[str, Any]:
    """The SARIF log of one scan, as plain JSON data."""
    codes = sorted({f.code for f in result.findings})
    descriptors = [_rule_descriptor(code, result.findings) for code in codes]
    index = {code: i for i, code in enumerate(codes)}
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": "torchaxe",
                "version": __version__,
                "semanticVersion": __version__,
                "informationUri": INFORMATION_URI,
                "rules": descriptors,
            }
        },
        "invocations": [
            {
                "executionSuccessful": True,
                "toolExecutionNotifications": [_notification(d) for d in result.diagnostics],
            }
        ],
        "columnKind": "unicodeCodePoints",
        "results": [_result(f, index[f.code]) for f in sorted(result.findings, key=lambda f: f.sort_key)],
        "properties": {
            "target": result.target,
            **{_camel(k): v for k, v in result.stats.to_dict().items()},
        },
    }
    return {"$schema": SCHEMA_URI, "version": SARIF_VERSION, "runs": [run]}


def artifact_uri(path: str) -> str:
    """A relative POSIX URI reference for a relative path, a ``file://`` URI for an
    absolute one (POSIX or Windows form), percent-encoded either way."""
    if path.startswith("/"):
        return PurePosixPath(path).as_uri()
    windows = PureWindowsPath(path)
    if windows.is_absolute():
        return windows.as_uri()
    posix = windows.as_posix() if os.sep == "\\" else path
    return quote(posix, safe="/")


# ------------------------------------------------------------------ rules
def _rule_descriptor(code: str, findings: list[Finding]) -> dict[str, Any]:
    rule = _lookup_rule(code)
    if rule is None:
        # A finding from outside the registry (a plugin, a hand-built result).
        first = next(f for f in findings if f.code == code)
        descriptor: dict[str, Any] = {
            "id": code,
            "shortDescription": {"text": first.message},
            "defaultConfiguration": {"level": "warning"},
            "properties": {"category": first.category, "tags": [first.category]},
        }
        url = _first_url(first.references)
        if url:
            descriptor["helpUri"] = url
        return descriptor
    docs = rule.docs()
    descriptor = {
        "id": rule.code,
        "name": rule.name,
        "shortDescription": {"text": rule.message},
        "fullDescription": {"text": docs.get("What it does", rule.message)},
        "help": {"text": _help_text(rule, docs), "markdown": _help_markdown(rule, docs)},
        "defaultConfiguration": {"level": "warning"},
        "properties": {
            "category": rule.category,
            "fixSafety": rule.fix_safety.value if rule.fix_safety else None,
            "fixTitle": rule.fix_title,
            "hasFix": rule.has_fix(),
            "targets": list(rule.targets),
            "tags": ["performance", rule.category],
        },
    }
    url = _first_url(rule.references)
    if url:
        descriptor["helpUri"] = url
    return descriptor


def _lookup_rule(code: str) -> Any:
    from torchaxe.errors import TorchaxeError
    from torchaxe.scan.rules import get_rule

    try:
        return get_rule(code)
    except TorchaxeError:
        return None


def _first_url(references: tuple[str, ...] | list[str]) -> str | None:
    for ref in references:
        if _URL.match(ref.strip()):
            return ref.strip()
    return None


def _help_markdown(rule: Any, docs: dict[str, str]) -> str:
    parts = [f"**{rule.code} {rule.name}**: {rule.message}"]
    for heading, body in docs.items():
        parts.append(f"## {heading}\n{body}")
    return "\n\n".join(parts)


def _help_text(rule: Any, docs: dict[str, str]) -> str:
    parts = [f"{rule.code} {rule.name}: {rule.message}"]
    for heading, body in docs.items():
        parts.append(f"{heading}\n{body}")
    return "\n\n".join(parts)


# ------------------------------------------------------------------ results
def _region(line: int, col: int, end_line: int, end_col: int) -> dict[str, int]:
    return {
        "startLine": max(line, 1),
        "startColumn": max(col, 1),
        "endLine": max(end_line, line, 1),
        "endColumn": max(end_col, 1),
    }


def _result(f: Finding, rule_index: int) -> dict[str, Any]:
    location = {
        "physicalLocation": {
            "artifactLocation": {"uri": artifact_uri(f.path)},
            "region": _region(f.line, f.col, f.end_line, f.end_col),
        }
    }
    if f.snippet:
        location["physicalLocation"]["contextRegion"] = {
            "startLine": max(f.line, 1),
            "endLine": max(f.line + len(f.snippet.splitlines()) - 1, f.line, 1),
            "snippet": {"text": f.snippet},
        }
    text = f.message
    if f.replacement:
        text += f" Replacement: {f.replacement}."
    properties: dict[str, Any] = {"category": f.category, "target": f.target, "applicability": None}
    if f.replacement:
        properties["replacement"] = f.replacement
    if f.fix is not None:
        properties["applicability"] = f.fix.applicability.value
        properties["fixTitle"] = f.fix.title
        if f.fix.imports:
            properties["fixImports"] = list(f.fix.imports)
    if f.references:
        properties["references"] = list(f.references)
    out: dict[str, Any] = {
        "ruleId": f.code,
        "ruleIndex": rule_index,
        "level": "warning",
        "message": {"text": text},
        "locations": [location],
        "properties": properties,
    }
    sarif_fix = _fix(f)
    if sarif_fix is not None:
        out["fixes"] = [sarif_fix]
    return out


def _fix(f: Finding) -> dict[str, Any] | None:
    """The finding's fix as SARIF replacements, or None when it has no edits.

    A fix that also needs imports is left out: where the import goes depends on the
    file's text, which a renderer does not read, and a consumer that applied the
    edits alone would leave code that fails with a NameError. Its imports are listed
    in the result's ``fixImports`` property instead.
    """
    fix = f.fix
    if fix is None or not fix.edits or fix.imports or fix.applicability is Applicability.DISPLAY_ONLY:
        return None
    replacements = []
    for edit in sorted(fix.edits, key=lambda e: (e.start, e.end)):
        replacement: dict[str, Any] = {
            "deletedRegion": _region(edit.start.line, edit.start.col, edit.end.line, edit.end.col),
        }
        if edit.content:
            replacement["insertedContent"] = {"text": edit.content}
        replacements.append(replacement)
    return {
        "description": {"text": f"{fix.title or 'apply the fix'} ({_FIX_NOTE[fix.applicability]})"},
        "artifactChanges": [{"artifactLocation": {"uri": artifact_uri(f.path)}, "replacements": replacements}],
    }


def _notification(d: Diagnostic) -> dict[str, Any]:
    physical: dict[str, Any] = {"artifactLocation": {"uri": artifact_uri(d.path)}}
    if d.line:
        physical["region"] = {"startLine": max(d.line, 1)}
    return {
        "level": "error",
        "message": {"text": d.message},
        "descriptor": {"id": d.code},
        "locations": [{"physicalLocation": physical}],
    }


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)
