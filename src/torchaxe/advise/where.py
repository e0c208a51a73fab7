"""Where the gain achieved since ``torchaxe apply`` came from.

The original files (kept by ``apply``) and the script as it is now (with its run
table) are each profiled once with op recording, as the baseline is, and compared
with ``torchaxe compare``'s model: the phases and the aten operators whose time per
step changed most, and the operators that appear in one run only (a fused kernel
now, a hand-written formula before). The result is a short list for the advice's
``achieved`` entry. It fits the budget or is skipped, and it never fails the advice:
anything that goes wrong becomes one note.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from torchaxe.advise.baseline import ProfileRunner
from torchaxe.advise.options import AdviseOptions
from torchaxe.compare.model import PHASES, Comparison, OperatorRow, compare_profiles
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.knobs import KnobSet
from torchaxe.runtime.profile import Profile

#: Lines of each kind in the list: phases, shared operators, operators of one run only.
MAX_PHASES = 3
MAX_OPERATORS = 5
MAX_ONLY = 3
#: The two profiled runs may take at most this share of the budget left.
BUDGET_SHARE = 0.5
#: A line is listed only when it moved (or, in one run only, took) at least this share
#: of the original's step time: the profiler's bookkeeping rows and the run-to-run
#: jitter of small operators stay out.
MIN_SHARE = 0.01


def _item(kind: str, name: str, title: str, before: float | None, now: float | None,
          before_calls: float | None = None, now_calls: float | None = None) -> dict[str, Any]:
    return {"kind": kind, "name": name, "title": title, "original_seconds_per_step": before,
            "now_seconds_per_step": now, "change_seconds_per_step": (now or 0.0) - (before or 0.0),
            "original_calls_per_step": before_calls, "now_calls_per_step": now_calls}


def _operator(kind: str, row: OperatorRow) -> dict[str, Any]:
    return _item(kind, row.name, row.name, row.a_seconds_per_step, row.b_seconds_per_step, row.a_calls_per_step,
                 row.b_calls_per_step)


def where_changed(comparison: Comparison) -> list[dict[str, Any]]:
    """The few lines that say where the step time moved, A being the original and B
    the run now: the phases that changed most (the step itself left out: the measured
    gain says it), the operators of both runs whose time per step changed most, and
    the operators of one run only, most time first; each at least ``MIN_SHARE`` of
    the original's step time. Each line has the same keys: ``kind`` (phase,
    operator, only_original, only_now), ``name``, ``title``, the seconds and calls
    per step of each run and the change (now minus original)."""
    floor = MIN_SHARE * (comparison.a.step_seconds_median or 0.0)
    phases = []
    for key, title in PHASES:
        before, now = comparison.a.phases.get(key), comparison.b.phases.get(key)
        if key != "step" and before is not None and now is not None and abs(now - before) >= floor:
            phases.append(_item("phase", key, title, before, now))
    phases.sort(key=lambda item: -abs(item["change_seconds_per_step"]))
    shared = [row for row in comparison.operators
              if row.a_seconds_per_step is not None and row.b_seconds_per_step is not None
              and abs(row.change) >= floor]
    only_a = [row for row in comparison.only_in_a if (row.a_seconds_per_step or 0.0) >= floor]
    only_b = [row for row in comparison.only_in_b if (row.b_seconds_per_step or 0.0) >= floor]
    items = (phases[:MAX_PHASES] + [_operator("operator", row) for row in shared[:MAX_OPERATORS]]
             + [_operator("only_original", row) for row in only_a[:MAX_ONLY]]
             + [_operator("only_now", row) for row in only_b[:MAX_ONLY]])
    return [item for item in items if item["change_seconds_per_step"]]


def _profiled(profiler: ProfileRunner, command: Sequence[str], options: AdviseOptions, target: str,
              knobs: KnobSet) -> Profile:
    run = profiler(command, options, target, knobs=knobs)
    profile = Profile.from_dict(run.profile)
    if profile.status == "error":
        raise TorchaxeError(f"the {knobs.name} run raised: {profile.detail}")
    if not profile.ops:
        raise TorchaxeError(f"the {knobs.name} run recorded no operators: {profile.detail}")
    return profile


def explain_gain(command: Sequence[str], options: AdviseOptions, target: str, original: KnobSet, now: KnobSet,
                 profiler: ProfileRunner, time_left: float, profile_seconds: float,
                 progress: Callable[[str], None] = lambda line: None) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Profile ``original`` and ``now`` once each and say where the step time moved:
    ``(where, None)``, or ``(None, note)`` when the budget is short or a run fails.
    ``profile_seconds`` is how long the baseline's profiled run took; both runs must
    fit in ``BUDGET_SHARE`` of ``time_left``."""
    allowed = BUDGET_SHARE * time_left
    needed = 2 * profile_seconds
    if needed > allowed or allowed <= 0:
        return None, (f"where the gain came from was not profiled: the two profiled runs (about {needed:.0f} s) "
                      f"would take more than half of the {max(time_left, 0):.0f} s left of the --budget")
    # Each run stops on its own before the share of the budget is spent.
    timeout = allowed / 2 if options.timeout is None else min(options.timeout, allowed / 2)
    bounded = replace(options, timeout=timeout)
    progress("profiling the original files and the applied changes once each, to say where the gain came from")
    try:
        before = _profiled(profiler, command, bounded, target, original)
        after = _profiled(profiler, command, bounded, target, now)
    except (TorchaxeError, OSError, ValueError) as exc:
        return None, f"where the gain came from is unknown: {exc}"
    return where_changed(compare_profiles(before, after, "original", "now")), None


def _calls(value: float | None) -> str:
    return "" if value is None else f", {value:.3g} call{'' if value == 1 else 's'}"


def describe(item: dict[str, Any]) -> str:
    """One line of the list, as the text and HTML advice show it."""
    from torchaxe.units import duration

    before, now = item.get("original_seconds_per_step"), item.get("now_seconds_per_step")
    if item["kind"] == "only_original":
        return f"only in the original: {item['name']} {duration(before, 2)} per step{_calls(item.get('original_calls_per_step'))}"
    if item["kind"] == "only_now":
        return f"only now: {item['name']} {duration(now, 2)} per step{_calls(item.get('now_calls_per_step'))}"
    calls = ""
    if item["kind"] == "operator":
        calls = f" ({item.get('original_calls_per_step') or 0:.3g} -> {item.get('now_calls_per_step') or 0:.3g} calls)"
    return (f"{item['title']}: {duration(before, 2)} -> {duration(now, 2)} per step, "
            f"{1e3 * item['change_seconds_per_step']:+.2f} ms{calls}")
