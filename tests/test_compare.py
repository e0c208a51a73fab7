"""`torchaxe compare`: two real runs of the bundled GPT example (tanh GELU against erf
GELU), the shared Ascend sample against a torch.profiler trace of a CPU run, the JSON
schema, the HTML page (escaped, self-contained, rendered in a headless browser) and
the errors a user can make."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from profile_support import EXAMPLES, TINY_GPT, run_command
from test_advise_report import browser
from test_traces import ASCEND, _train
from torchaxe.compare.model import compare_paths, compare_profiles
from torchaxe.report.compare_html import render_comparison_html
from torchaxe.report.compare_text import render_comparison
from torchaxe.runtime.profile import save_profile

PAYLOAD = "<script>alert('x')</script>"


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """The GPT example profiled with its op table, once with each GELU formula."""
    folder = tmp_path_factory.mktemp("compare")
    paths = {}
    for mlp in ("tanh", "erf"):
        argv = ["python", str(EXAMPLES / "gpt" / "train.py"), *TINY_GPT, "--mlp", mlp]
        profile = run_command(argv, steps=2, warmup=1, ops=True, ops_steps=2, shapes=True, flops=True)
        paths[mlp] = save_profile(profile, folder / f"{mlp}.json")
    return paths


def test_two_runs_name_the_operators_that_differ(gpt_runs):
    comparison = compare_paths(gpt_runs["tanh"], gpt_runs["erf"])
    data = comparison.to_dict()
    assert data["schema"] == "torchaxe.compare/1"
    assert data["a"]["source"] == data["b"]["source"] == "harness"
    assert data["a"]["step_seconds_median"] > 0 and data["b"]["step_seconds_median"] > 0
    assert data["step_ratio"] == pytest.approx(data["b"]["step_seconds_median"] / data["a"]["step_seconds_median"])
    # Both counted FLOPs: the MFU of each is there.
    assert data["a"]["mfu_measured"] > 0 and data["b"]["mfu_measured"] > 0
    # The changed formula is what appears in one run only.
    assert "aten::tanh" in {r["name"] for r in data["only_in_a"]}
    assert "aten::gelu" in {r["name"] for r in data["only_in_b"]}
    # Shared operators are aligned by name, per step, with their calls and shapes.
    [mm] = [r for r in data["operators"] if r["name"] == "aten::mm"]
    assert mm["a_calls_per_step"] == mm["b_calls_per_step"] > 0
    assert mm["a_seconds_per_step"] > 0 and mm["b_seconds_per_step"] > 0 and mm["a_shapes"]
    changes = [abs(r["change_seconds_per_step"]) for r in data["operators"]]
    assert changes == sorted(changes, reverse=True)
    assert {p["name"] for p in data["phases"]} >= {"step", "data_wait", "backward", "outside_backward", "gc"}
    json.dumps(data, allow_nan=False)


def test_text_report_through_the_cli(gpt_runs):
    done = subprocess.run([sys.executable, "-m", "torchaxe", "compare", str(gpt_runs["tanh"]), str(gpt_runs["erf"])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.splitlines()[2].startswith("step time   A ")
    assert "operators whose time per step changed most" in text
    assert "only in A: " in text and "aten::tanh" in text and "only in B: " in text and "aten::gelu" in text
    assert "MFU table peak unknown" in text


def test_an_ascend_run_against_a_cpu_trace(tmp_path):
    trace = _train(tmp_path / "cpu_trace.json", [4] * 5)
    comparison = compare_paths(ASCEND / "ut_timeline", trace)
    data = comparison.to_dict()
    assert data["a"]["source"] == "ascend-trace" and data["a"]["target"] == "npu"
    assert data["b"]["source"] == "torch-trace" and data["b"]["target"] == "cpu"
    assert data["a"]["kernels"] and not data["b"]["kernels"]
    # Aligned by the aten name, though one side ran on the NPU: the NPU side's time is
    # the device time of the kernels its trace links to the operator, listed under it.
    assert data["a"]["operator_time"] == "device" and data["b"]["operator_time"] == "host"
    rows = {r["name"]: r for r in data["operators"]}
    shared = {name for name, r in rows.items() if r["a_seconds_per_step"] and r["b_seconds_per_step"]}
    assert {"aten::addmm", "aten::mm"} <= shared
    addmm = rows["aten::addmm"]
    assert "aclnnAddmm_MatMulCommon_MatMulV2" in {k["name"] for k in addmm["a_kernels"]}
    assert addmm["a_seconds_per_step"] == pytest.approx(sum(k["seconds_per_step"] for k in addmm["a_kernels"]))
    assert addmm["b_kernels"] == []
    # The tasks the trace links to no operator stay listed apart.
    assert data["a"]["kernels_linked"] and not data["b"]["kernels_linked"]
    assert [k["name"] for k in data["a"]["unlinked_kernels"]] == ["MEMCPY_ASYNC"]
    assert "MEMCPY_ASYNC" not in {k["name"] for r in data["operators"] for k in r["a_kernels"]}
    assert any("ran on npu" in note for note in data["notes"])
    assert any("unverified on Ascend hardware" in note for note in data["notes"])
    assert any(f["kind"] == "online-compile" for f in data["a"]["findings"])
    text = io.StringIO()
    render_comparison(comparison, text)
    lines = text.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  aten::addmm "))
    assert lines[at + 1].startswith("      A kernels: aclnnAddmm_")
    assert "A kernels linked to no operator: MEMCPY_ASYNC" in text.getvalue()
    page = render_comparison_html(comparison)
    assert 'id="kernels-A"' in page and "aclnnAddmm_MatMulCommon_MatMulV2" in page


def test_html_is_escaped_self_contained_and_renders(gpt_runs, tmp_path):
    comparison = compare_paths(gpt_runs["tanh"], gpt_runs["erf"])
    comparison.a.path = PAYLOAD
    comparison.operators[0].name += PAYLOAD
    page = render_comparison_html(comparison)
    assert PAYLOAD not in page and "&lt;script&gt;" in page
    assert "default-src 'none'" in page and "http://" not in page and "https://" not in page
    assert 'id="operator-table"' in page and 'id="only-A"' in page
    exe = browser()
    if exe is None:
        pytest.skip("no chromium here: install Debian's `chromium` package (.ci/run does) to run this test")
    path = tmp_path / "compare.html"
    path.write_text(page, encoding="utf-8")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1600"]
    dom = subprocess.run([exe, *flags, "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="phases"' in dom.stdout and "aten::gelu" in dom.stdout and "&lt;script&gt;" in dom.stdout


def test_profiles_without_an_op_table_still_compare_steps(tmp_path):
    from test_flops import SCRIPT
    from profile_support import run_script

    a = run_script(tmp_path, SCRIPT, steps=2, warmup=1)
    comparison = compare_profiles(a, a)
    assert comparison.step_ratio == pytest.approx(1.0) and comparison.operators == []
    assert any("--ops" in note for note in comparison.notes)


@pytest.mark.parametrize("content, message", [
    (None, "no such file or folder"),
    ("{not json", "not JSON"),
    ('{"schema": "torchaxe.profile/9"}', "newer torchaxe"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "a.json"
    if content is not None:
        path.write_text(content)
    done = subprocess.run([sys.executable, "-m", "torchaxe", "compare", str(path), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr


def test_html_goes_to_a_file_atomically(gpt_runs, tmp_path):
    out = tmp_path / "c.html"
    done = subprocess.run([sys.executable, "-m", "torchaxe", "compare", str(gpt_runs["tanh"]), str(gpt_runs["erf"]),
                           "--format", "html", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_text().startswith("<!DOCTYPE html>") and done.stdout == ""
