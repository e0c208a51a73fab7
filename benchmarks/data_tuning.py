"""Loader tuning on the image example: data wait before and after, search against grid.

The workload is examples/image_classifier/train.py at a size where loading is a large
part of the step on a small machine (128-pixel JPEGs, a random 96-pixel crop, no
workers as written). Four measurements, every one a trial run of the unmodified script
in a subprocess (the trial bootstrap), so all are comparable:

1. ``torchaxe data --tune`` (the real command, in a subprocess): its harness run gives
   the data-wait fraction *before* tuning, the estimate, and the **search**: which
   points it tried and how many trial runs it used;
2. the **grid**: every distinct point of the same space (``LoaderTuner.grid``), one
   run each, its best being the highest median throughput;
3. a **head-to-head**: the script as written, the search's pick and the grid's pick,
   interleaved A B C for ``--rounds`` rounds, so that both picks are judged on the same
   footing (the grid's own figures favour whichever point ran during a quiet moment);
   the data wait *after* tuning is the search pick's wait here.

Every run gets ``OMP_NUM_THREADS=--threads`` (default 1): on a 2-core machine the
training process then leaves a core to the loader's workers ("where the cores allow");
``--threads 0`` leaves the environment as it is.

Throughput is samples per second over the total time of the measured steps (an
epoch-start stall counts). Printed: the throughputs, waits and ratios, the trials each used, and the targets: data wait under
5% of the step after tuning, the search's pick within 10% of the grid's pick's
throughput, using at most a third of the grid's trials. ``--json`` prints one object.
Progress goes to stderr. Exit code 0 when every target passes, 1 otherwise, 2 when the
benchmark cannot run.

    .venv/bin/python benchmarks/data_tuning.py
    .venv/bin/python benchmarks/data_tuning.py --rounds 5 --trial-steps 10 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "image_classifier" / "train.py"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, save_result  # noqa: E402

from torchaxe.data.tuning import LoaderPoint, LoaderTuner, TuneOptions  # noqa: E402
from torchaxe.runtime.stats import Samples  # noqa: E402

WORKLOAD = ["--images-per-class", "32", "--image-size", "128", "--crop-size", "96", "--width", "8",
            "--num-workers", "0", "--steps", "100000", "--log-every", "100000"]
BATCH_SIZE = 16
TARGET_WAIT = 0.05
TARGET_WITHIN = 0.10
TARGET_TRIAL_SHARE = 1 / 3


def log(line: str) -> None:
    sys.stderr.write(f"data_tuning: {line}\n")
    sys.stderr.flush()


def point_from(settings: dict[str, Any]) -> LoaderPoint:
    return LoaderPoint(settings.get("num_workers"), settings.get("prefetch_factor"),
                       settings.get("persistent_workers"), settings.get("pin_memory"),
                       settings.get("multiprocessing_context"))


def run_torchaxe_data(command: list[str], args: argparse.Namespace, home: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "torchaxe", "data", "--tune", "--format", "json", "--no-store",
            "--steps", str(args.trial_steps), "--warmup", str(args.trial_warmup), "--samples", "16",
            "--trial-steps", str(args.trial_steps), "--trial-warmup", str(args.trial_warmup),
            "--max-trials", str(args.max_trials), "--", *command]
    env = dict(os.environ, TORCHAXE_HOME=home)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    for line in proc.stderr.splitlines():
        if line.startswith("torchaxe data:"):
            log(line)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"data_tuning: error: torchaxe data exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout)


def head_to_head(command: list[str], points: dict[str, LoaderPoint], args: argparse.Namespace) -> dict[str, Any]:
    from torchaxe.runtime.trials import TrialOptions, run_trials

    names = list(points)
    knob_sets = [points[n].knob_set(n) for n in names]
    options = TrialOptions(repeats=args.rounds, steps=args.trial_steps, warmup=args.trial_warmup, timeout=600)
    report = run_trials(knob_sets, command, options, progress=lambda line: log(f"head-to-head: {line}"))
    out = {}
    for name, result in zip(names, report.results):
        steps = [s for r in result.runs if r.ok for s in r.step_seconds]
        waits = [w for r in result.runs if r.ok for w in r.data_wait_seconds]
        median = Samples.of(steps).median
        mean = sum(steps) / len(steps) if steps else None
        out[name] = {"label": points[name].label, "ok": result.ok, "error": result.knobs.name if not result.ok else None,
                     "median_step_seconds": median, "mean_step_seconds": mean,
                     "throughput": BATCH_SIZE / mean if mean else None,
                     "wait_fraction": sum(waits) / sum(steps) if steps else None,
                     "ratio_to_as_written": result.ratio.to_dict() if result.ratio else None,
                     "runs": [r.to_dict() for r in result.runs]}
    return out


def _lowest_wait(grid) -> dict[str, Any] | None:
    """Where the cores do not allow both, the point that waits least and what it costs."""
    ok = [r for r in grid.results if r.ok and r.wait_fraction is not None and r.throughput]
    if not ok or grid.best is None or not grid.best.throughput:
        return None
    low = min(ok, key=lambda r: r.wait_fraction)
    return {"label": low.point.label, "wait_fraction": low.wait_fraction, "throughput": low.throughput,
            "vs_grid_pick": low.throughput / grid.best.throughput}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trial-steps", type=int, default=8)
    parser.add_argument("--trial-warmup", type=int, default=3)
    parser.add_argument("--max-trials", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="head-to-head rounds")
    parser.add_argument("--data-dir", default=None, help="where the example's JPEGs go (default: a temp folder)")
    parser.add_argument("--images-per-class", type=int, default=32,
                        help="data set size (4 classes, batch 16: 32 gives 8 steps an epoch). PyTorch's DataLoader "
                             "does not prefetch across epochs, so each epoch's first batch waits for a worker: "
                             "short epochs put a floor under the data wait that no loader setting removes")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every run (0: leave it): 1 leaves the loader a core of a small machine")
    parser.add_argument("--json", action="store_true")
    add_save_options(parser)
    args = parser.parse_args(argv)
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # every run inherits it

    home = tempfile.mkdtemp(prefix="torchaxe-bench-home-")
    workload = list(WORKLOAD)
    workload[workload.index("--images-per-class") + 1] = str(args.images_per_class)
    default_dir = "torchaxe-bench-shapes128" + ("" if args.images_per_class == 32 else f"-{args.images_per_class}")
    data_dir = args.data_dir or str(Path(tempfile.gettempdir()) / default_dir)
    command = ["python", str(SCRIPT), "--data-dir", data_dir, *workload]
    log("generating the data set ...")
    subprocess.run([sys.executable, str(SCRIPT), "--data-dir", data_dir, *workload[:-4], "--steps", "1"],
                   check=True, capture_output=True, cwd=ROOT)

    log("1/3 torchaxe data --tune (the search) ...")
    data = run_torchaxe_data(command, args, home)
    search = data["tuning"]
    before = data["summary"]["data_wait_fraction"]
    estimate = data["estimate"]

    log("2/3 the full grid ...")
    tuner = LoaderTuner(command, TuneOptions(steps=args.trial_steps, warmup=args.trial_warmup, repeats=1, timeout=600,
                                             max_trials=10_000),
                        cores=data["cores"], batch_size=BATCH_SIZE, accelerator=data["target"] != "cpu",
                        progress=lambda line: log(f"grid: {line}"))
    grid = tuner.grid(estimate)
    grid_best = grid.best

    log("3/3 head-to-head: as written, the search's pick, the grid's pick ...")
    picks = {"as-written": LoaderPoint(), "search": point_from(search["best"]["point"]) if search["best"] else LoaderPoint(),
             "grid": grid_best.point if grid_best else LoaderPoint()}
    same_pick = picks["search"].canonical() == picks["grid"].canonical()
    if same_pick:
        picks.pop("grid")  # the same point: the ratio is 1 by identity
    h2h = head_to_head(command, picks, args)
    grid_h2h = h2h.get("grid", h2h["search"])
    after = h2h["search"]["wait_fraction"]
    within = (h2h["search"]["throughput"] / grid_h2h["throughput"]
              if h2h["search"]["throughput"] and grid_h2h["throughput"] else None)
    share = search["trials"] / grid.trials if grid.trials else None
    targets = [
        ("data wait after tuning < 5% of the step", after is not None and after < TARGET_WAIT,
         f"{100 * after:.1f}%" if after is not None else "n/a"),
        ("search pick within 10% of the grid pick's throughput", within is not None and within >= 1 - TARGET_WITHIN,
         f"{within:.3f}x" if within is not None else "n/a"),
        ("search trials <= 1/3 of the grid's", share is not None and share <= TARGET_TRIAL_SHARE,
         f"{search['trials']} of {grid.trials} ({share:.2f})" if share is not None else "n/a"),
    ]
    result = {
        "benchmark": "data_tuning",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "cores_for_rank": data["cores"], "python": platform.python_version(),
                    "load_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "workload": command,
        "before": {"data_wait_fraction": before, "verdict": data["verdict"]["headline"], "estimate": estimate},
        "search": {"trials": search["trials"], "stopped_because": search["stopped_because"],
                   "pick": search["best"]["label"] if search["best"] else None,
                   "points": [(r["label"], r["throughput"], r["wait_fraction"]) for r in search["results"]]},
        "grid": {"trials": grid.trials, "points": len(grid.results), "pick": grid_best.point.label if grid_best else None,
                 "pick_throughput_own_run": grid_best.throughput if grid_best else None,
                 "lowest_wait": _lowest_wait(grid)},
        "head_to_head": {k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in h2h.items()},
        "after": {"data_wait_fraction": after},
        "search_vs_grid_throughput": within,
        "same_pick": same_pick,
        "threads": args.threads,
        "targets": [{"name": n, "pass": ok, "value": v} for n, ok, v in targets],
    }
    save_result(args, "data_tuning", result, argv)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"data tuning benchmark  {result['date']}")
        print(f"machine: {result['machine']}")
        print(f"workload: python examples/image_classifier/train.py {' '.join(workload)}"
              + (f"  (OMP_NUM_THREADS={args.threads})" if args.threads > 0 else ""))
        print(f"before tuning: data wait {100 * before:.1f}% of the step ({data['verdict']['headline']})")
        print(f"estimate: {estimate}")
        print(f"search: {search['trials']} trial runs, stopped: {search['stopped_because']}")
        for label, rate, wait in result["search"]["points"]:
            print(f"   {label:<70} {rate or 0:8.1f} samples/s  wait {100 * (wait or 0):5.1f}%")
        print(f"grid: {grid.trials} trial runs over {len(grid.results)} points")
        for r in sorted(grid.results, key=lambda r: -(r.throughput or 0))[:6]:
            print(f"   {r.point.label:<70} {r.throughput or 0:8.1f} samples/s  wait {100 * (r.wait_fraction or 0):5.1f}%")
        low = result["grid"]["lowest_wait"]
        if low:
            print(f"   lowest data wait in the grid: {100 * low['wait_fraction']:.1f}% with {low['label']}, "
                  f"{low['throughput']:.1f} samples/s ({low['vs_grid_pick']:.2f}x the grid pick's own run)")
        print(f"head-to-head, {args.rounds} interleaved rounds:")
        for name, v in h2h.items():
            ratio = v["ratio_to_as_written"]
            ratio_text = f"{ratio['median']:.3f} ({ratio['min']:.3f}..{ratio['max']:.3f})" if ratio else "n/a"
            print(f"   {name:<11} {v['label']:<62} {v['throughput'] or 0:8.1f} samples/s  wait "
                  f"{100 * (v['wait_fraction'] or 0):5.1f}%  median-step ratio {ratio_text}")
        if same_pick:
            print("   (the search and the grid picked the same point: their ratio is 1 by identity)")
        print("targets")
        for name, ok, value in targets:
            print(f"  {'PASS' if ok else 'FAIL'}  {name}: {value}")
    return 0 if all(ok for _, ok, _ in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
