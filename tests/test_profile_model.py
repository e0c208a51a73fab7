"""The Profile model: JSON round trip, validation of bad files, summaries, stats, merge."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.merge import MERGE_SCHEMA, merge_profiles
from torchaxe.runtime.profile import (
    SCHEMA,
    ErrorInfo,
    HostSyncSite,
    InputSignature,
    OpShapeGroup,
    OpSource,
    OpStat,
    Profile,
    ProfileFormatError,
    RunInfo,
    ShapeReport,
    ShapeTally,
    StepRecord,
    Summary,
    load_profile,
    rank_path,
    save_profile,
)
from torchaxe.runtime.stats import Samples, quantile


def make_profile(seconds=(0.5, 0.1, 0.2, 0.3), warmup=1, rank=None, world=None, status="stopped",
                 backward=None) -> Profile:
    steps = [
        StepRecord(index=i, seconds=s, phase="warmup" if i <= warmup else "measured", data_wait_seconds=s / 10,
                   batches=1, host_syncs=2, gc_seconds=0.0, gc_collections=0, host_rss_bytes=1000 + i,
                   start_seconds=float(i), backward_seconds=backward[i - 1] if backward else None)
        for i, s in enumerate(seconds, 1)
    ]
    return Profile(
        status=status,
        run=RunInfo(command=["python", "train.py"], target="cpu", rank=rank, world_size=world, local_rank=rank,
                    options={"steps": 3, "warmup": warmup}),
        steps=steps,
        host_syncs=[HostSyncSite(file="train.py", line=12, call="item", count=4, function="main",
                                 code="x = loss.item()")],
        ops=[OpStat(name="aten::mm", calls=6, self_seconds=0.01, total_seconds=0.012, kind="op",
                    input_shapes=[OpShapeGroup(input_shapes=[[4, 8], [8, 2], None], calls=6, self_seconds=0.01)],
                    sources=[OpSource(location="train.py:9", function="forward", count=6)])],
        ops_steps=[2],
        shapes=ShapeReport(
            modules=[ShapeTally(name="Net.fc", type="Linear", calls=4,
                                signatures=[InputSignature(shapes=[[4, 8]], dtypes=["float32"], count=4)])],
            batches=ShapeTally(name="DataLoader", type="batch", calls=4,
                               signatures=[InputSignature(shapes=[[4, 8], None], dtypes=["float32", None], count=3),
                                           InputSignature(shapes=[[2, 8], None], dtypes=["float32", None], count=1)]),
        ),
        error=None,
        detail="stopped after 3 measured steps",
        warnings=["only 3 measured steps: the median is rough"],
        seconds=2.0,
        host_rss_peak_bytes=5000,
    )


def test_round_trip_is_lossless(tmp_path):
    profile = make_profile()
    data = profile.to_dict()
    assert data["schema"] == SCHEMA
    again = Profile.from_dict(json.loads(json.dumps(data)))
    assert again.to_dict() == data
    path = save_profile(profile, tmp_path / "p.json")
    assert load_profile(path).to_dict() == data
    assert not list(tmp_path.glob("*.torchaxe-tmp"))


def test_error_round_trip():
    profile = make_profile(status="error")
    profile.error = ErrorInfo(type="ValueError", message="boom", file="train.py", line=7,
                              traceback="Traceback (most recent call last):\n...")
    again = Profile.from_dict(profile.to_dict())
    assert again.error == profile.error
    assert again.to_dict()["error"]["location"] == "train.py:7"


def test_summary_uses_measured_steps_only():
    profile = make_profile(seconds=(9.0, 0.1, 0.2, 0.3, 0.4), warmup=1)
    s = profile.summary
    assert s.steps_total == 5 and s.steps_measured == 4
    assert s.step_seconds_median == pytest.approx(0.25)
    assert s.step_seconds_p90 == pytest.approx(np.percentile([0.1, 0.2, 0.3, 0.4], 90))
    assert s.data_wait_fraction == pytest.approx(0.1)
    assert s.host_syncs_per_step == 2
    assert s.host_rss_peak_bytes == 5000
    assert s.peak_device_memory_bytes is None
    assert profile.to_dict()["summary"] == s.to_dict()


def test_summary_of_no_steps_is_empty_not_an_error():
    s = Summary.of([])
    assert s.steps_measured == 0 and s.step_seconds_median is None and s.data_wait_fraction is None


def test_summary_is_recomputed_from_steps_not_trusted():
    data = make_profile().to_dict()
    data["summary"]["step_seconds_median"] = 123.0
    assert Profile.from_dict(data).summary.step_seconds_median == pytest.approx(0.2)


def test_unknown_keys_are_ignored_within_a_major_version():
    data = make_profile().to_dict()
    data["schema"] = "torchaxe.profile/1.3"
    data["something_new"] = {"x": 1}
    data["steps"][0]["npu_aicore_seconds"] = 0.1
    assert Profile.from_dict(data).steps[0].seconds == 0.5


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="torchaxe.profile/2"), "from a newer torchaxe"),
    (lambda d: d.update(schema="other/1"), "is not a torchaxe.profile file"),
    (lambda d: d.update(schema="torchaxe.profile/x"), "has no version number"),
    (lambda d: d.pop("schema"), "schema: missing"),
    (lambda d: d.update(status="finished"), "status: 'finished' is not one of"),
    (lambda d: d.update(steps="many"), "steps: expected a list"),
    (lambda d: d["steps"][1].update(seconds="fast"), "steps[1].seconds: expected a finite number"),
    (lambda d: d["steps"][1].update(seconds=-1), "steps[1].seconds: -1 is below 0"),
    (lambda d: d["steps"][1].update(index=1), "indices must be unique and increasing"),
    (lambda d: d["steps"][0].update(phase="cooldown"), "steps[0].phase"),
    (lambda d: d["steps"][0].update(batches=True), "steps[0].batches: expected an integer, got a boolean"),
    (lambda d: d["run"].update(rank=3, world_size=2), "rank 3 is not below world_size 2"),
    (lambda d: d.pop("run"), "run: missing"),
    (lambda d: d["ops"][0]["input_shapes"][0].update(input_shapes=[[4, -1]]), "expected a shape"),
    (lambda d: d["shapes"]["modules"][0]["signatures"][0].update(dtypes=[]), "1 shapes but 0 dtypes"),
    (lambda d: d["host_syncs"][0].pop("line"), "host_syncs[0].line: missing"),
])
def test_bad_profiles_are_refused_in_one_line(mutate, message):
    data = make_profile().to_dict()
    mutate(data)
    with pytest.raises(ProfileFormatError) as caught:
        Profile.from_dict(data)
    assert message in caught.value.message
    assert "\n" not in caught.value.message


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "top level: expected an object"),
    ("", "not JSON"),
])
def test_bad_files_name_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileFormatError) as caught:
        load_profile(path)
    assert str(path) in caught.value.message and message in caught.value.message
    assert "\n" not in caught.value.message


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(ProfileFormatError, match="no such file"):
        load_profile(tmp_path / "nope.json")
    with pytest.raises(ProfileFormatError, match="is a folder"):
        load_profile(tmp_path)


def test_save_refuses_a_missing_folder(tmp_path):
    with pytest.raises(TorchaxeError, match="does not exist"):
        save_profile(make_profile(), tmp_path / "no" / "p.json")


def test_rank_path():
    assert rank_path("out/p.json", 1, 4).as_posix() == "out/p.rank1.json"
    assert rank_path("p", 0, 2).as_posix() == "p.rank0.json"
    assert rank_path("p.json", 0, 1).as_posix() == "p.json"
    assert rank_path("p.json", None, None).as_posix() == "p.json"


def test_quantiles_match_numpy():
    rng = random.Random(3)
    for n in (1, 2, 5, 10, 37):
        values = [rng.random() for _ in range(n)]
        for q in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_samples_spread_and_noise():
    steady = Samples.of([1.0, 1.01, 0.99, 1.0, None])
    assert len(steady) == 4 and not steady.is_noisy()
    noisy = Samples.of([1.0, 2.0, 1.0, 2.0])
    assert noisy.is_noisy() and noisy.relative_spread == pytest.approx(1.0 / 1.5)
    assert not Samples.of([]) and Samples.of([]).median is None


def test_merge_finds_the_slowest_rank():
    fast = make_profile(seconds=(1.0, 0.10, 0.10, 0.10), rank=0, world=3)
    mid = make_profile(seconds=(1.0, 0.11, 0.11, 0.11), rank=1, world=3)
    slow = make_profile(seconds=(1.0, 0.15, 0.12, 0.20), rank=2, world=3)
    report = merge_profiles([("a", fast), ("c", slow), ("b", mid)])
    assert [r.rank for r in report.ranks] == [0, 1, 2]
    assert report.slowest_by == "step_seconds" and report.slowest.rank == 2
    assert report.median_step_seconds == pytest.approx(0.11)
    assert report.slowest_vs_median == pytest.approx(0.15 / 0.11 - 1)
    assert report.slowest_counts() == {0: 0, 1: 0, 2: 3}
    data = report.to_dict()
    assert data["schema"] == MERGE_SCHEMA and data["slowest_rank"] == 2
    assert data["steps"][0]["seconds"] == {"0": 0.10, "1": 0.11, "2": 0.15}
    assert report.warnings == []


def test_merge_compares_time_outside_backward_when_every_rank_has_it():
    # Data parallel: every step takes 0.3 s everywhere; rank 1 is the one the
    # others wait for, inside backward.
    fast = make_profile(seconds=(1, 0.3, 0.3, 0.3), backward=(0, 0.25, 0.25, 0.24), rank=0, world=2)
    slow = make_profile(seconds=(1, 0.3, 0.3, 0.3), backward=(0, 0.05, 0.05, 0.05), rank=1, world=2)
    report = merge_profiles([("a", fast), ("b", slow)])
    assert report.slowest_by == "outside_backward_seconds"
    assert report.slowest.rank == 1
    assert report.slowest.outside_backward_seconds_median == pytest.approx(0.25)
    assert report.median_rank_measure == pytest.approx((0.25 + 0.05) / 2)
    assert report.slowest_vs_median == pytest.approx(0.25 / 0.15 - 1)
    assert report.slowest_counts() == {0: 0, 1: 3}
    data = report.to_dict()
    assert data["slowest_by"] == "outside_backward_seconds" and data["slowest_rank"] == 1
    assert data["steps"][0]["outside_backward_seconds"] == {"0": pytest.approx(0.05), "1": pytest.approx(0.25)}


def test_merge_warns_about_missing_ranks_and_failed_ones():
    report = merge_profiles([("a", make_profile(rank=0, world=4)),
                             ("b", make_profile(rank=3, world=4, status="error"))])
    assert any("2 of 4 ranks" in w for w in report.warnings)
    assert any("rank 3 ended with status error" in w for w in report.warnings)


@pytest.mark.parametrize("profiles, message", [
    ([], "nothing to merge"),
    ([("a", make_profile())], "not from a distributed run"),
    ([("a", make_profile(rank=0, world=2)), ("b", make_profile(rank=0, world=2))], "rank 0 again"),
    ([("a", make_profile(rank=0, world=2)), ("b", make_profile(rank=1, world=3))], "different sizes"),
])
def test_merge_refuses_files_that_do_not_belong_together(profiles, message):
    with pytest.raises(TorchaxeError, match=message):
        merge_profiles(profiles)


def test_host_syncs_of_a_run_without_steps_keep_their_heading():
    import io

    from torchaxe.report.profile_text import render_profile_summary

    profile = make_profile(seconds=(), status="completed")
    out = io.StringIO()
    render_profile_summary(profile, None, out)
    text = out.getvalue()
    assert "steps       none on cpu" in text
    assert "  host syncs  by line, over the whole run (no measured step to count them by):" in text
    assert "train.py:12 .item() x4" in text


def test_an_uneven_optimizer_time_shows_its_mean_beside_the_median():
    # Seen in a review: "optimizer 6.3% of step time in optimizer.step() (median 0.71 ms
    # per step)" on 400 ms steps, four of ten updates taking 70 ms.
    import io

    from torchaxe.report.profile_text import render_profile_summary

    profile = make_profile(seconds=(0.5,) + (0.4,) * 10)
    for i, step in enumerate(profile.steps[1:]):
        step.optimizer_seconds = 0.07 if i % 5 in (1, 3) else 0.0007
    out = io.StringIO()
    render_profile_summary(profile, None, out)
    line = next(l for l in out.getvalue().splitlines() if l.startswith("  optimizer"))
    assert "median 0.70 ms per step, mean 28.4 ms: a few steps' updates took far longer" in line, line
    for step in profile.steps[1:]:
        step.optimizer_seconds = 0.0007
    out = io.StringIO()
    render_profile_summary(profile, None, out)
    assert "mean" not in next(l for l in out.getvalue().splitlines() if l.startswith("  optimizer"))
