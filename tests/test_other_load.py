"""Other processes' load during a measured run: counted from their CPU time, our own
runs left out, and said in advise's report."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchaxe.runtime.other_load import OtherLoad, OtherLoadWatch, busy_note


class Machine:
    """A scripted machine: each sample advances the clock by one second and returns
    the next snapshot."""

    def __init__(self, snapshots):
        self.snapshots = list(snapshots)
        self.now = 1000.0
        self.taken = 0

    def clock(self) -> float:
        return self.now

    def snapshot(self):
        snap = self.snapshots[min(self.taken, len(self.snapshots) - 1)]
        self.taken += 1
        self.now += 1.0
        return snap


def watch_over(machine: Machine, family=frozenset({1}), cores=2, usable=2) -> OtherLoad:
    watch = OtherLoadWatch(interval=3600.0, snapshot=machine.snapshot, family=lambda: set(family),
                           clock=machine.clock, cores=cores, usable=usable)
    watch.start()
    for _ in range(len(machine.snapshots) - 2):
        watch.sample()
    load = watch.stop()
    assert load is not None
    return load


def test_others_cpu_time_over_the_watch_is_their_average_cores_busy() -> None:
    # pid 1 is ours (the runs); pid 7 a busy neighbour at 1.5 cores; pid 9 idle.
    snaps = [{1: ("python", 10.0 + 2 * i, 0.0), 7: ("trainer", 50.0 + 1.5 * i, 0.0), 9: ("sshd", 3.0, 0.0)}
             for i in range(5)]
    load = watch_over(Machine(snaps))
    assert load.cores == pytest.approx(1.5, rel=0.05)
    assert load.busy
    assert load.busiest[0][:2] == ("trainer", 7)
    assert "trainer (pid 7)" in busy_note([load])


def test_an_idle_neighbour_and_our_own_runs_are_not_busy() -> None:
    snaps = [{1: ("python", 10.0 + 2 * i, 0.0), 2: ("python", 5.0 + 1.9 * i, 0.0), 9: ("sshd", 3.0 + 0.05 * i, 0.0)}
             for i in range(5)]
    load = watch_over(Machine(snaps), family={1, 2})
    assert load.cores == pytest.approx(0.05, abs=0.02)
    assert not load.busy
    assert busy_note([load, None]) is None


def test_a_process_started_during_the_watch_counts_from_its_start() -> None:
    # pid 5 appears at the third sample, started after the second, with 2 s of CPU.
    snaps = [{1: ("python", 0.0, 0.0)}, {1: ("python", 0.0, 0.0)},
             {1: ("python", 0.0, 0.0), 5: ("make", 2.0, 1002.5)}, {1: ("python", 0.0, 0.0), 5: ("make", 2.0, 1002.5)}]
    load = watch_over(Machine(snaps))
    assert load.cores == pytest.approx(2.0 / 3.0)
    # A pid reused by a new process is not a negative use of the old one.
    snaps = [{5: ("old", 90.0, 0.0)}, {5: ("new", 1.0, 1001.5)}, {5: ("new", 2.0, 1001.5)}]
    assert watch_over(Machine(snaps)).cores == pytest.approx(2.0 / 2.0)


def test_load_the_cores_outside_the_run_can_hold_does_not_count() -> None:
    # 8-core machine, the run may use 2: others' 5 cores of load fit on the other 6.
    snaps = [{7: ("other", 5.0 * i, 0.0)} for i in range(4)]
    assert not watch_over(Machine(snaps), cores=8, usable=2).busy
    snaps = [{7: ("other", 7.0 * i, 0.0)} for i in range(4)]
    assert watch_over(Machine(snaps), cores=8, usable=2).cores == pytest.approx(1.0)


def test_a_machine_that_cannot_be_read_gives_no_figure() -> None:
    def broken():
        raise PermissionError("no /proc")

    watch = OtherLoadWatch(interval=3600.0, snapshot=broken, family=set)
    watch.start()
    assert watch.stop() is None


def test_the_note_names_the_worst_run_and_how_many_were_busy() -> None:
    quiet = OtherLoad(0.1, 2, 10.0)
    loud = OtherLoad(1.2, 2, 10.0, (("pytest", 42, 1.1),))
    note = busy_note([quiet, loud, loud, None])
    assert note.startswith("other processes kept 1.2 of the 2 usable cores busy during 2 of the 3 runs measured "
                           "(busiest: pytest (pid 42))")
    assert OtherLoad.from_dict(loud.to_dict()) == OtherLoad(1.2, 2, 10.0, (("pytest", 42, 1.1),))


def test_a_real_busy_process_outside_the_family_is_seen() -> None:
    # A child counts as another process when the family is only this one.
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        watch = OtherLoadWatch(interval=0.5, family=lambda: {os.getpid()}).start()
        time.sleep(2.0)
        load = watch.stop()
    finally:
        spin.kill()
        spin.wait()
    assert load is not None
    assert load.cores >= 0.5
    assert any(pid == spin.pid for _, pid, _ in load.busiest)


def test_a_trial_run_records_the_load_and_its_json(tmp_path: Path) -> None:
    from torchaxe.runtime.knobs import knob_set_from_dict
    from torchaxe.runtime.trials import TrialOptions, run_in_subprocess

    script = tmp_path / "train.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(6):\n    opt.zero_grad()\n    m(torch.randn(8, 4)).sum().backward()\n"
                      "    opt.step()\n")
    run = run_in_subprocess(knob_set_from_dict({"name": "original"}, "test"), [sys.executable, str(script)],
                            TrialOptions(repeats=1, steps=2, warmup=1), 1)
    assert run.ok, run.error
    assert run.other_load is not None and run.other_load.seconds > 0
    assert run.to_dict()["other_load"]["usable"] == run.other_load.usable


def test_profile_names_a_busy_process_beside_the_measured_steps(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import time\nimport torch\nm = torch.nn.Linear(64, 64)\n"
                      "opt = torch.optim.SGD(m.parameters(), lr=0.01)\n"
                      "for _ in range(200):\n    opt.zero_grad()\n    m(torch.randn(32, 64)).sum().backward()\n"
                      "    opt.step()\n    time.sleep(0.03)\n")
    # Not below the profiled process: to it, another process.
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"])
    try:
        run = subprocess.run([sys.executable, "-m", "torchaxe", "profile", "--steps", "40", "--warmup", "2",
                              "--out", str(tmp_path / "p.json"), "--", sys.executable, str(script)],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        spin.kill()
        spin.wait()
    assert run.returncode == 0, run.stderr
    assert "other processes kept" in run.stderr, run.stderr


def test_a_torchrun_rank_counts_its_sibling_ranks_as_its_own_job():
    # Under torchrun each rank's harness watches the machine: the job's other ranks
    # (children of the same launcher) are not other load. This test process plays the
    # launcher; a child of it plays a rank, another child its sibling.
    import json
    import os
    import subprocess
    import sys

    from torchaxe.runtime.other_load import own_family

    code = "import json; from torchaxe.runtime.other_load import own_family; print(json.dumps(sorted(own_family())))"
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        plain = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
        rank = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env={**plain, "TORCHELASTIC_RUN_ID": "job"})
        assert {sibling.pid, os.getpid()} <= set(json.loads(rank.stdout))
        alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=plain)
        assert sibling.pid not in set(json.loads(alone.stdout))
    finally:
        sibling.kill()
        sibling.wait()
    assert os.getpid() in own_family({})
