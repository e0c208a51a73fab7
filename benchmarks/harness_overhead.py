"""How much `torchaxe profile`'s default instrumentation adds to a training step.

The GPT example (examples/gpt/train.py, at a small size so that steps are short and
any fixed cost per step shows) is run as a subprocess alternately without and with
the harness, A B A B, ``--repeats`` pairs, so that drift on the machine hits both
sides alike. Both sides time the same thing the same way: the interval between the
ends of consecutive optimizer steps.

* without: ``python -c BOOTSTRAP train.py ARGS``, where the bootstrap registers one
  global optimizer step post-hook that records ``time.perf_counter()``, then runs the
  script with runpy (torch is imported first on both sides);
* with: ``python -m torchaxe profile --steps all --warmup K -- python train.py ARGS``
  (default instrumentation: no --ops, no --shapes), whose Profile holds the same
  intervals as step seconds.

Both sides are pinned to the same core (``--cpu``, default the last one this
process may use; ``--cpu -1`` leaves them unpinned), so that where the scheduler puts
them, and how other work on the machine lands on them, does not differ between the
sides. Steps 1..K of every run are warmup and left out; the next ``--steps`` steps are
measured.

Separate processes of the same program differ by several percent in step time on
their own (memory layout, where other work lands), which on a busy machine can hide
a 3% difference. So the benchmark also runs both sides alternately inside one
subprocess (``--same-process-repeats`` pairs: the hook timer around ``runpy``, then
``Harness(HarnessOptions(steps=None, warmup=K)).run(...)``, the same instrumentation
as the CLI's default), which isolates what the instrumentation itself costs. Both
ratios are printed; the target is judged on the separate-process comparison, as
asked, and the same-process one says whether a failure is the instrumentation or
the machine. Every raw step time is kept. Quoted: the median step time over all
measured steps of each side, their ratio (the overhead), the ratio of each pair of
runs with its spread, and, as a cross-check, the ratio of the script's own
``done: ... ms/step`` figures. Target: the ratio of medians at most 1.03.

Progress goes to stderr, results to stdout (a table, or with ``--json`` one object
whose top-level keys are ``JSON_KEYS``); ``--record FILE`` adds the table, with
date, command and machine, as the newest entry of FILE's "Log of runs" (RESULTS.md), or
to its "Harness overhead" section when it has no log.
Exit code: 0 the target passed, 1 it failed, 2 the benchmark could not run.

    .venv/bin/python benchmarks/harness_overhead.py
    .venv/bin/python benchmarks/harness_overhead.py --repeats 9 --steps 80 --record benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TextIO

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "gpt" / "train.py"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, save_result  # noqa: E402

from torchaxe.runtime.stats import Samples  # noqa: E402  (after the path set-up above)
from torchaxe.units import duration  # noqa: E402

#: Most the default instrumentation may add to the median step time.
TARGET_RATIO = 1.03
#: Model sizes of the GPT example: small steps make a fixed per-step cost visible.
SIZES = {
    "tiny": ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16", "--batch-size", "4"],
    "small": ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--batch-size", "8"],
    "default": [],
}
JSON_KEYS = ("benchmark", "date", "command", "machine", "workload", "runs", "without", "with", "ratio",
             "pair_ratios", "script_reported", "same_process", "target")

BOOTSTRAP = """\
import json, os, runpy, sys, time
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
ends = []
register_optimizer_step_post_hook(lambda optimizer, args, kwargs: ends.append(time.perf_counter()))
out, script = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.realpath(script))
try:
    runpy.run_path(script, run_name="__main__")
finally:
    with open(out, "w") as fh:
        json.dump(ends, fh)
"""

SAME_PROCESS_DRIVER = """\
import contextlib, io, json, os, runpy, sys, time
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torchaxe.runtime.command import parse_command
from torchaxe.runtime.harness import Harness, HarnessOptions
out, repeats, warmup, script, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
sys.path[0] = os.path.dirname(os.path.realpath(script))
def without():
    ends = []
    handle = register_optimizer_step_post_hook(lambda optimizer, a, k: ends.append(time.perf_counter()))
    saved, sys.argv = sys.argv, [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        handle.remove()
        sys.argv = saved
    return {k: ends[k - 1] - ends[k - 2] for k in range(2, len(ends) + 1)}
def with_():
    options = HarnessOptions(steps=None, warmup=warmup, target="cpu")
    profile = Harness(options).run(parse_command(["python", script, *args]))
    return {s.index: s.seconds for s in profile.steps}
runs = []
for repeat in range(1, repeats + 1):
    for side, measure in (("without", without), ("with", with_)):
        with contextlib.redirect_stdout(io.StringIO()):
            steps = measure()
        runs.append({"side": side, "repeat": repeat, "steps": steps})
with open(out, "w") as fh:
    json.dump(runs, fh)
"""

_DONE = re.compile(r"^done: .*?([0-9.]+) ms/step", re.MULTILINE)


class BenchmarkError(Exception):
    """A reason the benchmark cannot run, in one line."""


@dataclass
class Run:
    """One subprocess run: its measured step times (seconds) and the script's own figure."""

    side: str
    repeat: int
    step_seconds: list[float]
    done_ms_per_step: float | None = None

    @property
    def median(self) -> float:
        return Samples.of(self.step_seconds).median or 0.0


@dataclass
class Workload:
    size: str
    warmup: int
    steps: int
    threads: int
    cpu: int | None = None
    args: list[str] = field(default_factory=list)

    @property
    def script_args(self) -> list[str]:
        return [*SIZES[self.size], "--steps", str(self.warmup + self.steps), "--log-every", "1000", *self.args]


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.pop("TORCHAXE_DEBUG", None)
    return env


def _run(cmd: list[str], env: dict[str, str], cpu: int | None = None) -> subprocess.CompletedProcess:
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800, preexec_fn=pin)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BenchmarkError(f"cannot run {shlex.join(cmd[:4])}...: {exc}") from None
    if done.returncode != 0:
        last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        raise BenchmarkError(f"{shlex.join(cmd[:6])}... exited {done.returncode}: {last[0]}")
    return done


def _done_ms(stdout: str) -> float | None:
    match = _DONE.search(stdout)
    return float(match.group(1)) if match else None


def subprocess_runner(workload: Workload) -> Callable[[str, int], Run]:
    """Runs one side of one pair as a subprocess and returns its measured steps."""
    env = _child_env(workload.threads)

    def run(side: str, repeat: int) -> Run:
        with tempfile.TemporaryDirectory(prefix="torchaxe-overhead-") as tmp:
            out = Path(tmp) / "out.json"
            first = workload.warmup + 1  # 1-based index of the first measured step
            if side == "without":
                done = _run([sys.executable, "-c", BOOTSTRAP, str(out), str(SCRIPT), *workload.script_args], env,
                            workload.cpu)
                ends = json.loads(out.read_text())
                # Step k (k >= 2) is the interval between the ends of steps k-1 and k.
                steps = {k: ends[k - 1] - ends[k - 2] for k in range(2, len(ends) + 1)}
            else:
                done = _run([sys.executable, "-m", "torchaxe", "profile", "--steps", "all", "--warmup",
                             str(workload.warmup), "--target", "cpu", "-o", str(out), "--", "python", str(SCRIPT),
                             *workload.script_args], env, workload.cpu)
                profile = json.loads(out.read_text())
                steps = {s["index"]: s["seconds"] for s in profile["steps"]}
            measured = [steps[k] for k in range(first, first + workload.steps) if k in steps]
            if len(measured) != workload.steps:
                raise BenchmarkError(f"{side} run {repeat}: {len(measured)} measured steps, expected {workload.steps}")
            return Run(side, repeat, measured, _done_ms(done.stdout))

    return run


def same_process_runner(workload: Workload, repeats: int) -> Callable[[], list[Run]]:
    """Runs both sides alternately inside one subprocess, ``repeats`` pairs."""
    env = _child_env(workload.threads)

    def run() -> list[Run]:
        with tempfile.TemporaryDirectory(prefix="torchaxe-overhead-") as tmp:
            out = Path(tmp) / "runs.json"
            _run([sys.executable, "-c", SAME_PROCESS_DRIVER, str(out), str(repeats), str(workload.warmup),
                  str(SCRIPT), *workload.script_args], env, workload.cpu)
            first = workload.warmup + 1
            runs = []
            for entry in json.loads(out.read_text()):
                steps = {int(k): v for k, v in entry["steps"].items()}
                measured = [steps[k] for k in range(first, first + workload.steps) if k in steps]
                if len(measured) != workload.steps:
                    raise BenchmarkError(f"same-process {entry['side']} run {entry['repeat']}: {len(measured)} "
                                         f"measured steps, expected {workload.steps}")
                runs.append(Run(entry["side"], entry["repeat"], measured))
            return runs

    return run


# --------------------------------------------------------------------------- analysis


def _describe(samples: Samples) -> dict[str, Any]:
    return {
        "median": samples.median,
        "p10": samples.p10,
        "p90": samples.p90,
        "min": samples.min,
        "max": samples.max,
        "iqr_over_median": samples.relative_spread,
        "noisy": samples.is_noisy(),
    }


def compare(runs: list[Run]) -> dict[str, Any]:
    """The ratio of the two sides' medians over all their measured steps, and the
    ratios of each pair of runs."""
    without = [r for r in runs if r.side == "without"]
    with_ = [r for r in runs if r.side == "with"]
    a = Samples.of(s for r in without for s in r.step_seconds)
    b = Samples.of(s for r in with_ for s in r.step_seconds)
    pairs = Samples.of(w.median / o.median for o, w in zip(without, with_) if o.median > 0)
    return {
        "without_median": a.median,
        "with_median": b.median,
        "ratio": b.median / a.median if a.median else None,
        "pair_ratios": {"values": list(pairs.values), **_describe(pairs)},
        "pairs": len(pairs),
    }


def analyse(runs: list[Run], same_process: list[Run] | None = None) -> dict[str, Any]:
    """Medians of each side over all measured steps, their ratio, and per-pair ratios."""
    without = [r for r in runs if r.side == "without"]
    with_ = [r for r in runs if r.side == "with"]
    a = Samples.of(s for r in without for s in r.step_seconds)
    b = Samples.of(s for r in with_ for s in r.step_seconds)
    pairs = Samples.of(w.median / o.median for o, w in zip(without, with_) if o.median > 0)
    ratio = b.median / a.median if a.median else None
    done_a = Samples.of(r.done_ms_per_step for r in without)
    done_b = Samples.of(r.done_ms_per_step for r in with_)
    return {
        "without": {"step_seconds": _describe(a), "run_medians": [r.median for r in without],
                    "raw_step_seconds": [r.step_seconds for r in without]},
        "with": {"step_seconds": _describe(b), "run_medians": [r.median for r in with_],
                 "raw_step_seconds": [r.step_seconds for r in with_]},
        "ratio": ratio,
        "pair_ratios": {"values": list(pairs.values), **_describe(pairs)},
        "script_reported": {
            "without_ms_per_step_median": done_a.median,
            "with_ms_per_step_median": done_b.median,
            "ratio": done_b.median / done_a.median if done_a and done_b and done_a.median else None,
        },
        "same_process": compare(same_process) if same_process else None,
        "target": {
            "name": f"median step time with / without <= {TARGET_RATIO}",
            "status": "PASS" if ratio is not None and ratio <= TARGET_RATIO else "FAIL",
        },
    }


# --------------------------------------------------------------------------- environment


def machine_info() -> dict[str, Any]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        cpuinfo = ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = None, ""
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": model.group(1).strip() if model else platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "torchaxe_git": (head + ("+dirty" if dirty else "")) if head else None,
        "loadavg_1min_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


# --------------------------------------------------------------------------- output


def render_text(data: dict[str, Any], out: TextIO) -> None:
    w = data["workload"]
    out.write(f"harness overhead: {w['script']} {' '.join(w['script_args'])}\n")
    pinned = f", both pinned to cpu {w['pinned_cpu']}" if w.get("pinned_cpu") is not None else ""
    out.write(f"  {w['steps']} measured steps after {w['warmup']} warmup per run, {w['repeats']} pairs of runs "
              f"(without, with) interleaved, OMP_NUM_THREADS={w['threads']}{pinned}\n")
    out.write(f"  {'pair':>4}  {'without':>10}  {'with':>10}  {'ratio':>6}\n")
    pairs = data["pair_ratios"]["values"]
    for i, (a, b) in enumerate(zip(data["without"]["run_medians"], data["with"]["run_medians"]), 1):
        ratio = f"{pairs[i - 1]:.3f}" if i <= len(pairs) else "n/a"
        out.write(f"  {i:>4}  {duration(a, 2):>10}  {duration(b, 2):>10}  {ratio:>6}\n")
    a, b = data["without"]["step_seconds"], data["with"]["step_seconds"]
    out.write(f"  median step time over all measured steps: without {duration(a['median'], 2)}, "
              f"with {duration(b['median'], 2)}\n")
    ratio = data["ratio"]
    overhead = f"{ratio:.3f} ({100 * (ratio - 1):+.1f}%)" if ratio is not None else "n/a"
    out.write(f"  ratio with/without: {overhead}\n")
    p = data["pair_ratios"]
    if p["median"] is not None:
        out.write(f"  pair ratios: median {p['median']:.3f}, min {p['min']:.3f}, max {p['max']:.3f}, "
                  f"IQR {100 * (p['iqr_over_median'] or 0):.1f}% of median{' (noisy)' if p['noisy'] else ''}\n")
    s = data["script_reported"]
    if s["ratio"] is not None:
        out.write(f"  the script's own `done:` figure: without {s['without_ms_per_step_median']:.1f} ms/step, "
                  f"with {s['with_ms_per_step_median']:.1f} ms/step, ratio {s['ratio']:.3f}\n")
    same = data.get("same_process")
    if same and same["ratio"] is not None:
        q = same["pair_ratios"]
        out.write(f"  same process, {same['pairs']} pairs alternating: without {duration(same['without_median'], 2)}, "
                  f"with {duration(same['with_median'], 2)}, ratio {same['ratio']:.3f} "
                  f"({100 * (same['ratio'] - 1):+.1f}%); "
                  f"pair ratios {q['min']:.3f}..{q['max']:.3f}\n")
    for key in ("without", "with"):
        if data[key]["step_seconds"]["noisy"]:
            out.write(f"  note: the {key} step times are noisy (IQR above 10% of the median)\n")
    out.write(f"  target {data['target']['name']}: {data['target']['status']}\n")


LOG_HEADING = "## Log of runs"


def record(path: Path, data: dict[str, Any], text: str) -> None:
    """Add this result to ``path``: as the newest entry of its "Log of runs" section when
    it has one, else at the end of its "Harness overhead" section (created when
    missing); the rest of the file is left exactly as it was."""
    m = data["machine"]
    text_now = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    log = re.search(rf"^{LOG_HEADING}.*$", text_now, re.M)
    if log:
        log_at = max(log.start() - 1, 0)
        ratio = data["ratio"]
        change = f"{100 * (ratio - 1):+.1f}%" if ratio is not None else "not measured"
        entry = (
            f"### {data['date']} · {m['nproc']} cores, {m['cpu_model']} · `{m['torchaxe_git']}` · "
            f"harness overhead: {change}, {data['target']['status']}\n\n"
            f"`{data['command']}`, Python {m['python']}, torch {m['torch']}, "
            f"1-minute load {m['loadavg_1min_at_start']} at the start:\n\n"
            f"```text\n{text.rstrip()}\n```\n\n"
        )
        first = text_now.find("\n### ", log_at)
        following = text_now.find("\n## ", log.end())
        if first < 0 or 0 <= following < first:
            first = len(text_now) if following < 0 else following
            entry = "\n" + entry.rstrip("\n") + "\n"
        from torchaxe.atomic import write_text_atomic

        write_text_atomic(path, text_now[: first + 1] + entry + text_now[first + 1:])
        return
    entry = (
        f"\n### {data['date']}\n\n"
        f"- command: `{data['command']}`\n"
        f"- machine: {m['nproc']} cores, {m['cpu_model']}, Python {m['python']}, torch {m['torch']}, "
        f"torchaxe {m['torchaxe_git']}, 1-minute load {m['loadavg_1min_at_start']} at the start\n\n"
        f"```text\n{text.rstrip()}\n```\n"
    )
    heading = "## Harness overhead"
    intro = (f"{heading}\n\nWhat `torchaxe profile`'s default instrumentation adds to the median step time of the "
             "GPT example (`benchmarks/harness_overhead.py`; target: at most 3%). Newest last.\n")
    start = text_now.find(f"\n{heading}\n")
    if start < 0:
        updated = text_now.rstrip("\n") + "\n\n" + intro + entry
    else:
        following = text_now.find("\n## ", start + len(heading) + 1)
        end = len(text_now) if following < 0 else following
        updated = text_now[:end].rstrip("\n") + "\n" + entry + text_now[end:]
    from torchaxe.atomic import write_text_atomic

    write_text_atomic(path, updated)


# --------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise BenchmarkError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harness_overhead.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="pairs of runs, without and with (default 7)")
    parser.add_argument("--steps", type=int, default=60, help="measured steps per run (default 60)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start of each run (default 5)")
    parser.add_argument("--size", choices=tuple(SIZES), default="small", help="GPT example size (default small)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the runs (default 1)")
    parser.add_argument("--cpu", type=int, default=None,
                        help="core both sides are pinned to (default: the last one available; -1: no pinning)")
    parser.add_argument("--same-process-repeats", type=int, default=8,
                        help="pairs run alternately inside one subprocess (default 8; 0 skips them)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--record", metavar="FILE", help="append the result to FILE's 'Harness overhead' section")
    add_save_options(parser)
    return parser


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None,
         runner: Callable[[str, int], Run] | None = None,
         same_runner: Callable[[], list[Run]] | None = None) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        if args.repeats < 1 or args.steps < 1 or args.warmup < 1 or args.threads < 1:
            raise BenchmarkError("--repeats, --steps, --warmup and --threads must be at least 1")
        if args.same_process_repeats < 0:
            raise BenchmarkError("--same-process-repeats must be 0 or more")
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if args.cpu is None:
            cpu = cpus[-1] if cpus and args.threads == 1 else None
        elif args.cpu < 0:
            cpu = None
        elif args.cpu not in cpus:
            raise BenchmarkError(f"--cpu {args.cpu}: not one of the cores this process may use ({cpus})")
        else:
            cpu = args.cpu
        workload = Workload(size=args.size, warmup=args.warmup, steps=args.steps, threads=args.threads, cpu=cpu)
        run = runner or subprocess_runner(workload)
        runs: list[Run] = []
        for repeat in range(1, args.repeats + 1):
            for side in ("without", "with"):
                err.write(f"harness_overhead: pair {repeat}/{args.repeats}: {side}\n")
                err.flush()
                runs.append(run(side, repeat))
        same: list[Run] | None = None
        if args.same_process_repeats > 0:
            err.write(f"harness_overhead: {args.same_process_repeats} pairs in one process\n")
            err.flush()
            same = (same_runner or same_process_runner(workload, args.same_process_repeats))()
        data = {
            "benchmark": "harness_overhead",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join([".venv/bin/python", "benchmarks/harness_overhead.py", *argv]),
            "machine": machine_info(),
            "workload": {"script": str(SCRIPT.relative_to(ROOT)), "script_args": workload.script_args,
                         "size": args.size, "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
                         "threads": args.threads, "pinned_cpu": cpu},
            "runs": len(runs),
            **analyse(runs, same),
        }
        data = {key: data[key] for key in JSON_KEYS}
    except BenchmarkError as exc:
        err.write(f"harness_overhead: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        err.write("harness_overhead: interrupted\n")
        return 130
    import io

    table = io.StringIO()
    render_text(data, table)
    if args.record:
        record(Path(args.record), data, table.getvalue())
    save_result(args, "harness_overhead", data, argv)
    out.write(json.dumps(data, indent=2) + "\n" if args.json else table.getvalue())
    return 0 if data["target"]["status"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
