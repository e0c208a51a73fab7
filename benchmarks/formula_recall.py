"""How well the formula rules (AX110-AX120, AX123) find hand-written math, by meaning.

Scans a labelled corpus (default ``tests/formula_corpus``; see its README) with only the
formula rules and reports, per category:

* recall: positive cases (``# formula: CATEGORY``) with at least one finding of that
  category inside them, over all positive cases of the category;
* false positives: look-alike cases (``# lookalike: CATEGORY``) with any formula
  finding inside them, over all look-alikes of the category. A finding of another
  category inside a positive case, or outside every case, is listed as stray and
  counted as a false positive of its own category.

Targets: recall >= 95 % and false positives <= 2 % of the look-alikes, per category.
Results go to stdout (a table, or ``--json``), progress to stderr. Exit code: 0 every
target met, 1 a target missed, 2 the benchmark could not run (one line on stderr).

    .venv/bin/python benchmarks/formula_recall.py
    .venv/bin/python benchmarks/formula_recall.py --target cpu --json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT / "tests" / "formula_corpus"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, save_result  # noqa: E402
TARGET_RECALL = 0.95
TARGET_FALSE_POSITIVES = 0.02
LABEL = re.compile(r"#\s*(formula|lookalike):\s*([a-z_]+)")
#: Categories with a fused operator only on npu: not looked for on cpu or cuda.
NPU_ONLY = ("swiglu", "rotary", "quick_gelu")


class BenchmarkError(Exception):
    """A reason the benchmark cannot run, in one line."""


@dataclass
class Case:
    path: str
    name: str
    first: int
    last: int
    kind: str  # "formula" or "lookalike"
    category: str
    findings: list[Any] = field(default_factory=list)

    def contains(self, line: int) -> bool:
        return self.first <= line <= self.last


def load_cases(corpus: Path) -> list[Case]:
    """The labelled cases: top-level functions, classes and assignments whose first
    line carries a label comment."""
    cases = []
    for path in sorted(corpus.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        try:
            tree = ast.parse(text)
        except SyntaxError as exc:
            raise BenchmarkError(f"{path}: does not parse ({exc.msg}, line {exc.lineno})") from None
        for node in tree.body:
            first = node.lineno
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.decorator_list:
                first = node.decorator_list[0].lineno
            label = None
            for lineno in range(first, node.lineno + 1):
                label = LABEL.search(lines[lineno - 1]) or label
            if label is None:
                continue
            name = getattr(node, "name", None) or ast.unparse(getattr(node, "targets", [node])[0])
            cases.append(Case(str(path), name, first, node.end_lineno or node.lineno, label.group(1), label.group(2)))
    return cases


def run(corpus: Path, target: str) -> dict[str, Any]:
    from torchaxe.scan.engine import ScanOptions, scan_paths
    from torchaxe.scan.formulas.analysis import categories_for

    if not corpus.is_dir():
        raise BenchmarkError(f"--corpus {corpus}: not a folder")
    cases = load_cases(corpus)
    if not cases:
        raise BenchmarkError(f"--corpus {corpus}: no labelled cases")
    started = time.perf_counter()
    result = scan_paths([corpus], ScanOptions(target=target, select=("AX11", "AX120", "AX123"), jobs=1))
    seconds = time.perf_counter() - started
    crashes = [f"{d.path}: {d.message}" for d in result.diagnostics]
    looked_for = sorted(categories_for(target))
    stray: list[str] = []
    by_path: dict[str, list[Case]] = {}
    for case in cases:
        by_path.setdefault(str(Path(case.path).resolve()), []).append(case)
    for finding in result.findings:
        owner = next((c for c in by_path.get(str(Path(finding.path).resolve()), []) if c.contains(finding.line)), None)
        if owner is None:
            stray.append(f"{finding.path}:{finding.line} {finding.code} {finding.category} (outside every case)")
            continue
        owner.findings.append(finding)
    categories: dict[str, dict[str, Any]] = {}
    for category in looked_for:
        positives = [c for c in cases if c.kind == "formula" and c.category == category]
        negatives = [c for c in cases if c.kind == "lookalike" and c.category == category]
        hits = [c for c in positives if any(f.category == category for f in c.findings)]
        false = [c for c in negatives if c.findings]
        wrong = [f"{Path(c.path).name}:{c.first} {c.name}: {f.category}" for c in positives for f in c.findings
                 if f.category != c.category]
        stray_here = [s for s in stray if f" {category} " in s]
        # A finding of this category inside a positive case of another category is a
        # false positive, unless that category is not looked for on this target: then
        # the formula nested in it (the SiLU of a SwiGLU on cpu) is the right finding.
        counted_false = len(false) + sum(1 for c in cases if c.kind == "formula" and c.category != category
                                         and c.category in looked_for
                                         and any(f.category == category for f in c.findings))
        counted_false += len(stray_here)
        recall = len(hits) / len(positives) if positives else None
        fp_rate = counted_false / len(negatives) if negatives else (0.0 if not counted_false else None)
        categories[category] = {
            "positives": len(positives),
            "hits": len(hits),
            "recall": recall,
            "lookalikes": len(negatives),
            "false_positives": counted_false,
            "false_positive_rate": fp_rate,
            "misses": [f"{Path(c.path).name}:{c.first} {c.name}" for c in positives if c not in hits],
            "false_positive_cases": [f"{Path(c.path).name}:{c.first} {c.name}: "
                                     + ", ".join(sorted({f.category for f in c.findings})) for c in false],
            "other_category_findings": wrong,
            "status": "PASS" if (recall is None or recall >= TARGET_RECALL)
            and (fp_rate is not None and fp_rate <= TARGET_FALSE_POSITIVES) else "FAIL",
        }
    positives = [c for c in cases if c.kind == "formula" and c.category in looked_for]
    negatives = [c for c in cases if c.kind == "lookalike" and c.category in looked_for]
    total_false = sum(v["false_positives"] for v in categories.values())
    return {
        "benchmark": "formula_recall",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "corpus": str(corpus),
        "target": target,
        "cases": {"positives": len(positives), "lookalikes": len(negatives)},
        "seconds": round(seconds, 3),
        "overall": {
            "recall": sum(1 for c in positives if any(f.category == c.category for f in c.findings)) / len(positives)
            if positives else None,
            "false_positive_rate": total_false / len(negatives) if negatives else None,
        },
        "categories": categories,
        "stray": stray,
        "diagnostics": crashes,
    }


def _machine() -> dict[str, Any]:
    import importlib.metadata

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {"nproc": os.cpu_count(), "python": platform.python_version(), "torch": torch_version,
            "platform": platform.platform()}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def render_text(data: dict[str, Any], command: str, out: TextIO) -> None:
    w = out.write
    m = data["machine"]
    w(f"torchaxe formula recall  {data['date']}\n")
    w(f"command: {command}\n")
    w(f"machine: {m['nproc']} cores, Python {m['python']}, torch {m['torch']}, {m['platform']}\n")
    w(f"corpus: {data['corpus']} ({data['cases']['positives']} positive cases, {data['cases']['lookalikes']} "
      f"look-alikes), target {data['target']}, scanned in {data['seconds']:.2f} s\n\n")
    w(f"{'category':<12} {'positives':>9} {'found':>6} {'recall':>7}   {'look-alikes':>11} {'false +':>8} "
      f"{'FP rate':>8}   status\n")
    for name, c in data["categories"].items():
        w(f"{name:<12} {c['positives']:>9} {c['hits']:>6} {_pct(c['recall']):>7}   {c['lookalikes']:>11} "
          f"{c['false_positives']:>8} {_pct(c['false_positive_rate']):>8}   {c['status']}\n")
    o = data["overall"]
    w(f"{'all':<12} {data['cases']['positives']:>9} {'':>6} {_pct(o['recall']):>7}   "
      f"{data['cases']['lookalikes']:>11} {'':>8} {_pct(o['false_positive_rate']):>8}\n")
    for name, c in data["categories"].items():
        for miss in c["misses"]:
            w(f"  missed {name}: {miss}\n")
        for fp in c["false_positive_cases"]:
            w(f"  false positive ({name} look-alike): {fp}\n")
        for other in c["other_category_findings"]:
            w(f"  other category in a {name} case: {other}\n")
    for line in data["stray"]:
        w(f"  stray: {line}\n")
    for line in data["diagnostics"]:
        w(f"  diagnostic: {line}\n")
    w(f"\ntargets: recall >= {TARGET_RECALL:.0%} and false positives <= {TARGET_FALSE_POSITIVES:.0%} of the "
      "look-alikes, per category\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Recall and false positives of the formula rules on a labelled corpus.")
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="Folder of labelled cases (default tests/formula_corpus).")
    parser.add_argument("--target", choices=("cpu", "cuda", "npu"), default="npu",
                        help="Target to scan for (default npu: every category has a fused operator there).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    add_save_options(parser)
    return parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise BenchmarkError(message)


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    parser.__class__ = _Parser
    try:
        args = parser.parse_args(argv)
        err.write(f"formula_recall: scanning {args.corpus} for target {args.target}\n")
        data = run(Path(args.corpus), args.target)
    except BenchmarkError as exc:
        err.write(f"formula_recall: error: {exc}\n")
        return 2
    command = shlex.join(["python", "benchmarks/formula_recall.py", *argv])
    data["command"] = command
    save_result(args, "formula_recall", data, argv)
    if args.json:
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        render_text(data, command, out)
    failed = any(c["status"] == "FAIL" for c in data["categories"].values()) or data["diagnostics"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
