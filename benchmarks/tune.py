"""What `torchaxe tune` delivers on the GPT example, and what it costs.

1. **Cold tuning**: ``torchaxe tune --kb FRESH.sqlite --budget B -- python
   examples/gpt/train.py ARGS`` in a subprocess, on an empty knowledge base and an
   empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in the same temporary folder,
   unless set); its wall time and the number of candidates it measured.
2. **Warm tuning**: the same command again. Target: it measures nothing (every
   subgraph's strategies are in the knowledge base), and its time is start-up plus
   watching the steps.
3. **Steady-state step time, eager vs tuned**: ``torchaxe trial``'s machinery
   (``run_trials``) runs the script, interleaved A B A B for ``--repeats`` rounds,
   under the untouched knob set ``{}`` and under ``{"tune": {"kb": FRESH.sqlite}}``
   (the winners swapped in after the model's first forward, no code change); the
   first ``--warmup`` steps of every run are left out (inductor compiles the winners
   in worker processes during the first several steps: a short warmup measures the
   compilation, not the steady state) and the next ``--steps`` steps measured. Quoted: the median step time of
   each side over all measured steps and the speed-up, eager median / tuned median,
   with the per-round ratios. Target: tuned >= 1.3x faster than eager. The tuned
   runs also record how long swapping the winners in took: torchaxe's own part
   (capture, signatures, knowledge-base look-ups; target < 1 s) and torch.compile's
   set-up (importing dynamo and inductor), which is compile time.

Progress goes to stderr; the results go to stdout (a table, or with ``--json`` one
object). Exit code: 0 both targets met, 1 a target missed, 2 the benchmark could not run.

    .venv/bin/python benchmarks/tune.py
    .venv/bin/python benchmarks/tune.py --budget 15m --repeats 5 --steps 20 --json
    .venv/bin/python benchmarks/tune.py --reuse-kb /tmp/torchaxe-tune-bench-XXXX/kb.sqlite   # steps only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, save_result  # noqa: E402
SCRIPT = ROOT / "examples" / "gpt" / "train.py"
TARGET_SPEEDUP = 1.3


def _say(line: str) -> None:
    sys.stderr.write(f"[tune benchmark] {line}\n")
    sys.stderr.flush()


def _tune(kb: Path, budget: str, script_args: list[str], extra: list[str]) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "torchaxe", "tune", "--kb", str(kb), "--budget", budget, "--json", *extra,
            "--", "python", str(SCRIPT), *script_args]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"benchmark: `torchaxe tune` failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return seconds, json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="15m", help="tuning budget of the cold run (default 15m)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved eager/tuned rounds (default 5)")
    parser.add_argument("--steps", type=int, default=15, help="measured steps per run (default 15)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="steps left out per run (default 20): inductor compiles the winners' kernels in "
                             "worker processes for several steps after the first forward")
    parser.add_argument("--tune-repeats", type=int, default=7, help="timing rounds per subgraph while tuning")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--reuse-kb", metavar="PATH", default=None,
                        help="skip the two tuning runs: measure eager vs tuned with this knowledge base "
                             "(from an earlier run of this benchmark)")
    parser.add_argument("--script-args", default="--steps 200",
                        help="arguments of examples/gpt/train.py (default: its own sizes, 200 steps)")
    add_save_options(parser)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT / "src"))
    from torchaxe.runtime.knobs import knob_set_from_dict
    from torchaxe.runtime.trials import TrialOptions, run_trials

    script_args = args.script_args.split()
    if args.reuse_kb:
        kb = Path(args.reuse_kb).resolve()
        home = kb.parent
    else:
        home = Path(tempfile.mkdtemp(prefix="torchaxe-tune-bench-"))
        kb = home / "kb.sqlite"
    os.environ["TORCHAXE_HOME"] = str(home)
    if not args.reuse_kb and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # A cold run compiles from scratch: inductor's own caches start empty too (the
        # tuned trial runs after it then reuse what tuning compiled, as a user's would).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(home / "inductor-cache")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    if args.reuse_kb:
        _say(f"reusing {kb}: no tuning runs")
        cold_seconds = warm_seconds = float("nan")
        cold = warm = {"measured": 0, "budget_exhausted": False, "subgraphs": []}
    else:
        _say(f"cold tuning (budget {args.budget}) into {kb} ...")
        cold_seconds, cold = _tune(kb, args.budget, script_args, ["--repeats", str(args.tune_repeats)])
        _say(f"cold: {cold_seconds:.1f} s, {cold['measured']} candidates measured")
        _say("warm tuning ...")
        warm_seconds, warm = _tune(kb, args.budget, script_args, ["--repeats", str(args.tune_repeats)])
        _say(f"warm: {warm_seconds:.1f} s, {warm['measured']} candidates measured")

    eager = knob_set_from_dict({"name": "eager"}, "eager")
    tuned = knob_set_from_dict({"name": "tuned", "tune": {"kb": str(kb)}}, "tuned")
    report = run_trials([eager, tuned], ["python", str(SCRIPT), *script_args],
                        TrialOptions(repeats=args.repeats, steps=args.steps, warmup=args.warmup), progress=_say)
    base, other = report.results
    if not base.ok or not other.ok:
        failed = base.failed_run or other.failed_run
        _say(f"trial failed: {failed.error if failed else 'no runs'}")
        return 2
    eager_median, tuned_median = base.samples.median, other.samples.median
    speedup = eager_median / tuned_median
    per_round = [1.0 / r for r in other.ratio.per_repeat] if other.ratio else []
    per_round_median = statistics.median(per_round) if per_round else float("nan")
    applied = [run.applied.get("tune") for run in other.runs if run.applied and run.applied.get("tune")]
    own = [a["seconds"] - a.get("apply_seconds", 0.0) for a in applied if "seconds" in a]
    setup = [a.get("apply_seconds", 0.0) for a in applied if "seconds" in a]
    result = {
        "date": started, "machine": {"cores": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                                     "python": platform.python_version(), "load_at_start": load},
        "script": [str(SCRIPT.relative_to(ROOT)), *script_args],
        "tuning": {"cold_seconds": cold_seconds, "cold_measured": cold["measured"],
                   "cold_budget_exhausted": cold["budget_exhausted"], "warm_seconds": warm_seconds,
                   "warm_measured": warm["measured"],
                   "winners": {", ".join(s["names"]): {"winner": s["winner"], "speedup": s["speedup"]}
                               for s in cold["subgraphs"]}},
        "steps": {"eager_median_s": eager_median, "tuned_median_s": tuned_median, "speedup": speedup,
                  "per_round_speedup": per_round, "per_round_speedup_median": per_round_median, "eager_noisy": base.samples.is_noisy(),
                  "tuned_noisy": other.samples.is_noisy(), "applied": applied[-1] if applied else None},
        "warm_apply": {"own_seconds": own, "compile_setup_seconds": setup},
        "targets": {"speedup_at_least_1.3": speedup >= TARGET_SPEEDUP,
                    "warm_tunes_nothing": None if args.reuse_kb else warm["measured"] == 0,
                    "warm_apply_under_1s_beyond_compile": bool(own) and max(own) < 1.0},
    }
    save_result(args, "tune", result, argv)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"torchaxe tune benchmark  {started}")
        print(f"machine: {result['machine']}")
        print(f"script: {' '.join(result['script'])}")
        print(f"cold tuning: {cold_seconds:.1f} s wall, {cold['measured']} candidates measured"
              f"{' (budget ran out)' if cold['budget_exhausted'] else ''}")
        print(f"warm tuning: {warm_seconds:.1f} s wall, {warm['measured']} candidates measured")
        for names, w in result["tuning"]["winners"].items():
            gain = f"{w['speedup']:.2f}x" if w["speedup"] else "-"
            print(f"  {names}: {w['winner']} ({gain} fwd+bwd of the subgraph)")
        print(f"step time: eager {eager_median * 1e3:.1f} ms, tuned {tuned_median * 1e3:.1f} ms (medians of "
              f"{len(base.samples)} and {len(other.samples)} steps); speed-up {speedup:.2f}x, per round "
              f"{', '.join(f'{r:.2f}' for r in per_round)} (median {per_round_median:.2f}x)")
        if own:
            print(f"apply in the tuned runs (after the first forward): torchaxe's own "
                  f"{', '.join(f'{x:.2f}' for x in own)} s; torch.compile set-up "
                  f"{', '.join(f'{x:.2f}' for x in setup)} s")
        for name, ok in result["targets"].items():
            print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'MISS'}  {name}")
    return 0 if all(v is not False for v in result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
