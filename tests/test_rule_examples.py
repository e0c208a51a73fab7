"""Every rule's inline examples become tests: Valid code is not flagged, Invalid code
is flagged on exactly the stated lines (with the stated message, where one is given)
and fixes to exactly the stated source."""

from __future__ import annotations

import ast

import pytest

from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.fix import fix_source, is_applicable
from torchaxe.scan.rules import Invalid, Valid, all_rules

CASES = [
    pytest.param(rule, i, example, id=f"{rule.code}-{i}-{type(example).__name__.lower()}-{example.target}")
    for rule in all_rules()
    for i, example in enumerate(rule.examples)
]


def _options(rule, target):
    # The examples are written for a machine with CPUs to spare (AX401's worker count).
    capabilities = {**torch_capabilities(target), "cpus": 16}
    return ScanOptions(target=target, select=(rule.code,), capabilities=capabilities)


@pytest.mark.parametrize("rule,index,example", CASES)
def test_example(rule, index, example):
    options = _options(rule, example.target)
    report = scan_source(example.code, "example.py", options)
    assert not report.diagnostics, report.diagnostics
    own = [f for f in report.findings if f.code == rule.code]
    if isinstance(example, Valid):
        assert own == [], f"{rule.code} flagged valid code:\n{example.code}\n{own}"
        return
    flagged = sorted(f.line for f in own)
    assert flagged == list(example.lines), f"{rule.code} expected findings on lines {example.lines}, got {own}"
    for f in own:
        assert f.category == rule.category
        assert f.target == example.target
        assert f.message
        if example.message is not None:
            assert example.message in f.message, f"{rule.code}: {example.message!r} not in {f.message!r}"
    fixed = fix_source(example.code, "example.py", options, unsafe=True)
    assert fixed.error is None
    if example.fixed is None:
        assert not any(is_applicable(f.fix, unsafe=True) for f in own)
        assert fixed.fixed == example.code
    else:
        assert fixed.fixed == example.fixed
        ast.parse(fixed.fixed)
        # Fixing twice changes nothing the second time.
        again = fix_source(fixed.fixed, "example.py", options, unsafe=True)
        assert again.fixed == fixed.fixed


def test_every_rule_has_positive_and_negative_examples():
    for rule in all_rules():
        kinds = {type(e) for e in rule.examples}
        assert kinds == {Valid, Invalid}, f"{rule.code} needs Valid and Invalid examples"


def test_every_invalid_example_pins_the_lines_it_flags():
    for rule in all_rules():
        for i, example in enumerate(rule.examples):
            if isinstance(example, Invalid):
                assert example.lines, f"{rule.code} example {i}: give lines=(...) the rule flags"


def test_references_have_one_source():
    """A rule lists its references once, in ``references``; the docs' References section
    is made from it, so the docstring must not carry its own copy."""
    import inspect

    from torchaxe.scan.rules.base import parse_doc_sections

    for rule in all_rules():
        assert rule.references, f"{rule.code} lists no references"
        assert "References" not in parse_doc_sections(inspect.getdoc(rule) or ""), rule.code
        assert rule.docs()["References"] == "\n".join(f"- {r}" for r in rule.references)


def test_rule_codes_and_names_are_unique():
    rules = all_rules()
    codes = [r.code for r in rules]
    names = [r.name for r in rules]
    assert len(codes) == len(set(codes))
    assert len(names) == len(set(names))


def test_every_rule_documents_itself():
    from torchaxe.scan.rules.base import DOC_SECTIONS

    for rule in all_rules():
        docs = rule.docs()
        missing = [s for s in DOC_SECTIONS if not docs.get(s, "").strip()]
        assert not missing, f"{rule.code} lacks documentation sections {missing}"
        assert rule.code and rule.name and rule.category and rule.message
        assert rule.name == rule.name.lower() and " " not in rule.name


def test_docs_rule_reference_is_generated_from_the_rules():
    import io
    from pathlib import Path

    from torchaxe.report.rule_docs import render_reference

    out = io.StringIO()
    render_reference(all_rules(), out)
    committed = Path(__file__).resolve().parent.parent / "docs" / "rules.md"
    assert committed.read_text() == out.getvalue(), "run `torchaxe rules --format markdown > docs/rules.md`"
