"""Model FLOPs utilisation (MFU) of the bundled examples, before and after advise, and
where the tuned GPT example's step time went.

For each of examples/gpt, examples/image_classifier and examples/seq_varlen (small
sizes: a step takes milliseconds to a tenth of a second on a CPU), on a copy of the
example:

1. **before**: the original profiled once under the harness with op recording, FLOP
   counting and the peak probe (as advise profiles its baseline);
2. ``torchaxe advise --budget B`` on the copy, then ``torchaxe apply --unsafe-fixes``:
   the copy's code is fixed and its run knobs go to its torchaxe.toml (as
   benchmarks/end_to_end.py does);
3. **after**: the tuned copy profiled the same way, under its run knobs (as ``torchaxe
   run`` applies them).

MFU is the model's FLOPs per step (counted once on the original: the model, not the
kernels that compute it, so a compiled run that the counter sees less of is not
credited with fewer FLOPs) over each run's median step time, against the peak
measured on this device by the profiles' matrix-product probe in the run's dtype (a
bf16 run against the bf16 probe; the best probe of all the runs in that dtype, so
that a probe slowed by a busy moment does not move one run's figure) and, where
``backends/peaks.py`` knows the device (``--target cuda``), the published peak. The GPT example's two profiles are then
compared (``torchaxe compare``): the operators whose time per step changed most and
those found in one run only are printed.

There is no target: MFU is reported. A faster run can even show a lower MFU when its
changes move it to a dtype whose peak is higher.

    .venv/bin/python benchmarks/mfu.py --budget 3m --save
    .venv/bin/python benchmarks/mfu.py --only gpt --budget 45s --target cuda --gpt-args "--d-model 512 ..."
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from advised_runs import torchaxe  # noqa: E402
from end_to_end import device_name  # noqa: E402
from saved_run import add_save_options, save_result  # noqa: E402

from torchaxe.advise.where import MIN_SHARE  # noqa: E402

#: Each example with the arguments that keep it running until the harness stops it.
EXAMPLES: dict[str, list[str]] = {
    "gpt": ["--steps", "100000", "--log-every", "100000"],
    "image_classifier": ["--steps", "100000", "--log-every", "100000", "--images-per-class", "16"],
    "seq_varlen": ["--steps", "100000", "--log-every", "100000"],
}
#: The example whose original and tuned runs are compared operator by operator.
COMPARED = "gpt"
#: Operators shown from the comparison: changed most, then in one run only.
TOP_OPERATORS = 6
TOP_ONLY = 4


def log(line: str) -> None:
    print(f"mfu: {line}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- figures


def run_figures(profile: dict[str, Any]) -> dict[str, Any]:
    """What one profile says about its utilisation: step time, FLOPs per step, the
    dtype and both peaks (null when missing)."""
    summary = profile.get("summary") or {}
    flops = profile.get("flops") or {}
    return {"step_seconds_median": summary.get("step_seconds_median"),
            "steps_measured": summary.get("steps_measured"),
            "flops_per_step": flops.get("flops_per_step"), "dtype": flops.get("dtype"),
            "device_name": flops.get("device_name"),
            "peak_table": flops.get("peak_flops_per_second_table"),
            "peak_measured": flops.get("peak_flops_per_second_measured"),
            "note": flops.get("note")}


def utilisation(model_flops: int | None, run: dict[str, Any], peaks: dict[str, float]) -> dict[str, Any]:
    """MFU of one run: the model's FLOPs per step over its median step time, against
    the table peak for its dtype and the best peak measured in that dtype (``peaks``,
    else its own probe's)."""
    step = run.get("step_seconds_median")
    achieved = model_flops / step if model_flops and step else None
    table = run.get("peak_table")
    measured = peaks.get(run.get("dtype") or "") or run.get("peak_measured")
    return {"achieved_flops_per_second": achieved, "peak_measured_used": measured,
            "mfu_table": achieved / table if achieved and table else None,
            "mfu_measured": achieved / measured if achieved and measured else None}


def best_peaks(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The highest peak any run's probe measured, by dtype: one device, one peak per
    dtype, so that a probe slowed by a busy moment does not move a run's MFU."""
    peaks: dict[str, float] = {}
    for run in runs:
        dtype, peak = run.get("dtype"), run.get("peak_measured")
        if dtype and peak:
            peaks[dtype] = max(peaks.get(dtype, 0.0), peak)
    return peaks


def example_result(name: str, before_profile: dict[str, Any], after_profile: dict[str, Any] | None,
                   chosen: list[str], error: str | None = None) -> dict[str, Any]:
    """One example's row before its MFU is worked out (``with_mfu``): both runs'
    figures, the step speed-up and what advise chose."""
    before = run_figures(before_profile)
    after = run_figures(after_profile) if after_profile is not None else None
    speedup = None
    if after and before["step_seconds_median"] and after["step_seconds_median"]:
        speedup = before["step_seconds_median"] / after["step_seconds_median"]
    return {"example": name, "chosen": list(chosen), "before": before, "after": after, "speedup": speedup,
            "error": error}


def with_mfu(examples: list[dict[str, Any]]) -> dict[str, float]:
    """Each run's MFU on its example's model FLOPs (counted on the original), against
    the best peaks of all the runs; returns those peaks."""
    runs = [run for ex in examples for run in (ex["before"], ex["after"]) if run]
    peaks = best_peaks(runs)
    for ex in examples:
        model_flops = ex["before"].get("flops_per_step")
        for run in (ex["before"], ex["after"]):
            if run:
                run.update(utilisation(model_flops, run, peaks))
    return peaks


def difference(comparison: dict[str, Any], top: int = TOP_OPERATORS, only: int = TOP_ONLY) -> dict[str, Any]:
    """From a ``torchaxe.compare/1`` object: the step ratio, the shared operators whose
    time per step changed most, and the operators of one run only (most time first),
    each at least ``MIN_SHARE`` of the original's step time, as advise lists them."""
    floor = MIN_SHARE * ((comparison.get("a") or {}).get("step_seconds_median") or 0.0)
    def row(r: dict[str, Any]) -> dict[str, Any]:
        return {"name": r["name"], "original_seconds_per_step": r["a_seconds_per_step"],
                "tuned_seconds_per_step": r["b_seconds_per_step"],
                "change_seconds_per_step": r["change_seconds_per_step"],
                "original_calls_per_step": r["a_calls_per_step"], "tuned_calls_per_step": r["b_calls_per_step"]}

    shared = [r for r in comparison.get("operators") or []
              if r["a_seconds_per_step"] is not None and r["b_seconds_per_step"] is not None
              and abs(r["change_seconds_per_step"]) >= floor]
    only_a = [r for r in comparison.get("only_in_a") or [] if (r["a_seconds_per_step"] or 0.0) >= floor]
    only_b = [r for r in comparison.get("only_in_b") or [] if (r["b_seconds_per_step"] or 0.0) >= floor]
    return {"step_ratio": comparison.get("step_ratio"),
            "operators": [row(r) for r in shared[:top]],
            "only_in_original": [row(r) for r in only_a[:only]],
            "only_in_tuned": [row(r) for r in only_b[:only]]}


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{1e3 * value:.2f} ms"


def mfu_pair(run: dict[str, Any] | None) -> str:
    """``measured-peak MFU`` and, where known, ``/ table-peak MFU``."""
    if run is None:
        return "n/a"
    text = _pct(run.get("mfu_measured"))
    if run.get("mfu_table") is not None:
        text += f" (table {_pct(run['mfu_table'])})"
    return text


def render(result: dict[str, Any]) -> str:
    """The printed report: one line per example, then the comparison of the GPT runs."""
    peaks = ", ".join(f"{dtype} {peak / 1e9:.1f} GFLOP/s" for dtype, peak in sorted(result["peaks_measured"].items()))
    lines = [f"MFU before and after advise ({result['machine']}, target {result['target']}, advise --budget "
             f"{result['budget']}); MFU on the original's FLOPs per step, against the best measured peak"
             + f" ({peaks or 'none measured'})" + (" and the table peak" if result["target"] != "cpu" else "")]
    for ex in result["examples"]:
        before, after = ex["before"], ex["after"]
        if ex.get("error") and after is None:
            lines.append(f"  {ex['example']}: before {mfu_pair(before)} at {_ms(before and before['step_seconds_median'])}; "
                         f"after: not measured ({ex['error']})")
            continue
        dtype = f", {after['dtype']}" if after and after.get("dtype") and after["dtype"] != before.get("dtype") else ""
        lines.append(
            f"  {ex['example']}: MFU {mfu_pair(before)} -> {mfu_pair(after)}{dtype}; step {_ms(before['step_seconds_median'])} -> "
            f"{_ms(after and after['step_seconds_median'])}"
            + (f" ({ex['speedup']:.2f}x)" if ex.get("speedup") else "")
            + f"; {_flops(before['flops_per_step'])} per step; chosen: {', '.join(ex['chosen']) or 'nothing'}")
    diff = result.get("compare")
    if diff:
        ratio = diff.get("step_ratio")
        lines.append(f"  compare {COMPARED} original -> tuned"
                     + (f" (step ratio {ratio:.3f})" if ratio else "") + ": operators whose time per step changed most")
        for r in diff["operators"]:
            lines.append(f"    {r['name']:<44} {_ms(r['original_seconds_per_step']):>10} -> "
                         f"{_ms(r['tuned_seconds_per_step']):>10} ({1e3 * r['change_seconds_per_step']:+.2f} ms)")
        for key, title, side in (("only_in_original", "only in the original", "original_seconds_per_step"),
                                 ("only_in_tuned", "only in the tuned run", "tuned_seconds_per_step")):
            if diff[key]:
                lines.append(f"    {title}: " + ", ".join(f"{r['name']} {_ms(r[side])}" for r in diff[key]))
    elif result.get("compare_error"):
        lines.append(f"  compare {COMPARED}: {result['compare_error']}")
    return "\n".join(lines)


def _flops(value: int | None) -> str:
    return "n/a FLOP" if not value else f"{value / 1e9:.2f} GFLOP"


# --------------------------------------------------------------------------- running


def profile(command: list[str], target: str, steps: int, knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run profiled as advise profiles its baseline, under ``knobs`` when given."""
    from torchaxe.advise.baseline import profile_in_subprocess
    from torchaxe.advise.options import AdviseOptions
    from torchaxe.runtime.knobs import knob_set_from_dict

    options = AdviseOptions(target=target, steps=steps, warmup=4, budget=600.0, timeout=300.0)
    knob_set = knob_set_from_dict({"name": "tuned", **knobs}, "mfu") if knobs is not None else None
    return profile_in_subprocess(command, options, target, knobs=knob_set).profile


def measure_example(name: str, work: Path, args: argparse.Namespace) -> tuple[dict[str, Any], Path | None, Path | None]:
    """One example before and after advise; the paths of both profiles (for compare)."""
    from torchaxe.advise.apply import read_run_knobs
    from torchaxe.errors import TorchaxeError

    copy = work / name
    shutil.copytree(ROOT / "examples" / name, copy)
    script = copy / "train.py"
    extra = [*EXAMPLES[name], "--device", args.target, *(args.gpt_args.split() if name == "gpt" else [])]
    if name == "image_classifier":
        extra += ["--data-dir", str(work / "images")]
    command = ["python", str(script), *extra]
    log(f"{name}: profiling the original")
    try:
        before = profile(command, args.target, args.steps)
    except TorchaxeError as exc:
        return example_result(name, {}, None, [], f"the original: {exc}"), None, None
    before_path = work / f"{name}-before.json"
    before_path.write_text(json.dumps(before), encoding="utf-8")
    log(f"{name}: advise --budget {args.budget}")
    advised = torchaxe("advise", "--budget", args.budget, "--format", "json", "--save", str(work / f"{name}.advice.json"),
                       "--target", args.target, "--", *command, cwd=copy)
    if advised.returncode != 0:
        tail = [line for line in advised.stderr.splitlines() if line.strip()]
        return example_result(name, before, None, [], f"advise: {tail[-1] if tail else 'failed'}"), before_path, None
    chosen = [r["key"] for r in json.loads(advised.stdout)["recommendations"] if r["selected"]]
    applied = torchaxe("apply", "--unsafe-fixes", "--advice", str(work / f"{name}.advice.json"), cwd=copy)
    if applied.returncode != 0:
        tail = [line for line in applied.stderr.splitlines() if line.strip()]
        return example_result(name, before, None, chosen, f"apply: {tail[-1] if tail else 'failed'}"), before_path, None
    knobs, _ = read_run_knobs(copy)
    log(f"{name}: chosen {', '.join(chosen) or 'nothing'}; profiling the tuned copy")
    try:
        after = profile(command, args.target, args.steps, knobs)
    except TorchaxeError as exc:
        return example_result(name, before, None, chosen, f"the tuned copy: {exc}"), before_path, None
    after_path = work / f"{name}-after.json"
    after_path.write_text(json.dumps(after), encoding="utf-8")
    return example_result(name, before, after, chosen), before_path, after_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="3m", help="advise's --budget for each example (default 3m)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps of each profiled run")
    parser.add_argument("--only", choices=tuple(EXAMPLES), action="append",
                        help="this example only (repeatable; default all three)")
    parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                        help="device of the examples (passed as --device) and of advise (default cpu)")
    parser.add_argument("--gpt-args", default="", help="extra arguments for examples/gpt/train.py (a larger model "
                        "on a GPU, as benchmarks/gpu_checks.sh gives)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    add_save_options(parser)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="torchaxe-mfu-"))
    os.environ["TORCHAXE_HOME"] = str(work / "home")
    device = device_name() if args.target == "cuda" else None
    results, paths = [], {}
    try:
        for name in args.only or list(EXAMPLES):
            result, before_path, after_path = measure_example(name, work, args)
            results.append(result)
            paths[name] = (before_path, after_path)
            speed = f"{result['speedup']:.2f}x" if result["speedup"] else "not measured"
            log(f"{name}: step time {speed} after advise")
        compare, compare_error = None, None
        before_path, after_path = paths.get(COMPARED, (None, None))
        if before_path and after_path:
            done = torchaxe("compare", str(before_path), str(after_path), "--format", "json", cwd=work)
            if done.returncode == 0:
                compare = difference(json.loads(done.stdout))
            else:
                compare_error = (done.stderr.strip().splitlines() or ["failed"])[-1]
        elif COMPARED in paths:
            compare_error = "not compared: the tuned run was not profiled"
        peaks = with_mfu(results)
        result = {"target": args.target, "budget": args.budget, "steps": args.steps,
                  "machine": device or f"{platform.machine()}, {os.cpu_count()} cores",
                  "peaks_measured": peaks, "examples": results, "compare": compare, "compare_error": compare_error,
                  "seconds": time.perf_counter() - started}
        result["text"] = render(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2) if args.json else result["text"])
    save_result(args, "mfu" if args.target == "cpu" else f"mfu_{args.target}", result, argv, device=device)
    return 0 if all(r["after"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
