"""What torchaxe delivers on a data-parallel job: advise -> apply -> run under torchrun,
against the original and against the best of the distributed changes tried exhaustively.

On a copy of the DDP example (examples/ddp, gradient accumulation without
``no_sync``), launched as ``torchrun --nproc-per-node N`` (gloo on the CPU, nccl with
``--target cuda``):

1. ``torchaxe advise --budget B -- torchrun ...`` on the copy (every arm a torchrun job);
2. ``torchaxe apply --unsafe-fixes``: the copy's code is fixed, its run knobs written;
3. **tuned** (the fixed copy under its run knobs) against the **original** (the same
   job reading the original file through the source overlay), interleaved;
4. **exhaustive**: every combination of the distributed-axis changes advise knew
   (code rules AX6xx and the ``ddp`` / environment knobs of that axis; one per group),
   each measured against the original, interleaved, then the tuned run and the best
   combination side by side in the same rounds.

Printed: each rank's step, communication and exposed communication per step before
(original) and after (tuned), the speedup, and the targets: exposed communication per
step cut by at least half (the median over ranks); tuned within 10% of the exhaustive
best (side by side).

    .venv/bin/python benchmarks/distributed.py --budget 6m --repeats 3
    .venv/bin/python benchmarks/distributed.py --target cuda --save
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from advised_runs import advise_then_apply, combination_arms, combinations, side_by_side  # noqa: E402
from saved_run import add_save_options, save_result  # noqa: E402

from torchaxe.advise.measure import Measurer  # noqa: E402
from torchaxe.runtime.knobs import knob_set_from_dict  # noqa: E402
from torchaxe.runtime.trials import TrialOptions  # noqa: E402
from torchaxe.scan.engine import ScanOptions, scan_paths  # noqa: E402


def log(line: str) -> None:
    print(f"[distributed] {line}", file=sys.stderr, flush=True)


def exposed(rows: list[dict] | None) -> float | None:
    """The job's exposed communication per step: the median over its ranks."""
    values = [r.get("comm_exposed_seconds_per_step") for r in rows or []]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.1f} ms"


def breakdown(title: str, rows: list[dict] | None) -> list[str]:
    out = [f"  {title}:"]
    for r in rows or []:
        wait = r.get("data_wait_fraction")
        out.append(f"    rank {r['rank']}: step {ms(r.get('step_seconds_median'))}, comm {ms(r.get('comm_seconds_per_step'))}, "
                   f"exposed {ms(r.get('comm_exposed_seconds_per_step'))}, "
                   f"data wait {'-' if wait is None else f'{wait:.1%}'}")
    return out


def group_of(key: str) -> str:
    """At most one bucket size and one gradient compression in a combination."""
    return next((g for g in ("knob:ddp-bucket-cap", "knob:ddp-comm") if key.startswith(g)), key)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="6m", help="advise's --budget")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the final comparisons")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node)")
    parser.add_argument("--args", default="", help="extra arguments for examples/ddp/train.py")
    parser.add_argument("--max-combinations", type=int, default=16)
    parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu")
    add_save_options(parser)
    args = parser.parse_args()

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="torchaxe-dist-"))
    os.environ["TORCHAXE_HOME"] = str(work / "home")
    copy = work / "ddp"
    shutil.copytree(ROOT / "examples" / "ddp", copy)
    script = copy / "train.py"
    original_text = script.read_text()
    original_file = work / "original-train.py"
    original_file.write_text(original_text)
    extra = ["--steps", "100000", "--device", args.target, *args.args.split()]
    command = ["torchrun", "--nproc-per-node", str(args.nproc), "--standalone", str(script), *extra]

    log(f"advise --budget {args.budget} on a copy of examples/ddp, {args.nproc} ranks")
    done = advise_then_apply(copy, work, command, args.budget, args.target, log)
    if done is None:
        return 2
    advice, run_knobs, advise_seconds = done
    chosen = [r["key"] for r in advice["recommendations"] if r["selected"]]
    tuned_file = work / "tuned-train.py"
    tuned_file.write_text(script.read_text())
    script.write_text(original_text)

    options = TrialOptions(repeats=1, steps=args.steps, warmup=args.warmup, timeout=600.0, target=args.target)
    measurer = Measurer(command, options, progress=log)
    plain = knob_set_from_dict({"name": "original"}, "distributed")
    tuned = knob_set_from_dict({**run_knobs, "name": "tuned",
                                "sources": {**run_knobs.get("sources", {}), str(script): str(tuned_file)}},
                               "distributed")
    base, (tuned_arm,), _ = measurer.compare(plain, [tuned], args.repeats, "tuned vs original", warm=True)

    findings = scan_paths([script], ScanOptions(target=args.target)).findings
    candidates = [r for r in advice["recommendations"] if r["axis"] == "distributed"
                  and r["status"] in ("measured", "failed", "not_measured")]
    combos, possible = combinations(candidates, group_of, args.max_combinations)
    log(f"exhaustive: {len(combos)} of {possible} combinations of {len(candidates)} distributed changes")
    arms = combination_arms(combos, findings, work, "distributed")
    _, ex_arms, _ = measurer.compare(plain, arms, max(1, args.repeats - 1), "exhaustive") if arms else (None, [], True)
    ok = [a for a in ex_arms if a.ok and a.ratio]
    best = min(ok, key=lambda a: a.ratio) if ok else None
    side = side_by_side(measurer, plain, tuned, best.knobs, args.repeats) if best is not None and tuned_arm.ratio \
        else None

    speedup = 1 / tuned_arm.ratio if tuned_arm.ratio else None
    before, after = exposed(base.rank_figures), exposed(tuned_arm.rank_figures)
    cut = 1 - after / before if before and after is not None else None
    within = bool(side and side[0] >= 0.9) or bool(best is None and speedup)
    lines = [
        f"distributed end to end: examples/ddp/train.py, {args.nproc} ranks, {advice.get('distributed', {}).get('backend')}"
        f" ({platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')})",
        f"  advise: {advise_seconds:.0f} s (budget {args.budget}); chosen: {', '.join(chosen) or 'nothing'}",
        "  measured by advise: " + ", ".join(f"{r['key']} {r['speedup']:.2f}x" for r in advice["recommendations"]
                                            if r["status"] == "measured"),
        *breakdown("before (original)", base.rank_figures),
        *breakdown("after (tuned)", tuned_arm.rank_figures),
        f"  exposed communication per step (median over ranks): {ms(before)} -> {ms(after)}"
        + (f", cut {cut:.0%}" if cut is not None else ""),
        f"  step median: original {ms(base.median)}, tuned {ms(tuned_arm.median)}; tuned vs original "
        + (f"{speedup:.2f}x (per round {', '.join(f'{r:.3f}' for r in tuned_arm.ratios)})" if speedup
           else f"not measured ({tuned_arm.error})"),
        f"  exhaustive ({len(arms)} of {possible} combinations): best {best.name} {1 / best.ratio:.2f}x"
        if best else "  exhaustive: nothing measured",
        f"  side by side, same rounds: tuned {1 / side[2].ratio:.2f}x, best {1 / side[3].ratio:.2f}x; tuned / best "
        f"{side[0]:.2f} (per round {', '.join(f'{r:.3f}' for r in side[1])})" if side else "",
        f"  targets: exposed communication cut >= 50%: {'PASS' if cut is not None and cut >= 0.5 else 'FAIL'}; "
        f"within 10% of the best: {'PASS' if within else 'FAIL'}",
        f"  total {time.perf_counter() - started:.0f} s",
    ]
    text = "\n".join(line for line in lines if line)
    print(text)
    save_result(args, "distributed" if args.target == "cpu" else f"distributed_{args.target}", {
        "target": args.target, "nproc": args.nproc, "budget": args.budget, "advise_seconds": advise_seconds,
        "chosen": chosen, "original_median_s": base.median, "tuned_median_s": tuned_arm.median, "speedup": speedup,
        "per_round_ratios": list(tuned_arm.ratios), "ranks_before": base.rank_figures,
        "ranks_after": tuned_arm.rank_figures, "exposed_before_s": before, "exposed_after_s": after,
        "exposed_cut": cut,
        "exhaustive": {"measured": len(arms), "possible": possible, "best": best.name if best else None,
                       "best_speedup": 1 / best.ratio if best else None},
        "side_by_side": {"tuned_over_best": side[0], "per_round": side[1]} if side else None,
        "targets": {"exposed_cut_at_least_half": bool(cut is not None and cut >= 0.5), "within_10pct_of_best": within},
        "seconds": time.perf_counter() - started, "text": text,
    }, script="distributed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
