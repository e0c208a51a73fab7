"""`torchaxe bind check`: thread counters replayed from a canned /proc, and a live run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchaxe.bind.check import descendants, judge, measure, memory_node, parse_stat
from torchaxe.bind.topology import read_topology
from torchaxe.errors import TorchaxeError

TREES = Path(__file__).parent / "data" / "sysfs"


def stat_line(pid: int, name: str, ppid: int, ticks: int, cpu: int) -> str:
    fields = [str(pid), f"({name})", "R", str(ppid)] + ["0"] * 48
    fields[13] = str(ticks)  # utime (field 14)
    fields[14] = "0"         # stime (field 15)
    fields[38] = str(cpu)    # processor (field 39)
    return " ".join(fields) + "\n"


class FakeProc:
    """A /proc tree whose counters advance on every sleep, with a clock to match."""

    def __init__(self, root: Path, threads: dict[int, list[tuple[int, int, int, int, int]]], allowed: str,
                 numa_maps: str | None, pid: int = 100, sched: bool = True) -> None:
        # threads: tid -> per step (ticks, cpu, migrations, voluntary, involuntary)
        self.root, self.threads, self.allowed, self.pid, self.sched = root, threads, allowed, pid, sched
        self.step, self.now = 0, 0.0
        (root / str(pid)).mkdir(parents=True)
        if numa_maps is not None:
            (root / str(pid) / "numa_maps").write_text(numa_maps)
        self.write()

    def write(self) -> None:
        for tid, steps in self.threads.items():
            ticks, cpu, migr, vol, invol = steps[min(self.step, len(steps) - 1)]
            task = self.root / str(self.pid) / "task" / str(tid)
            task.mkdir(parents=True, exist_ok=True)
            name = "python" if tid == self.pid else "pt_thread (x)"
            (task / "stat").write_text(stat_line(tid, name, 1, ticks, cpu))
            (task / "status").write_text(f"Name:\t{name}\nCpus_allowed_list:\t{self.allowed}\n"
                                         f"voluntary_ctxt_switches:\t{vol}\nnonvoluntary_ctxt_switches:\t{invol}\n")
            if self.sched:
                (task / "sched").write_text(f"python ({tid}, #threads: 2)\n---\nse.nr_migrations    :   {migr}\n")
        main = self.threads[self.pid][min(self.step, len(self.threads[self.pid]) - 1)]
        (self.root / str(self.pid) / "stat").write_text(stat_line(self.pid, "python", 1, main[0], main[1]))

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += 1.0
        self.step += 1
        self.write()


def test_parse_stat_with_a_name_holding_parentheses_and_spaces():
    name, ppid, ticks, cpu = parse_stat(stat_line(7, "a (b) c", 3, 250, 5))
    assert (name, ppid, ticks, cpu) == ("a (b) c", 3, 250, 5)


def test_unbound_thread_hopping_nodes_would_gain(tmp_path):
    topo = read_topology(TREES / "xeon-2s-smt", target="cpu", environ={})
    # tid 101 is busy: 100 ticks (1 s of CPU) per 1 s step, hopping node 0 -> 1 -> 0 -> 1
    busy = [(0, 0, 0, 0, 0), (100, 20, 10, 5, 40), (200, 3, 20, 10, 80), (300, 60, 30, 15, 120)]
    idle = [(5, 1, 0, 0, 0)] * 4
    fake = FakeProc(tmp_path, {100: idle, 101: busy}, "0-79", "7f0000 default anon=9 N0=1000 N1=12\n")
    report = measure(100, duration=3.0, proc_root=tmp_path, topology=topo, clock=fake.clock, sleep=fake.sleep)
    assert report.samples == 4 and report.seconds == pytest.approx(3.0)
    [p] = report.processes
    assert p.home_node == 0 and "numa_maps" in p.home_from
    hot = next(t for t in p.threads if t.tid == 101)
    assert hot.busy == pytest.approx(1.0)
    assert hot.migrations_per_s == pytest.approx(10.0) and hot.migrations_exact
    assert hot.switches_per_s == pytest.approx(45.0) and hot.involuntary_per_s == pytest.approx(40.0)
    assert hot.cpus_seen == (3, 20, 60)
    assert hot.off_node == pytest.approx(2 / 3)
    assert [t.tid for t in p.busy_threads] == [101]
    assert report.verdict == "binding would likely help"
    data = report.to_dict()
    json.dumps(data)
    assert data["processes"][0]["threads"][1]["name"] == "pt_thread (x)"


def test_bound_steady_thread_is_left_alone(tmp_path):
    topo = read_topology(TREES / "xeon-2s-smt", target="cpu", environ={})
    steady = [(i * 90, 4, 0, i, 0) for i in range(4)]
    fake = FakeProc(tmp_path, {100: steady}, "4", "x N0=10\n")
    report = measure(100, duration=3.0, proc_root=tmp_path, topology=topo, clock=fake.clock, sleep=fake.sleep)
    assert report.verdict == "already bound; threads stay put"
    assert report.processes[0].threads[0].off_node == 0.0


def test_without_a_sched_file_migrations_are_counted_from_samples(tmp_path):
    topo = read_topology(TREES / "firecracker-2cpu", target="cpu", environ={})
    hop = [(0, 0, 0, 0, 0), (100, 1, 0, 0, 0), (200, 0, 0, 0, 0), (300, 1, 0, 0, 0)]
    fake = FakeProc(tmp_path, {100: hop}, "0-1", None, sched=False)
    report = measure(100, duration=3.0, proc_root=tmp_path, topology=topo, clock=fake.clock, sleep=fake.sleep)
    t = report.processes[0].threads[0]
    assert not t.migrations_exact and t.migrations_per_s == pytest.approx(1.0)
    assert t.off_node is None  # one node: nothing is off-node
    assert report.processes[0].home_from == "ran there most"
    assert any("at least" in r for r in report.reasons)


def test_idle_process_has_nothing_to_judge(tmp_path):
    topo = read_topology(TREES / "firecracker-2cpu", target="cpu", environ={})
    fake = FakeProc(tmp_path, {100: [(0, 0, 0, 0, 0)] * 3}, "0-1", None)
    report = measure(100, duration=2.0, proc_root=tmp_path, topology=topo, clock=fake.clock, sleep=fake.sleep)
    assert report.verdict == "nothing to judge"


def test_descendants_and_memory_node(tmp_path):
    for pid, ppid in [(10, 1), (11, 10), (12, 11), (13, 1)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat_line(pid, "p", ppid, 0, 0))
    assert sorted(descendants(tmp_path, 10)) == [10, 11, 12]
    (tmp_path / "10" / "numa_maps").write_text("a default N0=3 N1=5\nb default N1=1 kernelpagesize_kB=4\n")
    assert memory_node(tmp_path, 10) == 1 and memory_node(tmp_path, 11) is None


def test_missing_process_is_a_one_line_error(tmp_path):
    with pytest.raises(TorchaxeError, match="no process 4242"):
        measure(4242, proc_root=tmp_path)


@pytest.mark.slow
def test_live_check_of_a_busy_command(capsys):
    from torchaxe.cli import main

    code = main(["bind", "check", "--json", "--delay", "0.3", "--duration", "1", "--",
                 sys.executable, "-c", "import time\nend=time.time()+30\nwhile time.time()<end: pass"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "torchaxe.bind-check/1" and data["samples"] >= 3
    [proc] = data["processes"]
    assert proc["busy_threads"] == 1
    assert proc["threads"][0]["cpu_seconds"] > 0.1
    assert data["verdict"]


@pytest.mark.slow
def test_live_check_by_pid_of_a_bound_process(capsys):
    from torchaxe.cli import main

    child = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c",
                              "import time\nend=time.time()+30\nwhile time.time()<end: pass"])
    try:
        time.sleep(0.5)
        assert main(["bind", "check", "--duration", "1", str(child.pid)]) == 0
    finally:
        child.kill()
        child.wait()
    out = capsys.readouterr().out
    assert "verdict:" in out and "bound" in out and str(child.pid) in out


def test_judge_says_oversubscribed():
    from torchaxe.bind.check import ProcessReport, ThreadReport

    topo = read_topology(TREES / "firecracker-2cpu", target="cpu", environ={})
    threads = [ThreadReport(1, i, "t", (0, 1), 1.0, 0.6, 0.0, True, 100.0, 90.0, (0,), None) for i in range(4)]
    verdict, reasons = judge([ProcessReport(1, "p", (0, 1), 0, "x", threads)], topo)
    assert any("4 busy threads for 2 CPUs: oversubscribed" in r for r in reasons)
    assert verdict.startswith("binding may help")
