"""``advise`` after ``apply``: where the gain achieved came from -- the original files
and the script now, each profiled once, compared phase by phase and operator by
operator -- within the budget, and never an error. Fake runs and fake profiles."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from test_advise import Clock, FakeRuns, fake_profile, run_advice, script  # noqa: F401  (fixture)
from torchaxe.advise.apply import apply_advice, load_advice
from torchaxe.advise.pipeline import AdviseOptions, Advisor, BaselineProfile
from torchaxe.advise.where import describe, where_changed
from torchaxe.compare.model import compare_profiles
from torchaxe.errors import TorchaxeError
from torchaxe.report.advice_html import render_advice_html
from torchaxe.report.advice_text import render_advice_text
from torchaxe.runtime.profile import Profile


def profile_dict(step: float, backward: float, ops: dict[str, tuple[float, int]]) -> dict:
    """A profile of four measured steps, its op table over two of them: ``ops`` maps
    an operator to its (self seconds, calls) over those two steps."""
    return {
        "schema": "torchaxe.profile/1", "status": "stopped", "detail": "stopped after 4 measured steps",
        "run": {"command": ["python", "train.py"], "target": "cpu"},
        "summary": {},
        "steps": [{"index": i, "phase": "measured", "seconds": step, "backward_seconds": backward,
                   "data_wait_seconds": 0.001} for i in range(1, 5)],
        "ops_steps": [1, 2],
        "ops": [{"name": name, "calls": calls, "self_seconds": seconds, "total_seconds": seconds}
                for name, (seconds, calls) in ops.items()],
    }


#: Before apply: a hand-written tanh GELU (tanh, many muls); now: one fused gelu.
ORIGINAL = profile_dict(0.100, 0.040, {"aten::mm": (0.060, 40), "aten::mul": (0.040, 400), "aten::tanh": (0.016, 8),
                                       "aten::add": (0.004, 20)})
NOW = profile_dict(0.070, 0.030, {"aten::mm": (0.056, 40), "aten::mul": (0.010, 100), "aten::gelu": (0.006, 8),
                                  "aten::add": (0.0041, 20), "SoftmaxBackward0": (0.0001, 2)})


class FakeProfiler:
    """The baseline profile without knobs; by knob set name with them (the gain
    achieved explained), recording which knob sets were profiled."""

    def __init__(self, base: dict, by_name: dict[str, dict] | None = None, fail: str | None = None) -> None:
        self.base = base
        self.by_name = by_name or {"original-before-apply": ORIGINAL, "applied": NOW}
        self.fail = fail
        self.profiled: list[str] = []
        self.timeouts: list[float | None] = []

    def __call__(self, command, options, target, knobs=None) -> BaselineProfile:
        if knobs is None:
            return BaselineProfile(self.base, {"modules": [], "settings": {"num_threads": 2}}, 2.0)
        self.profiled.append(knobs.name)
        self.timeouts.append(options.timeout)
        if knobs.name == self.fail:
            raise TorchaxeError("the script failed before its first step: RuntimeError: boom")
        return BaselineProfile(self.by_name[knobs.name], {}, 2.0)


def applied(script: Path, tmp_path: Path) -> None:  # noqa: F811
    """`torchaxe apply` of an advice that chose the GELU fix and compile."""
    path = tmp_path / "advice.json"
    path.write_text(run_advice(script, FakeRuns()).to_json())
    apply_advice(load_advice(path))


def advise_again(script: Path, profiler: FakeProfiler, budget: float = 600.0, clock=None):  # noqa: F811
    runs = FakeRuns(times={"original-before-apply": 0.1, "applied": 0.07})
    return Advisor(["python", str(script)], AdviseOptions(target="cpu", budget=budget), runner=runs,
                   profiler=profiler, clock=clock or Clock()).run()


def test_the_list_names_the_phases_and_operators_that_moved_and_what_one_run_only_has() -> None:
    where = where_changed(compare_profiles(Profile.from_dict(ORIGINAL), Profile.from_dict(NOW)))
    by_kind: dict[str, list[dict]] = {}
    for item in where:
        by_kind.setdefault(item["kind"], []).append(item)
    # Phases per step, largest change first; the step itself is the measured gain, not listed.
    phases = by_kind["phase"]
    assert [p["name"] for p in phases][:2] == ["outside_backward", "backward"]
    assert phases[1]["original_seconds_per_step"] == pytest.approx(0.040)
    assert phases[1]["change_seconds_per_step"] == pytest.approx(-0.010)
    assert "step" not in {p["name"] for p in phases} and "data_wait" not in {p["name"] for p in phases}
    # Shared operators by change per step (the op table covers two steps); add moved by
    # less than 1% of the step, the profiler's bookkeeping row is smaller still: left out.
    ops = by_kind["operator"]
    assert [o["name"] for o in ops] == ["aten::mul", "aten::mm"]
    assert ops[0]["change_seconds_per_step"] == pytest.approx(-0.015)
    assert (ops[0]["original_calls_per_step"], ops[0]["now_calls_per_step"]) == (200, 50)
    assert [o["name"] for o in by_kind["only_original"]] == ["aten::tanh"]
    assert [o["name"] for o in by_kind["only_now"]] == ["aten::gelu"]
    assert by_kind["only_now"][0]["now_seconds_per_step"] == pytest.approx(0.003)
    assert describe(by_kind["only_original"][0]) == "only in the original: aten::tanh 8.00 ms per step, 4 calls"
    assert describe(ops[0]) == "aten::mul: 20.00 ms -> 5.00 ms per step, -15.00 ms (200 -> 50 calls)"


def test_advise_after_apply_says_where_the_gain_came_from(script: Path, tmp_path: Path) -> None:  # noqa: F811
    applied(script, tmp_path)
    profiler = FakeProfiler(fake_profile(script))
    advice = advise_again(script, profiler)
    achieved = advice.achieved
    assert achieved["status"] == "measured" and achieved["speedup"] == pytest.approx(0.1 / 0.07)
    # Profiled once each: the original files (through the kept copies) and the script now.
    assert profiler.profiled == ["original-before-apply", "applied"]
    # Each bounded within its share of the budget left.
    assert all(t is not None and t <= 600 / 4 for t in profiler.timeouts)
    names = {(item["kind"], item["name"]) for item in achieved["where"]}
    assert {("only_original", "aten::tanh"), ("only_now", "aten::gelu"), ("operator", "aten::mul")} <= names
    assert "where_note" not in achieved
    data = json.loads(advice.to_json())
    assert data["achieved"]["where"] == achieved["where"]
    out = io.StringIO()
    render_advice_text(advice, out, width=300)
    text = out.getvalue()
    assert "where it came from (the original files and the script now, each profiled once):" in text
    assert "only in the original: aten::tanh 8.00 ms per step" in text and "only now: aten::gelu" in text
    html = render_advice_html(advice)
    assert 'id="achieved-where"' in html and "only in the original: aten::tanh" in html


def test_a_short_budget_skips_the_profiles_with_a_note(script: Path, tmp_path: Path) -> None:  # noqa: F811
    applied(script, tmp_path)
    profiler = FakeProfiler(fake_profile(script))
    # Each trial run takes 1 s of a 6 s budget: two profiled runs of 2 s do not fit in half the rest.
    clock = Clock()
    runs = FakeRuns(times={"original-before-apply": 0.1, "applied": 0.07})

    def timed(knobs, command, options, repeat):
        clock.now += 1.0
        return runs(knobs, command, options, repeat)

    advice = Advisor(["python", str(script)], AdviseOptions(target="cpu", budget=6.0), runner=timed,
                     profiler=profiler, clock=clock).run()
    assert advice.achieved["status"] == "measured"
    assert profiler.profiled == []
    assert "where" not in advice.achieved
    assert advice.achieved["where_note"].startswith("where the gain came from was not profiled: the two profiled "
                                                    "runs (about 4 s) would take more than half of the")
    out = io.StringIO()
    render_advice_text(advice, out, width=300)
    assert advice.achieved["where_note"] in out.getvalue()


def test_a_failed_profile_is_a_note_not_an_error(script: Path, tmp_path: Path) -> None:  # noqa: F811
    applied(script, tmp_path)
    profiler = FakeProfiler(fake_profile(script), fail="applied")
    advice = advise_again(script, profiler)
    assert advice.achieved["status"] == "measured" and "where" not in advice.achieved
    assert advice.achieved["where_note"] == ("where the gain came from is unknown: the script failed before its "
                                             "first step: RuntimeError: boom")
    # The rest of the advice went on.
    assert any(r.status == "measured" for r in advice.recommendations)


def test_a_profile_without_an_op_table_is_a_note(script: Path, tmp_path: Path) -> None:  # noqa: F811
    applied(script, tmp_path)
    bare = dict(NOW, ops=[], ops_steps=[])
    advice = advise_again(script, FakeProfiler(fake_profile(script), {"original-before-apply": ORIGINAL,
                                                                       "applied": bare}))
    assert advice.achieved["where_note"] == ("where the gain came from is unknown: the applied run recorded no "
                                             "operators: stopped after 4 measured steps")
