"""How fast `torchaxe scan` reads a large real tree, and how that compares with TorchFix.

The default tree is the installed torch package's own Python sources (found without
importing torch). Every measurement keeps its raw samples; medians and min..max are
quoted, and a measurement whose spread exceeds 10 % of its median says it is noisy.
Runs that are compared are interleaved (jobs=1, jobs=2, jobs=1, ...), so drift on the
machine hits both sides alike.

What is measured:

* the full tree, in-process through ``scan_paths``, for each ``--jobs`` value,
  ``--repeats`` times. torch's capabilities are read once before timing and reported
  separately as ``capabilities_seconds`` (the CLI pays that once per run);
* a random sample of the same files (``--sample``, fixed ``--seed``), torchaxe in-process
  with jobs=1, torchaxe's CLI (``--jobs 1``, a subprocess, startup included) and
  TorchFix's CLI (``--jobs 1 --select ALL``, a subprocess, startup included), when a
  ``torchfix`` executable is found: ``--torchfix PATH``, else ``torchfix`` on PATH, else
  ``benchmarks/.torchfix-venv/bin/torchfix`` (keep TorchFix out of the project venv:
  ``python -m venv benchmarks/.torchfix-venv && benchmarks/.torchfix-venv/bin/pip install torchfix``).

Rates are files handed to the tool per second of wall clock (files that never mention
torch are skipped by both tools and still count). Targets: >= 300 files/s on the full
tree with jobs=2; >= 100x TorchFix's rate on the same sample (torchaxe in-process, jobs=1;
the CLI-to-CLI ratio is printed beside it); zero rule crashes (AX906). Unparsable files
(AX901) are reported separately and are not crashes.

With ``--work`` nothing is timed: two cold scans of the tree (the result cache off),
one with ``--jobs 2`` and one in-process with ``--jobs 1``, count what the formula rules
did (files analysed, candidate trees, trees that passed the structural prefilter and
were evaluated, node evaluations on probes, processes that imported torch, whether sympy
was imported). These counts do not depend on the machine's load, so they compare
changes where timings on a shared machine cannot. Keys: ``WORK_KEYS``.

Progress goes to stderr, results to stdout: a table, or with ``--json`` one JSON object
whose top-level keys are ``JSON_KEYS``. Exit code: 0 every measured target passed,
1 a target failed, 2 the benchmark could not run (one line on stderr).

    .venv/bin/python benchmarks/scan_speed.py                 # torch tree, jobs 1 and 2
    .venv/bin/python benchmarks/scan_speed.py --json --sample 150 --repeats 3
    .venv/bin/python benchmarks/scan_speed.py --work            # cold-scan work counts
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, save_result  # noqa: E402

#: Top-level keys of the ``--json`` object (the test checks them).
JSON_KEYS = (
    "benchmark",
    "date",
    "command",
    "machine",
    "tree",
    "files_total",
    "target",
    "rules",
    "capabilities_seconds",
    "full_tree",
    "scan",
    "sample",
    "startup",
    "ratios",
    "targets",
)
#: Keys of one measurement (``full_tree["jobs=N"]`` and the sample entries).
MEASUREMENT_KEYS = (
    "label",
    "files",
    "seconds",
    "median_seconds",
    "files_per_s_median",
    "files_per_s_min",
    "files_per_s_max",
    "spread_pct",
    "noisy",
    "cpu_seconds",
    "files_per_cpu_s_median",
)
#: Keys of ``scan``: what the full-tree scan found.
SCAN_KEYS = (
    "files_scanned",
    "files_skipped",
    "findings",
    "findings_by_code",
    "crashes",
    "unparsable",
    "diagnostics_by_code",
    "crash_examples",
    "unparsable_files",
    "consistent_across_runs",
)

#: Keys of the ``--work`` object.
WORK_KEYS = (
    "benchmark",
    "date",
    "tree",
    "files_total",
    "target",
    "files_analysed",
    "candidate_trees",
    "trees_evaluated",
    "node_evaluations",
    "findings",
    "jobs2_processes_importing_torch",
    "jobs2_findings",
    "sympy_imported",
)

#: Keys of ``startup``: the CLI's start-up and a warm scan of a small project, each
#: beside TorchFix's CLI on the same files.
STARTUP_KEYS = ("project_files", "torchaxe_help", "torchfix_help", "torchaxe_warm_project_jobs2",
                "torchfix_project_jobs2")

TARGET_FILES_PER_S = 300.0
TARGET_HELP_SECONDS = 0.3
TARGET_WARM_RATIO = 40.0
PROJECT_FILES = 81
TARGET_JOBS = 2
TARGET_RATIO = 100.0
NOISY_SPREAD_PCT = 10.0
CRASH_CODE = "AX906"
UNPARSABLE_CODE = "AX901"
DEFAULT_TORCHFIX_VENV = Path(__file__).resolve().parent / ".torchfix-venv" / "bin" / "torchfix"

Timer = Callable[[], float]


def cpu_clock() -> float:
    """CPU seconds of this process and its finished children (pool workers, subprocesses).
    Next to the wall clock it shows contention: a run that waited for the CPU has
    wall > cpu / workers."""
    own = time.process_time()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own + kids.ru_utime + kids.ru_stime


@dataclass(frozen=True)
class Clocks:
    """The wall clock and the CPU clock; both injectable so tests run on fake time."""

    wall: Timer = time.perf_counter
    cpu: Timer = cpu_clock

    def start(self) -> tuple[float, float]:
        return self.wall(), self.cpu()

    def since(self, started: tuple[float, float]) -> tuple[float, float]:
        return self.wall() - started[0], self.cpu() - started[1]


class BenchmarkError(Exception):
    """A reason the benchmark cannot run, in one line for the user."""


# --------------------------------------------------------------------------- measurements
@dataclass
class Measurement:
    """Raw wall-clock samples of one thing run over ``files`` files."""

    label: str
    files: int
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)

    def add(self, wall_cpu: tuple[float, float]) -> float:
        self.seconds.append(wall_cpu[0])
        self.cpu_seconds.append(wall_cpu[1])
        return wall_cpu[0]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread_pct(self) -> float:
        """(max - min) / median of the samples, in percent."""
        if len(self.seconds) < 2 or self.median <= 0:
            return 0.0
        return 100.0 * (max(self.seconds) - min(self.seconds)) / self.median

    @property
    def noisy(self) -> bool:
        return self.spread_pct > NOISY_SPREAD_PCT

    def rate(self, seconds: float) -> float:
        return self.files / seconds if seconds > 0 else float("inf")

    @property
    def rate_median(self) -> float:
        return self.rate(self.median)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "files": self.files,
            "seconds": [round(s, 4) for s in self.seconds],
            "median_seconds": round(self.median, 4),
            "files_per_s_median": round(self.rate_median, 2),
            "files_per_s_min": round(self.rate(max(self.seconds)), 2),
            "files_per_s_max": round(self.rate(min(self.seconds)), 2),
            "spread_pct": round(self.spread_pct, 1),
            "noisy": self.noisy,
            "cpu_seconds": [round(s, 4) for s in self.cpu_seconds],
            "files_per_cpu_s_median": round(self.rate(statistics.median(self.cpu_seconds)), 2),
        }


@dataclass
class ScanSummary:
    """What one in-process scan found, reduced to comparable counts."""

    files_scanned: int
    files_skipped: int
    findings_by_code: dict[str, int]
    diagnostics_by_code: dict[str, int]
    crash_examples: list[str]
    unparsable_files: list[str]

    @classmethod
    def of(cls, result: Any) -> ScanSummary:
        diags = result.diagnostics
        return cls(
            files_scanned=result.stats.files_scanned,
            files_skipped=result.stats.files_skipped,
            findings_by_code=dict(sorted(Counter(f.code for f in result.findings).items())),
            diagnostics_by_code=dict(sorted(Counter(d.code for d in diags).items())),
            crash_examples=[f"{d.path}: {d.message}" for d in diags if d.code == CRASH_CODE][:10],
            unparsable_files=[f"{d.path}: {d.message}" for d in diags if d.code == UNPARSABLE_CODE],
        )

    def key(self) -> tuple:
        return (self.files_scanned, self.files_skipped, self.findings_by_code, self.diagnostics_by_code)

    def to_dict(self, consistent: bool) -> dict[str, Any]:
        return {
            "files_scanned": self.files_scanned,
            "files_skipped": self.files_skipped,
            "findings": sum(self.findings_by_code.values()),
            "findings_by_code": self.findings_by_code,
            "crashes": self.diagnostics_by_code.get(CRASH_CODE, 0),
            "unparsable": self.diagnostics_by_code.get(UNPARSABLE_CODE, 0),
            "diagnostics_by_code": self.diagnostics_by_code,
            "crash_examples": self.crash_examples,
            "unparsable_files": self.unparsable_files,
            "consistent_across_runs": consistent,
        }


# --------------------------------------------------------------------------- environment
def torch_source_tree() -> Path:
    """The folder of the installed torch package, located without importing it."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise BenchmarkError("torch is not installed in this Python; give a folder with --tree PATH")
    return Path(next(iter(spec.submodule_search_locations)))


def cpu_model(cpuinfo_text: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo text (injectable), else platform's guess."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo_text = ""
    m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo_text, re.MULTILINE)
    return m.group(1).strip() if m else (platform.processor() or platform.machine() or "unknown")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine_info(torchfix_version: str | None) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "nproc": cores,
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _dist_version("torch"),
        "torchaxe": _dist_version("torchaxe"),
        "torchaxe_git": _git_revision(),
        "torchfix": torchfix_version,
        # Other work on the machine skews the figures; the 1-minute load says how much.
        "loadavg_1min_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def find_torchfix(explicit: str | None, disabled: bool) -> Path | None:
    """``--torchfix PATH``, else ``torchfix`` on PATH, else the benchmark's own venv."""
    if disabled:
        return None
    if explicit:
        path = Path(explicit).absolute()  # TorchFix runs in another working folder
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BenchmarkError(f"--torchfix {explicit}: not an executable file")
        return path
    found = shutil.which("torchfix")
    if found:
        return Path(found)
    if DEFAULT_TORCHFIX_VENV.is_file() and os.access(DEFAULT_TORCHFIX_VENV, os.X_OK):
        return DEFAULT_TORCHFIX_VENV
    return None


def torchfix_version(exe: Path) -> str:
    try:
        done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BenchmarkError(f"cannot run {exe} --version: {exc}") from None
    if done.returncode != 0:
        raise BenchmarkError(f"{exe} --version failed: {_last_line(done.stderr)}")
    return done.stdout.strip()


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


# --------------------------------------------------------------------------- runners
def run_inprocess(paths: list[Path], options: Any, clocks: Clocks) -> tuple[tuple[float, float], ScanSummary]:
    from torchaxe.scan.engine import scan_paths

    started = clocks.start()
    result = scan_paths(list(paths), options)
    return clocks.since(started), ScanSummary.of(result)


def run_torchaxe_cli(files: list[Path], target: str, clocks: Clocks, workdir: Path) -> tuple[float, float]:
    """Wall clock of ``python -m torchaxe scan --jobs 1`` on the files (JSON report to a file)."""
    out = workdir / "torchaxe-report.json"
    cmd = [sys.executable, "-m", "torchaxe", "scan", "--jobs", "1", "--target", target, "--format", "json",
           "-o", str(out), *map(str, files)]
    started = clocks.start()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    seconds = clocks.since(started)
    # Exit codes are bit flags (1 findings, 2 diagnostics); only a missing report is a failure.
    try:
        json.loads(out.read_text())
    except (OSError, ValueError):
        raise BenchmarkError(f"torchaxe CLI failed (exit {done.returncode}): {_last_line(done.stderr)}") from None
    finally:
        out.unlink(missing_ok=True)
    return seconds


def torchaxe_command() -> list[str]:
    """How a user starts torchaxe: the console script beside this Python, else ``-m``."""
    script = Path(sys.executable).parent / "torchaxe"
    return [str(script)] if script.exists() else [sys.executable, "-m", "torchaxe"]


def run_timed(cmd: list[str], clocks: Clocks, workdir: Path, env: dict[str, str] | None = None,
              ok: tuple[int, ...] = (0,)) -> tuple[float, float]:
    """Wall and CPU clock of one command; an exit code outside ``ok`` is a failure."""
    started = clocks.start()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, env=env, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchmarkError(f"cannot run {cmd[0]}: {exc}") from None
    spent = clocks.since(started)
    if done.returncode not in ok:
        raise BenchmarkError(f"{Path(cmd[0]).name} failed (exit {done.returncode}): {_last_line(done.stderr)}")
    return spent


_TORCHFIX_DONE = re.compile(r"Finished checking (\d+) files")


def run_torchfix(exe: Path, files: list[Path], clocks: Clocks, workdir: Path) -> tuple[tuple[float, float], int]:
    """Wall clock of ``torchfix --jobs 1 --select ALL`` on the files, and how many it checked."""
    cmd = [str(exe), "--jobs", "1", "--select", "ALL", *map(str, files)]
    started = clocks.start()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=max(900, 20 * len(files)))
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"torchfix took longer than {max(900, 20 * len(files))} s; use a smaller --sample") from None
    except OSError as exc:
        raise BenchmarkError(f"cannot run {exe}: {exc}") from None
    seconds = clocks.since(started)
    m = _TORCHFIX_DONE.search(done.stderr)
    # torchfix exits 1 when some file failed to parse; that is still a completed run.
    if done.returncode not in (0, 1) or (m is None and done.returncode != 0):
        raise BenchmarkError(f"torchfix failed (exit {done.returncode}): {_last_line(done.stderr)}")
    return seconds, int(m.group(1)) if m else 0


# --------------------------------------------------------------------------- the benchmark
def _parse_jobs(text: str) -> list[int]:
    try:
        jobs = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2, got {text!r}") from None
    if not jobs or any(j < 0 for j in jobs):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0 like 1,2, got {text!r}")
    return list(dict.fromkeys(jobs))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so errors stay one line at main()."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BenchmarkError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="scan_speed.py", description="Measure torchaxe scan speed (and TorchFix's, when installed).")
    p.add_argument("--tree", help="Folder to scan (default: the installed torch package's sources).")
    p.add_argument("--jobs", type=_parse_jobs, default=[1, 2], metavar="N[,N...]",
                   help="Worker counts for the full-tree scan, comma-separated (default 1,2).")
    p.add_argument("--repeats", type=_positive, default=3, help="Runs per measurement (default 3).")
    p.add_argument("--sample", type=_positive, default=150, help="Files in the TorchFix comparison sample (default 150).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the sample (default 0).")
    p.add_argument("--torchfix", metavar="PATH", help="The torchfix executable (default: PATH, then benchmarks/.torchfix-venv).")
    p.add_argument("--no-torchfix", action="store_true", help="Skip the TorchFix comparison.")
    p.add_argument("--torchfix-repeats", type=_positive, default=1,
                   help="Runs of TorchFix (default 1: it is slow, ~1 file/s).")
    p.add_argument("--target", default="cpu", choices=("cpu", "cuda", "npu"), help="torchaxe --target (default cpu).")
    p.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    p.add_argument("--work", action="store_true",
                   help="Count the formula work of one cold scan (no result cache) instead of timing: files analysed, "
                        "trees evaluated, node evaluations, processes that imported torch. Noise-free.")
    add_save_options(p)
    return p


def measure_full_tree(
    tree: Path, args: argparse.Namespace, options: Callable[[int], Any], clocks: Clocks,
    log: Callable[[str], None], n_files: int,
) -> tuple[dict[int, Measurement], list[ScanSummary]]:
    """The whole tree in-process per ``--jobs`` value, interleaved: j1, j2, j1, j2, ..."""
    full = {j: Measurement(f"torchaxe in-process, full tree, --jobs {j}", n_files) for j in args.jobs}
    summaries: list[ScanSummary] = []
    for rep in range(1, args.repeats + 1):
        for j in args.jobs:
            spent, summary = run_inprocess([tree], options(j), clocks)
            seconds = full[j].add(spent)
            summaries.append(summary)
            log(f"full tree --jobs {j} run {rep}/{args.repeats}: {seconds:.2f} s (cpu {spent[1]:.2f} s), "
                f"{full[j].rate(seconds):.1f} files/s, {sum(summary.findings_by_code.values())} findings")
    return full, summaries


def measure_sample(
    sample: list[Path], args: argparse.Namespace, options: Callable[[int], Any], clocks: Clocks,
    log: Callable[[str], None], tf_exe: Path | None,
) -> tuple[Measurement, Measurement | None, Measurement | None, int | None]:
    """torchaxe in-process and CLI (jobs=1) on the sample, interleaved with TorchFix's CLI."""
    s_inproc = Measurement("torchaxe in-process, sample, --jobs 1", len(sample))
    s_cli = Measurement("torchaxe CLI, sample, --jobs 1", len(sample)) if tf_exe else None
    s_tf = Measurement("torchfix CLI, sample, --jobs 1 --select ALL", len(sample)) if tf_exe else None
    tf_checked = None
    rounds = max(args.repeats, args.torchfix_repeats if tf_exe else 0)
    with tempfile.TemporaryDirectory(prefix="scan-speed-") as tmp:
        workdir = Path(tmp)
        for rep in range(1, rounds + 1):
            if rep <= args.repeats:
                spent, _ = run_inprocess(sample, options(1), clocks)
                seconds = s_inproc.add(spent)
                log(f"sample in-process --jobs 1 run {rep}/{args.repeats}: {seconds:.2f} s")
                if s_cli is not None:
                    seconds = s_cli.add(run_torchaxe_cli(sample, args.target, clocks, workdir))
                    log(f"sample torchaxe CLI --jobs 1 run {rep}/{args.repeats}: {seconds:.2f} s")
            if s_tf is not None and tf_exe is not None and rep <= args.torchfix_repeats:
                log(f"sample torchfix run {rep}/{args.torchfix_repeats} on {len(sample)} files (slow) ...")
                spent, tf_checked = run_torchfix(tf_exe, sample, clocks, workdir)
                seconds = s_tf.add(spent)
                log(f"sample torchfix run {rep}/{args.torchfix_repeats}: {seconds:.2f} s "
                    f"({tf_checked} files mentioned torch and were checked)")
    return s_inproc, s_cli, s_tf, tf_checked


def measure_startup(
    project: list[Path], args: argparse.Namespace, clocks: Clocks, log: Callable[[str], None], tf_exe: Path | None,
) -> dict[str, Any]:
    """``--help`` of both CLIs, then a warm ``--jobs 2`` scan of ``project`` by torchaxe's
    CLI (its result store filled by one untimed cold scan, in a folder of its own) and
    TorchFix's CLI on the same files (it keeps no results between runs), interleaved."""
    rounds = max(args.repeats, 5)
    ax_help = Measurement("torchaxe --help", 0)
    tf_help = Measurement("torchfix --help", 0) if tf_exe else None
    ax_warm = Measurement("torchaxe CLI, warm project, --jobs 2", len(project))
    tf_scan = Measurement("torchfix CLI, project, --jobs 2 --select ALL", len(project)) if tf_exe else None
    with tempfile.TemporaryDirectory(prefix="scan-speed-startup-") as tmp:
        workdir = Path(tmp)
        env = {**os.environ, "TORCHAXE_HOME": str(workdir / "home")}
        env.pop("TORCHAXE_NO_CACHE", None)
        scan = [*torchaxe_command(), "scan", "--jobs", "2", "--target", args.target, "--format", "json",
                "-o", str(workdir / "report.json"), *map(str, project)]
        run_timed(scan, clocks, workdir, env, ok=(0, 1, 2, 3))  # the cold scan that fills the store
        for rep in range(1, rounds + 1):
            ax_help.add(run_timed([*torchaxe_command(), "--help"], clocks, workdir, env))
            if tf_help is not None and tf_exe is not None:
                tf_help.add(run_timed([str(tf_exe), "--help"], clocks, workdir))
            if rep <= args.repeats:
                seconds = ax_warm.add(run_timed(scan, clocks, workdir, env, ok=(0, 1, 2, 3)))
                log(f"warm project scan run {rep}/{args.repeats}: {seconds:.2f} s")
            if tf_scan is not None and tf_exe is not None and rep <= args.torchfix_repeats:
                log(f"torchfix project scan run {rep}/{args.torchfix_repeats} on {len(project)} files (slow) ...")
                seconds = tf_scan.add(run_timed([str(tf_exe), "--jobs", "2", "--select", "ALL", *map(str, project)],
                                                clocks, workdir, ok=(0, 1)))
                log(f"torchfix project scan run {rep}/{args.torchfix_repeats}: {seconds:.2f} s")
        log(f"--help: torchaxe {ax_help.median:.3f} s"
            + (f", torchfix {tf_help.median:.3f} s" if tf_help is not None else ""))
    return {
        "project_files": len(project),
        "torchaxe_help": ax_help.to_dict(),
        "torchfix_help": tf_help.to_dict() if tf_help else None,
        "torchaxe_warm_project_jobs2": ax_warm.to_dict(),
        "torchfix_project_jobs2": tf_scan.to_dict() if tf_scan else None,
    }


def run_benchmark(
    args: argparse.Namespace,
    argv: list[str],
    log: Callable[[str], None],
    clocks: Clocks = Clocks(),
    capabilities: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every measurement and return the figures as one JSON-ready dict."""
    try:
        from torchaxe.errors import TorchaxeError
        from torchaxe.scan.capabilities import torch_capabilities
        from torchaxe.scan.discover import discover
        from torchaxe.scan.engine import ScanOptions
        from torchaxe.scan.rules import all_rules
    except ImportError as exc:
        raise BenchmarkError(f"cannot import torchaxe ({exc}); run with the project's venv") from None

    tree = (Path(args.tree) if args.tree else torch_source_tree()).resolve()
    if not tree.is_dir():
        raise BenchmarkError(f"--tree {args.tree}: not a folder")
    tf_exe = find_torchfix(args.torchfix, args.no_torchfix)
    tf_version = torchfix_version(tf_exe) if tf_exe else None
    machine = machine_info(tf_version)

    try:
        files = discover([tree]).files
        rules = [r.code for r in all_rules()]
    except TorchaxeError as exc:
        raise BenchmarkError(str(exc)) from None
    if not files:
        raise BenchmarkError(f"--tree {tree}: no .py files")
    log(f"tree {tree}: {len(files)} .py files; {len(rules)} rules; target {args.target}")

    started = clocks.wall()
    caps = capabilities if capabilities is not None else torch_capabilities(args.target)
    caps_seconds = clocks.wall() - started
    log(f"torch capabilities read in {caps_seconds:.2f} s (once, outside the timed scans)")

    def options(jobs: int) -> Any:
        return ScanOptions(target=args.target, jobs=jobs, capabilities=caps)

    full, summaries = measure_full_tree(tree, args, options, clocks, log, len(files))
    consistent = all(s.key() == summaries[0].key() for s in summaries)
    if not consistent:
        log("warning: runs disagree on counts (files, findings or diagnostics); the first run is reported")
    sample = sorted(random.Random(args.seed).sample(sorted(files), min(args.sample, len(files))))
    s_inproc, s_cli, s_tf, tf_checked = measure_sample(sample, args, options, clocks, log, tf_exe)
    project = sorted(random.Random(args.seed + 1).sample(sorted(files), min(PROJECT_FILES, len(files))))
    startup = measure_startup(project, args, clocks, log, tf_exe)

    ratios: dict[str, float | None] = {
        "sample_inprocess_jobs1_vs_torchfix": None,
        "sample_cli_jobs1_vs_torchfix": None,
        f"full_tree_jobs{TARGET_JOBS}_vs_torchfix": None,
        "warm_project_cli_jobs2_vs_torchfix": None,
    }
    if startup["torchfix_project_jobs2"] is not None:
        ratios["warm_project_cli_jobs2_vs_torchfix"] = round(
            startup["torchfix_project_jobs2"]["median_seconds"] / startup["torchaxe_warm_project_jobs2"]["median_seconds"], 1)
    if s_tf is not None and s_cli is not None:
        tf_rate = s_tf.rate_median
        ratios["sample_inprocess_jobs1_vs_torchfix"] = round(s_inproc.rate_median / tf_rate, 1)
        ratios["sample_cli_jobs1_vs_torchfix"] = round(s_cli.rate_median / tf_rate, 1)
        if TARGET_JOBS in full:
            ratios[f"full_tree_jobs{TARGET_JOBS}_vs_torchfix"] = round(full[TARGET_JOBS].rate_median / tf_rate, 1)

    scan = summaries[0].to_dict(consistent)
    crashes = max(s.diagnostics_by_code.get(CRASH_CODE, 0) for s in summaries)
    targets = [
        _target(f"full tree --jobs {TARGET_JOBS} >= {TARGET_FILES_PER_S:g} files/s",
                full[TARGET_JOBS].rate_median if TARGET_JOBS in full else None, TARGET_FILES_PER_S, "files/s"),
        _target(f"sample in-process --jobs 1 >= {TARGET_RATIO:g}x torchfix",
                ratios["sample_inprocess_jobs1_vs_torchfix"], TARGET_RATIO, "x"),
        {"name": f"zero crashes ({CRASH_CODE})", "value": crashes, "threshold": 0, "unit": "crashes",
         "status": "PASS" if crashes == 0 else "FAIL"},
        _target_at_most(f"torchaxe --help <= {TARGET_HELP_SECONDS:g} s",
                        startup["torchaxe_help"]["median_seconds"], TARGET_HELP_SECONDS, "s"),
        _target(f"warm {PROJECT_FILES}-file project CLI --jobs 2 >= {TARGET_WARM_RATIO:g}x torchfix",
                ratios["warm_project_cli_jobs2_vs_torchfix"], TARGET_WARM_RATIO, "x"),
    ]
    return {
        "benchmark": "scan_speed",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/scan_speed.py", *argv]),
        "machine": machine,
        "tree": str(tree),
        "files_total": len(files),
        "target": args.target,
        "rules": rules,
        "capabilities_seconds": round(caps_seconds, 3),
        "full_tree": {f"jobs={j}": m.to_dict() for j, m in full.items()},
        "scan": scan,
        "sample": {
            "files": len(sample),
            "seed": args.seed,
            "torchaxe_inprocess_jobs1": s_inproc.to_dict(),
            "torchaxe_cli_jobs1": s_cli.to_dict() if s_cli else None,
            "torchfix": s_tf.to_dict() if s_tf else None,
            "torchfix_files_checked": tf_checked,
        },
        "startup": startup,
        "ratios": ratios,
        "targets": targets,
    }


def _target_at_most(name: str, value: float | None, threshold: float, unit: str) -> dict[str, Any]:
    status = "SKIP" if value is None else ("PASS" if value <= threshold else "FAIL")
    return {"name": name, "value": value if value is None else round(value, 3), "threshold": threshold,
            "unit": unit, "status": status}


def _target(name: str, value: float | None, threshold: float, unit: str) -> dict[str, Any]:
    status = "SKIP" if value is None else ("PASS" if value >= threshold else "FAIL")
    return {"name": name, "value": value if value is None else round(value, 1), "threshold": threshold,
            "unit": unit, "status": status}


# --------------------------------------------------------------------------- work counts
def count_work(tree: Path, target: str, capabilities: dict[str, Any] | None, log: Callable[[str], None]) -> dict[str, Any]:
    """Cold scans of ``tree`` with counters on the formula machinery (see ``--work``).

    The ``--jobs 2`` scan runs first, while this process has not imported torch, so
    that its workers start as a user's would. Processes that import torch for the
    formula rules are recorded by pid in a temporary file."""
    from torchaxe.scan.capabilities import torch_capabilities
    from torchaxe.scan.discover import discover
    from torchaxe.scan.engine import ScanOptions, scan_paths
    from torchaxe.scan.formulas import analysis
    from torchaxe.scan.formulas.store import FingerprintStore

    if "torch" in sys.modules:
        raise BenchmarkError("--work needs a process that has not imported torch")
    caps = capabilities if capabilities is not None else torch_capabilities(target)
    files = discover([tree]).files
    counts = {"files_analysed": 0, "candidate_trees": 0, "trees_evaluated": 0, "node_evaluations": 0}
    originals = (analysis.STORE, analysis.load_compute, analysis._analyse, analysis._fingerprints)
    with tempfile.TemporaryDirectory() as tmp:
        pids = Path(tmp) / "pids"
        pids.write_text("")

        def compute() -> Any:
            if "torch" not in sys.modules:
                with open(pids, "a") as f:
                    f.write(f"{os.getpid()}\n")
            return originals[1]()

        try:
            analysis.load_compute = compute
            analysis.STORE = FingerprintStore(use_disk=False)
            log("work: cold scan with --jobs 2")
            parallel = scan_paths([tree], ScanOptions(target=target, jobs=2, capabilities=caps))
            importers = len(set(pids.read_text().split()))

            def analyse(ctx: Any) -> Any:
                counts["files_analysed"] += 1
                return originals[2](ctx)

            def fingerprints(nodes: list[Any], categories: Any) -> Any:
                counts["candidate_trees"] += len(nodes)
                return originals[3](nodes, categories)

            analysis.STORE = FingerprintStore(use_disk=False)
            analysis._analyse = analyse
            analysis._fingerprints = fingerprints
            import torch  # noqa: F401  (the counters below wrap torch-side code)

            from torchaxe.scan.formulas import fingerprints as fp
            from torchaxe.scan.formulas import interpreter

            before_sympy = "sympy" in sys.modules
            original_tree, original_node = fp.compute, interpreter.Evaluator._compute

            def tree_counted(*a: Any, **k: Any) -> Any:
                counts["trees_evaluated"] += 1
                return original_tree(*a, **k)

            def node_counted(self: Any, node: Any) -> Any:
                counts["node_evaluations"] += 1
                return original_node(self, node)

            fp.compute, interpreter.Evaluator._compute = tree_counted, node_counted
            try:
                log("work: cold scan with --jobs 1, counting")
                serial = scan_paths([tree], ScanOptions(target=target, jobs=1, capabilities=caps))
            finally:
                fp.compute, interpreter.Evaluator._compute = original_tree, original_node
        finally:
            analysis.STORE, analysis.load_compute, analysis._analyse, analysis._fingerprints = originals
    return {
        "benchmark": "scan_speed --work",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tree": str(tree),
        "files_total": len(files),
        "target": target,
        **counts,
        "findings": len(serial.findings),
        "jobs2_processes_importing_torch": importers,
        "jobs2_findings": len(parallel.findings),
        "sympy_imported": "sympy" in sys.modules and not before_sympy,
    }


def render_work(data: dict[str, Any], out: TextIO) -> None:
    out.write(f"torchaxe formula work, one cold scan  {data['date']}\n")
    out.write(f"tree: {data['tree']} ({data['files_total']} .py files), target {data['target']}\n")
    for key in WORK_KEYS[5:]:
        out.write(f"  {key:<36}{data[key]}\n")


# --------------------------------------------------------------------------- rendering
def _fmt_measurement(m: dict[str, Any]) -> str:
    runs = " ".join(f"{s:.2f}" for s in m["seconds"])
    noisy = "  (noisy)" if m["noisy"] else ""
    span = f"{m['files_per_s_min']:.1f}..{m['files_per_s_max']:.1f}"
    return (f"{m['files_per_s_median']:>9.1f} {span:>15} {m['spread_pct']:>6.1f}% "
            f"{m['files_per_cpu_s_median']:>11.1f}   {runs}{noisy}")


_HEADER = f"{'':46}{'files/s':>9} {'min..max':>15} {'spread':>7} {'files/cpu-s':>11}   wall runs (s)\n"


def render_text(data: dict[str, Any], out: TextIO) -> None:
    mach = data["machine"]
    w = out.write
    w(f"torchaxe scan speed  {data['date']}\n")
    w(f"machine: {mach['nproc']} cores, {mach['cpu_model']}, Python {mach['python']}, torch {mach['torch']}, "
      f"torchaxe {mach['torchaxe']} ({mach['torchaxe_git']}), torchfix {mach['torchfix'] or 'not used'}, "
      f"load {mach['loadavg_1min_at_start']} at start\n")
    w(f"tree: {data['tree']} ({data['files_total']} .py files), target {data['target']}, {len(data['rules'])} rules\n")
    w(f"torch capabilities read once, outside the timed scans: {data['capabilities_seconds']:.2f} s\n\n")
    w(_HEADER)
    for m in data["full_tree"].values():
        w(f"{m['label']:<46}{_fmt_measurement(m)}\n")
    s = data["scan"]
    w(f"\nfull tree: {s['files_scanned']} scanned, {s['files_skipped']} skipped (no 'torch' or nothing a rule looks for); "
      f"{s['findings']} findings {s['findings_by_code']}; crashes ({CRASH_CODE}) {s['crashes']}; "
      f"unparsable ({UNPARSABLE_CODE}) {s['unparsable']}; same counts every run: {s['consistent_across_runs']}\n")
    for line in s["crash_examples"]:
        w(f"  crash: {line}\n")
    for line in s["unparsable_files"]:
        w(f"  unparsable: {line}\n")
    sample = data["sample"]
    w(f"\nsample: {sample['files']} files (seed {sample['seed']})\n")
    w(_HEADER)
    for key in ("torchaxe_inprocess_jobs1", "torchaxe_cli_jobs1", "torchfix"):
        if sample[key]:
            w(f"{sample[key]['label']:<46}{_fmt_measurement(sample[key])}\n")
    if sample["torchfix"] is None:
        w("torchfix: not measured (--no-torchfix, or not found: give --torchfix PATH or install it into "
          "benchmarks/.torchfix-venv)\n")
    startup = data["startup"]
    w(f"\nstart-up, and a warm scan of a {startup['project_files']}-file project (its results stored by one cold scan)\n")
    w(_HEADER)
    for key in STARTUP_KEYS[1:]:
        if startup[key]:
            w(f"{startup[key]['label']:<46}{_fmt_measurement(startup[key])}\n")
    ratios = "  ".join(f"{k} {v}x" for k, v in data["ratios"].items() if v is not None)
    if ratios:
        w(f"ratios (median rates): {ratios}\n")
    w("\ntargets\n")
    for t in data["targets"]:
        value = "-" if t["value"] is None else f"{t['value']} {t['unit']}"
        w(f"  {t['status']:<4}  {t['name']}: {value}\n")


def main(
    argv: list[str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    clocks: Clocks = Clocks(),
    capabilities: dict[str, Any] | None = None,
) -> int:
    """Run the benchmark; 0 all measured targets pass, 1 one fails, 2 it could not run."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)

    def log(line: str) -> None:
        err.write(f"scan_speed: {line}\n")
        err.flush()

    try:
        args = build_parser().parse_args(argv)
        if args.work:
            tree = (Path(args.tree) if args.tree else torch_source_tree()).resolve()
            if not tree.is_dir():
                raise BenchmarkError(f"--tree {args.tree}: not a folder")
            work = count_work(tree, args.target, capabilities, log)
            out.write(json.dumps(work, indent=2) + "\n" if args.json else "")
            if not args.json:
                render_work(work, out)
            return 0
        data = run_benchmark(args, argv, log, clocks=clocks, capabilities=capabilities)
        save_result(args, "scan_speed", data, argv)
    except BenchmarkError as exc:
        err.write(f"scan_speed: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        err.write("scan_speed: interrupted\n")
        return 130
    except Exception as exc:  # a broken rule module, a full disk: still one line
        if os.environ.get("TORCHAXE_DEBUG"):
            raise
        err.write(f"scan_speed: error: {type(exc).__name__}: {exc} (TORCHAXE_DEBUG=1 for the traceback)\n")
        return 2
    if args.json:
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        render_text(data, out)
    return 1 if any(t["status"] == "FAIL" for t in data["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
