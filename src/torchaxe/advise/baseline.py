"""The baseline: the unchanged script profiled once in a subprocess (op times, shapes,
data wait, the files it imported, the settings it left on), the checks that it reached
its steps, the steps each trial run measures, and what the report plots of it."""

from __future__ import annotations

import json
import math
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from torchaxe.advise.options import AdviseOptions
from torchaxe.errors import TorchaxeError, first_line
from torchaxe.runtime import ranks
from torchaxe.runtime.knobs import KnobSet
from torchaxe.runtime.profile import rank_path
from torchaxe.runtime.ranks import rank_files
from torchaxe.runtime.knobs import knob_set_from_dict
from torchaxe.runtime.torchrun import torchrun_failure
from torchaxe.runtime.other_load import OtherLoad
from torchaxe.runtime.trials import TrialOptions, launch_bootstrap

#: Measured steps of the profiled run, and of each trial run when the steps are not given.
DEFAULT_STEPS = 8
#: With short steps, each trial run measures at least this many seconds of steps (at
#: most ``MAX_AUTO_STEPS``): eight 5 ms steps are one scheduler hiccup away from noise.
MEASURE_WINDOW = 0.5
MAX_AUTO_STEPS = 64
#: Runs that take turns (runtime/turns.py) measure longer: a few turns each, at the
#: cost of their steps alone (they share one start-up time per round).
TURNS_MEASURE_WINDOW = 2.0


def auto_steps(step_seconds: float | None, window: float = MEASURE_WINDOW) -> int:
    """Measured steps per trial run for a script whose steps take ``step_seconds``,
    to fill ``window`` seconds of steps."""
    if not step_seconds or step_seconds <= 0:
        return DEFAULT_STEPS
    return max(DEFAULT_STEPS, min(MAX_AUTO_STEPS, math.ceil(window / step_seconds)))


@dataclass
class BaselineProfile:
    profile: dict[str, Any]
    context: dict[str, Any]
    seconds: float
    #: Under torchrun: the job across its ranks (runtime/ranks.py ``distributed_view``);
    #: ``profile`` and ``context`` are then the first rank's.
    distributed: dict[str, Any] | None = None
    #: How busy other processes kept the cores during the profiled run (None: not watched).
    other_load: OtherLoad | None = None

    def steps_per_run(self, options: AdviseOptions, window: float = MEASURE_WINDOW) -> int:
        """Measured steps per trial run: ``options.steps``, else chosen from the
        profiled step time (``window`` seconds of them), and never more than a script
        that ended on its own ran."""
        if options.steps is not None:
            return options.steps
        steps = auto_steps((self.profile.get("summary") or {}).get("step_seconds_median"), window)
        if self.profile.get("status") == "completed":
            # The script ended within the profiled run: its runs hold no more steps than that.
            total = len(self.profile.get("steps") or [])
            steps = max(1, min(steps, total - options.warmup))
        return steps

    def expected_run_seconds(self, warmup: int, steps: int) -> float:
        """One trial run: start-up to the first step, then warmup + steps at the
        profiled median (the profiled run itself is slower: it records operators)."""
        recorded = self.profile.get("steps") or []
        startup = (recorded[0].get("start_seconds") if recorded else None) or 0.3 * self.seconds
        median = (self.profile.get("summary") or {}).get("step_seconds_median") or 0.0
        estimate = startup + 1.2 * (warmup + steps) * median + 1.0
        return max(min(estimate, self.seconds), 1.0)

    def trial_options(self, options: AdviseOptions, steps: int, target: str) -> TrialOptions:
        """The options of every trial run."""
        timeout = options.timeout
        if timeout is None:
            # A run may take far longer than the profiled one (a first compile), not forever.
            timeout = max(120.0, 10 * self.seconds)
        return TrialOptions(repeats=1, steps=steps, warmup=options.warmup, timeout=timeout,
                            target=target, step_marker=options.step_marker)


#: ``(command, options, target)``: the unchanged script profiled; with ``knobs=`` (the
#: gain achieved since ``apply`` explained), the script under that knob set.
ProfileRunner = Callable[..., BaselineProfile]


def profile_in_subprocess(command: Sequence[str], options: AdviseOptions, target: str,
                          knobs: KnobSet | None = None) -> BaselineProfile:
    """Run the script once under the harness with op and shape recording: unchanged,
    or under ``knobs`` (a knob set with its environment, as a trial run applies it)."""
    from torchaxe.runtime import run_context

    with tempfile.TemporaryDirectory(prefix="torchaxe-advise-") as tmp:
        # The first run is bounded too: a script that never reaches its steps must not
        # hold advise past its budget.
        timeout = options.timeout if options.timeout is not None else options.budget
        trial = TrialOptions(repeats=1, steps=options.steps or DEFAULT_STEPS, warmup=options.warmup,
                             timeout=timeout, target=target, step_marker=options.step_marker,
                             first_step_timeout=options.first_step_timeout)
        done = launch_bootstrap(knobs or knob_set_from_dict({"name": "original"}, "advise"), command, trial,
                                Path(tmp), extra=("--ops", "--shapes", "--flops") if options.flops else
                                ("--ops", "--shapes"), context=True,
                                limit=timeout + 30.0)
        if done.killed:
            raise TorchaxeError(f"the profiled run of the script (operators and shapes recorded on some steps) ran "
                                f"{timeout + 30:.0f} s without finishing its first {options.warmup} warm-up + "
                                f"{options.steps or DEFAULT_STEPS} steps (--budget {options.budget:g} s): give a larger "
                                f"--budget, or, for a script whose steps take seconds, a smaller --warmup "
                                f"(now {options.warmup})")
        files = rank_files(done.profile_path)
        if not files:
            tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
            problem = torchrun_failure(done.stderr) or (tail[-1] if tail else "no output")
            if done.returncode is not None and done.returncode < 0:
                try:
                    name = signal.Signals(-done.returncode).name
                except ValueError:
                    name = f"signal {-done.returncode}"
                raise TorchaxeError(f"the profiled run crashed ({name}) before its first step: {problem}; "
                                    "`torchaxe profile` without --ops, or `python -X faulthandler`, shows where")
            raise TorchaxeError(f"the script failed before its first step: {problem}")
        # The first rank that ran on this node: its context (imported files, settings) was written here.
        contexts = {rank: rank_path(done.context_path, rank, len(files)) for rank in files}
        first = min([rank for rank, path in contexts.items() if path.exists()] or files)
        profile = json.loads(files[first].read_text(encoding="utf-8"))
        context = run_context.load(contexts[first])
        distributed = None
        if len(files) > 1 or ((profile.get("run") or {}).get("world_size") or 1) > 1:
            distributed = _job_view(done.profile_path)
    return BaselineProfile(profile, context, done.seconds, distributed, done.other_load)


def _job_view(out: Path) -> dict[str, Any] | None:
    """The ranks side by side; a rank whose run failed names the failure."""
    profiles = ranks.load_ranks(out)
    failed = ranks.failed_rank(profiles)
    if failed is not None:
        raise TorchaxeError(f"rank {failed[0]} of the profiled run: {failed[1].status}: {failed[1].detail}")
    return ranks.distributed_view(profiles)



def check_profile(profile: dict[str, Any], options: AdviseOptions) -> None:
    """A clear error when the profiled run raised, ended early or showed no step."""
    steps = (profile.get("summary") or {}).get("steps_measured") or 0
    if profile.get("status") == "error":
        error = profile.get("error") or {}
        where = f" at {error.get('file')}:{error.get('line')}" if error.get("file") else ""
        counted = ""
        if options.flops and options.warmup >= 1 and len(profile.get("steps") or []) == options.warmup - 1:
            # It stopped in the last warm-up step, whose FLOPs the profiled run counts.
            counted = ("; it stopped in the step whose FLOPs torchaxe counts (the last warm-up step): if the script "
                       "runs on its own, --no-flops leaves the counter out")
        raise TorchaxeError(f"the script raised {error.get('type', 'an error')}{where}: "
                            f"{first_line(error.get('message', profile.get('detail', '')))}{counted}")
    if not steps:
        if profile.get("status") == "timeout":
            limit = options.timeout if options.timeout is not None else options.budget
            option = "--timeout" if options.timeout is not None else "--budget"
            seconds = [s.get("seconds") for s in profile.get("steps") or [] if s.get("seconds")]
            slow = ""
            if seconds:
                # Slow steps (an LBFGS closure, a large model on a CPU): fewer of them do.
                each = sorted(seconds)[len(seconds) // 2]
                slow = (f"; its steps took {each:.1f} s each and it needs --warmup {options.warmup} + --steps "
                        f"{options.steps or DEFAULT_STEPS} of them: lower those (e.g. --warmup 2 --steps 3)")
            raise TorchaxeError(f"the profiled run of the unchanged script reached no measured step within its "
                                f"{limit:g} s ({option}, which bounds the first run too): give a larger {option}"
                                + slow)
        seen = len(profile.get("steps") or [])
        if seen:
            raise TorchaxeError(
                f"the script ended after {seen} training step(s); advise needs --warmup {options.warmup} + --steps "
                f"{options.steps or DEFAULT_STEPS}: lower them, or make the script run longer")
        # The harness says why (no optimizer, gradients never cleared, a marker never called).
        seen = next((w for w in profile.get("warnings") or [] if w.startswith(("no step was seen: ",
                                                                               "no step was seen in this process: "))),
                    None)
        reason = seen.partition(": ")[2] if seen else (
            "no optimizer.step() and no backward pass after an update were seen; if one call of a function of "
            "yours is one training step, pass --step-marker MODULE:FUNCTION naming it")
        within = ""
        if profile.get("status") == "stopped" and options.first_step_timeout:
            within = f" within {options.first_step_timeout:g} s of the start of training (--first-step-timeout)"
        raise TorchaxeError(f"no training step was detected{within}: {reason}")


def plot_data(profile: dict[str, Any]) -> dict[str, Any]:
    """What the report plots: the step-time breakdown, data wait per step, top ops."""
    steps = [s for s in profile.get("steps") or [] if s.get("phase") == "measured"]
    summary = profile.get("summary") or {}
    step = summary.get("step_seconds_median") or 0.0
    wait = summary.get("data_wait_seconds_median") or 0.0
    backward = summary.get("backward_seconds_median") or 0.0
    gc_time = summary.get("gc_seconds_per_step") or 0.0
    rest = max(step - wait - backward - gc_time, 0.0)
    ops = sorted(profile.get("ops") or [], key=lambda o: -(o.get("self_seconds") or 0))[:10]
    n_ops_steps = max(len(profile.get("ops_steps") or []), 1)
    return {
        "breakdown": {"data_wait": wait, "forward_and_rest": rest, "backward": backward, "gc": gc_time},
        "data_wait_per_step": [s.get("data_wait_seconds") or 0.0 for s in steps],
        "step_seconds": [s.get("seconds") or 0.0 for s in steps],
        "top_ops": [{"name": o["name"], "seconds_per_step": (o.get("self_seconds") or 0.0) / n_ops_steps,
                     "calls_per_step": (o.get("calls") or 0) / n_ops_steps} for o in ops],
        "static_shapes": (profile.get("shapes") or {}).get("static"),
    }
