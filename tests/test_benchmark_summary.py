"""benchmarks/summary.py builds the table of current figures from saved runs."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def summary():
    yield _load("summary")
    sys.modules.pop("summary_bench", None)


def never_changed(commit, paths):
    return False


def _saved(folder: Path, name: str, result: dict, commit: str = "abc1234") -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({
        "benchmark": name, "date": "2026-12-02T09:00:00+00:00", "commit": commit, "machine": "2 cores, test CPU",
        "command": f"python benchmarks/{name}.py --save", "result": result}))


def _scan_speed(rate: float, ratio: float, help_s: float | None = None, warm: float | None = None) -> dict:
    targets = [
        {"name": "full tree --jobs 2 >= 300 files/s", "value": rate, "status": "PASS" if rate >= 300 else "FAIL"},
        {"name": "sample in-process --jobs 1 >= 100x torchfix", "value": ratio,
         "status": "PASS" if ratio >= 100 else "FAIL"},
        {"name": "zero crashes (AX906)", "value": 0, "status": "PASS"},
    ]
    data = {"benchmark": "scan_speed", "date": "2026-12-02T10:00:00+00:00", "command": "python benchmarks/scan_speed.py",
            "machine": {"nproc": 16, "cpu_model": "Test CPU", "torch": "2.13.0", "torchaxe_git": "def5678"},
            "full_tree": {"jobs=2": {"files_per_s_median": rate, "noisy": False}},
            "ratios": {"sample_inprocess_jobs1_vs_torchfix": ratio, "warm_project_cli_jobs2_vs_torchfix": warm},
            "targets": targets}
    if help_s is not None:
        data["startup"] = {"torchaxe_help": {"median_seconds": help_s}, "torchfix_help": {"median_seconds": 1.5}}
        targets.append({"name": "torchaxe --help <= 0.3 s", "value": help_s, "status": "PASS" if help_s <= 0.3 else "FAIL"})
        targets.append({"name": "warm 81-file project CLI --jobs 2 >= 40x torchfix", "value": warm,
                        "status": "PASS" if warm >= 40 else "FAIL"})
    return data


def _rows(summary, folder: Path, changed=never_changed) -> dict[str, dict[str, str]]:
    return {r["figure"]: r for r in summary.table_rows(summary.load_runs(folder), changed)}


def _row(rows: dict, start: str) -> dict[str, str]:
    return next(r for f, r in rows.items() if f.startswith(start))


def test_a_bare_scan_speed_output_fills_its_rows(summary, tmp_path):
    (tmp_path / "scan_speed.json").write_text(json.dumps(_scan_speed(412.3, 180.0, help_s=0.21, warm=55.5)))
    rows = _rows(summary, tmp_path)
    warm = _row(rows, "Scan speed, warm")
    assert warm["value"] == "412.3 files/s" and warm["status"] == "PASS"
    assert warm["commit"] == "`def5678`" and warm["date"] == "2026-12-02 10:00:00 UTC"
    assert warm["machine"] == "16 cores, Test CPU, 2.13.0"
    assert _row(rows, "Scan vs TorchFix")["value"] == "180.0x"
    assert _row(rows, "CLI start-up")["value"] == "0.210 s (TorchFix 1.50 s)"
    assert _row(rows, "CLI start-up")["status"] == "PASS"
    assert _row(rows, "Warm 81-file")["value"] == "55.5x"


def test_pass_and_fail_follow_the_targets(summary, tmp_path):
    (tmp_path / "scan_speed.json").write_text(json.dumps(_scan_speed(250.0, 90.0, help_s=0.45, warm=12.0)))
    _saved(tmp_path, "harness_overhead", {"ratio": 1.051, "target": {"status": "FAIL"}})
    _saved(tmp_path, "end_to_end", {"speedup": 1.93, "side_by_side": {"tuned_over_best": 0.95},
                                    "exhaustive": {"best_speedup": 2.1}})
    _saved(tmp_path, "tune", {"steps": {"speedup": 1.35}, "tuning": {"cold_seconds": 80.0, "warm_measured": 0},
                              "targets": {"speedup_at_least_1.3": True, "warm_tunes_nothing": True}})
    _saved(tmp_path, "data_tuning", {"before": {"data_wait_fraction": 0.2}, "after": {"data_wait_fraction": 0.07},
                                     "search_vs_grid_throughput": 0.98, "search": {"trials": 7}, "grid": {"trials": 26},
                                     "targets": [{"name": "wait", "pass": False, "value": "7.0%"},
                                                 {"name": "within", "pass": True, "value": "0.98x"}]})
    _saved(tmp_path, "compile_mode", {"results": [
        {"example": "gpt", "pick": "compile-static", "fastest": "compile-dynamic", "pick_ok": True},
        {"example": "seq_varlen", "pick": "eager", "fastest": "compile-static", "pick_ok": False}]})
    rows = _rows(summary, tmp_path)
    assert _row(rows, "Scan speed, warm")["status"] == "FAIL"
    assert _row(rows, "Scan vs TorchFix")["status"] == "FAIL"
    assert _row(rows, "CLI start-up")["status"] == "FAIL"
    assert _row(rows, "Warm 81-file")["status"] == "FAIL"
    assert _row(rows, "Harness overhead")["value"] == "1.051 (+5.1%)"
    assert _row(rows, "Harness overhead")["status"] == "FAIL"
    assert _row(rows, "advise end to end, CPU (")["status"] == "FAIL"
    within = _row(rows, "advise end to end, CPU:")
    assert within["status"] == "PASS" and within["value"] == "0.95 of the best (side by side)"
    assert _row(rows, "Auto-tuning")["status"] == "PASS"
    assert _row(rows, "Data-loader")["status"] == "FAIL"
    assert _row(rows, "Compile-mode choice, CPU")["status"] == "FAIL"
    assert _row(rows, "advise end to end, CPU (")["commit"] == "`abc1234`"


def test_the_best_combination_being_the_chosen_one_meets_the_within_target(summary, tmp_path):
    # Two copies of one configuration differ by noise alone: that is no shortfall.
    chosen = ["knob:tf32", "knob:autocast-bf16", "knob:compile"]
    _saved(tmp_path, "end_to_end_cuda", {"speedup": 3.6, "chosen": chosen,
                                         "side_by_side": {"tuned_over_best": 0.88},
                                         "exhaustive": {"best": "knob:compile+knob:tf32+knob:autocast-bf16",
                                                        "best_speedup": 4.2}})
    row = _row(_rows(summary, tmp_path), "advise end to end, H200:")
    assert row["status"] == "PASS"
    assert row["value"] == "the best combination itself (side by side 0.88: the same changes twice)"
    # A different best is judged by the side-by-side ratio.
    _saved(tmp_path, "end_to_end_cuda", {"speedup": 3.6, "chosen": chosen[:2],
                                         "side_by_side": {"tuned_over_best": 0.88},
                                         "exhaustive": {"best": "+".join(chosen), "best_speedup": 4.2}})
    row = _row(_rows(summary, tmp_path), "advise end to end, H200:")
    assert row["status"] == "FAIL" and row["value"] == "0.88 of the best (side by side)"


def test_the_real_scripts_row_needs_every_script_advised_and_the_median(summary, tmp_path):
    scripts = [{"name": "a", "speedup": 1.5, "advised": True}, {"name": "b", "speedup": 1.2, "advised": True},
               {"name": "c", "speedup": 1.4, "advised": True}]
    _saved(tmp_path, "real_scripts", {"scripts": scripts, "median_speedup": 1.4})
    row = _row(_rows(summary, tmp_path), "advise on real and framework scripts")
    assert row["value"] == "median 1.40x over 3 scripts (1.20..1.50); 3 of 3 advised" and row["status"] == "PASS"
    scripts.append({"name": "d", "speedup": None, "advised": False, "error": "advise: no step detected"})
    _saved(tmp_path, "real_scripts", {"scripts": scripts, "median_speedup": 1.4})
    row = _row(_rows(summary, tmp_path), "advise on real and framework scripts")
    assert row["value"].endswith("3 of 4 advised") and row["status"] == "FAIL"


def test_a_missing_run_quotes_the_log_or_says_not_measured(summary, tmp_path):
    rows = _rows(summary, tmp_path / "none")
    e2e = _row(rows, "advise end to end, H200 (")
    assert e2e["value"] == "2.07x (no saved run; from the log)"
    assert e2e["status"] == "PASS" and e2e["date"].startswith("2026-11-30")
    assert _row(rows, "CLI start-up")["value"] == "not measured yet"
    assert len(rows) == len(summary.ROWS)


def test_a_run_older_than_the_code_it_measures_is_stale(summary, tmp_path):
    _saved(tmp_path, "harness_overhead", {"ratio": 1.01, "target": {"status": "PASS"}}, commit="old0001+dirty")
    asked = []

    def changed(commit, paths):
        asked.append((commit, paths))
        return commit == "old0001+dirty"

    row = _row(_rows(summary, tmp_path, changed), "Harness overhead")
    assert row["status"] == "PASS, stale"
    assert ("old0001+dirty", ("src/torchaxe/runtime",)) in asked


def test_write_replaces_only_the_marked_block(summary, tmp_path):
    _saved(tmp_path, "harness_overhead", {"ratio": 1.01, "target": {"status": "PASS"}})
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Results\n\n{summary.START}\nold table\n{summary.END}\n\n## Log\nkept\n")
    out = io.StringIO()
    code = summary.main(["--results", str(tmp_path), "--write", str(results)], stdout=out, stderr=io.StringIO(),
                        changed_since=never_changed)
    text = results.read_text()
    assert code == 0
    assert "old table" not in text and text.endswith(f"{summary.END}\n\n## Log\nkept\n")
    assert "| Harness overhead" in text and out.getvalue() in text


def test_without_markers_one_line_and_nothing_written(summary, tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n")
    err = io.StringIO()
    code = summary.main(["--results", str(tmp_path), "--write", str(results)], stdout=io.StringIO(), stderr=err,
                        changed_since=never_changed)
    assert code == 2 and err.getvalue().count("\n") == 1 and results.read_text() == "# Results\n"


def test_save_writes_the_result_inside_a_saved_run(tmp_path):
    saved = _load("saved_run")
    parser = __import__("argparse").ArgumentParser()
    saved.add_save_options(parser)
    args = parser.parse_args(["--out", str(tmp_path / "r.json")])
    path = saved.save_result(args, "tune", {"steps": {"speedup": 1.5}}, ["--out", "r.json"])
    data = json.loads(path.read_text())
    assert tuple(data) == saved.SAVED_KEYS
    assert data["result"] == {"steps": {"speedup": 1.5}} and data["command"] == "python benchmarks/tune.py --out r.json"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_the_machine_line_says_whether_the_cpu_has_bfloat16_instructions():
    # bf16 autocast is many times faster or slower depending on these flags alone.
    saved = _load("saved_run")
    assert saved._cpu_vectors({"avx2", "fma"}) == "AVX2, no bf16"
    assert saved._cpu_vectors({"avx2", "avx512f"}) == "AVX-512, no bf16"
    assert saved._cpu_vectors({"avx2", "avx512f", "avx512_bf16"}) == "AVX-512, bf16"
    assert saved._cpu_vectors({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}) == "AMX, bf16"
    assert saved._cpu_vectors({"neon"}) == ""
    assert "cores" in saved.machine_line()


def test_a_corpus_file_no_python_parses_does_not_fail_the_recall_row(summary, tmp_path):
    # Old PyTorch code (`.cuda(async=True)`) parses on no Python since 3.7: its labelled
    # instances count as misses; the scanner itself did not fail.
    result = {"overall": {"recall": 0.95, "false_positives": 0}, "status": "PASS",
              "corpus": {"positives": 40, "lookalikes": 20, "files": 30, "repositories": 25},
              "diagnostics": ["/c/mean-teacher/main.py: cannot parse: invalid syntax"]}
    _saved(tmp_path, "real_recall", result)
    assert _row(_rows(summary, tmp_path), "Scanner recall on public code")["status"] == "PASS"
    result["diagnostics"].append("/c/other.py: rule AX201 failed: KeyError: 'x'")
    _saved(tmp_path, "real_recall", result)
    assert _row(_rows(summary, tmp_path), "Scanner recall on public code")["status"] == "FAIL"
