"""``torchaxe bind check``: is a running training process migrating between cores,
running away from its memory, or fighting for CPUs — would binding help?

For the process and (by default) its descendants (torchrun's ranks, DataLoader
workers), every thread is read at the start and the end of a window and sampled in
between (``/proc/PID/task/TID/stat``, ``status``, ``sched``):

- CPU time (``stat`` utime + stime) and the CPU it last ran on (field 39);
- context switches (``status`` voluntary/nonvoluntary), migrations between CPUs
  (``sched`` ``se.nr_migrations``; where the kernel has no ``sched`` file, changes of
  the last CPU between samples, a lower bound);
- its node in each sample where it ran, compared with the node holding most of the
  process's memory (``numa_maps``), or else the node it ran on most.

Everything is read below an injectable ``/proc`` and the clock and sleep are
injectable, so the tests replay canned readings.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torchaxe.cpulist import format_cpulist, parse_cpulist
from torchaxe.errors import TorchaxeError

#: Thresholds for the verdict (per busy thread): documented in docs/bind.md.
BUSY_SHARE = 0.05
MIGRATIONS_HIGH = 2.0
OFF_NODE_HIGH = 0.10
PREEMPTIONS_HIGH = 50.0


@dataclass
class Reading:
    """One thread's counters at one moment."""

    ticks: int
    cpu: int
    migrations: int | None
    voluntary: int
    involuntary: int


@dataclass
class ThreadReport:
    pid: int
    tid: int
    name: str
    allowed: tuple[int, ...]
    cpu_seconds: float
    busy: float
    migrations_per_s: float
    migrations_exact: bool
    switches_per_s: float
    involuntary_per_s: float
    cpus_seen: tuple[int, ...]
    off_node: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "tid": self.tid, "name": self.name, "allowed_cpus": format_cpulist(self.allowed),
                "cpu_seconds": round(self.cpu_seconds, 4), "busy": round(self.busy, 4),
                "migrations_per_s": round(self.migrations_per_s, 3), "migrations_exact": self.migrations_exact,
                "context_switches_per_s": round(self.switches_per_s, 3),
                "involuntary_switches_per_s": round(self.involuntary_per_s, 3),
                "cpus_seen": list(self.cpus_seen),
                "off_node_fraction": None if self.off_node is None else round(self.off_node, 4)}


@dataclass
class ProcessReport:
    pid: int
    name: str
    allowed: tuple[int, ...]
    home_node: int | None
    home_from: str
    threads: list[ThreadReport] = field(default_factory=list)

    @property
    def busy_threads(self) -> list[ThreadReport]:
        return [t for t in self.threads if t.busy >= BUSY_SHARE]


@dataclass
class CheckReport:
    seconds: float
    samples: int
    processes: list[ProcessReport]
    allowed: tuple[int, ...]
    nodes: int
    verdict: str
    reasons: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "torchaxe.bind-check/1", "seconds": round(self.seconds, 3), "samples": self.samples,
            "allowed_cpus": format_cpulist(self.allowed), "numa_nodes": self.nodes,
            "verdict": self.verdict, "reasons": list(self.reasons),
            "processes": [{"pid": p.pid, "name": p.name, "allowed_cpus": format_cpulist(p.allowed),
                           "home_node": p.home_node, "home_from": p.home_from,
                           "busy_threads": len(p.busy_threads),
                           "threads": [t.to_dict() for t in p.threads]} for p in self.processes],
        }


# ---------------------------------------------------------------------- reading


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def parse_stat(text: str) -> tuple[str, int, int, int]:
    """``/proc/PID/stat`` -> (name, ppid, utime + stime ticks, last CPU). The name may
    hold spaces and parentheses: the fields start after the last ``)``."""
    head, _, rest = text.rpartition(")")
    name = head.partition("(")[2]
    fields = rest.split()
    # fields[0] is field 3 (state): field N is fields[N - 3].
    return name, int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[36])


def parse_status(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def parse_sched_migrations(text: str | None) -> int | None:
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("se.nr_migrations"):
            try:
                return int(float(line.split(":", 1)[1]))
            except ValueError:
                return None
    return None


def read_thread(proc: Path, pid: int, tid: int) -> tuple[Reading, str, tuple[int, ...]] | None:
    base = proc / str(pid) / "task" / str(tid)
    stat, status = _read(base / "stat"), _read(base / "status")
    if stat is None or status is None:
        return None  # the thread ended
    try:
        name, _, ticks, cpu = parse_stat(stat)
        fields = parse_status(status)
        allowed = parse_cpulist(fields.get("Cpus_allowed_list", ""), "Cpus_allowed_list")
        reading = Reading(ticks, cpu, parse_sched_migrations(_read(base / "sched")),
                          int(fields.get("voluntary_ctxt_switches", 0)), int(fields.get("nonvoluntary_ctxt_switches", 0)))
    except (ValueError, IndexError, TorchaxeError):
        return None
    return reading, name, allowed


def descendants(proc: Path, pid: int) -> list[int]:
    """``pid`` and every process below it, from the ppid field of ``/proc/*/stat``."""
    children: dict[int, list[int]] = defaultdict(list)
    try:
        entries = [p.name for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return [pid]
    for name in entries:
        text = _read(proc / name / "stat")
        if text is None:
            continue
        try:
            _, ppid, _, _ = parse_stat(text)
        except (ValueError, IndexError):
            continue
        children[ppid].append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(sorted(children.get(p, ())))
    return out


def memory_node(proc: Path, pid: int) -> int | None:
    """The node holding most of the process's pages (``numa_maps`` ``N<node>=pages``)."""
    text = _read(proc / str(pid) / "numa_maps")
    if not text:
        return None
    pages: Counter = Counter()
    for line in text.splitlines():
        for token in line.split():
            if token.startswith("N") and "=" in token:
                node, _, count = token[1:].partition("=")
                if node.isdigit() and count.isdigit():
                    pages[int(node)] += int(count)
    return pages.most_common(1)[0][0] if pages else None


# ---------------------------------------------------------------------- measuring


def measure(pid: int, duration: float = 5.0, interval: float = 0.1, children: bool = True,
            proc_root: str | os.PathLike = "/proc", topology=None,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
            alive: Callable[[], bool] | None = None) -> CheckReport:
    """Watch ``pid`` (and its descendants) for ``duration`` seconds."""
    proc = Path(proc_root)
    if not (proc / str(pid)).is_dir():
        raise TorchaxeError(f"no process {pid} (nothing under {proc / str(pid)})")
    if topology is None:
        from torchaxe.bind.topology import read_topology

        topology = read_topology("/", target="cpu")
    node_of = topology.node_of_cpu()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    first: dict[tuple[int, int], Reading] = {}
    last: dict[tuple[int, int], Reading] = {}
    names: dict[tuple[int, int], str] = {}
    allowed: dict[tuple[int, int], tuple[int, ...]] = {}
    seen_cpus: dict[tuple[int, int], Counter] = defaultdict(Counter)
    changes: dict[tuple[int, int], int] = defaultdict(int)
    proc_names: dict[int, str] = {}
    samples = 0
    start = clock()
    end = start + duration
    while True:
        now = clock()
        pids = descendants(proc, pid) if children else [pid]
        for p in pids:
            try:
                tids = sorted(int(t.name) for t in (proc / str(p) / "task").iterdir() if t.name.isdigit())
            except OSError:
                continue
            for tid in tids:
                got = read_thread(proc, p, tid)
                if got is None:
                    continue
                reading, name, mask = got
                key = (p, tid)
                if tid == p:
                    proc_names[p] = name
                previous = last.get(key)
                if previous is None:
                    first[key] = reading
                else:
                    if reading.ticks > previous.ticks:
                        seen_cpus[key][reading.cpu] += 1
                    if reading.cpu != previous.cpu:
                        changes[key] += 1
                last[key] = reading
                names[key] = name
                allowed[key] = mask
        samples += 1
        if now >= end or (alive is not None and not alive()):
            break
        sleep(min(interval, max(end - clock(), 0)))
    seconds = max(clock() - start, 1e-9)
    if not last:
        raise TorchaxeError(f"process {pid} ended before it could be measured")

    by_pid: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for key in last:
        by_pid[key[0]].append(key)
    processes = []
    for p, keys in sorted(by_pid.items()):
        home = memory_node(proc, p)
        home_from = "most memory, numa_maps"
        if home is None:
            runs = Counter()
            for key in keys:
                for cpu, n in seen_cpus[key].items():
                    if cpu in node_of:
                        runs[node_of[cpu]] += n
            home = runs.most_common(1)[0][0] if runs else None
            home_from = "ran there most"
        threads = []
        for key in sorted(keys, key=lambda k: k[1]):
            a, b = first[key], last[key]
            exact = a.migrations is not None and b.migrations is not None
            migrations = (b.migrations - a.migrations) if exact else changes[key]  # type: ignore[operator]
            counted = sum(seen_cpus[key].values())
            off = None
            if counted and home is not None and len(topology.nodes) > 1:
                off = sum(n for cpu, n in seen_cpus[key].items() if node_of.get(cpu, home) != home) / counted
            cpu_seconds = (b.ticks - a.ticks) / tick
            threads.append(ThreadReport(
                pid=p, tid=key[1], name=names[key], allowed=allowed[key], cpu_seconds=cpu_seconds,
                busy=cpu_seconds / seconds, migrations_per_s=migrations / seconds, migrations_exact=exact,
                switches_per_s=((b.voluntary - a.voluntary) + (b.involuntary - a.involuntary)) / seconds,
                involuntary_per_s=(b.involuntary - a.involuntary) / seconds,
                cpus_seen=tuple(sorted(seen_cpus[key])), off_node=off))
        mask = allowed.get((p, p)) or tuple(sorted({c for k in keys for c in allowed[k]}))
        processes.append(ProcessReport(p, proc_names.get(p, "?"), mask, home, home_from, threads))
    verdict, reasons = judge(processes, topology)
    return CheckReport(seconds, samples, processes, topology.allowed, len(topology.nodes), verdict, reasons)


def judge(processes: list[ProcessReport], topology) -> tuple[str, list[str]]:
    """Would binding help? A verdict and the facts behind it."""
    allowed = set(topology.allowed)
    busy = [t for p in processes for t in p.busy_threads]
    reasons: list[str] = []
    if not busy:
        return "nothing to judge", [f"no thread used more than {BUSY_SHARE:.0%} of a CPU while measured"]
    unbound = [p for p in processes if p.busy_threads and allowed <= set(p.allowed)]
    bound = [p for p in processes if p.busy_threads and not allowed <= set(p.allowed)]
    migr = sum(t.migrations_per_s for t in busy) / len(busy)
    off = [t.off_node for t in busy if t.off_node is not None]
    off_mean = sum(off) / len(off) if off else None
    preempt = sum(t.involuntary_per_s for t in busy) / len(busy)
    if unbound:
        reasons.append(f"{len(unbound)} process(es) with busy threads are not bound: they may run on any of "
                       f"{len(allowed)} CPUs ({', '.join(str(p.pid) for p in unbound)})")
    if bound:
        reasons.append(f"{len(bound)} process(es) are bound: "
                       + "; ".join(f"{p.pid} to {format_cpulist(p.allowed)}" for p in bound))
    exact = all(t.migrations_exact for t in busy)
    reasons.append(f"busy threads migrate {migr:.1f} times/s each on average"
                   f"{'' if exact else ' (at least: counted from samples, the kernel has no sched file)'}")
    if off_mean is not None:
        reasons.append(f"busy threads ran off their process's home node in {off_mean:.0%} of samples")
    reasons.append(f"busy threads are preempted {preempt:.1f} times/s each on average")
    cpus_in_use = len({c for p in processes if p.busy_threads for c in p.allowed})
    if len(busy) > cpus_in_use:
        reasons.append(f"{len(busy)} busy threads for {cpus_in_use} CPUs: oversubscribed "
                       "(fewer compute threads per rank would help more than binding)")
    moving = migr > MIGRATIONS_HIGH or (off_mean is not None and off_mean > OFF_NODE_HIGH)
    if unbound and moving:
        verdict = "binding would likely help"
    elif unbound and preempt > PREEMPTIONS_HIGH:
        verdict = "binding may help (threads are preempted often)"
    elif unbound:
        verdict = "binding is unlikely to help much (threads already stay put)"
    elif moving:
        verdict = "bound, but threads still move: check the plan (or bind the threads of each rank more tightly)"
    else:
        verdict = "already bound; threads stay put"
    return verdict, reasons


def render_check(report: CheckReport, out, top: int = 12) -> None:
    from torchaxe.bind.render import text_console, text_table

    console = text_console(out)
    console.print(f"bind check: {len(report.processes)} process(es), {report.seconds:.1f} s, {report.samples} samples; "
                  f"allowed CPUs {format_cpulist(report.allowed)}, {report.nodes} NUMA node(s)")
    table = text_table("pid", "tid", "name", "busy", "migr/s", "ctx sw/s", "preempt/s", "off-node", "CPUs seen", "allowed")
    threads = sorted((t for p in report.processes for t in p.threads), key=lambda t: -t.busy)
    for t in threads[:top]:
        table.add_row(str(t.pid), str(t.tid), t.name, f"{t.busy:.0%}",
                      f"{t.migrations_per_s:.1f}{'' if t.migrations_exact else '+'}", f"{t.switches_per_s:.1f}",
                      f"{t.involuntary_per_s:.1f}", "-" if t.off_node is None else f"{t.off_node:.0%}",
                      format_cpulist(t.cpus_seen) or "-", format_cpulist(t.allowed))
    console.print(table)
    if len(threads) > top:
        console.print(f"({len(threads) - top} more threads; --json lists them all)")
    for p in report.processes:
        if p.busy_threads:
            console.print(f"process {p.pid} ({p.name}): home node {p.home_node} ({p.home_from}), "
                          f"{len(p.busy_threads)} busy thread(s), allowed {format_cpulist(p.allowed)}")
    console.print(f"verdict: {report.verdict}")
    for r in report.reasons:
        console.print(f"  - {r}")
