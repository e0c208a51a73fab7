"""benchmarks/harness_overhead.py must keep running, keep its JSON shape and judge
its target from the raw samples; a fake runner stands in for the subprocesses."""

from __future__ import annotations

import io
import json

import pytest
from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("harness_overhead") as module:
        yield module


def fake_runner(bench, without=0.010, with_=0.0101):
    def run(side, repeat):
        base = without if side == "without" else with_
        return bench.Run(side, repeat, [base * (1 + 0.001 * i) for i in range(5)], base * 1e3)
    return run


def fake_same(bench, without=0.010, with_=0.0102):
    def run():
        return [bench.Run(side, r, [base] * 5) for r in (1, 2) for side, base in (("without", without), ("with", with_))]
    return run


def test_json_shape_and_pass(bench, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    code = bench.main(["--repeats", "3", "--steps", "5", "--json"], stdout=out, stderr=err, runner=fake_runner(bench),
                      same_runner=fake_same(bench))
    assert code == 0, err.getvalue()
    data = json.loads(out.getvalue())
    assert tuple(data) == bench.JSON_KEYS
    assert data["runs"] == 6 and len(data["without"]["raw_step_seconds"]) == 3
    assert data["ratio"] == pytest.approx(1.01)
    assert data["pair_ratios"]["values"] == pytest.approx([1.01] * 3)
    assert data["script_reported"]["ratio"] == pytest.approx(1.01)
    assert data["same_process"]["ratio"] == pytest.approx(1.02) and data["same_process"]["pairs"] == 2
    assert data["target"]["status"] == "PASS"
    assert err.getvalue().count("harness_overhead: pair") == 6


def test_fails_above_three_percent_and_records_at_the_end(bench, tmp_path):
    results = tmp_path / "RESULTS.md"
    theirs = "# Benchmark results\n\n## Scan speed\n\ntheirs, untouched\n"
    results.write_text(theirs)
    out = io.StringIO()
    code = bench.main(["--repeats", "2", "--steps", "5", "--same-process-repeats", "0", "--record", str(results)], stdout=out,
                      stderr=io.StringIO(), runner=fake_runner(bench, with_=0.0105))
    assert code == 1
    assert "ratio with/without: 1.050 (+5.0%)" in out.getvalue() and ": FAIL" in out.getvalue()
    text = results.read_text()
    assert text.startswith(theirs + "\n## Harness overhead\n")
    assert "- command: `.venv/bin/python benchmarks/harness_overhead.py --repeats 2" in text
    assert out.getvalue().strip() in text


def test_a_new_record_goes_into_its_own_section(bench, tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Harness overhead\n\nold entry\n\n## Later section\n\nalso theirs\n")
    bench.main(["--repeats", "1", "--steps", "5", "--same-process-repeats", "0", "--record", str(results)], stdout=io.StringIO(),
               stderr=io.StringIO(), runner=fake_runner(bench))
    text = results.read_text()
    assert text.count("## Harness overhead") == 1 and text.count("### ") == 1
    assert text.index("old entry") < text.index("### ") < text.index("## Later section")
    assert text.endswith("\n## Later section\n\nalso theirs\n")


def test_a_record_is_the_newest_entry_of_the_log(bench, tmp_path):
    results = tmp_path / "RESULTS.md"
    head = "# Benchmark results\n\n## Current figures\n\ntable\n\n## Log of runs, newest first\n\nintro\n"
    results.write_text(head + "\n### 2026-11-30 14:16 · old\n\nold entry\n")
    bench.main(["--repeats", "1", "--steps", "5", "--same-process-repeats", "0", "--record", str(results)], stdout=io.StringIO(),
               stderr=io.StringIO(), runner=fake_runner(bench))
    text = results.read_text()
    assert text.startswith(head + "\n### ") and "harness overhead: " in text
    assert "## Harness overhead" not in text and text.count("### ") == 2
    assert text.index("```text") < text.index("### 2026-11-30 14:16 · old")
    assert text.endswith("\n\n### 2026-11-30 14:16 · old\n\nold entry\n")


def test_record_creates_the_file(bench, tmp_path):
    results = tmp_path / "RESULTS.md"
    bench.main(["--repeats", "1", "--steps", "5", "--same-process-repeats", "0", "--record", str(results)], stdout=io.StringIO(),
               stderr=io.StringIO(), runner=fake_runner(bench))
    assert results.read_text().startswith("# Benchmark results\n\n## Harness overhead\n")


def test_bad_flag_is_one_line(bench):
    err = io.StringIO()
    assert bench.main(["--repeats", "two"], stdout=io.StringIO(), stderr=err) == 2
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("harness_overhead: error:")
    err = io.StringIO()
    assert bench.main(["--warmup", "0"], stdout=io.StringIO(), stderr=err) == 2


@pytest.mark.slow
def test_one_real_pair(bench):
    out = io.StringIO()
    code = bench.main(["--repeats", "1", "--steps", "3", "--warmup", "1", "--size", "tiny", "--same-process-repeats", "1",
                       "--json"],
                      stdout=out, stderr=io.StringIO())
    assert code in (0, 1)
    data = json.loads(out.getvalue())
    assert len(data["without"]["raw_step_seconds"][0]) == 3 and len(data["with"]["raw_step_seconds"][0]) == 3
    assert data["script_reported"]["ratio"] is not None
    assert data["same_process"]["pairs"] == 1
