"""Trials: run the user's script under several knob sets, interleaved, and compare.

``run_trials(knob_sets, command, TrialOptions(...))`` runs, for each of ``repeats``
rounds, every knob set once in the order given (A B C A B C ...), each in a fresh
subprocess through the bootstrap (``python -m torchaxe.runtime.bootstrap``), which
applies the knobs and records warmup + ``steps`` steps with the harness. Interleaving
spreads slow drifts of the machine (other work, thermal state) over all sets alike.
``interleave`` is that loop, shared by every caller that compares runs (advise, data
tuning, ``shapes --try``).

Per knob set the result keeps every measured step time (raw samples, by repeat) and
gives their median, p90 and spread; the **ratio** to the first knob set (the
baseline) is computed per repeat, from the two runs of that round (each by its steps'
mean less the fastest and slowest tenth: ``TrialRun.typical``), and quoted as the
median of those ratios with their min..max. A ratio below 1 means
faster steps than the baseline.

A knob set whose run breaks (the script raises, exits non-zero, times out, or no step
is seen) is marked failed with a one-line error and the tail of its stderr, and is not
run again; the other sets go on. The run itself is injectable (``runner``), so tests
of the bookkeeping need no subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from torchaxe.errors import TorchaxeError
from torchaxe.runtime import ranks
from torchaxe.runtime.knobs import KnobSet
from torchaxe.runtime.other_load import OtherLoad, OtherLoadWatch
from torchaxe.runtime.process import run_tree
from torchaxe.runtime.ranks import rank_files
from torchaxe.runtime.torchrun import torchrun_failure
from torchaxe.runtime.stats import Samples
from torchaxe.units import duration

SCHEMA = "torchaxe.trial/1"
#: The share of a run's measured steps set aside at each end (the fastest, the
#: slowest) before their mean is taken to compare it with another run.
TRIM = 0.1
#: Lines of a failed run's stderr kept in the report.
STDERR_TAIL_LINES = 15
#: Beyond ``--timeout``, how long the subprocess gets (start-up, writing the profile)
#: before it is killed.
KILL_GRACE_SECONDS = 20.0


@dataclass(frozen=True)
class TrialOptions:
    repeats: int = 3
    steps: int = 10
    warmup: int = 2
    #: Per run, counted by the harness from the start of the script.
    timeout: float | None = None
    target: str = "auto"
    #: ``MODULE:FUNCTION`` that ends a step, for loops without a torch.optim optimizer.
    step_marker: str | None = None
    #: Stop a run that shows no step this long after training started (None: never).
    first_step_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise TorchaxeError(f"--repeats {self.repeats}: must be at least 1")
        if self.steps < 1:
            raise TorchaxeError(f"--steps {self.steps}: must be at least 1")
        if self.warmup < 0:
            raise TorchaxeError(f"--warmup {self.warmup}: must be 0 or more")
        if self.timeout is not None and self.timeout <= 0:
            raise TorchaxeError(f"--timeout {self.timeout}: must be a positive number of seconds")

    def to_dict(self) -> dict[str, Any]:
        return {"repeats": self.repeats, "steps": self.steps, "warmup": self.warmup, "timeout": self.timeout,
                "target": self.target, "step_marker": self.step_marker}


@dataclass
class TrialRun:
    """One run of one knob set: its measured step times, or why it failed."""

    knobs: str
    repeat: int
    ok: bool
    step_seconds: list[float] = field(default_factory=list)
    status: str | None = None  # the profile's status, when a profile was written
    returncode: int | None = None
    seconds: float | None = None  # wall time of the subprocess
    error: str | None = None
    stderr_tail: str = ""
    applied: dict[str, Any] | None = None  # run.options.knobs of the profile
    #: Per measured step, time blocked on the DataLoader (same order as step_seconds).
    data_wait_seconds: list[float] = field(default_factory=list)
    #: Per measured step, host time in optimizers' ``step()`` (None: none stepped).
    optimizer_seconds: list[float | None] = field(default_factory=list)
    #: The run's peak memory: the device allocator's peak where the run had a device
    #: (``memory_kind`` ``device``), else the process's peak resident set (``host_rss``).
    peak_memory_bytes: int | None = None
    memory_kind: str | None = None
    #: A run under torchrun: each rank's own figures (runtime/ranks.py ``rank_row``),
    #: where the job's step is the slowest rank's.
    ranks: list[dict[str, Any]] | None = None
    #: Turns the run was given, side by side with others (runtime/turns.py); None: alone.
    turns: int | None = None
    #: The wall time of its warm-up steps (the first rank's), where a change that
    #: compiles pays its compilation; None when the run had none.
    warmup_seconds: float | None = None
    #: How busy other processes kept the run's cores (None: not watched).
    other_load: OtherLoad | None = None

    @property
    def median(self) -> float | None:
        return Samples.of(self.step_seconds).median

    @property
    def samples_scale(self) -> float:
        """How many times the original's samples one step of this run processed: a
        knob that enlarged the batch notes it (``samples_scale`` among what it applied)."""
        scale = (self.applied or {}).get("samples_scale")
        return float(scale) if isinstance(scale, (int, float)) and scale > 0 else 1.0

    @property
    def typical(self) -> float | None:
        """The step time runs are compared by: the mean of the measured steps less the
        fastest and the slowest tenth (:data:`TRIM`). Not the median: where steps
        alternate, fast ones between ones that wait (a loader's workers delivering
        batches in bursts), the median lands on one kind and says nothing of the time
        the run takes; a rare spike is still set aside."""
        return Samples.of(self.step_seconds).trimmed_mean(TRIM)

    @property
    def typical_per_sample_unit(self) -> float | None:
        """:attr:`typical` per original batch of samples (itself when the batch was
        not changed): what runs with different batch sizes compare by."""
        typical = self.typical
        return None if typical is None else typical / self.samples_scale

    def to_dict(self) -> dict[str, Any]:
        return {"repeat": self.repeat, "ok": self.ok, "status": self.status, "returncode": self.returncode,
                "seconds": self.seconds, "median_step_seconds": self.median, "step_seconds": list(self.step_seconds),
                "error": self.error, "stderr_tail": self.stderr_tail or None, "applied": self.applied,
                "peak_memory_bytes": self.peak_memory_bytes, "memory_kind": self.memory_kind,
                "ranks": self.ranks, "turns": self.turns,
                "other_load": self.other_load.to_dict() if self.other_load is not None else None}


@dataclass
class Ratio:
    """Step-time ratio to the baseline, one value per repeat that both completed."""

    per_repeat: list[float]

    @property
    def samples(self) -> Samples:
        return Samples.of(self.per_repeat)

    def to_dict(self) -> dict[str, Any]:
        s = self.samples
        return {"median": s.median, "min": s.min, "max": s.max, "per_repeat": list(self.per_repeat)}


@dataclass
class KnobResult:
    knobs: KnobSet
    runs: list[TrialRun] = field(default_factory=list)
    ratio: Ratio | None = None

    @property
    def name(self) -> str:
        return self.knobs.name

    @property
    def failed_run(self) -> TrialRun | None:
        return next((r for r in self.runs if not r.ok), None)

    @property
    def ok(self) -> bool:
        return self.failed_run is None and bool(self.runs)

    @property
    def samples(self) -> Samples:
        return Samples.of(s for r in self.runs if r.ok for s in r.step_seconds)

    def to_dict(self) -> dict[str, Any]:
        s = self.samples
        failed = self.failed_run
        return {
            "name": self.name,
            "file": self.knobs.source,
            "knobs": self.knobs.to_dict(),
            "status": "ok" if self.ok else "failed",
            "error": failed.error if failed else None,
            "stderr_tail": failed.stderr_tail if failed else None,
            "step_seconds": {"median": s.median, "p90": s.p90, "min": s.min, "max": s.max,
                             "spread": s.relative_spread, "samples": len(s), "noisy": s.is_noisy()},
            "ratio": self.ratio.to_dict() if self.ratio is not None else None,
            "runs": [r.to_dict() for r in self.runs],
        }


@dataclass
class TrialReport:
    command: list[str]
    options: TrialOptions
    results: list[KnobResult]

    @property
    def baseline(self) -> KnobResult:
        return self.results[0]

    @property
    def failed(self) -> list[KnobResult]:
        return [r for r in self.results if not r.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "command": list(self.command), "options": self.options.to_dict(),
                "baseline": self.baseline.name, "knob_sets": [r.to_dict() for r in self.results]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


Runner = Callable[[KnobSet, Sequence[str], TrialOptions, int], TrialRun]


def unique_names(knob_sets: Sequence[KnobSet]) -> list[KnobSet]:
    """The same names twice (an A/A comparison of one file) get ``-2``, ``-3`` suffixes."""
    from dataclasses import replace

    seen: dict[str, int] = {}
    out = []
    for k in knob_sets:
        count = seen.get(k.name, 0) + 1
        seen[k.name] = count
        out.append(k if count == 1 else replace(k, name=f"{k.name}-{count}"))
    return out


Arm = TypeVar("Arm")


def interleave(arms: Sequence[Arm] | Callable[[int], Sequence[Arm]], run: Callable[[Arm, int], object],
               failed: Callable[[Arm], bool], *, rounds: int | None = None, first: int = 1,
               required: Sequence[Arm] = (), reserve: int = 0,
               stop: Callable[[int, int], bool] | None = None,
               together: Callable[[list[Arm], int], object] | None = None) -> bool:
    """The one measuring loop: interleaved rounds, A B C A B C ..., so that slow drifts
    of the machine fall on every arm alike. In each round every arm runs once, in the
    order given, through ``run(arm, repeat)``, which makes and records one run; an arm
    that has ``failed`` is not run again.

    ``arms``: the same every round, or a function of the round's repeat number giving
    that round's arms (none: the measuring ends). ``rounds``: how many (None: until
    ``arms`` gives none); ``first``: the repeat number of the first. ``required``: the
    arms the others are compared with: when one fails, the measuring ends there.
    ``stop(repeat, runs)``, the budget's hook: asked before each round with the runs it
    would make plus ``reserve`` (runs that must still fit afterwards); True ends the
    measuring. Returns False when ``stop`` ended it, else True; what ``run`` raises (a
    deadline passed) ends it too, with the runs so far kept. ``together(arms,
    repeat)``: instead of ``run``, makes and records the round's runs of every arm
    that has not failed at once (runs side by side that take turns, runtime/turns.py)."""
    needed = {id(a) for a in required}
    repeat = first
    while rounds is None or repeat < first + rounds:
        planned = list(arms(repeat) if callable(arms) else arms)
        if not planned:
            return True
        if stop is not None and stop(repeat, sum(not failed(a) for a in planned) + reserve):
            return False
        if together is not None:
            together([a for a in planned if not failed(a)], repeat)
            if any(id(a) in needed and failed(a) for a in planned):
                return True
            repeat += 1
            continue
        for arm in planned:
            if not failed(arm):
                run(arm, repeat)
            if id(arm) in needed and failed(arm):
                return True  # nothing left to compare the others with
        repeat += 1
    return True


def run_trials(knob_sets: Sequence[KnobSet], command: Sequence[str], options: TrialOptions | None = None, *,
               runner: Runner | None = None, progress: Callable[[str], None] = lambda line: None,
               turn_steps: int | None = None, turns: Callable[..., list[TrialRun]] | None = None) -> TrialReport:
    """Run every knob set ``options.repeats`` times, interleaved, and compare them.
    ``turn_steps``: each round's runs side by side, taking turns of that many
    measured steps (runtime/turns.py; ``turns`` stands in for its runner in tests)."""
    options = options or TrialOptions()
    if not knob_sets:
        raise TorchaxeError("no knob sets: give at least one --knobs FILE")
    runner = runner or run_in_subprocess
    results = [KnobResult(k) for k in unique_names(knob_sets)]

    def report(result: KnobResult, run: TrialRun, repeat: int) -> None:
        run.knobs = result.name
        result.runs.append(run)
        if run.ok:
            progress(f"repeat {repeat}/{options.repeats}: {result.name}: median step "
                     f"{duration(run.median, 2)} over {len(run.step_seconds)} steps")
        else:
            progress(f"repeat {repeat}/{options.repeats}: {result.name}: FAILED: {run.error}")

    def measure(result: KnobResult, repeat: int) -> None:
        progress(f"repeat {repeat}/{options.repeats}: {result.name} ...")
        report(result, runner(result.knobs, command, options, repeat), repeat)

    together: Callable[[list[KnobResult], int], None] | None = None
    if turn_steps is not None:
        from torchaxe.runtime.turns import run_in_turns

        side_by_side = turns or run_in_turns

        def in_turns(round_results: list[KnobResult], repeat: int) -> None:
            progress(f"repeat {repeat}/{options.repeats}: {len(round_results)} runs side by side, taking turns ...")
            shift = repeat % max(len(round_results), 1)  # who goes first rotates
            order = round_results[shift:] + round_results[:shift]
            runs = side_by_side([r.knobs for r in order], command, options, repeat, turn_steps=turn_steps)
            for result, run in sorted(zip(order, runs), key=lambda pair: results.index(pair[0])):
                report(result, run, repeat)

        together = in_turns

    # A set broken once is not run again; the others go on, the baseline's failure included.
    interleave(results, measure, lambda result: result.failed_run is not None, rounds=options.repeats,
               together=together)
    _ratios(results)
    return TrialReport(list(command), options, results)


def _ratios(results: list[KnobResult]) -> None:
    baseline = results[0]
    by_repeat = {r.repeat: r.typical for r in baseline.runs if r.ok and r.typical}
    for result in results:
        if not result.ok:
            continue
        ratios = [run.typical / by_repeat[run.repeat] for run in result.runs
                  if run.ok and run.typical is not None and by_repeat.get(run.repeat)]
        result.ratio = Ratio(ratios) if ratios else None


# ------------------------------------------------------------------ the subprocess


def bootstrap_argv(knobs_path: str, profile_path: str, command: Sequence[str], options: TrialOptions) -> list[str]:
    """The command line of one run: the documented bootstrap, then the user's command;
    for a torchrun job, torchrun with the bootstrap in front of every rank's script
    (each rank then writes ``PROFILE.rankN.json``)."""
    from torchaxe.runtime.torchrun import parse_job

    args = [knobs_path, "--out", profile_path, "--steps", str(options.steps), "--warmup", str(options.warmup),
            "--target", options.target]
    if options.timeout is not None:
        args += ["--timeout", repr(options.timeout)]
    if options.step_marker:
        args += ["--step-marker", options.step_marker]
    if options.first_step_timeout is not None:
        args += ["--first-step-timeout", repr(options.first_step_timeout)]
    return parse_job(command).launch(["torchaxe.runtime.bootstrap", *args])


def child_environment(knobs: KnobSet, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run: ours with the knob's variables (so they are there
    from the interpreter's first instruction, before any import)."""
    env = dict(os.environ if base is None else base)
    for var, value in knobs.env.items():
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    return env


@dataclass
class Launched:
    """What one run through the bootstrap left: its exit code, whether it was killed
    for its limit, its stderr, the profile path it was given (ranks write
    ``PROFILE.rankN.json``), and what follower nodes reported failing."""

    returncode: int
    killed: bool
    seconds: float
    stderr: str
    profile_path: Path
    context_path: Path | None = None
    problems: list[str] = field(default_factory=list)
    #: How busy other processes kept the cores meanwhile (None: not watched).
    other_load: OtherLoad | None = None


def launch_bootstrap(knobs: KnobSet, command: Sequence[str], options: TrialOptions, folder: Path, *,
                     extra: Sequence[str] = (), context: bool = False, limit: float | None = None,
                     env: dict[str, str] | None = None, guard: Path | None = None) -> Launched:
    """Run the command once under ``knobs`` through the bootstrap, with its files in
    ``folder``; the files the script writes are put back afterwards. A torchrun job's
    ranks each write their profile; when the job spans nodes (``runtime/nodes.py``),
    the followers run it too and their ranks' profiles are gathered into ``folder``.
    ``guard``: the write guard's folder shared with runs made at the same time (see
    :func:`runtime.turns.run_in_turns`), whose caller puts the files back once they
    have all ended; by default the run's own, restored when it ends."""
    from dataclasses import asdict

    from torchaxe.runtime import nodes
    from torchaxe.runtime.protect import restore

    knobs_path = folder / "knobs.json"
    knobs_path.write_text(json.dumps(knobs.to_dict()), encoding="utf-8")
    profile_path = folder / "profile.json"
    stderr_path = folder / "stderr.txt"
    context_path = folder / "context.json" if context else None
    shared = guard is not None
    guard = guard if guard is not None else folder / "writes"
    argv = bootstrap_argv(str(knobs_path), str(profile_path), command, options)
    cut = argv.index("--")
    added = [*extra, "--protect-writes", str(guard)] + (["--context-out", str(context_path)] if context else [])
    argv = [*argv[:cut], *added, *argv[cut:]]
    if limit is None and options.timeout is not None:
        limit = options.timeout + KILL_GRACE_SECONDS
    leader = nodes.active()
    number = leader.announce({"knobs": knobs.to_dict(), "options": asdict(options), "extra": list(extra),
                              "context": context, "limit": limit}) if leader is not None else None
    started = time.perf_counter()
    watch = OtherLoadWatch().start()
    try:
        with open(stderr_path, "wb") as err:
            returncode, killed = run_tree(argv, env={**child_environment(knobs), **(env or {})},
                                          stdout=subprocess.DEVNULL, stderr=err,
                                          limit=limit)
    finally:
        other_load = watch.stop()
    seconds = time.perf_counter() - started
    if not shared:
        restore(guard)  # the files the script wrote, as they were before this run
    problems: list[str] = []
    if leader is not None and number is not None:
        problems = leader.collect(number, profile_path, (limit or 600.0) + nodes.RESULT_GRACE_SECONDS)
    stderr = stderr_path.read_text(encoding="utf-8", errors="replace")
    return Launched(returncode, killed, seconds, stderr, profile_path, context_path, problems, other_load)


def follower_run(message: dict[str, Any], command: Sequence[str]) -> dict[str, Any]:
    """A follower node's part of one run the leader posted: the same bootstrap, its
    local ranks' profiles returned as text (runtime/nodes.py)."""
    from torchaxe.runtime.knobs import knob_set_from_dict

    knobs = knob_set_from_dict(message["knobs"], "the leader's knob set")
    options = TrialOptions(**message["options"])
    with tempfile.TemporaryDirectory(prefix="torchaxe-follow-") as tmp:
        done = launch_bootstrap(knobs, command, options, Path(tmp), extra=message.get("extra") or (),
                                context=bool(message.get("context")), limit=message.get("limit"))
        profiles = {str(rank): path.read_text(encoding="utf-8") for rank, path in rank_files(done.profile_path).items()}
    tail = "\n".join(done.stderr.rstrip().splitlines()[-STDERR_TAIL_LINES:])
    return {"profiles": profiles, "returncode": done.returncode, "killed": done.killed,
            "error": torchrun_failure(done.stderr) or _last_error_line(tail)}


def run_in_subprocess(knobs: KnobSet, command: Sequence[str], options: TrialOptions, repeat: int,
                      env: dict[str, str] | None = None, guard: Path | None = None) -> TrialRun:
    """Run the command once under ``knobs`` through the bootstrap (``env``: variables
    added to the run's environment; ``guard``: a write guard shared with other runs,
    see :func:`launch_bootstrap`); the script's stdout is discarded, its stderr kept
    for the error report."""
    with tempfile.TemporaryDirectory(prefix="torchaxe-trial-") as tmp:
        done = launch_bootstrap(knobs, command, options, Path(tmp), env=env, guard=guard)
        returncode, killed, stderr_text = done.returncode, done.killed, done.stderr
        tail = "\n".join(stderr_text.rstrip().splitlines()[-STDERR_TAIL_LINES:])
        run = TrialRun(knobs=knobs.name, repeat=repeat, ok=False, returncode=returncode, seconds=done.seconds,
                       other_load=done.other_load)
        profiles = ranks.load_ranks(done.profile_path)
    distributed = len(profiles) > 1 or any(p.run.world_size and p.run.world_size > 1 for p in profiles.values())
    profile = ranks.first_rank(profiles)
    failed = ranks.failed_rank(profiles)
    root = torchrun_failure(stderr_text) if distributed or not profiles else None
    culprit = ranks.root_cause_rank(root)
    if culprit is not None and culprit not in profiles:
        failed = None  # the rank torchrun saw fail first wrote nothing: its failure, not a peer's, is the error
    elif culprit is not None and ranks.failed_rank({culprit: profiles[culprit]}) is not None:
        failed = (culprit, profiles[culprit])
    if failed is not None:
        profile = failed[1]
    if profile is not None:
        job = ranks.job_steps(profiles)
        run.status = profile.status
        run.applied = ranks.first_rank(profiles).run.options.get("knobs")
        run.step_seconds = job.seconds
        run.data_wait_seconds = job.data_wait_seconds
        run.optimizer_seconds = job.optimizer_seconds
        warmup = [step.seconds for step in profile.steps if step.phase == "warmup"]
        run.warmup_seconds = sum(warmup) if warmup else None
        peaks = [peak_memory(p) for p in profiles.values()]
        peaks = [p for p in peaks if p[0] is not None]
        run.peak_memory_bytes, run.memory_kind = max(peaks) if peaks else (None, None)
        if distributed:
            run.ranks = ranks.rank_rows(profiles)
    who = f"rank {failed[0]}: " if failed is not None and distributed else ""
    missing = ranks.missing_local_ranks(profiles) if distributed else []
    if killed:
        run.error = f"timeout: killed {KILL_GRACE_SECONDS:g} s after --timeout {options.timeout:g} s"
    elif profile is None:
        run.error = root or _last_error_line(tail) or f"the run exited with code {returncode} without writing a profile"
    elif failed is not None or (profile.status == "exited" and profile.exit_code):
        run.error = f"{who}{profile.status}: {profile.detail}"
    elif root is not None and returncode != 0:
        run.error = root
    elif missing:
        run.error = (f"local rank {missing[0]} wrote no profile (it died or was killed): "
                     f"{_last_error_line(tail) or f'torchrun exited with code {returncode}'}")
    elif not run.step_seconds:
        run.error = f"no measured steps: {profile.detail}" + (f" ({profile.warnings[0]})" if profile.warnings else "")
    elif returncode != 0:
        run.error = f"the run exited with code {returncode}: {profile.detail}"
    else:
        run.ok = True
    if not run.ok:
        run.stderr_tail = tail
        if done.problems:
            run.error = f"{run.error}; {'; '.join(done.problems)}"
    return run


def peak_memory(profile: Any) -> tuple[int | None, str | None]:
    """A profile's peak memory and its kind: the device allocator's peak where the run
    had a device, else the peak resident set of the process; (None, None) when neither
    was recorded."""
    summary = profile.summary
    if summary.peak_device_memory_bytes is not None:
        return summary.peak_device_memory_bytes, "device"
    if summary.host_rss_peak_bytes is not None:
        return summary.host_rss_peak_bytes, "host_rss"
    return None, None


def _last_error_line(tail: str) -> str | None:
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower():
            return line
    return lines[-1] if lines else None
