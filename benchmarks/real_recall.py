"""How well the scanner finds its patterns in real public code nobody wrote for it.

Reads a manifest (default ``benchmarks/real_corpus.toml``) that names files of public
repositories, each at one commit, with labelled line ranges: a *positive* is code the
scanner must report (one finding of the class's rules inside the range), a *look-alike*
is code that resembles a pattern and must not be reported (no finding of the class's
rules inside it). The code itself is not kept here: ``--sources DIR`` is a folder laid
out as ``DIR/owner+repo/path`` (``DIR/owner+repo@COMMIT12/path`` for a file taken at
another commit than the repository's other files); ``--print-fetch`` prints the git
commands that fill it.

Per class, and over all classes, it reports recall (positives found / positives) and
false positives (look-alikes reported). Targets: recall >= 90 % over all classes and
no false positive. Results go to stdout (a table, or ``--json``), progress to stderr.
Exit code: 0 targets met, 1 a target missed, 2 the benchmark could not run (one line
on stderr).

    .venv/bin/python benchmarks/real_recall.py --print-fetch --sources /tmp/real > fetch.sh
    sh fetch.sh
    TORCHAXE_NO_CACHE=1 .venv/bin/python benchmarks/real_recall.py --sources /tmp/real
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MANIFEST = ROOT / "benchmarks" / "real_corpus.toml"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, machine_line, save_result  # noqa: E402

TARGET_RECALL = 0.90
TARGET_FALSE_POSITIVES = 0
TARGET = "npu"  # every class has a replacement there (rotary has one on npu only)
#: Each class, the rules whose findings count for it (code prefixes).
CLASSES: dict[str, tuple[str, ...]] = {
    "attention_layout": ("AX118",),
    "chunked_attention": ("AX118",),
    "rotary_apply": ("AX119",),
    "channel_layer_norm": ("AX116",),
    "optimizer_kwargs": ("AX201",),
    # The host syncs (AX301-AX304); AX305/AX306 are copies, not syncs, and have no class.
    "loop_sync_helper": ("AX301", "AX302", "AX303", "AX304"),
    "ddp_accumulation": ("AX601",),
    "sampler_epoch": ("AX602",),
    "collective_logging": ("AX603",),
    "find_unused": ("AX604",),
    "ddp_device_order": ("AX605",),
    "compile_wrapper_order": ("AX606",),
    # benchmarks/real_corpus_formulas.toml: one class per formula rule.
    "attention": ("AX118",),
    "rotary": ("AX119",),
    "rms_norm": ("AX115",),
    "layer_norm": ("AX116",),
    "gelu_tanh": ("AX110",),
    "gelu_erf": ("AX111",),
    "quick_gelu": ("AX112",),
    "silu": ("AX113",),
    "mish": ("AX120",),
    "swiglu": ("AX114",),
    # benchmarks/real_corpus_review.toml: operators named after a fused one (AX103), read
    # by name; and the host syncs of training loops (AX301-AX304).
    "fused_op_name": ("AX103",),
    "loop_sync": ("AX301", "AX302", "AX303", "AX304"),
    # benchmarks/real_corpus_averages.toml: moving averages of weights kept one tensor at
    # a time (AX205), and gradient scalers beside bfloat16 autocast (AX702).
    "ema_loop": ("AX205",),
    "grad_scaler_bf16": ("AX702",),
    # benchmarks/real_corpus_bce.toml: binary cross-entropy on a sigmoid's output (AX703).
    "bce_on_sigmoid": ("AX703",),
    # benchmarks/real_corpus_cells.toml: recurrent cells stepped over a known sequence (AX121).
    "cell_loop": ("AX121",),
    # benchmarks/real_corpus_xent.toml: cross-entropies written by hand (AX122).
    "hand_xent": ("AX122",),
    # benchmarks/real_corpus_syncs.toml: sizes decided by tensor values on every step (AX307).
    "mask_index_sync": ("AX307",),
    # benchmarks/real_corpus_heldout.toml: the classes above, and optimizers left unfused.
    "unfused_optimizer": ("AX201",),
}
KINDS = ("positive", "lookalike")


class BenchmarkError(Exception):
    """A reason the benchmark cannot run, in one line."""


@dataclass
class Case:
    repo: str
    commit: str
    path: str
    first: int
    last: int
    cls: str
    kind: str
    note: str = ""
    findings: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.repo}/{self.path}:{self.first}-{self.last}"


def load_manifest(path: Path) -> list[Case]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BenchmarkError(f"--manifest {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise BenchmarkError(f"--manifest {path}: not TOML ({exc})") from None
    cases: list[Case] = []
    for i, entry in enumerate(data.get("file", [])):
        try:
            repo, commit, file_path = str(entry["repo"]), str(entry["commit"]), str(entry["path"])
            for case in entry["cases"]:
                first, last = (int(n) for n in case["lines"])
                cls, kind = str(case["class"]), str(case["kind"])
                if cls not in CLASSES or kind not in KINDS or first > last:
                    raise ValueError(f"{cls}/{kind} lines {first}-{last}")
                cases.append(Case(repo, commit, file_path, first, last, cls, kind, str(case.get("note", ""))))
        except (KeyError, TypeError, ValueError) as exc:
            raise BenchmarkError(f"--manifest {path}: file entry {i + 1} is malformed ({exc})") from None
    if not cases:
        raise BenchmarkError(f"--manifest {path}: no labelled cases")
    return cases


def context_files(path: Path) -> list[tuple[str, str, str]]:
    """``(repo, commit, path)`` of the manifest's entries with no cases: other files of
    a labelled repository (the model a training script imports, a helper it calls),
    scanned with the labelled ones as a scan of the project would, and never counted."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return [(str(e["repo"]), str(e["commit"]), str(e["path"])) for e in data.get("file", []) if not e.get("cases")]


def source_folders(cases: list[Case]) -> dict[tuple[str, str], str]:
    """The folder name of each (repo, commit): ``owner+repo`` for the commit most of
    the repository's files come from, ``owner+repo@COMMIT12`` for any other."""
    counts: dict[str, dict[str, int]] = {}
    for case in {(c.repo, c.commit, c.path): c for c in cases}.values():
        counts.setdefault(case.repo, {}).setdefault(case.commit, 0)
        counts[case.repo][case.commit] += 1
    folders = {}
    for repo, commits in counts.items():
        main = max(sorted(commits), key=lambda c: commits[c])
        for commit in commits:
            name = repo.replace("/", "+", 1)
            folders[(repo, commit)] = name if commit == main else f"{name}@{commit[:12]}"
    return folders


def _context_folders(cases: list[Case], context: list[tuple[str, str, str]]) -> dict[tuple[str, str], str]:
    folders = source_folders(cases)
    for repo, commit, path in context:
        if (repo, commit) not in folders:
            raise BenchmarkError(f"context file {repo}/{path}: no labelled case of {repo} at {commit[:12]}")
    return folders


def fetch_commands(cases: list[Case], sources: Path, context: list[tuple[str, str, str]] = ()) -> str:
    """Shell commands that clone each repository once and write every listed file at
    its commit (the context files too) into the ``--sources`` layout."""
    folders = _context_folders(cases, list(context))
    lines = ["set -e", f"mkdir -p {shlex.quote(str(sources))}", "clones=$(mktemp -d)"]
    listed = {(c.repo, c.commit, c.path) for c in cases} | set(context)
    for repo in sorted({c.repo for c in cases}):
        clone = "$clones/" + repo.replace("/", "+", 1)
        lines.append(f"git clone --quiet --filter=blob:none https://github.com/{repo}.git \"{clone}\"")
        for (r, commit, path) in sorted(item for item in listed if item[0] == repo):
            target = sources / folders[(r, commit)] / path
            lines.append(f"mkdir -p {shlex.quote(str(target.parent))}")
            lines.append(f"git -C \"{clone}\" show {commit}:{shlex.quote(path)} > {shlex.quote(str(target))}")
    lines.append('rm -rf "$clones"')
    return "\n".join(lines) + "\n"


def run(cases: list[Case], sources: Path, context: list[tuple[str, str, str]] = ()) -> dict[str, Any]:
    from torchaxe.scan.engine import ScanOptions, scan_paths

    if not sources.is_dir():
        raise BenchmarkError(f"--sources {sources}: not a folder (fill it with --print-fetch)")
    folders = _context_folders(cases, list(context))
    files: dict[Path, list[Case]] = {}
    for case in cases:
        files.setdefault(sources / folders[(case.repo, case.commit)] / case.path, []).append(case)
    for repo, commit, path in context:
        files.setdefault(sources / folders[(repo, commit)] / path, [])
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise BenchmarkError(f"--sources {sources}: {len(missing)} listed files are missing, e.g. {missing[0]}")
    labelled = [cls for cls in CLASSES if any(c.cls == cls for c in cases)]
    select = tuple(sorted({code for cls in labelled for code in CLASSES[cls]}))
    started = time.perf_counter()
    result = scan_paths(sorted(files), ScanOptions(target=TARGET, select=select, jobs=1))
    seconds = time.perf_counter() - started
    by_file = {str(p.resolve()): group for p, group in files.items()}
    for finding in result.findings:
        for case in by_file.get(str(Path(finding.path).resolve()), ()):
            if case.first <= finding.line <= case.last and finding.code.startswith(CLASSES[case.cls]):
                case.findings.append(f"{finding.code}:{finding.line}")
    classes: dict[str, dict[str, Any]] = {}
    for cls in labelled:
        positives = [c for c in cases if c.cls == cls and c.kind == "positive"]
        lookalikes = [c for c in cases if c.cls == cls and c.kind == "lookalike"]
        hits = [c for c in positives if c.findings]
        false = [c for c in lookalikes if c.findings]
        classes[cls] = {
            "rules": list(CLASSES[cls]),
            "positives": len(positives),
            "found": len(hits),
            "recall": len(hits) / len(positives) if positives else None,
            "lookalikes": len(lookalikes),
            "false_positives": len(false),
            "misses": [f"{c.where}" + (f" ({c.note})" if c.note else "") for c in positives if not c.findings],
            "false_positive_cases": [f"{c.where} {', '.join(c.findings)}" + (f" ({c.note})" if c.note else "")
                                     for c in false],
        }
    positives = [c for c in cases if c.kind == "positive"]
    lookalikes = [c for c in cases if c.kind == "lookalike"]
    found = sum(1 for c in positives if c.findings)
    false = sum(1 for c in lookalikes if c.findings)
    recall = found / len(positives) if positives else None
    return {
        "benchmark": "real_recall",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_line(),
        "target": TARGET,
        "corpus": {"files": sum(1 for group in files.values() if group), "context_files": len(context),
                   "repositories": len({c.repo for c in cases}), "positives": len(positives),
                   "lookalikes": len(lookalikes)},
        "seconds": round(seconds, 3),
        "overall": {"found": found, "recall": recall, "false_positives": false},
        "classes": classes,
        "diagnostics": [f"{d.path}: {d.message}" for d in result.diagnostics],
        "targets": {"recall": TARGET_RECALL, "false_positives": TARGET_FALSE_POSITIVES},
        "status": "PASS" if recall is not None and recall >= TARGET_RECALL and false <= TARGET_FALSE_POSITIVES
        else "FAIL",
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def render_text(data: dict[str, Any], command: str, out: TextIO) -> None:
    w = out.write
    corpus = data["corpus"]
    w(f"torchaxe real-code recall  {data['date']}\n")
    w(f"command: {command}\n")
    w(f"machine: {data['machine']}\n")
    extra = f" (and {corpus['context_files']} unlabelled files they import)" if corpus.get("context_files") else ""
    w(f"corpus: {corpus['positives']} positives and {corpus['lookalikes']} look-alikes in {corpus['files']} files of "
      f"{corpus['repositories']} repositories{extra}, target {data['target']}, scanned in {data['seconds']:.2f} s\n\n")
    w(f"{'class':<21} {'rules':<11} {'positives':>9} {'found':>6} {'recall':>7}   {'look-alikes':>11} {'false +':>8}\n")
    for name, c in data["classes"].items():
        rules = c["rules"][0] if len(c["rules"]) == 1 else f"{c['rules'][0]}-{c['rules'][-1]}"
        w(f"{name:<21} {rules:<11} {c['positives']:>9} {c['found']:>6} {_pct(c['recall']):>7}   "
          f"{c['lookalikes']:>11} {c['false_positives']:>8}\n")
    o = data["overall"]
    w(f"{'all':<21} {'':<11} {corpus['positives']:>9} {o['found']:>6} {_pct(o['recall']):>7}   "
      f"{corpus['lookalikes']:>11} {o['false_positives']:>8}\n")
    for name, c in data["classes"].items():
        for miss in c["misses"]:
            w(f"  missed {name}: {miss}\n")
        for fp in c["false_positive_cases"]:
            w(f"  false positive ({name}): {fp}\n")
    for line in data["diagnostics"]:
        w(f"  diagnostic: {line}\n")
    w(f"\ntargets: recall >= {TARGET_RECALL:.0%} over all classes, no false positive: {data['status']}\n")


def benchmark_name(manifest: Path) -> str:
    """The name a run is saved under: ``real_recall`` for the default manifest,
    ``real_recall_<x>`` for ``real_corpus_<x>.toml`` (each corpus keeps its own result)."""
    stem = manifest.stem
    if manifest.resolve() == DEFAULT_MANIFEST.resolve() or not stem.startswith("real_corpus_"):
        return "real_recall"
    return "real_recall_" + stem[len("real_corpus_"):]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise BenchmarkError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(description="Recall and false positives of the scanner on labelled public code.")
    parser.add_argument("--manifest", default=str(DEFAULT_MANIFEST),
                        help="The labelled files (default benchmarks/real_corpus.toml).")
    parser.add_argument("--sources", required=True, help="Folder holding the files: DIR/owner+repo/path.")
    parser.add_argument("--print-fetch", action="store_true",
                        help="Print the git commands that fill --sources, and exit.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    add_save_options(parser)
    return parser


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        cases = load_manifest(Path(args.manifest))
        context = context_files(Path(args.manifest))
        if args.print_fetch:
            out.write(fetch_commands(cases, Path(args.sources), context))
            return 0
        err.write(f"real_recall: scanning {len(cases)} labelled cases under {args.sources}\n")
        data = run(cases, Path(args.sources), context)
    except BenchmarkError as exc:
        err.write(f"real_recall: error: {exc}\n")
        return 2
    command = shlex.join(["python", "benchmarks/real_recall.py", *argv])
    data["command"] = command
    save_result(args, benchmark_name(Path(args.manifest)), data, argv, script="real_recall")
    if args.json:
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        render_text(data, command, out)
    return 0 if data["status"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
