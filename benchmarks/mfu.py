"""Model FLOPs utilisation (MFU) of the bundled examples, before and after advise, and
where the tuned GPT example's step time went.

For each of examples/gpt, examples/image_classifier and examples/seq_varlen (small
sizes: a step takes milliseconds to a tenth of a second on a CPU), on a copy of the
example:

1. ``torchaxe advise --budget B`` on a second copy, then ``torchaxe apply
   --unsafe-fixes``: that copy's code is fixed and its run knobs go to its torchaxe.toml
   (as benchmarks/end_to_end.py does);
2. ``--rounds`` rounds, each profiling **before** (the original) and then **after** (the
   tuned copy under its run knobs, as ``torchaxe run`` applies them), under the harness
   with op recording, FLOP counting and the peak probe (as advise profiles its
   baseline). Interleaving keeps a busy moment of a shared machine from landing on one
   side only: each side's step time is the median of its rounds' medians, and the
   step speed-up the median of the rounds' ratios.

MFU is the model's FLOPs per step (counted once on the original: the model, not the
kernels that compute it, so a compiled run that the counter sees less of is not
credited with fewer FLOPs) over each run's median step time, against the peak
measured on this device by the profiles' matrix-product probe in the run's dtype (a
bf16 run against the bf16 probe; the best probe of all the runs in that dtype, so
that a probe slowed by a busy moment does not move one run's figure) and, where
``backends/peaks.py`` knows the device (``--target cuda``), the published peak. The GPT
example's two profiles of the round whose ratio is the median are then compared
(``torchaxe compare``): the operators whose time per step changed most and those found
in one run only are printed.

There is no target: MFU is reported. A faster run can even show a lower MFU when its
changes move it to a dtype whose peak is higher.

    .venv/bin/python benchmarks/mfu.py --budget 6m --rounds 3 --save
    .venv/bin/python benchmarks/mfu.py --only gpt --budget 45s --target cuda --gpt-args "--d-model 512 ..."
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
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


def combined_figures(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures over its rounds: the first round's FLOPs and dtype, the median
    of the rounds' median step times, the best peak any round's probe measured."""
    runs = [run_figures(p) for p in profiles]
    figures = dict(runs[0])
    steps = [r["step_seconds_median"] for r in runs if r["step_seconds_median"]]
    figures["step_seconds_median"] = statistics.median(steps) if steps else None
    figures["step_seconds_rounds"] = [r["step_seconds_median"] for r in runs]
    figures["steps_measured"] = sum(r["steps_measured"] or 0 for r in runs)
    peaks = [r["peak_measured"] for r in runs if r["peak_measured"]]
    figures["peak_measured"] = max(peaks) if peaks else None
    return figures


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


Profiles = "dict[str, Any] | list[dict[str, Any]]"


def _rounds(profiles: Any) -> list[dict[str, Any]]:
    return [profiles] if isinstance(profiles, dict) else list(profiles or [])


def round_ratios(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[float]:
    """Each round's original step over its tuned step (rounds where both were measured)."""
    ratios = []
    for b, a in zip(before, after):
        b_step, a_step = run_figures(b)["step_seconds_median"], run_figures(a)["step_seconds_median"]
        if b_step and a_step:
            ratios.append(b_step / a_step)
    return ratios


def median_round(ratios: list[float]) -> int | None:
    """The index of the round whose ratio is the median (the lower middle of an even
    count): the pair the operator comparison is made on."""
    if not ratios:
        return None
    order = sorted(range(len(ratios)), key=ratios.__getitem__)
    return order[(len(order) - 1) // 2]


def example_result(name: str, before_profiles: Profiles, after_profiles: Profiles | None,
                   chosen: list[str], error: str | None = None) -> dict[str, Any]:
    """One example's row before its MFU is worked out (``with_mfu``): both sides' figures
    over their rounds (one profile or a list, round by round), the step speed-up (the
    median of the rounds' ratios) and what advise chose."""
    before_runs, after_runs = _rounds(before_profiles), _rounds(after_profiles)
    before = combined_figures(before_runs) if before_runs else run_figures({})
    after = combined_figures(after_runs) if after_runs else None
    ratios = round_ratios(before_runs, after_runs)
    speedup = statistics.median(ratios) if ratios else None
    return {"example": name, "chosen": list(chosen), "before": before, "after": after, "speedup": speedup,
            "per_round_ratios": ratios, "error": error}


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
             f"{result['budget']}, {result.get('rounds', 1)} interleaved rounds); MFU on the original's FLOPs per step, against the best measured peak"
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
            + (f" ({ex['speedup']:.2f}x; rounds {', '.join(f'{r:.2f}' for r in ex['per_round_ratios'])})"
               if ex.get("speedup") else "")
            + f"; {_flops(before['flops_per_step'])} per step; chosen: {', '.join(ex['chosen']) or 'nothing'}"
            + (f"; stopped after {len(ex['per_round_ratios'])} rounds: {ex['error']}" if ex.get("error") else ""))
    diff = result.get("compare")
    if diff:
        ratio = diff.get("step_ratio")
        lines.append(f"  compare {COMPARED} original -> tuned, the median round"
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
    """One example before and after advise, interleaved over ``args.rounds`` rounds; the
    paths of the median round's two profiles (for compare)."""
    from torchaxe.advise.apply import read_run_knobs
    from torchaxe.errors import TorchaxeError

    extra = [*EXAMPLES[name], "--device", args.target, *(args.gpt_args.split() if name == "gpt" else [])]
    if name == "image_classifier":
        extra += ["--data-dir", str(work / "images")]
    original, tuned = work / name / "original", work / name / "tuned"
    for copy in (original, tuned):
        shutil.copytree(ROOT / "examples" / name, copy)
    command = ["python", str(original / "train.py"), *extra]
    tuned_command = ["python", str(tuned / "train.py"), *extra]

    def failed(stage: str, text: str) -> tuple[dict[str, Any], None, None]:
        tail = [line for line in text.splitlines() if line.strip()]
        return example_result(name, [], None, [], f"{stage}: {tail[-1] if tail else 'failed'}"), None, None

    log(f"{name}: advise --budget {args.budget}")
    advice = work / f"{name}.advice.json"
    advised = torchaxe("advise", "--budget", args.budget, "--format", "json", "--save", str(advice),
                       "--target", args.target, "--", *tuned_command, cwd=tuned)
    if advised.returncode != 0:
        return failed("advise", advised.stderr)
    advice_data = json.loads(advised.stdout)
    chosen = [r["key"] for r in advice_data["recommendations"] if r["selected"]]
    measured = [f"{r['key']} {r['speedup']:.2f}x" for r in advice_data["recommendations"]
                if r["status"] == "measured" and r.get("speedup")]
    log(f"{name}: advise measured {', '.join(measured) or 'nothing'}")
    if not chosen:  # why: the budget, the noise, or nothing faster
        for note in advice_data.get("notes", []):
            log(f"{name}: advise's note: {note}")
    applied = torchaxe("apply", "--unsafe-fixes", "--advice", str(advice), cwd=tuned)
    if applied.returncode != 0:
        return failed("apply", applied.stderr)
    knobs, _ = read_run_knobs(tuned)
    log(f"{name}: chosen {', '.join(chosen) or 'nothing'}")
    before: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []
    error = None
    for round_index in range(args.rounds):
        log(f"{name}: round {round_index + 1}/{args.rounds}: the original, then the tuned copy")
        try:
            before.append(profile(command, args.target, args.steps))
        except TorchaxeError as exc:
            error = f"the original: {exc}"
            break
        try:
            after.append(profile(tuned_command, args.target, args.steps, knobs))
        except TorchaxeError as exc:
            error = f"the tuned copy: {exc}"
            before.pop()
            break
    if not before:
        return example_result(name, [], None, chosen, error), None, None
    pick = median_round(round_ratios(before, after))
    paths: list[Path | None] = [None, None]
    if pick is not None:
        for i, (side, runs) in enumerate((("before", before), ("after", after))):
            paths[i] = work / f"{name}-{side}.json"
            paths[i].write_text(json.dumps(runs[pick]), encoding="utf-8")
    return example_result(name, before, after or None, chosen, error), paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="6m",
                        help="advise's --budget for each example (default 6m: with 3m, advise measured each change "
                        "of the GPT example in one round only on a 2-core CPU, too few to tell it from the noise)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps of each profiled run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of profiling the original and the tuned copy (default 3)")
    parser.add_argument("--only", choices=tuple(EXAMPLES), action="append",
                        help="this example only (repeatable; default all three)")
    parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                        help="device of the examples (passed as --device) and of advise (default cpu)")
    parser.add_argument("--gpt-args", default="", help="extra arguments for examples/gpt/train.py (a larger model "
                        "on a GPU, as benchmarks/gpu_checks.sh gives)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    add_save_options(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

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
        result = {"target": args.target, "budget": args.budget, "steps": args.steps, "rounds": args.rounds,
                  "machine": device or f"{platform.machine()}, {os.cpu_count()} cores",
                  "peaks_measured": peaks, "examples": results, "compare": compare, "compare_error": compare_error,
                  "seconds": time.perf_counter() - started}
        result["text"] = render(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2) if args.json else result["text"])
    save_result(args, "mfu" if args.target == "cpu" else f"mfu_{args.target}", result, argv, device=device, script="mfu")
    return 0 if all(r["after"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
