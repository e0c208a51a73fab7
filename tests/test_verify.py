"""`torchaxe verify`: every formula rule's fix safety agrees with what is measured on
the CPU, the command's output and its errors."""

from __future__ import annotations

import itertools
import json

import pytest

from torchaxe.cli import main
from torchaxe.errors import TorchaxeError
from torchaxe.findings import Applicability
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.formulas.verify import verify
from torchaxe.scan.rules import Invalid, all_rules
from torchaxe.scan.rules._formula import FormulaRule

FORMULA_RULES = [r for r in all_rules() if issubclass(r, FormulaRule)]
SMALL = {"attention": (2, 2, 16, 8), "rotary": (2, 2, 16, 8)}


def _fake_timer():
    ticks = itertools.count()
    return lambda: float(next(ticks)) * 1e-3


@pytest.mark.parametrize("rule", FORMULA_RULES, ids=lambda r: r.code)
def test_fix_safety_agrees_with_measurement_on_cpu(rule):
    [result] = verify((rule.code,), "cpu", "float32", SMALL.get(rule.category, (4, 8, 32)), repeats=1,
                      timer=_fake_timer())
    assert result.error is None
    declared = rule.safety_by_target.get("cpu")
    assert result.fix_safety == (declared.value if declared else None)
    if declared is Applicability.SAFE:
        assert result.within_tolerance, (rule.code, result.max_abs, result.max_rel)
    assert result.agrees


@pytest.mark.parametrize("rule", FORMULA_RULES, ids=lambda r: r.code)
def test_declared_safety_is_what_the_examples_get(rule):
    """The table verify checks is the rule's real behaviour: each example whose fix is
    applied on a target gets that target's declared applicability."""
    for example in rule.examples:
        if not isinstance(example, Invalid) or example.fixed is None:
            continue
        options = ScanOptions(target=example.target, select=(rule.code,))
        [finding] = [f for f in scan_source(example.code, "e.py", options).findings if f.code == rule.code][:1]
        if "the fix also deletes" in finding.message:
            # Spread over statements: the fix deletes code, which is never called safe.
            assert finding.fix.applicability is Applicability.UNSAFE, (rule.code, example.code)
        else:
            assert finding.fix.applicability is rule.safety_by_target[example.target], (rule.code, example.code)


def test_npu_replacement_is_never_run_but_its_formula_is_compared():
    [result] = verify(("AX110",), "cpu", "float64", (64,), repeats=1, timer=_fake_timer())
    assert result.npu_replacement == "torch_npu.fast_gelu(x)"
    assert 0.01 < result.npu_emulated_max_abs < 0.03  # fast_gelu is x * sigmoid(1.702 x)
    [quick] = verify(("AX112",), "cpu", "float64", (64,), repeats=1, timer=_fake_timer())
    assert quick.replacement is None and quick.npu_emulated_max_abs < 1e-12  # the same function


def test_timing_is_interleaved_and_kept_raw():
    [result] = verify(("AX113",), "cpu", "float32", (8, 8), repeats=4, timer=_fake_timer())
    assert len(result.hand.samples) == len(result.fused.samples) == 4
    assert result.speedup is not None


@pytest.mark.parametrize("args,message", [
    (("--device", "npu"), "never imports torch_npu"),
    (("AX201",), "no formula rule"),
    (("AX118", "--shape", "8"), "needs at least 3 dimensions"),
    (("--shape", "8,-1"), "positive"),
    (("AX9",), "torchaxe verify: 'AX9' matches no rule"),  # not "--select": the user gave no such option
])
def test_user_errors_are_one_line(capsys, args, message):
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_json(capsys):
    code = main(["verify", "AX117", "--shape", "4,16", "--repeats", "1", "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    [result] = data["results"]
    assert result["code"] == "AX117" and result["within_tolerance"] and result["agrees_with_fix_safety"]


def test_verify_errors_are_torchaxe_errors():
    with pytest.raises(TorchaxeError):
        verify(("AX110",), "cpu", "int8")
