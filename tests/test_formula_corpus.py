"""The labelled corpus (tests/formula_corpus): recall and false positives of the
formula rules stay at their targets, and benchmarks/formula_recall.py keeps its shape."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "formula_recall.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("formula_recall_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("target", ["npu", "cpu"])
def test_corpus_meets_the_targets(bench, target):
    data = bench.run(bench.DEFAULT_CORPUS, target)
    assert not data["diagnostics"]
    report = {name: (c["recall"], c["false_positive_rate"], c["misses"], c["false_positive_cases"])
              for name, c in data["categories"].items()}
    for name, c in data["categories"].items():
        assert c["positives"] >= 4 and c["lookalikes"] >= 3, name
        assert c["recall"] >= bench.TARGET_RECALL, report[name]
        assert c["false_positive_rate"] <= bench.TARGET_FALSE_POSITIVES, report[name]
    assert not data["stray"], data["stray"]
    if target == "cpu":
        assert not {"swiglu", "rotary", "quick_gelu"} & set(data["categories"])


def test_json_output_and_exit_code(bench):
    out, err = io.StringIO(), io.StringIO()
    assert bench.main(["--json"], stdout=out, stderr=err) == 0
    data = json.loads(out.getvalue())
    assert {"benchmark", "date", "command", "machine", "corpus", "target", "cases", "seconds", "overall",
            "categories", "stray", "diagnostics"} <= set(data)


def test_bad_arguments_are_one_line(bench, tmp_path):
    err = io.StringIO()
    assert bench.main(["--target", "tpu"], stdout=io.StringIO(), stderr=err) == 2
    assert err.getvalue().count("\n") == 1
    err = io.StringIO()
    assert bench.main(["--corpus", str(tmp_path)], stdout=io.StringIO(), stderr=err) == 2
    assert "no labelled cases" in err.getvalue()
