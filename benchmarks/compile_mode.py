"""Does `torchaxe shapes` pick the fastest compile setting? Measured on this CPU.

For the fixed-shape example (examples/gpt/train.py) and the variable-length one
(examples/seq_varlen/train.py):

1. the verdict: ``torchaxe shapes --format json --target cpu`` (a subprocess) records
   the shapes and names its pick (static shapes pick ``compile-static``, dynamic ones
   ``compile-static+bucketing`` when bucketing is cheap, else ``compile-dynamic``, and
   ``eager`` when recurrent layers, which torch.compile does not trace into, are there);
2. the measurement: the candidate settings, each a knob set run by the trials in fresh
   subprocesses, interleaved A B C D A B C D over ``--repeats`` rounds:
   ``eager``, ``compile-static`` (``torch.compile(model, dynamic=False)``),
   ``compile-dynamic`` (``dynamic=True``) and, where the batches vary,
   ``compile-static+bucketing`` (the bucket boundaries the verdict proposed, applied
   to the script's own collate function by the ``bucketing`` knob). The first
   ``--warmup`` steps of each run are the compile/warm-up cost, reported apart; the
   next ``--steps`` steps give the steady-state step time (median over all rounds; the
   mean is shown too, because with dynamic shapes a static compile keeps recompiling
   after the warm-up and the median hides it). Ratios are to eager, per round.
3. the check: the fastest candidate (lowest median of its per-round ratios to eager),
   and whether the verdict's pick is it or within 5% of it, round by round (the target).

Progress on stderr, the table on stdout (``--json``: one object).

    .venv/bin/python benchmarks/compile_mode.py            # inductor, 3 rounds
    .venv/bin/python benchmarks/compile_mode.py --quick    # 1 round, few steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, save_result  # noqa: E402


from torchaxe.runtime.stats import Samples  # noqa: E402
from torchaxe.shapes.measure import PICK_TOLERANCE, candidates, run_compile_trial  # noqa: E402
from torchaxe.shapes.verdict import Verdict  # noqa: E402
from torchaxe.units import duration  # noqa: E402

EXAMPLES = {
    "gpt (fixed shapes)": ["examples/gpt/train.py", "--steps", "100000", "--log-every", "100000"],
    "seq_varlen (variable lengths)": ["examples/seq_varlen/train.py", "--steps", "100000", "--log-every", "100000"],
}


def progress(line: str) -> None:
    sys.stderr.write(f"compile_mode: {line}\n")
    sys.stderr.flush()


def verdict_of(script: list[str], steps: int, max_shapes: int, target: str = "cpu") -> dict[str, Any]:
    command = [sys.executable, "-m", "torchaxe", "shapes", "--format", "json", "--target", target, "--steps",
               str(steps), "--max-shapes", str(max_shapes), "--", "python", *script]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"compile_mode: torchaxe shapes failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout)


def measure(name: str, script: list[str], args: argparse.Namespace) -> dict[str, Any]:
    progress(f"{name}: recording shapes ({args.shape_steps} steps)")
    script = [*script, "--device", args.target]
    report = verdict_of(script, args.shape_steps, args.max_shapes, args.target)
    bucketing = None
    extra_padding = None
    if report["bucketing"]:
        b = report["bucketing"][0]
        bucketing = {"boundaries": b["chosen"]["boundaries"][0] if len(b["dims"]) == 1 else b["chosen"]["boundaries"],
                     "dim": b["dims"][0] if len(b["dims"]) == 1 else b["dims"], "pad_value": 0}
        extra_padding = b["chosen"]["extra_padding"]
    progress(f"{name}: verdict {report['verdict']}, pick {report['pick']}; measuring")
    verdict = Verdict(verdict=report["verdict"], reasons=report["reasons"], picks={args.target: report["pick"]})
    sets = candidates(args.target, bucketing, backend=args.backend)
    trial = run_compile_trial(["python", *script], verdict, args.target, steps=args.steps, warmup=args.warmup,
                              repeats=args.repeats, timeout=args.timeout, knob_sets=sets,
                              progress=lambda line: progress(f"{name}: {line}"))
    rows = []
    for r in trial.results:
        steady = r.steady_samples
        rows.append({"candidate": r.name, "ok": r.ok, "error": r.error,
                     "warmup_seconds": r.warmup_median, "steady_median": steady.median, "steady_mean": steady.mean,
                     "steady_p90": steady.p90, "spread": steady.relative_spread, "noisy": steady.is_noisy(),
                     "ratio_median": Samples.of(r.ratios).median, "ratio_min": Samples.of(r.ratios).min,
                     "ratio_max": Samples.of(r.ratios).max, "ratios": list(r.ratios)})
    winner = trial.winner
    return {"example": name, "command": ["python", *script], "verdict": report["verdict"], "pick": report["pick"],
            "reasons": report["reasons"], "bucketing": bucketing, "extra_padding": extra_padding, "rows": rows,
            "raw_steps": {r.name: r.steady for r in trial.results},
            "fastest": winner.name if winner else None, "pick_within": trial.pick_within, "pick_ok": trial.pick_ok}


def render(results: list[dict[str, Any]], header: str) -> str:
    lines = [header, ""]
    for res in results:
        lines.append(f"{res['example']}: {' '.join(res['command'])}")
        lines.append(f"  verdict {res['verdict']}, pick {res['pick']}"
                     + (f", bucketing {res['bucketing']['boundaries']}" if res["bucketing"] else "")
                     + (f" (+{100 * res['extra_padding']:.1f}% elements on the recorded batches)"
                        if res.get("extra_padding") is not None else ""))
        table = [("candidate", "warm-up", "steady median", "steady mean", "p90", "spread", "ratio to eager")]
        for row in res["rows"]:
            if not row["ok"]:
                table.append((row["candidate"], "FAILED", row["error"] or "", "", "", "", ""))
                continue
            ratio = (f"{row['ratio_median']:.3f} ({row['ratio_min']:.3f}..{row['ratio_max']:.3f})"
                     if row["ratio_median"] is not None else "n/a")
            spread = f"{100 * row['spread']:.1f}%" + (" noisy" if row["noisy"] else "") if row["spread"] is not None else "n/a"
            table.append((row["candidate"], duration(row["warmup_seconds"]), duration(row["steady_median"]),
                          duration(row["steady_mean"]), duration(row["steady_p90"]), spread, ratio))
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for r in table:
            lines.append("  " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        lines.append("  per-round ratios to eager:")
        for row in res["rows"]:
            if row["ok"] and row.get("ratios") and row["candidate"] != res["rows"][0]["candidate"]:
                lines.append(f"    {row['candidate']:<26} " + " ".join(f"{x:.3f}" for x in row["ratios"]))
        within = res["pick_within"]
        verdict = ("n/a (pick not measured)" if within is None else
                   f"{'PASS' if res['pick_ok'] else 'FAIL'}: the pick is "
                   + ("the fastest" if within <= 1e-12 else f"{100 * within:.1f}% slower than the fastest"))
        lines.append(f"  fastest (median per-round ratio): {res['fastest']}; {verdict} "
                     f"(target: within {100 * PICK_TOLERANCE:.0f}%)")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 2 warm-up + 6 steps, 8 shape steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steady-state steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="compile/warm-up steps per run, reported apart")
    parser.add_argument("--shape-steps", type=int, default=16, help="steps torchaxe shapes records")
    parser.add_argument("--max-shapes", type=int, default=4)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compile candidates")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    parser.add_argument("--only", choices=("gpt", "seq_varlen"), help="one example only")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                        help="device of the examples (their --device) and of the verdict (default cpu)")
    add_save_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup, args.shape_steps = 1, 6, 2, 8
    import torch

    started = datetime.now(timezone.utc)
    header = (f"torchaxe compile-mode benchmark  {started.isoformat(timespec='seconds')}\n"
              f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python "
              f"{platform.python_version()}, torch {torch.__version__}"
              f"{', ' + torch.cuda.get_device_name() if args.target == 'cuda' else ''}, load {os.getloadavg()[0]:.2f} at start\n"
              f"backend {args.backend}; {args.repeats} round(s) interleaved; {args.warmup} warm-up + {args.steps} "
              f"steady steps per run; verdict from {args.shape_steps} recorded steps, --max-shapes {args.max_shapes}")
    results = []
    for name, script in EXAMPLES.items():
        if args.only and not script[0].startswith(f"examples/{args.only}/"):
            continue
        results.append(measure(name, script, args))
    elapsed = (datetime.now(timezone.utc) - started).total_seconds()
    output = {"header": header, "seconds": elapsed, "results": results}
    save_result(args, "compile_mode" if args.target == "cpu" else f"compile_mode_{args.target}", output, argv,
                device=torch.cuda.get_device_name() if args.target == "cuda" else None, script="compile_mode")
    if args.json:
        print(json.dumps(output, indent=2))
    else:
        print(render(results, header))
        print(f"total {elapsed:.0f} s")
    return 0 if all(r["pick_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
