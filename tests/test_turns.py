"""Runs side by side that take turns (runtime/turns.py): the coordinator, the run's
side in the harness, the measuring loop that makes a round's runs at once."""

from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

import pytest

from profile_support import PRELUDE, run_script
from torchaxe.advise.measure import Measurer
from torchaxe.runtime.knobs import knob_set_from_dict
from torchaxe.runtime.trials import TrialOptions, TrialRun, run_in_subprocess
from torchaxe.runtime.turns import (ENV, ENV_WARM, TurnClient, TurnPlan, round_shares, run_in_turns,
                                    steps_per_turn)

SCRIPT = Path(__file__).parent / "scripts" / "trial_train.py"


def knobs(name: str, **extra):
    return knob_set_from_dict({"name": name, **extra}, "test")


def test_the_plan_travels_in_one_variable_and_bad_text_means_alone() -> None:
    plan = TurnPlan("/tmp/x;y/turns.sock", 3, 1)
    assert TurnPlan.from_env(plan.to_env()) == plan
    for text in (None, "", "nonsense", "/p;zero;1", "/p;0;1"):
        assert TurnPlan.from_env(text) is None


@pytest.mark.parametrize("step, steps, expected", [(0.05, 40, 10), (0.05, 20, 5), (0.3, 8, 2), (2.0, 8, 1),
                                                   (None, 12, 3), (0.001, 64, 16)])
def test_a_turn_is_half_a_second_of_steps_and_a_run_has_several(step, steps, expected) -> None:
    assert steps_per_turn(step, steps) == expected


class FakeRuns:
    """Runs in threads that take turns as the harness does: warm-up, the first wait,
    then ``steps`` measured steps with a wait every turn; each step notes who ran it
    and how many ran at once."""

    def __init__(self, steps: int, *, fail_before: set[str] = frozenset(), die_after_turn: set[str] = frozenset()):
        self.steps = steps
        self.fail_before = fail_before
        self.die_after_turn = die_after_turn
        self.log: list[str] = []
        self.active = 0
        self.most_active = 0
        #: runs warming up or stepping at once
        self.busy = 0
        self.most_busy = 0
        self.lock = threading.Lock()
        #: the --timeout each run was given
        self.timeouts: dict[str, float | None] = {}

    def __call__(self, knob_set, command, options, repeat, env) -> TrialRun:
        name = knob_set.name
        self.timeouts[name] = options.timeout
        if name in self.fail_before:
            return TrialRun(knobs=name, repeat=repeat, ok=False, error="crashed at import")
        client = TurnClient(TurnPlan.from_env(env[ENV]))
        with self.lock:
            self.busy += 1
            self.most_busy = max(self.most_busy, self.busy)
        time.sleep(0.01 * len(name))  # warm-up, longer for some
        with self.lock:
            self.busy -= 1
        client.wait()
        plan_steps = client.plan.steps
        for step in range(1, self.steps + 1):
            with self.lock:
                self.active += 1
                self.busy += 1
                self.most_active = max(self.most_active, self.active)
                self.most_busy = max(self.most_busy, self.busy)
                self.log.append(name)
            time.sleep(0.002)
            with self.lock:
                self.active -= 1
                self.busy -= 1
            if step == self.steps:
                client.end()
            elif name in self.die_after_turn and step == plan_steps:
                client.close()  # the process died mid-run: its socket closed
                return TrialRun(knobs=name, repeat=repeat, ok=False, error="killed")
            else:
                client.step_measured()
        return TrialRun(knobs=name, repeat=repeat, ok=True, step_seconds=[0.002] * self.steps)


def turns_of(log: list[str]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for name in log:
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + 1)
        else:
            out.append((name, 1))
    return out


def test_runs_take_turns_one_at_a_time_in_order() -> None:
    fake = FakeRuns(steps=6)
    runs = run_in_turns([knobs("a"), knobs("bb"), knobs("ccc")], ["python", "x.py"], TrialOptions(timeout=10), 1,
                        turn_steps=2, runner=fake)
    assert fake.most_active == 1
    # They warm up one after another too: never two computing at once.
    assert fake.most_busy == 1
    assert turns_of(fake.log) == [(n, 2) for _ in range(3) for n in ("a", "bb", "ccc")]
    assert [r.turns for r in runs] == [3, 3, 3] and all(r.ok for r in runs)
    # The round's wall time is shared among its runs.
    assert runs[0].seconds == runs[1].seconds == runs[2].seconds > 0


def test_a_first_compile_s_warm_up_is_charged_to_its_own_run() -> None:
    # A round of 60 s: four runs warmed up in 2 s each, a compiling one (run 4) in 32 s;
    # the 30 s beyond the others' were the compile's alone.
    shares = round_shares(60.0, 5, {0: 2.0, 1: 2.0, 2: 1.8, 3: 2.2, 4: 32.0}, once={4})
    assert shares[4] == pytest.approx(36.0) and shares[0] == shares[1] == pytest.approx(6.0)
    assert sum(shares.values()) == pytest.approx(60.0)
    # Nothing compiles, or no warm-up was timed: equal shares.
    assert set(round_shares(60.0, 3, {0: 1.0, 1: 9.0, 2: 1.0}, once=set()).values()) == {20.0}
    assert set(round_shares(60.0, 2, {0: None, 1: 30.0}, once={1}).values()) == {30.0}


def test_a_run_started_after_the_others_warm_up_has_what_is_left_of_the_rounds_limit() -> None:
    # Runs start one after another (each warms up alone): a --timeout counted from each
    # run's own start would let the last end past the round's limit (10 s a run, 3 runs).
    fake = FakeRuns(steps=2)
    run_in_turns([knobs("a" * 20), knobs("b" * 20), knobs("c")], ["python", "x.py"], TrialOptions(timeout=10), 1,
                 turn_steps=2, runner=fake, one_deadline=True)
    a, b, c = (fake.timeouts[n] for n in ("a" * 20, "b" * 20, "c"))
    assert a == pytest.approx(30, abs=0.05)
    # each 0.2 s warm-up of the runs before comes off the next one's limit
    assert a - b >= 0.2 and b - c >= 0.2 and c < 29.7
    # trial --turns: a --timeout per run, from its own start, as its help says
    fake = FakeRuns(steps=2)
    run_in_turns([knobs("a" * 20), knobs("c")], ["python", "x.py"], TrialOptions(timeout=10), 1, turn_steps=2,
                 runner=fake)
    assert set(fake.timeouts.values()) == {20}


class SlowWarmups(FakeRuns):
    """FakeRuns whose warm-ups take ``warm`` seconds by name, stopped as the harness
    stops them at the warm-up limit the round gives (no measured step: "stopped")."""

    def __init__(self, steps: int, warm: dict[str, float]):
        super().__init__(steps)
        self.warm = warm
        self.order: list[str] = []
        self.warm_limits: dict[str, float | None] = {}

    def __call__(self, knob_set, command, options, repeat, env) -> TrialRun:
        name = knob_set.name
        self.order.append(name)
        limit = float(env[ENV_WARM]) if ENV_WARM in env else None
        self.warm_limits[name] = limit
        if limit is not None and self.warm.get(name, 0.0) > limit:
            time.sleep(limit)
            return TrialRun(knobs=name, repeat=repeat, ok=False, status="stopped",
                            error="no measured steps: stopped: no step within the first-step timeout")
        time.sleep(self.warm.get(name, 0.0))
        return super().__call__(knob_set, command, options, repeat, env)


def test_a_first_compile_warms_up_last_and_is_stopped_where_it_would_cut_the_warm_runs() -> None:
    # advise's round under one deadline (3 runs x 1 s): the original and a cheap change
    # warm up first; the compile's warm-up may take what is left beyond the measured
    # steps of all three (0.2 s each), and its 5 s one is stopped there, not at the
    # round's end where every run would be cut.
    fake = SlowWarmups(steps=2, warm={"compiled": 5.0})
    sets = [knobs("compiled", compile={"mode": "default"}), knobs("cheap", env={"X": "1"}), knobs("original")]
    started = time.perf_counter()
    runs = run_in_turns(sets, ["python", "x.py"], TrialOptions(timeout=1.0), 1, turn_steps=2, runner=fake,
                        one_deadline=True, measure_seconds=0.2)
    assert time.perf_counter() - started < 4.0  # not the 5 s warm-up
    assert fake.order == ["original", "cheap", "compiled"]
    assert fake.warm_limits["compiled"] == pytest.approx(3.0 - 3 * 0.2, abs=0.2)
    compiled, cheap, original = runs
    assert original.ok and cheap.ok and fake.log.count("cheap") == 2
    assert compiled.status == "timeout" and compiled.error.startswith("timeout: not warm within")
    from torchaxe.advise.measure import cut_short

    assert cut_short(compiled)  # the deadline's, not a failure of the change
    # No time left for a warm-up at all: the run is not started.
    fake = SlowWarmups(steps=2, warm={"original": 0.5})
    runs = run_in_turns([knobs("original"), knobs("cheap", env={"X": "1"})], ["python", "x.py"],
                        TrialOptions(timeout=0.5), 1, turn_steps=2, runner=fake, one_deadline=True,
                        measure_seconds=0.3)
    assert fake.order == ["original"] and runs[1].status == "timeout" and runs[1].seconds is None
    # trial --turns (no deadline for the round): no warm-up limit
    fake = SlowWarmups(steps=2, warm={})
    run_in_turns(sets, ["python", "x.py"], TrialOptions(timeout=10), 1, turn_steps=2, runner=fake)
    assert set(fake.warm_limits.values()) == {None}


def test_a_run_that_fails_before_its_first_turn_or_dies_in_one_does_not_hold_the_others() -> None:
    fake = FakeRuns(steps=4, fail_before={"bb"}, die_after_turn={"ccc"})
    runs = run_in_turns([knobs("a"), knobs("bb"), knobs("ccc"), knobs("dddd")], ["python", "x.py"],
                        TrialOptions(), 1, turn_steps=2, runner=fake)
    assert [r.ok for r in runs] == [True, False, False, True]
    assert [r.turns for r in runs] == [2, 0, 1, 2]
    assert fake.log.count("a") == fake.log.count("dddd") == 4 and fake.most_active == 1


@pytest.mark.parametrize("warmup", [2, 0])
def test_the_harness_waits_for_its_turn_outside_any_step(tmp_path, monkeypatch, warmup) -> None:
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setitem(sys.modules, "torchaxe_test_clock", clock)
    calls: list[str] = []

    class Recording:
        def wait(self):
            calls.append("wait")
            clock.now += 1000.0  # the others' turns: in no step

        def step_measured(self):
            calls.append("step")

        def end(self):
            calls.append("end")

    monkeypatch.setattr(TurnClient, "from_environment", classmethod(lambda cls: Recording()))
    source = PRELUDE + """
import torchaxe_test_clock as clock
for k in range(1, 20):
    out = model(x)
    clock.now += 1
    out.sum().backward()
    opt.step()
"""
    profile = run_script(tmp_path, source, steps=4, warmup=warmup, clock=lambda: clock.now)
    assert calls == ["wait", "step", "step", "step", "end"]
    assert [s.seconds for s in profile.steps] == [1.0] * (4 + warmup)


def test_the_harness_stops_a_warm_up_longer_than_its_round_left_it(tmp_path, monkeypatch) -> None:
    # Steps after the first recompile too (new shapes): the first step ends in time,
    # but the warm-up of 4 steps of 0.3 s does not end within the 0.5 s it was given.
    monkeypatch.setenv(ENV, TurnPlan(str(tmp_path / "none.sock"), 2, 0).to_env())
    monkeypatch.setenv(ENV_WARM, "0.5")
    calls: list[str] = []
    monkeypatch.setattr(TurnClient, "wait", lambda self: calls.append("wait"))
    source = PRELUDE + """
import time
for k in range(1, 20):
    out = model(x)
    time.sleep(0.3)
    out.sum().backward()
    opt.step()
"""
    profile = run_script(tmp_path, source, steps=4, warmup=4)
    assert profile.status == "stopped" and not profile.measured_steps and calls == []
    assert profile.detail.startswith("stopped: not warm within 0.5 s of the start of training"), profile.detail
    assert 1 <= len(profile.steps) <= 3
    # Given the time, the same run is measured.
    monkeypatch.setenv(ENV, TurnPlan(str(tmp_path / "none.sock"), 2, 0).to_env())
    monkeypatch.setenv(ENV_WARM, "30")
    profile = run_script(tmp_path, source, steps=2, warmup=2)
    assert profile.status == "stopped" and len(profile.measured_steps) == 2


def test_a_round_made_at_once_gives_ratios_against_its_own_original_run() -> None:
    made: list[list[str]] = []
    medians = {"original": [0.10, 0.20], "fast": [0.05, 0.10], "same": [0.10, 0.22]}

    def together(knob_sets, repeat, options):
        made.append([k.name for k in knob_sets])
        return [TrialRun(knobs=k.name, repeat=repeat, ok=True, step_seconds=[medians[k.name][repeat - 1]],
                         seconds=1.0) for k in knob_sets]

    def one_by_one(*args):
        raise AssertionError("a round that fits goes together")

    measurer = Measurer(["python", "x.py"], TrialOptions(), runner=one_by_one, together=together)
    base, (same, fast), complete = measurer.compare(knobs("original"), [knobs("same"), knobs("fast")], 2)
    assert complete
    assert made == [["same", "fast", "original"], ["fast", "original", "same"]]  # who goes first rotates
    assert fast.ratios == [0.5, 0.5] and same.ratios == pytest.approx([1.0, 1.1])


def test_a_round_memory_cannot_hold_at_once_goes_one_by_one() -> None:
    order: list[str] = []

    def one(knob_set, command, options, repeat):
        order.append(knob_set.name)
        return TrialRun(knobs=knob_set.name, repeat=repeat, ok=True, step_seconds=[0.1], seconds=1.0)

    def together(knob_sets, repeat, options):
        raise AssertionError("three runs do not fit beside each other")

    measurer = Measurer(["python", "x.py"], TrialOptions(), runner=one, together=together, together_limit=2)
    measurer.compare(knobs("original"), [knobs("a"), knobs("b")], 1)
    assert order == ["original", "a", "b"]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _slow_compile(clock: _Clock, given: list[float | None], took: float):
    """A runner whose compiled change takes ``took`` seconds: the harness stops it at
    its --timeout (status timeout, no step measured) when that comes first."""
    def run(knob_set, command, options, repeat, env=None):
        given.append(options.timeout)
        seconds = took if knob_set.name == "compiled" else 10.0
        if options.timeout is not None and seconds > options.timeout:
            clock.now += options.timeout
            return TrialRun(knobs=knob_set.name, repeat=repeat, ok=False, status="timeout",
                            error="no measured steps: stopped at --timeout", seconds=options.timeout)
        clock.now += seconds
        return TrialRun(knobs=knob_set.name, repeat=repeat, ok=True, step_seconds=[0.1], seconds=seconds)
    return run


def test_a_first_compile_longer_than_the_runs_before_it_stops_at_the_deadline() -> None:
    # 100 s of budget; the original takes 10 s a run, the compiled change's first run
    # 500 s (nothing said so before it started): it is stopped when the budget ends.
    clock, given = _Clock(), []
    measurer = Measurer(["python", "x.py"], TrialOptions(timeout=1000.0), deadline=100.0, clock=clock,
                        runner=_slow_compile(clock, given, 500.0))
    base, (compiled,), complete = measurer.compare(knobs("original"), [knobs("compiled")], 2)
    assert not complete and not compiled.runs and clock.now <= 100.0 and measurer.stopped == ["compiled"]
    # Each --timeout leaves the 10 s the harness may take to stop a run after it.
    assert given[0] == 90.0 and given[1] == pytest.approx(80.0)
    # Runs that end in time keep the --timeout they were given.
    clock, given = _Clock(), []
    fast = Measurer(["python", "x.py"], TrialOptions(timeout=50.0), deadline=1000.0, clock=clock,
                    runner=_slow_compile(clock, given, 20.0))
    _, (done,), complete = fast.compare(knobs("original"), [knobs("compiled")], 1)
    assert complete and done.ratios and set(given) == {50.0}


def test_a_round_side_by_side_stopped_by_the_deadline_keeps_the_runs_that_ended() -> None:
    clock, given = _Clock(), []
    run = _slow_compile(clock, given, 500.0)

    def together(knob_sets, repeat, options):
        return [run(k, [], options, repeat) for k in knob_sets]

    measurer = Measurer(["python", "x.py"], TrialOptions(timeout=1000.0), deadline=100.0, clock=clock,
                        runner=run, together=together)
    base, (compiled, fused), complete = measurer.compare(knobs("original"), [knobs("compiled"), knobs("fused")], 1)
    # The compiled run was stopped: no failure, no ratio; the fused one ended in time.
    assert not complete and not compiled.ratios and not compiled.runs and compiled.error is None
    assert fused.ratios == [1.0] and measurer.stopped == ["compiled"]
    # each of the three runs side by side: a third of what is left less the grace to stop them
    assert given[0] == pytest.approx(90.0 / 3)


@pytest.mark.slow
def test_real_runs_take_turns_through_the_harness(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    options = TrialOptions(steps=8, warmup=2, timeout=120, target="cpu")
    # One compute thread each, and a 300 ms sleep against a step of a millisecond: on a
    # machine loaded by other tests, two threads' steps can take 100 ms.
    one = {"OMP_NUM_THREADS": "1"}
    runs = run_in_turns([knobs("base", env=one), knobs("slow", env={**one, "SLOW_MS": "300"})],
                        [sys.executable, str(SCRIPT)], options, 1, turn_steps=2, runner=run_in_subprocess)
    assert all(r.ok for r in runs), [r.error for r in runs]
    assert [r.turns for r in runs] == [4, 4]
    assert [len(r.step_seconds) for r in runs] == [8, 8]
    assert runs[1].median >= 0.3 > runs[0].median


WRITER = """
import torch
from torch import nn

model = nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(40):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    with open("log.txt", "a") as log:
        log.write(f"step {step}\\n")
    torch.save(model.state_dict(), "ckpt.pt")
"""


@pytest.mark.slow
def test_runs_side_by_side_leave_the_users_files_as_they_were(tmp_path, monkeypatch) -> None:
    # Three runs append to the user's log and write a checkpoint, taking turns: each
    # would back up what the one before it had already written, and the last to end
    # would put that back.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(WRITER)
    (tmp_path / "log.txt").write_text("the user's own log\n")
    options = TrialOptions(steps=6, warmup=1, timeout=120, target="cpu")
    runs = run_in_turns([knobs(f"run{n}") for n in range(3)], [sys.executable, "train.py"], options, 1,
                        turn_steps=2)
    assert all(r.ok for r in runs), [r.error for r in runs]
    assert (tmp_path / "log.txt").read_text() == "the user's own log\n"
    assert not (tmp_path / "ckpt.pt").exists()


def test_the_noise_benchmark_reports_how_far_identical_runs_land_from_one() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from turns_noise import spread

    figures = spread([0.9, 1.05, 1.2])
    assert figures["max_distance"] == pytest.approx(0.2) and figures["median_distance"] == pytest.approx(0.1)
    assert spread([])["max_distance"] is None


def test_trial_rounds_go_together_with_turns_and_report_in_the_sets_order() -> None:
    from torchaxe.runtime.trials import run_trials

    made: list[list[str]] = []
    medians = {"base": 0.10, "fast": 0.05}

    def side_by_side(knob_sets, command, options, repeat, *, turn_steps):
        assert turn_steps == 3
        made.append([k.name for k in knob_sets])
        return [TrialRun(knobs=k.name, repeat=repeat, ok=True, step_seconds=[medians[k.name]] * 4, seconds=1.0)
                for k in knob_sets]

    def one_by_one(*args):
        raise AssertionError("with turns, rounds go together")

    report = run_trials([knobs("base"), knobs("fast")], ["python", "x.py"], TrialOptions(repeats=2),
                        runner=one_by_one, turn_steps=3, turns=side_by_side)
    assert made == [["fast", "base"], ["base", "fast"]]
    base, fast = report.results
    assert [r.repeat for r in base.runs] == [1, 2] and fast.ratio.per_repeat == pytest.approx([0.5, 0.5])


def test_trial_turns_refuse_a_torchrun_job_in_one_line(tmp_path) -> None:
    import subprocess

    knob_file = tmp_path / "a.json"
    knob_file.write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "torchaxe", "trial", "--turns", "--knobs", str(knob_file), "--",
                           "torchrun", "--nproc-per-node", "2", str(SCRIPT)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--turns: runs take turns one process each" in proc.stderr


def test_a_run_waiting_for_its_turn_stops_its_own_child_processes_until_the_turn_comes_back(tmp_path) -> None:
    # A run's DataLoader workers that went on loading through the other runs' turns
    # made a loader with two workers measure 3.30x where it ran slower applied.
    import socket
    import subprocess

    import psutil

    path = str(tmp_path / "turns.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen: dict[str, str] = {}

    def coordinator() -> None:
        conn, _ = server.accept()
        reader = conn.makefile("rb")
        assert reader.readline().strip() == b"hello 1"
        assert reader.readline().strip() == b"wait"
        deadline = time.monotonic() + 5.0  # a stop signal takes effect when delivered
        while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["while waiting"] = psutil.Process(child.pid).status()
        conn.sendall(b"go\n")
        reader.readline()  # the connection closes with the client
        conn.close()

    thread = threading.Thread(target=coordinator, daemon=True)
    thread.start()
    client = TurnClient(TurnPlan(path, 2, 1))
    try:
        client.wait()
        assert client.plan is not None  # told "go": still taking turns
        assert psutil.Process(child.pid).status() != psutil.STATUS_STOPPED  # its turn: it runs again
        assert seen["while waiting"] == psutil.STATUS_STOPPED
    finally:
        client.close()
        thread.join(timeout=10)
        child.kill()
        child.wait()
        server.close()
