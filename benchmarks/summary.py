"""The table of current figures at the top of benchmarks/RESULTS.md, built from the
benchmarks' saved JSON results (``benchmarks/results/*.json``, written by each
script's ``--save``).

Each row reads one saved run (the cold-cache scan row reads ``scan_speed_cold.json``:
``TORCHAXE_NO_CACHE=1 python benchmarks/scan_speed.py --no-torchfix --jobs 2 --out
benchmarks/results/scan_speed_cold.json``). A row whose run is not on disk quotes the figure from
RESULTS.md's log, with its date, machine and commit, and says "no saved run". A figure
is marked stale when the code it measures changed after the commit it was measured at.

    python benchmarks/summary.py                 # print the table (Markdown)
    python benchmarks/summary.py --write         # and put it between the markers of RESULTS.md

Exit code: 0 done, 2 a saved run could not be read or the markers are missing (one line).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
START = "<!-- summary:start -->"
END = "<!-- summary:end -->"
COLUMNS = ("figure", "value", "target", "status", "date", "machine", "commit", "command")

H200 = "NVIDIA H200, 16 cores, Python 3.12, torch 2.11.0+cu130"


class SummaryError(Exception):
    """A saved run that cannot be read, or a RESULTS.md without the markers."""


@dataclass(frozen=True)
class Reading:
    value: str
    status: str  # PASS, FAIL or n/a (no target, or not measured by that run)


@dataclass(frozen=True)
class Quoted:
    """A figure from the log, for a row whose run has no saved JSON."""

    value: str
    status: str
    date: str
    machine: str
    commit: str  # as the log gives it
    command: str
    base: str | None = None  # the commit to check staleness against, when the log names one


@dataclass(frozen=True)
class Row:
    figure: str
    source: str  # stem of the saved run in benchmarks/results/
    target: str
    measures: tuple[str, ...]  # the code the figure depends on (for staleness)
    read: Callable[[dict[str, Any]], Reading | None]
    quoted: Quoted | None = None
    #: What makes the saved run, when not ``python benchmarks/<source>.py``.
    command: str | None = None


# --------------------------------------------------------------------------- readers


def _status(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def _scan_target(result: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    return next((t for t in result.get("targets", []) if t["name"].startswith(prefix)), None)


def _status_of(target: dict[str, Any] | None) -> str:
    if target is None or target.get("status") in (None, "SKIP"):
        return "n/a"
    return target["status"]


def read_full_tree(result: dict[str, Any]) -> Reading | None:
    m = result.get("full_tree", {}).get("jobs=2")
    if not m:
        return None
    noisy = " (noisy)" if m.get("noisy") else ""
    return Reading(f"{m['files_per_s_median']:.1f} files/s{noisy}", _status_of(_scan_target(result, "full tree")))


def read_sample_ratio(result: dict[str, Any]) -> Reading | None:
    ratio = result.get("ratios", {}).get("sample_inprocess_jobs1_vs_torchfix")
    if ratio is None:
        return None
    return Reading(f"{ratio}x", _status_of(_scan_target(result, "sample in-process")))


def read_help(result: dict[str, Any]) -> Reading | None:
    help_run = (result.get("startup") or {}).get("torchaxe_help")
    if not help_run:
        return None
    tf = (result.get("startup") or {}).get("torchfix_help")
    beside = f" (TorchFix {tf['median_seconds']:.2f} s)" if tf and tf.get("median_seconds") else ""
    return Reading(f"{help_run['median_seconds']:.3f} s{beside}", _status_of(_scan_target(result, "torchaxe --help")))


def read_warm_project(result: dict[str, Any]) -> Reading | None:
    ratio = result.get("ratios", {}).get("warm_project_cli_jobs2_vs_torchfix")
    if ratio is None:
        return None
    return Reading(f"{ratio}x", _status_of(_scan_target(result, "warm ")))


def read_crashes(result: dict[str, Any]) -> Reading | None:
    target = _scan_target(result, "zero crashes")
    if target is None:
        return None
    return Reading(f"{target['value']} crashes", _status_of(target))


def read_harness(result: dict[str, Any]) -> Reading | None:
    ratio = result.get("ratio")
    if ratio is None:
        return None
    return Reading(f"{ratio:.3f} ({100 * (ratio - 1):+.1f}%)", result.get("target", {}).get("status", "n/a"))


def scan_failures(result: dict[str, Any]) -> list[str]:
    """A recall run's diagnostics that are the scanner's failures (a rule that raised,
    a file it could not read): a corpus file no Python 3 parses (``.cuda(async=True)``)
    is the corpus's, and its labelled instances already count as misses."""
    return [d for d in result.get("diagnostics") or [] if ": cannot parse: " not in d]


def read_recall(result: dict[str, Any]) -> Reading | None:
    overall, cats = result.get("overall"), result.get("categories")
    if not overall or not cats or overall.get("recall") is None:
        return None
    cases = result.get("cases", {})
    fp = overall.get("false_positive_rate") or 0.0
    value = (f"recall {100 * overall['recall']:.1f}%, false positives {100 * fp:.1f}% "
             f"({cases.get('positives', '?')} cases, {cases.get('lookalikes', '?')} look-alikes, "
             f"target {result.get('target', '?')})")
    ok = all(c.get("status") == "PASS" for c in cats.values()) and not scan_failures(result)
    return Reading(value, _status(ok))


def read_real_recall(result: dict[str, Any]) -> Reading | None:
    overall, corpus = result.get("overall"), result.get("corpus")
    if not overall or not corpus or overall.get("recall") is None:
        return None
    value = (f"recall {100 * overall['recall']:.1f}%, {overall.get('false_positives', '?')} false positives "
             f"({corpus.get('positives', '?')} instances, {corpus.get('lookalikes', '?')} look-alikes, "
             f"{corpus.get('files', '?')} files of {corpus.get('repositories', '?')} repositories)")
    ok = result.get("status") == "PASS" and not scan_failures(result)
    return Reading(value, _status(ok))


def read_e2e_speedup(result: dict[str, Any]) -> Reading | None:
    speedup = result.get("speedup")
    if speedup is None:
        return None
    return Reading(f"{speedup:.2f}x", _status(speedup >= 2.0))


def read_e2e_within(result: dict[str, Any]) -> Reading | None:
    side = result.get("side_by_side")
    ex = result.get("exhaustive") or {}
    chosen = result.get("chosen") or []
    if ex.get("best_is_tuned") or (ex.get("best") and chosen and set(ex["best"].split("+")) == set(chosen)):
        # The exhaustive best is the combination advise chose: a side-by-side run of the
        # two only measured one configuration against itself.
        again = f" (side by side {side['tuned_over_best']:.2f}: the same changes twice)" if side else ""
        return Reading("the best combination itself" + again, _status(True))
    if side:
        return Reading(f"{side['tuned_over_best']:.2f} of the best (side by side)", _status(side["tuned_over_best"] >= 0.9))
    if result.get("speedup") and ex.get("best_speedup"):
        share = result["speedup"] / ex["best_speedup"]
        return Reading(f"{share:.2f} of the best (own rounds)", _status(share >= 0.9))
    return None


def read_real_scripts(result: dict[str, Any]) -> Reading | None:
    scripts, median = result.get("scripts"), result.get("median_speedup")
    if not scripts or median is None:
        return None
    advised = sum(1 for s in scripts if s.get("advised"))
    speedups = [s["speedup"] for s in scripts if s.get("speedup") is not None]
    value = (f"median {median:.2f}x over {len(speedups)} scripts ({min(speedups):.2f}..{max(speedups):.2f}); "
             f"{advised} of {len(scripts)} advised")
    return Reading(value, _status(median >= 1.3 and advised == len(scripts)))


def read_distributed_cut(result: dict[str, Any]) -> Reading | None:
    before, after, cut = result.get("exposed_before_s"), result.get("exposed_after_s"), result.get("exposed_cut")
    if cut is None or before is None or after is None:
        return None
    value = (f"exposed communication {1000 * before:.1f} -> {1000 * after:.1f} ms a step (cut {cut:.0%}); "
             f"tuned {result['speedup']:.2f}x" if result.get("speedup") else
             f"exposed communication {1000 * before:.1f} -> {1000 * after:.1f} ms a step (cut {cut:.0%})")
    return Reading(value, _status(cut >= 0.5))


def read_compile(result: dict[str, Any]) -> Reading | None:
    runs = result.get("results")
    if not runs:
        return None
    value = "; ".join(f"{r['example']}: pick {r['pick']}, fastest {r['fastest']}" for r in runs)
    return Reading(value, _status(all(r.get("pick_ok") for r in runs)))


def read_tune(result: dict[str, Any]) -> Reading | None:
    steps, tuning = result.get("steps"), result.get("tuning", {})
    if not steps or steps.get("speedup") is None:
        return None
    cold = tuning.get("cold_seconds")
    cold_text = f"; cold tune {cold:.1f} s, warm measures {tuning.get('warm_measured')}" if isinstance(cold, float) \
        and cold == cold else ""
    ok = all(v is not False for v in result.get("targets", {}).values())
    return Reading(f"{steps['speedup']:.2f}x step{cold_text}", _status(ok))


def read_data(result: dict[str, Any]) -> Reading | None:
    targets = result.get("targets")
    before = (result.get("before") or {}).get("data_wait_fraction")
    after = (result.get("after") or {}).get("data_wait_fraction")
    if not targets or before is None or after is None:
        return None
    within = result.get("search_vs_grid_throughput")
    trials = (result.get("search") or {}).get("trials"), (result.get("grid") or {}).get("trials")
    value = (f"data wait {100 * before:.1f}% -> {100 * after:.1f}%; search pick "
             f"{within:.3f}x the grid's; {trials[0]} of {trials[1]} trials" if within is not None else
             f"data wait {100 * before:.1f}% -> {100 * after:.1f}%")
    return Reading(value, _status(all(t["pass"] for t in targets)))


def read_binding(result: dict[str, Any]) -> Reading | None:
    if result.get("ratio_median") is None:
        return None
    return Reading(f"bound/unbound {result['ratio_median']:.3f} ({result['ratio_min']:.3f}..{result['ratio_max']:.3f})",
                   "n/a")


def read_mfu(result: dict[str, Any]) -> Reading | None:
    """MFU before -> after advise of each example (measured peak; the table peak beside
    it where the device has one). Reported, no target: n/a."""
    examples = [e for e in result.get("examples") or [] if (e.get("before") or {}).get("mfu_measured") is not None]
    if not examples:
        return None

    def pct(run: dict[str, Any] | None, key: str) -> str:
        value = (run or {}).get(key)
        return "n/a" if value is None else f"{100 * value:.1f}%"

    parts = []
    for e in examples:
        text = f"{e['example']} {pct(e['before'], 'mfu_measured')} -> {pct(e.get('after'), 'mfu_measured')}"
        if (e["before"] or {}).get("mfu_table") is not None:
            text += f" (table peak {pct(e['before'], 'mfu_table')} -> {pct(e.get('after'), 'mfu_table')})"
        if e.get("speedup"):
            text += f", step {e['speedup']:.2f}x"
        parts.append(text)
    return Reading("; ".join(parts), "n/a")


# --------------------------------------------------------------------------- the rows

ROWS: tuple[Row, ...] = (
    Row("Scan speed, warm cache (torch's tree, 2285 files, `--jobs 2`)", "scan_speed", ">= 300 files/s",
        ("src/torchaxe/scan",), read_full_tree),
    Row("Scan speed, cold cache (`TORCHAXE_NO_CACHE=1`, `--jobs 2`)", "scan_speed_cold", ">= 300 files/s",
        ("src/torchaxe/scan",), read_full_tree),
    Row("Scan vs TorchFix (same 150 files, in-process `--jobs 1`)", "scan_speed", ">= 100x",
        ("src/torchaxe/scan",), read_sample_ratio),
    Row("Warm 81-file project scan vs TorchFix (CLI, `--jobs 2`)", "scan_speed", ">= 40x",
        ("src/torchaxe/scan", "src/torchaxe/cli.py"), read_warm_project),
    Row("CLI start-up (`torchaxe --help`)", "scan_speed", "<= 0.3 s",
        ("src/torchaxe/cli.py", "src/torchaxe/__init__.py"), read_help),
    Row("Rule crashes (AX906) on torch's tree", "scan_speed", "0",
        ("src/torchaxe/scan",), read_crashes),
    Row("Harness overhead (GPT example, step time with/without)", "harness_overhead", "<= 1.03",
        ("src/torchaxe/runtime",), read_harness),
    Row("Formula recall on the corpus (AX110-AX120)", "formula_recall", ">= 95% recall, <= 2% false positives",
        ("src/torchaxe/scan/formulas", "src/torchaxe/scan/rules", "tests/formula_corpus"), read_recall),
    Row("Scanner recall on public code (benchmarks/real_corpus.toml)", "real_recall", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus.toml"), read_real_recall),
    Row("Distributed rules' recall on public code (AX601-AX606, benchmarks/real_corpus_distributed.toml)",
        "real_recall_distributed", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_distributed.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_distributed.toml"),
    Row("Formula rules' recall on public model code (AX110-AX120, benchmarks/real_corpus_formulas.toml)",
        "real_recall_formulas", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_formulas.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_formulas.toml"),
    Row("Scanner on a review corpus of 8 more repositories (AX103, AX116, AX120, AX30x; benchmarks/real_corpus_review.toml)",
        "real_recall_review", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_review.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_review.toml"),
    Row("Weight-average and loss-scaler rules on public code (AX205, AX702; benchmarks/real_corpus_averages.toml)",
        "real_recall_averages", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_averages.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_averages.toml"),
    Row("Binary cross-entropy on a sigmoid's output in public code (AX703; benchmarks/real_corpus_bce.toml)",
        "real_recall_bce", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_bce.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_bce.toml"),
    Row("Recurrent cells stepped over a known sequence in public code (AX121; benchmarks/real_corpus_cells.toml)",
        "real_recall_cells", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_cells.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_cells.toml"),
    Row("Cross-entropies written by hand in public code (AX122; benchmarks/real_corpus_xent.toml)",
        "real_recall_xent", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_xent.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_xent.toml"),
    Row("Sizes decided by tensor values on every training step in public code (AX307; "
        "benchmarks/real_corpus_syncs.toml)",
        "real_recall_syncs", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_syncs.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_syncs.toml"),
    Row("Held-out corpus: every scanner class on public code labelled before any scan (benchmarks/real_corpus_heldout.toml)",
        "real_recall_heldout", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_heldout.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_heldout.toml"),
    Row("Second held-out corpus: every scanner class on public code labelled before any scan "
        "(benchmarks/real_corpus_heldout2.toml)",
        "real_recall_heldout2", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_heldout2.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_heldout2.toml"),
    Row("Third held-out corpus: every scanner class on public code labelled before any scan "
        "(benchmarks/real_corpus_heldout3.toml)",
        "real_recall_heldout3", ">= 90% recall, 0 false positives",
        ("src/torchaxe/scan", "benchmarks/real_corpus_heldout3.toml"), read_real_recall,
        command="python benchmarks/real_recall.py --manifest benchmarks/real_corpus_heldout3.toml"),
    Row("advise end to end, CPU (GPT example, tuned vs original)", "end_to_end", ">= 2x",
        ("src/torchaxe",), read_e2e_speedup),
    Row("advise end to end, CPU: tuned vs the best combination", "end_to_end", ">= 0.9 of the best",
        ("src/torchaxe",), read_e2e_within),
    Row("advise under torchrun, CPU (DDP example, 2 ranks, gloo): exposed communication", "distributed",
        "cut >= 50%", ("src/torchaxe",), read_distributed_cut,
        command="python benchmarks/distributed.py --budget 5m --repeats 3"),
    Row("advise under torchrun, CPU: tuned vs the best distributed combination", "distributed",
        ">= 0.9 of the best", ("src/torchaxe",), read_e2e_within,
        command="python benchmarks/distributed.py --budget 5m --repeats 3"),
    Row("advise on real and framework scripts, CPU (advise, apply, run; each script's own step log)",
        "real_scripts", ">= 1.3x median; every script advised", ("src/torchaxe",), read_real_scripts),
    Row("advise end to end, H200 (larger GPT, tuned vs original)", "end_to_end_cuda", ">= 2x",
        ("src/torchaxe",), read_e2e_speedup,
        Quoted("2.07x", "PASS", "2026-11-30 23:45 UTC", H200, "not recorded (after `961074e`)",
               "benchmarks/gpu_checks.sh e2e (end_to_end.py --target cuda --budget 180s --repeats 2 --pruned "
               "--max-combinations 4 --check-accuracy)", "961074e")),
    Row("advise end to end, H200: tuned vs the best combination", "end_to_end_cuda", ">= 0.9 of the best",
        ("src/torchaxe",), read_e2e_within,
        Quoted("0.42 of the best (own rounds)", "FAIL", "2026-11-30 23:45 UTC", H200, "not recorded (after `961074e`)",
               "benchmarks/gpu_checks.sh e2e", "961074e")),
    Row("Compile-mode choice, CPU (the pick is the fastest)", "compile_mode", "within 5% of the fastest",
        ("src/torchaxe/shapes",), read_compile),
    Row("Compile-mode choice, H200 (GPT)", "compile_mode_cuda", "within 5% of the fastest",
        ("src/torchaxe/shapes",), read_compile,
        Quoted("gpt: pick compile-static, fastest compile-static", "PASS", "2026-11-30 23:32 UTC", H200,
               "not recorded (after `961074e`)",
               "python benchmarks/compile_mode.py --target cuda --only gpt --repeats 2 --steps 20", "961074e")),
    Row("Auto-tuning (`torchaxe tune`, GPT example, eager vs tuned step)", "tune", ">= 1.3x; warm run tunes nothing",
        ("src/torchaxe/tune",), read_tune),
    Row("Data-loader tuning (image example, 32-step epochs)", "data_tuning",
        "wait < 5%; search within 10% of the grid; <= 1/3 of its trials", ("src/torchaxe/data",), read_data),
    Row("MFU of the examples, CPU (measured peak, before -> after advise)", "mfu",
        "reported, no target (a faster run may show a lower MFU against a higher bf16 peak)",
        ("src/torchaxe",), read_mfu),
    Row("MFU of the GPT example, GPU (measured and table peak, before -> after advise)", "mfu_cuda",
        "reported, no target (a faster run may show a lower MFU against a higher bf16 peak)",
        ("src/torchaxe",), read_mfu, command="benchmarks/gpu_checks.sh (part mfu: benchmarks/mfu.py --target cuda)"),
    Row("Core binding (2-rank gloo MLP, bound vs unbound)", "binding", "a gain on a multi-NUMA machine (not run there)",
        ("src/torchaxe/bind",), read_binding),
)


# --------------------------------------------------------------------------- building the table


def load_runs(folder: Path) -> dict[str, dict[str, Any]]:
    """Every ``*.json`` of ``folder`` by stem. A saved run wraps the script's output under
    ``result``; a bare ``--json`` output (scan_speed.py's carries its own date, machine and
    command) is read as it is."""
    runs: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SummaryError(f"{path}: not a saved run ({exc})") from None
        if not isinstance(data, dict):
            raise SummaryError(f"{path}: not a saved run (not a JSON object)")
        runs[path.stem] = data
    return runs


def provenance(data: dict[str, Any]) -> tuple[str, str, str | None, str]:
    """(date, machine, commit, command) of a saved run or a bare output."""
    result = data.get("result", data) if isinstance(data.get("result"), dict) else data
    date = str(data.get("date") or result.get("date") or "?")
    machine = data.get("machine") or result.get("machine") or "?"
    if isinstance(machine, dict):
        machine = ", ".join(str(machine[k]) + suffix for k, suffix in
                            (("nproc", " cores"), ("cpu_model", ""), ("torch", "")) if machine.get(k))
    commit = data.get("commit")
    if not commit and isinstance(result.get("machine"), dict):
        commit = result["machine"].get("torchaxe_git")
    command = str(data.get("command") or result.get("command") or "?")
    return date.replace("T", " ").replace("+00:00", " UTC"), str(machine), commit, command


def git_changed_since(commit: str, paths: tuple[str, ...], root: Path = ROOT) -> bool | None:
    """Whether any of ``paths`` changed between ``commit`` and HEAD (None: git cannot tell)."""
    try:
        done = subprocess.run(["git", "diff", "--quiet", commit.split("+")[0], "HEAD", "--", *paths], cwd=root,
                              capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: False, 1: True}.get(done.returncode)


def table_rows(runs: dict[str, dict[str, Any]],
               changed_since: Callable[[str, tuple[str, ...]], bool | None] = git_changed_since,
               rows: tuple[Row, ...] = ROWS) -> list[dict[str, str]]:
    out = []
    for row in rows:
        data = runs.get(row.source)
        result = data.get("result", data) if data and isinstance(data.get("result"), dict) else data
        reading = row.read(result) if result else None
        if reading is not None:
            date, machine, commit, command = provenance(data)
            value, status, base = reading.value, reading.status, commit
            commit_text = f"`{commit}`" if commit else "not recorded"
        elif row.quoted is not None:
            q = row.quoted
            why = "no saved run" if data is None else "not in the saved run"
            value, status, date, machine, commit_text, command, base = (
                f"{q.value} ({why}; from the log)", q.status, q.date, q.machine, q.commit, q.command, q.base)
        else:
            out.append({"figure": row.figure, "value": "not measured yet", "target": row.target, "status": "n/a",
                        "date": "-", "machine": "-", "commit": "-", "command": row.command or f"python benchmarks/{row.source}.py"})
            continue
        if base and status != "n/a" and changed_since(base, row.measures):
            status += ", stale"
        out.append({"figure": row.figure, "value": value, "target": row.target, "status": status, "date": date,
                    "machine": machine, "commit": commit_text, "command": f"`{command}`"})
    return out


def render_markdown(rows: list[dict[str, str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    lines += ["",
              "Produced by `benchmarks/summary.py` from `benchmarks/results/*.json` (each script's `--save`). "
              "\"no saved run\": the figure is quoted from the log below. \"stale\": the code it measures "
              "changed after the commit it was measured at."]
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str) -> str:
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise SummaryError(f"the markers {START} and {END} are missing")
    return text[: start + len(START)] + "\n" + block + text[end:]


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None,
         changed_since: Callable[[str, tuple[str, ...]], bool | None] = git_changed_since) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(RESULTS_DIR), help="folder of saved runs (default benchmarks/results)")
    parser.add_argument("--write", nargs="?", const=str(RESULTS_MD), metavar="FILE",
                        help="also replace the block between the summary markers of FILE (default RESULTS.md)")
    args = parser.parse_args(argv)
    try:
        block = render_markdown(table_rows(load_runs(Path(args.results)), changed_since))
        if args.write:
            path = Path(args.write)
            text = replace_block(path.read_text(encoding="utf-8"), block)
            sys.path.insert(0, str(ROOT / "src"))
            from torchaxe.atomic import write_text_atomic

            write_text_atomic(path, text)
    except (SummaryError, OSError) as exc:
        err.write(f"summary: error: {exc}\n")
        return 2
    out.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
