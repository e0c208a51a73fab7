"""How far apart runs of the same script land, one after another and taking turns.

advise judges a change by its per-round ratio to the original's run of the same round,
and the run-to-run noise (its A/A arm) is the bar a change must clear. This measures
that noise both ways on one script, in one sitting: ``--arms`` copies of the unchanged
script against the original for ``--rounds`` rounds, first one run after another
(advise's default), then side by side taking turns (advise ``--turns`` on a cpu,
``runtime/turns.py``), with the steps per run and per turn advise would choose for
the script's step time. Every ratio is of two runs of identical code: 1.00 is
perfect. Printed per way: the largest and the median distance of a ratio from 1, and
the ratios; then the ratio of the two ways' median distances.

    .venv/bin/python benchmarks/turns_noise.py                       # the BERT loop
    .venv/bin/python benchmarks/turns_noise.py --script examples/gpt/train.py --arms 4 --save
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from saved_run import add_save_options, save_result  # noqa: E402

DEFAULT_SCRIPT = ROOT / "tests" / "scripts" / "frameworks" / "hf_custom_loop.py"


def spread(ratios: list[float]) -> dict[str, object]:
    distance = [abs(1.0 - r) for r in ratios]
    return {"ratios": [round(r, 4) for r in ratios], "max_distance": max(distance) if distance else None,
            "median_distance": statistics.median(distance) if distance else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", default=str(DEFAULT_SCRIPT), help="a training script that takes --steps N")
    parser.add_argument("--arms", type=int, default=3, help="copies of the original measured against it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step", type=float, default=0.08, help="the script's step time in seconds (sets the "
                        "steps per run and per turn as advise would)")
    parser.add_argument("--json", action="store_true")
    add_save_options(parser)
    args = parser.parse_args()
    if args.arms < 1 or args.rounds < 1:
        print("turns_noise: error: --arms and --rounds must be at least 1", file=sys.stderr)
        return 2
    script = Path(args.script).resolve()
    if not script.is_file():
        print(f"turns_noise: error: {script}: no such file", file=sys.stderr)
        return 2

    from torchaxe.advise.baseline import MEASURE_WINDOW, TURNS_MEASURE_WINDOW, auto_steps
    from torchaxe.advise.measure import Measurer
    from torchaxe.runtime.knobs import knob_set_from_dict
    from torchaxe.runtime.trials import TrialOptions
    from torchaxe.runtime.turns import run_in_turns, steps_per_turn

    warmup = 10
    original = knob_set_from_dict({"name": "original"}, "bench")
    copies = [knob_set_from_dict({"name": f"same-{i}"}, "bench") for i in range(args.arms)]
    os.chdir(script.parent)
    result: dict[str, object] = {"script": str(script.relative_to(ROOT) if script.is_relative_to(ROOT) else script),
                                 "arms": args.arms, "rounds": args.rounds}
    started = time.perf_counter()
    for way, window in (("one_by_one", MEASURE_WINDOW), ("turns", TURNS_MEASURE_WINDOW)):
        steps = auto_steps(args.step, window)
        command = [sys.executable, str(script), "--steps", str(warmup + steps + 20)]
        options = TrialOptions(repeats=1, steps=steps, warmup=warmup, timeout=600, target="cpu")
        together = None
        if way == "turns":
            turn = steps_per_turn(args.step, steps)

            def together(knob_sets, repeat, options=options, command=command, turn=turn):
                return run_in_turns(knob_sets, command, options, repeat, turn_steps=turn)

        measurer = Measurer(command, options, together=together,
                            progress=lambda line, way=way: print(f"turns_noise: {way}: {line}", file=sys.stderr))
        way_started = time.perf_counter()
        _, arms, _ = measurer.compare(original, copies, args.rounds, "measuring", warm=True)
        errors = [a.error for a in arms if a.error]
        if errors:
            print(f"turns_noise: error: {errors[0]}", file=sys.stderr)
            return 2
        ratios = [r for a in arms for r in a.ratios]
        result[way] = {**spread(ratios), "steps_per_run": steps, "seconds": time.perf_counter() - way_started,
                       **({"steps_per_turn": steps_per_turn(args.step, steps)} if way == "turns" else {})}
    one, turns = result["one_by_one"], result["turns"]
    result["median_distance_ratio"] = (one["median_distance"] / turns["median_distance"]
                                       if turns["median_distance"] else None)
    result["seconds"] = time.perf_counter() - started
    lines = [f"turns noise: {result['script']}, {args.arms} copies x {args.rounds} rounds "
             f"({platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')})"]
    for way in ("one_by_one", "turns"):
        r = result[way]
        lines.append(f"  {way.replace('_', ' ')}: largest {r['max_distance']:.1%} from 1, median {r['median_distance']:.1%} "
                     f"({r['steps_per_run']} steps a run; {r['seconds']:.0f} s); ratios "
                     + " ".join(f"{x:.3f}" for x in r["ratios"]))
    if result["median_distance_ratio"]:
        lines.append(f"  taking turns: {result['median_distance_ratio']:.1f}x closer to 1 (median distance)")
    result["text"] = "\n".join(lines)
    save_result(args, "turns_noise", result, sys.argv[1:])
    print(result["text"] if not args.json else __import__("json").dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
