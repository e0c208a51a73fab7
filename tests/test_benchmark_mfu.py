"""benchmarks/mfu.py: the MFU of each run from its profile, one measured peak per
dtype, the operators a comparison names, the printed report and its summary row --
on hand-made profiles (no run)."""

from __future__ import annotations

import sys

import pytest

from test_benchmark_summary import _load, summary  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def mfu():
    yield _load("mfu")
    sys.modules.pop("mfu_bench", None)


def profile(step: float, flops: int | None, peak: float, dtype: str = "float32", table: float | None = None) -> dict:
    return {"summary": {"step_seconds_median": step, "steps_measured": 10},
            "flops": {"flops_per_step": flops, "dtype": dtype, "device_name": "AMD EPYC",
                      "peak_flops_per_second_table": table, "peak_flops_per_second_measured": peak}}


def test_mfu_is_the_originals_flops_over_each_step_against_the_best_peak_of_its_dtype(mfu) -> None:
    # The tuned run is compiled: the counter saw fewer FLOPs, the model did not change.
    # Its probe ran at a busy moment (80 GFLOP/s against the original's 100).
    gpt = mfu.example_result("gpt", profile(0.100, 5_000_000_000, 100e9),
                             profile(0.050, 1_000_000_000, 80e9), ["knob:compile"])
    bf16 = mfu.example_result("seq_varlen", profile(0.200, 2_000_000_000, 90e9),
                              profile(0.100, 2_000_000_000, 40e9, dtype="bfloat16"), ["knob:autocast-bf16"])
    failed = mfu.example_result("image_classifier", profile(0.040, 1_000_000_000, 95e9), None, [], "advise: boom")
    peaks = mfu.with_mfu([gpt, bf16, failed])
    assert peaks == {"float32": 100e9, "bfloat16": 40e9}
    assert gpt["speedup"] == pytest.approx(2.0)
    assert gpt["before"]["mfu_measured"] == pytest.approx(0.5)  # 50 GFLOP/s of 100
    assert gpt["after"]["achieved_flops_per_second"] == pytest.approx(100e9)  # the original's FLOPs
    assert gpt["after"]["mfu_measured"] == pytest.approx(1.0)  # against the best float32 probe, not its own
    assert bf16["after"]["mfu_measured"] == pytest.approx(0.5)  # 20 GFLOP/s of the bf16 peak
    assert gpt["before"]["mfu_table"] is None
    assert failed["after"] is None and failed["speedup"] is None
    assert failed["before"]["mfu_measured"] == pytest.approx(25e9 / 100e9)


def test_interleaved_rounds_give_the_median_step_and_the_median_ratio(mfu) -> None:
    # Three rounds; the second ran at a busy moment on both sides.
    before = [profile(0.100, 5_000_000_000, 90e9), profile(0.300, 5_000_000_000, 40e9),
              profile(0.110, 5_000_000_000, 100e9)]
    after = [profile(0.050, 1_000_000_000, 95e9), profile(0.200, 1_000_000_000, 50e9),
             profile(0.050, 1_000_000_000, 99e9)]
    ex = mfu.example_result("gpt", before, after, ["knob:compile"])
    assert ex["per_round_ratios"] == pytest.approx([2.0, 1.5, 2.2])
    assert ex["speedup"] == pytest.approx(2.0)  # the median ratio, not 0.110 / 0.050
    assert ex["before"]["step_seconds_median"] == pytest.approx(0.110)
    assert ex["before"]["step_seconds_rounds"] == pytest.approx([0.100, 0.300, 0.110])
    assert ex["before"]["steps_measured"] == 30
    assert ex["before"]["peak_measured"] == 100e9  # the best probe of the rounds
    assert mfu.median_round(ex["per_round_ratios"]) == 0
    assert mfu.median_round([3.0, 1.0, 2.0, 4.0]) == 2  # the lower middle of an even count
    assert mfu.median_round([]) is None
    # The tuned copy failed in the third round: two paired rounds count.
    short = mfu.example_result("gpt", before[:2], after[:2], [], "the tuned copy: boom")
    assert short["per_round_ratios"] == pytest.approx([2.0, 1.5])
    assert "stopped after 2 rounds: the tuned copy: boom" in mfu.render(
        {"machine": "cpu", "target": "cpu", "budget": "3m", "rounds": 3, "peaks_measured": mfu.with_mfu([short]),
         "examples": [short], "compare": None})


def test_the_table_peak_applies_where_the_device_has_one(mfu) -> None:
    ex = mfu.example_result("gpt", profile(0.010, 4_000_000_000_000, 600e12, "bfloat16", table=989e12),
                            profile(0.008, 4_000_000_000_000, 650e12, "bfloat16", table=989e12), [])
    mfu.with_mfu([ex])
    assert ex["before"]["mfu_table"] == pytest.approx(400e12 / 989e12)
    assert ex["after"]["mfu_table"] == pytest.approx(500e12 / 989e12)
    assert ex["after"]["mfu_measured"] == pytest.approx(500e12 / 650e12)


def _row(name, a, b, a_calls=1.0, b_calls=1.0):
    return {"name": name, "a_seconds_per_step": a, "b_seconds_per_step": b, "a_calls_per_step": a_calls,
            "b_calls_per_step": b_calls, "change_seconds_per_step": (b or 0.0) - (a or 0.0)}


def test_difference_keeps_the_shared_operators_that_moved_most_and_the_ones_of_one_run(mfu) -> None:
    comparison = {
        "schema": "torchaxe.compare/1", "step_ratio": 0.5, "a": {"step_seconds_median": 0.1},
        "operators": [_row("aten::mul", 0.020, 0.002), _row("aten::tanh", 0.010, None), _row("aten::mm", 0.030, 0.025),
                      _row("aten::add", 0.001, 0.0015), _row("aten::sum", 0.001, 0.0012)],
        "only_in_a": [_row("aten::tanh", 0.010, None), _row("autograd::engine::evaluate_function: X", 0.00005, None)],
        "only_in_b": [_row("aten::gelu", None, 0.003)],
    }
    diff = mfu.difference(comparison, top=3)
    assert diff["step_ratio"] == 0.5
    # Changes under 1% of the original's step (1 ms) are jitter: left out.
    assert [r["name"] for r in diff["operators"]] == ["aten::mul", "aten::mm"]
    assert diff["operators"][0]["change_seconds_per_step"] == pytest.approx(-0.018)
    assert [r["name"] for r in diff["only_in_original"]] == ["aten::tanh"]
    assert diff["only_in_tuned"][0]["tuned_seconds_per_step"] == 0.003


def test_the_report_names_each_example_and_the_operators(mfu) -> None:
    gpt = mfu.example_result("gpt", profile(0.100, 5_000_000_000, 100e9), profile(0.050, None, 100e9),
                             ["knob:compile", "code:AX110"])
    seq = mfu.example_result("seq_varlen", profile(0.200, 2_000_000_000, 90e9), None, [], "advise: boom")
    result = {"machine": "x86_64, 2 cores", "target": "cpu", "budget": "3m", "examples": [gpt, seq],
              "compare": {"step_ratio": 0.5, "operators": [
                  {"name": "aten::mul", "original_seconds_per_step": 0.02, "tuned_seconds_per_step": 0.002,
                   "change_seconds_per_step": -0.018}],
                  "only_in_original": [{"name": "aten::tanh", "original_seconds_per_step": 0.01}],
                  "only_in_tuned": []}}
    result["peaks_measured"] = mfu.with_mfu(result["examples"])
    text = mfu.render(result)
    lines = text.splitlines()
    assert "against the best measured peak (float32 100.0 GFLOP/s)" in lines[0]
    assert lines[1] == ("  gpt: MFU 50.0% -> 100.0%; step 100.00 ms -> 50.00 ms (2.00x; rounds 2.00); 5.00 GFLOP per "
                        "step; chosen: knob:compile, code:AX110")
    assert lines[2].startswith("  seq_varlen: before 10.0% at 200.00 ms; after: not measured (advise: boom)")
    assert "compare gpt original -> tuned, the median round (step ratio 0.500)" in lines[3]
    assert "aten::mul" in lines[4] and "(-18.00 ms)" in lines[4]
    assert lines[5] == "    only in the original: aten::tanh 10.00 ms"


def test_the_summary_row_reports_before_and_after_with_no_target(mfu, summary) -> None:
    gpt = mfu.example_result("gpt", profile(0.100, 5_000_000_000, 100e9), profile(0.050, None, 100e9), [])
    seq = mfu.example_result("seq_varlen", profile(0.200, 2_000_000_000, 90e9), None, [], "advise: boom")
    mfu.with_mfu([gpt, seq])
    reading = summary.read_mfu({"examples": [gpt, seq]})
    assert reading.status == "n/a"
    assert reading.value == "gpt 50.0% -> 100.0%, step 2.00x; seq_varlen 10.0% -> n/a"  # the best float32 peak: gpt's
    assert summary.read_mfu({"examples": []}) is None
    rows = summary.table_rows({"mfu": {"date": "2026-12-01T21:00:00+00:00", "commit": "abc1234",
                                        "machine": "2 cores", "command": "python benchmarks/mfu.py --save",
                                        "result": {"examples": [gpt]}}}, lambda commit, paths: True)
    [row] = [r for r in rows if r["figure"].startswith("MFU of the examples, CPU")]
    assert row["value"].startswith("gpt 50.0% -> 100.0%") and row["status"] == "n/a"  # never stale: no target
