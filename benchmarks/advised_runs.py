"""The steps the end-to-end benchmarks share: advise and apply on a copy of an
example, and the exhaustive combinations of the changes advise knew.

``advise_then_apply`` runs ``torchaxe advise --budget B`` on the copy (its JSON advice
kept), then ``torchaxe apply --unsafe-fixes``, and returns the advice, the copy's run
knobs and how long advise took. ``combinations`` lists every combination of the
candidate recommendations with at most one member of each group, best predicted
first (the product of the members' own measured ratios; an unmeasured or failed one
counts as 1.0), at most ``limit``; ``combination_arms`` makes each a knob set, its
code fixes as a source overlay on the original code.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence


def torchaxe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    from alternate import run_to_end

    return run_to_end([sys.executable, "-m", "torchaxe", *args], cwd=cwd)


def advise_then_apply(copy: Path, work: Path, command: Sequence[str], budget: str, target: str,
                      log: Callable[[str], None], extra: Sequence[str] = ()) -> tuple[dict, dict, float] | None:
    """(advice, run knobs, advise seconds), or None when advise or apply failed (their
    stderr printed)."""
    from torchaxe.advise.apply import read_run_knobs

    started = time.perf_counter()
    result = torchaxe("advise", "--budget", budget, "--format", "json", "--save", str(work / "advice.json"),
                      "--target", target, *extra, "--", *command, cwd=copy)
    seconds = time.perf_counter() - started
    for line in result.stderr.splitlines()[-40:]:
        log(f"advise: {line}")
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return None
    advice = json.loads(result.stdout)
    chosen = [r["key"] for r in advice["recommendations"] if r["selected"]]
    log(f"advise took {seconds:.0f} s; chosen: {', '.join(chosen) or 'nothing'}")
    applied = torchaxe("apply", "--unsafe-fixes", "--advice", str(work / "advice.json"), cwd=copy)
    if applied.returncode != 0:
        print(applied.stderr, file=sys.stderr)
        return None
    run_knobs, _ = read_run_knobs(copy)
    return advice, run_knobs, seconds


def predicted(combo: Sequence[dict]) -> float:
    value = 1.0
    for r in combo:
        value *= statistics.median(r["ratios"]) if r.get("ratios") else 1.0
    return value


def combinations(candidates: Sequence[dict], group_of: Callable[[str], str], limit: int) -> tuple[list[tuple], int]:
    """The combinations to measure, best predicted first, and how many there are."""
    groups: dict[str, list[dict]] = {}
    for r in candidates:
        groups.setdefault(group_of(r["key"]), []).append(r)
    combos = [tuple(r for r in combo if r is not None)
              for combo in itertools.product(*[[None, *members] for members in groups.values()])]
    combos = [c for c in combos if c]
    possible = len(combos)
    if possible > limit:
        combos = sorted(combos, key=predicted)[:limit]
    return combos, possible


def combination_arms(combos: Sequence[tuple], findings: Sequence, work: Path, source: str) -> list:
    """One knob set per combination: its knobs merged, its code fixes read in place of
    the original files (written under ``work``)."""
    from torchaxe.advise.arms import merge_knobs
    from torchaxe.advise.candidates import fixed_sources
    from torchaxe.runtime.knobs import knob_set_from_dict

    arms = []
    for n, combo in enumerate(combos):
        fragment = merge_knobs([r["knobs"] for r in combo if r["applies"] == "knob"])
        codes = [code for r in combo if r["applies"] == "code" for code in r["rules"]]
        if codes:
            folder = work / f"combo-{n}"
            folder.mkdir()
            fragment["sources"] = fixed_sources(findings, codes, folder)
        arms.append(knob_set_from_dict({"name": "+".join(r["key"] for r in combo), **fragment}, source))
    return arms


def side_by_side(measurer, plain, tuned, best_knobs, repeats: int) -> tuple | None:
    """The tuned run and the exhaustive best measured again in the same rounds (the best
    of many noisy combinations is biased upwards: the winner's curse): (median of the
    per-round best/tuned ratios, those ratios, the tuned arm, the best arm), or None
    when no round measured both."""
    from dataclasses import replace

    _, (t_arm, b_arm), _ = measurer.compare(plain, [tuned, replace(best_knobs, name="best")], repeats,
                                            "side by side: tuned and the exhaustive best")
    pairs = [b / t for t, b in zip(t_arm.ratios, b_arm.ratios)]
    return (statistics.median(pairs), pairs, t_arm, b_arm) if pairs else None
