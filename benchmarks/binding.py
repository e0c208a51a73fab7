"""Throughput of a CPU-heavy multi-process training run with and without core binding.

A data-parallel training job (an MLP on synthetic data, ``torch.distributed`` with
gloo, one all-reduce of the gradients per step, ``--nproc`` local ranks) is started
through ``torchaxe launch`` alternately

* **unbound**: ``--bind none``, with ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` set to
  the same per-rank thread count the plan gives, so that the only difference is where
  the scheduler may put the threads;
* **bound**: ``--bind MODE`` (default exclusive, ``--loader-cores 0``: the job has no
  loader workers), each rank pinned to its own cores and starting that many threads;

A B A B for ``--repeats`` rounds, so that drift on the machine hits both sides alike.
Each run times ``--steps`` steps after ``--warmup`` steps between two barriers; the
throughput is the job's samples per second (all ranks). Quoted: the median
throughput of each side over its runs, the ratio bound / unbound of each round and
the median of those ratios with its min..max (above 1: binding is faster). Every raw
figure is kept in ``--json``.

    .venv/bin/python benchmarks/binding.py
    .venv/bin/python benchmarks/binding.py --nproc 4 --repeats 5 --steps 40 --json
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
import textwrap
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, save_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn

    steps, warmup, batch, width, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = nn.parallel.DistributedDataParallel(nn.Sequential(
        nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "samples": steps * batch * dist.get_world_size(),
                       "threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0))}, f)
    dist.destroy_process_group()
''')


def _plan(nproc: int, mode: str) -> dict:
    from torchaxe.bind.plan import plan_binding
    from torchaxe.bind.topology import read_topology

    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return plan_binding(read_topology("/"), nproc, mode, loader_cores=0, environ=environ).to_dict()


def _run(side: str, args, folder: Path, threads: int, index: int) -> dict:
    out = folder / f"{side}-{index}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    cmd = [sys.executable, "-m", "torchaxe", "launch", "--nproc-per-node", str(args.nproc), "--standalone",
           "--loader-cores", "0"]
    if side == "unbound":
        cmd += ["--bind", "none"]
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    else:
        cmd += ["--bind", args.mode]
    cmd += [str(folder / "workload.py"), str(args.steps), str(args.warmup), str(args.batch), str(args.width), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=folder)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"binding benchmark: {side} run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    result["throughput"] = result["samples"] / result["seconds"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--mode", default="exclusive", help="binding mode of the bound side (default exclusive)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each unbound then bound (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (default 3)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_save_options(parser)
    args = parser.parse_args(argv)

    plan = _plan(args.nproc, args.mode)
    threads = plan["ranks"][0]["threads"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results: dict[str, list[dict]] = {"unbound": [], "bound": []}
    with tempfile.TemporaryDirectory(prefix="torchaxe-bind-bench-") as tmp:
        folder = Path(tmp)
        (folder / "workload.py").write_text(WORKLOAD)
        for i in range(args.repeats):
            for side in ("unbound", "bound"):
                r = _run(side, args, folder, threads, i)
                results[side].append(r)
                print(f"round {i + 1}/{args.repeats} {side}: {r['throughput']:.1f} samples/s "
                      f"({r['threads']} threads/rank, rank 0 on CPUs {r['affinity'][0]}..{r['affinity'][-1]})",
                      file=sys.stderr, flush=True)
    ratios = [b["throughput"] / u["throughput"] for u, b in zip(results["unbound"], results["bound"])]
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "allowed": len(os.sched_getaffinity(0)), "processor": platform.processor()
                    or platform.machine(), "python": platform.python_version(), "load_at_start": load},
        "settings": vars(args), "threads_per_rank": threads,
        "plan": [r["cpulist"] for r in plan["ranks"]], "plan_warnings": plan["warnings"],
        "unbound": {"throughput": [r["throughput"] for r in results["unbound"]],
                    "median": statistics.median(r["throughput"] for r in results["unbound"])},
        "bound": {"throughput": [r["throughput"] for r in results["bound"]],
                  "median": statistics.median(r["throughput"] for r in results["bound"])},
        "ratios": ratios, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
    }
    save_result(args, "binding", summary, argv)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    import torch

    print(f"binding benchmark  {summary['date']}")
    print(f"machine: {summary['machine']['allowed']} allowed CPUs of {summary['machine']['cpus']}, "
          f"{summary['machine']['processor']}, Python {summary['machine']['python']}, torch {torch.__version__}, "
          f"load {load:.2f} at start" if load is not None else "")
    print(f"job: {args.nproc} ranks x {threads} thread(s), MLP width {args.width}, batch {args.batch}/rank, "
          f"{args.warmup} warmup + {args.steps} timed steps, gloo; bound = --bind {args.mode} "
          f"(ranks on {', '.join(summary['plan'])})")
    for w in plan["warnings"]:
        print(f"plan warning: {w}")
    print(f"{'':10}{'median samples/s':>18}  runs")
    for side in ("unbound", "bound"):
        s = summary[side]
        print(f"{side:10}{s['median']:>18.1f}  " + " ".join(f"{t:.1f}" for t in s["throughput"]))
    print(f"ratio bound/unbound per round: {' '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {summary['ratio_median']:.3f} (min {summary['ratio_min']:.3f}, max {summary['ratio_max']:.3f})")
    if summary["ratio_min"] <= 1.0 <= summary["ratio_max"]:
        print("note: the ratio's range crosses 1.00: no difference distinguishable with these repeats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
