"""The exhaustive search the end-to-end benchmarks share (benchmarks/advised_runs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from advised_runs import combination_arms, combinations  # noqa: E402


def rec(key, ratio=None, knobs=None):
    return {"key": key, "ratios": [ratio] if ratio else [], "applies": "knob", "knobs": knobs or {}, "rules": []}


def test_one_member_per_group_best_predicted_first():
    candidates = [rec("knob:ddp-bucket-cap-12", 0.9), rec("knob:ddp-bucket-cap-100", 0.8), rec("knob:a", 0.5)]
    group = lambda key: "bucket" if key.startswith("knob:ddp-bucket-cap") else key  # noqa: E731
    combos, possible = combinations(candidates, group, limit=10)
    assert possible == 5  # {none, 12, 100} x {none, a} without the empty one
    assert all(sum(r["key"].startswith("knob:ddp-bucket") for r in c) <= 1 for c in combos)
    best, possible = combinations(candidates, group, limit=2)
    assert possible == 5 and [[r["key"] for r in c] for c in best] == [["knob:ddp-bucket-cap-100", "knob:a"],
                                                                       ["knob:ddp-bucket-cap-12", "knob:a"]]


def test_each_combination_is_one_knob_set(tmp_path):
    combos = [(rec("knob:a", knobs={"ddp": {"static_graph": True}}),
               rec("knob:b", knobs={"ddp": {"gradient_as_bucket_view": True}}))]
    (arm,) = combination_arms(combos, [], tmp_path, "test")
    assert arm.name == "knob:a+knob:b"
    assert arm.to_dict()["ddp"] == {"static_graph": True, "gradient_as_bucket_view": True}


def test_side_by_side_pairs_the_rounds_of_the_tuned_run_and_the_best():
    from types import SimpleNamespace

    from advised_runs import side_by_side

    from torchaxe.runtime.knobs import knob_set_from_dict

    class Measurer:
        def compare(self, plain, arms, repeats, label):
            self.names = [a.name for a in arms]
            return None, (SimpleNamespace(ratios=[0.5, 0.6, 0.4]), SimpleNamespace(ratios=[0.45, 0.6, 0.44])), True

    measurer = Measurer()
    best = knob_set_from_dict({"name": "knob:a+knob:b"}, "test")
    median, pairs, tuned_arm, best_arm = side_by_side(measurer, None, knob_set_from_dict({"name": "tuned"}, "t"),
                                                      best, 3)
    assert measurer.names == ["tuned", "best"]
    assert [round(p, 3) for p in pairs] == [0.9, 1.0, 1.1] and round(median, 3) == 1.0
