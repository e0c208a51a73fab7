"""``torchaxe advise``: scan, profile, check, measure, rank.

1. **Profile** the unchanged script for a few steps in a subprocess (op times with
   the user lines they came from, shapes, data wait; the files it imported and the
   settings it left on) (baseline.py).
2. **Scan** the user's code: the script's folder and the files of its project
   (``scan.discover.project_root``) the run imported outside it; apart, the installed
   third-party files the run imported.
3. **Check** the environment (torchaxe/environment/checks.py).
4. **Candidates**: a code candidate per rule with an automatic fix in the user's
   code, a ``replace`` knob candidate per formula an installed package computes by hand
   (never edited: swapped at run time), knob candidates from what the profile showed
   (candidates.py), settings kept in the knowledge base.
5. **Measure** every candidate alone against the original, interleaved, within the
   budget (measure.py, judged by stats.py); then **search** among them: the chosen
   ones together, each left out, the near misses on top (search.py).
6. **Rank** by measured time saved per step, the accuracy cost beside each.

Everything that takes time reports progress; Ctrl-C stops the measuring and the
advice made of what was measured so far is returned, marked partial.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from torchaxe.advise.arms import ArmKnobs
from torchaxe.advise.baseline import (DEFAULT_STEPS, MEASURE_WINDOW, TURNS_MEASURE_WINDOW, BaselineProfile,
                                      ProfileRunner, check_profile, plot_data, profile_in_subprocess)
from torchaxe.advise.candidates import (OPTIMIZER_RULES, Candidate, code_candidates, installed_candidates,
                                        knob_candidates, run_by_the_job, script_speedups, stored_candidates)
from torchaxe.advise.evidence import micro_benchmarks
from torchaxe.advise.measure import AGAIN, ArmResult, Measurer, TogetherRunner, first_compile_runs
from torchaxe.advise.options import AdviseOptions
from torchaxe.advise.recommendation import Accuracy, Advice, Recommendation
from torchaxe.advise.search import LOSS_JUDGED_AXES, ChangeSearch
from torchaxe.advise.stats import (DECIDE_ROUNDS, MAX_ROUNDS, Noise, loss_delta, loss_noise, measured_figures,
                                   one_time_cost, own_runs_noise, promising, seed_dependent)
from torchaxe.environment.checks import environment_checks
from torchaxe.errors import TorchaxeError
from torchaxe.findings import Finding
from torchaxe.memory.candidates import profile_peak
from torchaxe.runtime import ranks
from torchaxe.runtime.candidate import MEMORY_KINDS, Memory
from torchaxe.runtime.job_command import batches_per_step, job_epochs_in, job_steps_in, job_steps_of_epochs
from torchaxe.runtime.knobs import KnobSet, knob_set_from_dict, pays_once
from torchaxe.runtime.load import busy, busy_text, load_average
from torchaxe.runtime.other_load import OtherLoad, busy_note
from torchaxe.runtime.trials import Runner, TrialOptions, TrialRun, run_in_subprocess
from torchaxe.runtime.stats import Samples
from torchaxe.runtime.turns import TurnsRunner, run_in_turns, steps_per_turn
from torchaxe.shapes.candidates import training_epoch
from torchaxe.units import bytes_text, counted, plural


def scan_for_advice(folder: Path, project: Path, imported: Sequence[str], scan_installed: bool, target: str,
                    progress: Callable[[str], None]):
    """Findings in the user's code (the script's folder and the project files the run
    imported outside it) and, apart, in the installed files the run imported (None
    when not scanned); and how many project files outside the folder were scanned."""
    from torchaxe.scan.discover import in_project
    from torchaxe.scan.engine import ScanOptions, scan_paths

    options = ScanOptions(target=target)
    prefix = str(folder).rstrip(os.sep) + os.sep
    outside = [p for p in imported if not p.startswith(prefix) and os.path.isfile(p)]
    mine = [p for p in outside if in_project(p, project)]
    progress(f"scanning {folder}" + (f" and {len(mine)} imported files of the project {project}" if mine else ""))
    own = scan_paths([folder, *mine], options)
    installed = [p for p in outside if p not in mine] if scan_installed else []
    extra = None
    if installed:
        progress(f"scanning {len(installed)} imported files of installed packages")
        extra = scan_paths(installed, options)
    return own, extra, len(mine)


#: The share of the memory available that runs side by side may take.
TURNS_MEMORY_SHARE = 0.6
#: The original's loss noise above which the accuracy check is said to judge little
#: (a change must then move the loss by more than this and the tolerance to be seen).
LOUD_LOSS_NOISE = 0.05
#: The original's own runs (same seed) this far apart in loss: the script draws its
#: random numbers unseeded, and a note says so.
UNSEEDED_LOSS_NOISE = 0.005


#: The knobs that change only DDP's communication (a compression hook, the bucket size,
#: the static graph's bucket order, views into the buckets, the buffers' broadcast):
#: their saving is bounded by its time (find_unused_parameters=False also saves a
#: graph traversal on the host, and is not).
DDP_COMM_KNOBS = ("knob:ddp-comm-", "knob:ddp-bucket-cap-", "knob:ddp-static-graph", "knob:ddp-bucket-view",
                  "knob:ddp-broadcast-buffers-false")
#: The changes that make optimizers' ``step()`` faster (a fused or foreach
#: implementation): their saving is bounded by the time in ``step()``, where that time
#: is the optimizer's whole cost (the cpu: on a device the host only launches kernels).
#: Rules whose findings in the user's code count only where a training step ran them.
_RAN_CODE_RULES = ("AX1", "AX203", "AX205")
OPTIMIZER_KNOBS = ("knob:fused-optimizer",) + tuple(f"code:{code}" for code in OPTIMIZER_RULES)
#: The loader changes (worker processes): bounded by the time the step waited for data
#: (not when they pin memory, which speeds up the copy to the device after the wait).
LOADER_KNOBS = ("knob:dataloader",)
#: How far a bounded change's measured saving may exceed the time of what it changes a
#: step (times, plus seconds) before it is taken for noise: the exchange's overlap with
#: backward, host-side work around the part timed, leave some room.
SAVING_MARGIN = 1.5
SAVING_SLACK = 0.002
#: What a change the budget's fit left out says at the end of its detail.
OUT_OF_BUDGET = "(not measured: out of --budget)"
#: The most of a step a change that pays once (a first compile) is expected to save
#: before measuring: a guessed one-time cost the job's steps would not pay back even at
#: this saving puts the change last in the budget's order.
LIKELY_MOST_SAVED = 0.5
#: A note says so when passes without gradients (evaluation inside the step) take at
#: least this share of the step time.
NO_GRAD_NOTE_SHARE = 0.2


def _counts_optimizer_steps(path: str) -> bool:
    """Whether ``path`` is the trainer module of a framework whose ``max_steps``
    counts optimizer steps, however many batches each accumulates."""
    path = path.replace(os.sep, "/")
    return path.endswith("/transformers/trainer.py") or "/lightning/pytorch/trainer/" in path \
        or "/pytorch_lightning/trainer/" in path


class Advisor:
    """One ``advise`` run, phase by phase: baseline, candidates, each measured alone,
    the search over them, the advice. Collaborators are injectable for tests:
    ``runner`` runs one trial, ``profiler`` the first profiled run, ``clock`` keeps
    the budget."""

    def __init__(self, command: Sequence[str], options: AdviseOptions, *,
                 progress: Callable[[str], None] = lambda line: None, runner: Runner | None = None,
                 profiler: ProfileRunner | None = None, clock: Callable[[], float] = time.monotonic,
                 turns: TurnsRunner | None = None, load: Callable[[], float | None] | None = None) -> None:
        from torchaxe.backends import resolve_target
        from torchaxe.runtime.command import check_module
        from torchaxe.runtime.torchrun import parse_script

        self.command = list(command)
        self.job, self.script = parse_script(command)
        check_module(self.script)
        stated = job_steps_in(self.command) if options.job_steps is None else None
        #: The job's length as the command states it in steps (``--steps 300``), if so.
        self.stated_steps = stated
        #: Where the job's length in steps came from, as the advice names it.
        self.job_source = "--job-steps"
        if stated is not None:
            # The command says how long the job is: a compile that it never pays back
            # is held back as with --job-steps.
            options = replace(options, job_steps=stated[0])
            self.job_source = f"read from the command: {stated[1]}"
        self.options = options
        self.target = resolve_target(options.target)
        self.progress = progress
        self.runner = runner or run_in_subprocess
        #: Runs a round side by side taking turns (a given runner alone: one by one).
        self.turns = turns if turns is not None else (run_in_turns if runner is None else None)
        self.profiler = profiler or profile_in_subprocess
        self.clock = clock
        self.started = clock()
        self._mark = self.started
        #: The note that the budget did not reach the changes measured last, and their keys.
        self._late_note: tuple[str | None, list[str]] = (None, [])
        #: The machine's 1-minute load average (None: unknown); the runs a busy machine
        #: makes are slowed unevenly, which advise says.
        self.load = load if load is not None else load_average
        self.cores: int | None = None
        #: How busy other processes kept the cores, run by run (the profiled run first).
        self.other_loads: list[OtherLoad | None] = []
        self.deadline = self.started + options.budget
        self.workdir = Path(tempfile.mkdtemp(prefix="torchaxe-advise-"))
        #: How far apart two runs of the unchanged script landed (the A/A arm).
        self.noise = Noise()
        #: Measured steps per trial run (``options.steps``, or chosen after the profile).
        self.steps = options.steps or DEFAULT_STEPS
        #: Median wall seconds of a trial run, by the change it made.
        self.run_seconds: dict[str, float] = {}
        #: The knob set of every arm, on top of the run table (see _against_run_knobs).
        self.arms = ArmKnobs(self.workdir, self.target, options.check_accuracy)
        self.advice = Advice(command=self.command, target=self.target, budget_seconds=options.budget,
                             repeats=options.repeats, memory_limit=options.memory_limit)
        if stated is not None:
            self.advice.notes.append(f"the job's length is read from the command ({stated[1]}): a change whose "
                                     f"one-time cost is not paid back within {stated[0]:,} steps is held back "
                                     "(--job-steps N says otherwise)")

    # ------------------------------------------------------------------ phases

    def run(self) -> Advice:
        try:
            self._run()
        except KeyboardInterrupt:
            self.advice.partial = True
            self.advice.notes.append("interrupted (Ctrl-C): the advice holds what was measured until then")
        finally:
            self._lap("measuring")
            self.advice.elapsed_seconds = self.clock() - self.started
            if self.options.job_steps is not None:
                self.advice.job = {"steps": self.options.job_steps, "source": self.job_source}
            shutil.rmtree(self.workdir, ignore_errors=True)
            self._busy_note()
        return self.advice

    def _lap(self, phase: str) -> None:
        """The time since the last lap, put down to ``phase`` (the report says where a
        --budget went)."""
        now = self.clock()
        if now > self._mark:
            self.advice.phases[phase] = self.advice.phases.get(phase, 0.0) + (now - self._mark)
        self._mark = now

    def _busy_note(self) -> None:
        """A note when other processes kept the machine busy. Where the runs were
        watched, from what the others used during them (runtime/other_load.py); else
        from the load average at the end: the runs (one at a time, each on the cores
        the script may use) load it about one core's worth per core; half again as
        much is someone else's work, which slows runs unevenly."""
        if any(load is not None for load in self.other_loads):
            note = busy_note(self.other_loads)
            if note is not None:
                self.advice.notes.append(note)
            return
        load, cores = self.load(), self.cores or os.cpu_count()
        if load is not None and cores and busy(load, cores):
            self.advice.notes.append(
                f"the machine was busy ({busy_text(load, cores)} at the end): other processes "
                "slow runs unevenly, so the figures are noisier than on a quiet machine; run advise again when it "
                "is quieter to confirm them")

    def _run(self) -> None:
        advice = self.advice
        self.progress("profiling the original script")
        base = self.profiler(self.command, self.options, self.target)
        self.other_loads.append(base.other_load)
        self._lap("profile")
        check_profile(base.profile, self.options)
        summary = base.profile.get("summary") or {}
        step = summary.get("step_seconds_median")
        in_turns = self._takes_turns()
        self.steps = base.steps_per_run(self.options, TURNS_MEASURE_WINDOW if in_turns else MEASURE_WINDOW)
        #: Steps of a turn when the runs of a round take turns; 0 when they go one by one.
        self.turn_steps = steps_per_turn(step, self.steps) if in_turns else 0
        advice.baseline = {"step_seconds_median": step, "data_wait_fraction": summary.get("data_wait_fraction"),
                           "host_syncs_per_step": summary.get("host_syncs_per_step"),
                           "gc_fraction": summary.get("gc_fraction"), "profile_run_seconds": base.seconds,
                           "source": "profiled run (with op recording on some steps)",
                           "steps_per_run": self.steps, "warmup_per_run": self.options.warmup,
                           "steps_per_turn": self.turn_steps or None}
        advice.profile = plot_data(base.profile)
        advice.flops = base.profile.get("flops")
        from torchaxe.runtime.opstats import NO_OP_TABLE

        lost = next((w for w in base.profile.get("warnings") or [] if w.startswith(NO_OP_TABLE)), None)
        if lost is not None:
            # The operators' times decide some candidates (bf16 with a fused attention in
            # float32) and tie findings to their time: without them those are not offered.
            advice.notes.append(f"the profiled run has no op table ({lost.removeprefix(NO_OP_TABLE)}): the "
                                "changes the operators' times decide (bf16 with the fused attention in float32) "
                                "and the time behind each finding are missing; run advise again for them")
        passes, share = summary.get("no_grad_passes_per_step"), summary.get("no_grad_fraction")
        if passes and share is not None and share >= NO_GRAD_NOTE_SHARE:
            advice.notes.append(
                f"each step also runs {passes:.1f} pass(es) without gradients (evaluation or generation under "
                f"no_grad/inference_mode), {100 * share:.0f}% of the step time: every speedup here includes them; "
                "evaluating less often would save more than most changes, and only you can decide it")
        advice.distributed = base.distributed

        from torchaxe.scan.discover import project_of

        folder = self.script.folder
        project = project_of(folder, base.context.get("modules") or [])
        own, extra, project_files = scan_for_advice(folder, project, base.context.get("modules") or [],
                                                    self.options.scan_installed, self.target, self.progress)
        self._lap("scan")
        findings = list(own.findings)
        advice.findings = [f.to_dict() for f in findings]
        advice.scanned = {"folder": str(folder), "project": str(project), "project_files": project_files,
                          "files": own.stats.files_scanned, "installed_files": 0, "installed_findings": []}
        if extra is not None:
            advice.scanned["installed_files"] = extra.stats.files_scanned
            advice.scanned["installed_findings"] = [f.to_dict() for f in extra.findings]

        settings = base.context.get("settings") or {}
        self.cores = settings.get("allowed_cpus")
        self._job_epochs(base.profile, settings, base.context.get("modules") or [])
        checks, env_candidates = environment_checks(settings, base.profile, findings, self.target, folder)
        advice.environment = checks

        imported = {os.path.realpath(p) for p in base.context.get("modules") or []}
        # The script runs as __main__, which is not kept in sys.modules.
        if self.script.kind == "path":
            imported.add(os.path.realpath(self.script.target))
        else:
            stem = Path.cwd().joinpath(*self.script.target.split("."))
            imported.update(os.path.realpath(p) for p in (stem.with_suffix(".py"), stem / "__main__.py"))
        measured_findings = findings
        if base.context.get("modules"):
            # A fix in a file the run never imports cannot change its speed: not measured.
            measured_findings = [f for f in findings if os.path.realpath(f.path) in imported]
            idle = sorted({f.path for f in findings} - {f.path for f in measured_findings})
            if idle:
                advice.notes.append(f"{len(findings) - len(measured_findings)} finding(s) in {len(idle)} file(s) the "
                                    f"run did not import (e.g. {idle[0]}) are listed but not measured")
        measured_findings = self._built_optimizers(measured_findings, base.context)
        measured_findings = self._loaders_with_workers(measured_findings, base.context)
        measured_findings = self._training_loaders(measured_findings, base.context)
        measured_findings, unrun = self._run_in_steps(measured_findings, base.context, settings)
        codes, advice_recs = code_candidates(measured_findings, base.profile, step)
        if unrun:
            unrun_codes, unrun_advice = code_candidates(unrun, base.profile, step)
            for c in unrun_codes:
                c.rec.status = "not_measured"
                c.rec.detail = (c.rec.detail + " " if c.rec.detail else "") + \
                    "(not measured: no training step of this run ran this code)"
            advice_recs += [c.rec for c in unrun_codes] + unrun_advice
        installed, idle = run_by_the_job(extra.findings if extra is not None else [], base.context)
        idle_keys = {(f.path, f.line, f.code) for f in idle}
        for item in advice.scanned.get("installed_findings") or []:
            item["executed"] = (item.get("path"), item.get("line"), item.get("code")) not in idle_keys
        if idle:
            advice.notes.append(
                f"{len(idle)} finding(s) in installed packages are left out: the run did not execute their code "
                f"(no DataLoader built there, or a function the traced training step did not call; e.g. {idle[0].path}:"
                f"{idle[0].line} {idle[0].code})")
        replaced, installed_advice = installed_candidates(installed, base.profile)
        advice_recs += installed_advice
        micro_benchmarks(codes + replaced, self.target, lambda: self.clock() > self.deadline, self.progress)
        self._lap("micro-benchmarks")
        candidates = codes + replaced + knob_candidates(
            self.target, base.profile, settings, memory_limit=self.options.memory_limit,
            allow_batch_change=self.options.allow_batch_change, notes=advice.notes,
            optimizer_fixes=[f for f in findings if f.code in OPTIMIZER_RULES]) + env_candidates
        advice.notes.extend(script_speedups(settings, self.target))
        static = bool((advice.profile or {}).get("static_shapes"))
        candidates += stored_candidates(self.command, static, advice.notes, base.profile)
        candidates = self._against_run_knobs(candidates)
        if self.options.skip:
            skipped = [c for c in candidates if c.key.startswith(self.options.skip)]
            candidates = [c for c in candidates if c not in skipped]
            if skipped:
                advice.notes.append("not tried (--skip): " + ", ".join(c.key for c in skipped))
        advice.recommendations = [c.rec for c in candidates] + advice_recs
        # After `torchaxe apply`, the gain achieved is what a second advise is for:
        # measured first, so that the budget cannot run out before it.
        self._achieved(base)
        if candidates:
            self._measure(candidates, findings, base)
            self._drop_late_note(candidates)
        else:
            advice.notes.append("nothing to measure: no fixable finding and no runtime setting to try")

    def _against_run_knobs(self, candidates: list[Candidate]) -> list[Candidate]:
        """With a ``run`` table in torchaxe.toml (what ``torchaxe run`` applies), every
        change is measured on top of it, against the script under it; a setting the
        table already makes is not tried again."""
        from torchaxe.advise.apply import read_run_knobs

        knobs, source = read_run_knobs(self.script.folder)
        if not knobs:
            return candidates
        try:
            knob_set_from_dict({"name": "run", **knobs}, str(source))
        except TorchaxeError as exc:
            self.advice.notes.append(f"the run table is not valid ({exc}): changes are measured against the script "
                                     "without it")
            return candidates
        self.arms.run_knobs = knobs

        def covered(c: Candidate) -> bool:
            for key, value in c.knobs.items():
                have = knobs.get(key)
                if have is None:
                    continue
                if not isinstance(value, dict) or not isinstance(have, dict) or set(value) & set(have):
                    return True
            return False

        done = [c for c in candidates if c.rec.applies == "knob" and covered(c)]
        if done:
            self.advice.notes.append(f"already set by the run table of {source}, not tried again: "
                                     + ", ".join(c.key for c in done))
        self.advice.notes.append(f"every change is measured on top of the run table of {source} (as `torchaxe run` "
                                 "applies it), against the script under that table")
        self.advice.baseline["run_knobs"] = knobs
        return [c for c in candidates if c not in done]

    def _achieved(self, base: BaselineProfile) -> None:
        """After ``torchaxe apply``: the script as it is now, with its run knobs,
        against the original files kept by apply, interleaved; then, when the budget
        allows, both profiled once to say where the gain came from (where.py)."""
        from torchaxe.advise.apply import kept_originals, read_run_knobs

        key = self.script.target if self.script.kind == "path" else self.script.folder
        originals = kept_originals(key)
        if not originals:
            return
        knobs, _ = read_run_knobs(self.script.folder)
        try:
            now = self.arms.of("applied", knobs)
        except TorchaxeError as exc:
            self.advice.achieved = {"status": "failed", "error": str(exc)}
            return
        before = self.arms.of("original-before-apply", {"sources": originals}, run_knobs=False)
        measurer = self._measurer(base)
        self.progress("measuring the gain achieved: the applied changes against the original files")
        base_arm, (arm,), complete = measurer.compare(before, [now], self.options.repeats, "achieved")
        entry: dict[str, Any] = {"status": "not_measured", "original_files": sorted(originals), "knobs": knobs}
        if base_arm.error or arm.error:
            entry.update(status="failed", error=base_arm.error or arm.error)
        elif arm.ratio:
            entry.update(measured_figures(arm, base_arm))
        if not complete:
            self.advice.partial = True
        self.advice.achieved = entry
        if entry["status"] == "measured":
            from torchaxe.advise.where import explain_gain

            where, note = explain_gain(self.command, self.options, self.target, before, now, self.profiler,
                                       self.deadline - self.clock(), base.seconds, self.progress)
            if where is not None:
                entry["where"] = where
            if note:
                entry["where_note"] = note

    def _takes_turns(self) -> bool:
        """Whether the runs of a round go side by side taking turns (runtime/turns.py):
        asked for, on a cpu, one process on one node."""
        from torchaxe.runtime import nodes

        return bool(self.options.turns and self.turns is not None and self.target == "cpu"
                    and not self.job.distributed and nodes.active() is None)

    def _together_limit(self, base: BaselineProfile) -> int | None:
        """How many runs fit in memory at once: the memory available now over the
        profiled run's peak resident set, with a margin. None when not known."""
        import psutil

        peak = profile_peak(base.profile)
        if peak is None or peak[1] != "host_rss" or peak[0] <= 0:
            return None
        return max(1, int(TURNS_MEMORY_SHARE * psutil.virtual_memory().available // peak[0]))

    def _measurer(self, base: BaselineProfile) -> Measurer:
        """The measuring loop of this advice's trial runs: one by one, or side by
        side taking turns."""
        options = base.trial_options(self.options, self.steps, self.target)
        together: TogetherRunner | None = None
        if self.turn_steps and self.turns is not None:
            turns, command, turn_steps = self.turns, self.command, self.turn_steps
            # About how long a run's measured steps take (the profiled steps were slower:
            # they recorded operators): a round keeps that much for each warm run.
            median = (base.profile.get("summary") or {}).get("step_seconds_median")
            measure = 1.2 * self.steps * median if median else None

            def in_turns(knob_sets: Sequence[KnobSet], repeat: int, bounded: TrialOptions) -> list[TrialRun]:
                # advise's --budget holds for every run of the round, however late it starts
                return turns(knob_sets, command, bounded, repeat, turn_steps=turn_steps, one_deadline=True,
                             measure_seconds=measure)

            together = in_turns

        return Measurer(self.command, options, deadline=self.deadline, runner=self.runner, clock=self.clock,
                        progress=self.progress, together=together, other_loads=self.other_loads,
                        together_limit=self._together_limit(base) if together is not None else None)

    def _drop_late_note(self, candidates: list[Candidate]) -> None:
        """The note that the budget did not reach the changes measured last goes when
        later rounds measured them after all (runs that proved shorter)."""
        note, keys = self._late_note
        if note is None or note not in self.advice.notes:
            return
        status = {c.rec.key: c.rec.status for c in candidates}
        if all(status.get(k) != "not_measured" for k in keys):
            self.advice.notes.remove(note)

    def _measure(self, candidates: list[Candidate], findings, base: BaselineProfile) -> None:
        advice = self.advice
        repeats = self.options.repeats
        measurer = self._measurer(base)
        # Fit the candidates into the budget: each run is about as long as the profiled
        # one; keep room for the combined run (2 arms x repeats).
        per_run = base.expected_run_seconds(self.options.warmup, self.steps)
        left = self.deadline - self.clock()
        # In runs of the original's length a round: one warm-up run first, the A/A arm
        # and the combined run kept in reserve.
        room = (left - per_run) / per_run / repeats - 1 - 2
        ordered = sorted(candidates, key=lambda c: -c.priority)
        ordered, late = self._unlikely_paid_back_last(ordered, per_run, base)

        def cost(c: Candidate) -> float:
            """A change's runs, in rounds: one a round, and a change that compiles pays
            for its first compile once on top (guessed)."""
            return 1.0 + ((first_compile_runs(per_run) - 1.0) / repeats if pays_once(c.rec.knobs or {}) else 0.0)

        # When they all fit, all of them, the most promising first. When not, the most
        # promise for the runs they cost first, each while it fits: a short budget
        # measures several changes of one run a round rather than spend itself on
        # first compiles (a review's accelerate loop: two compiles stopped before their
        # first step, five cheap changes never tried). One change needs a warm-up run,
        # the original and the change at the least: the best is measured whenever that
        # fits.
        chosen: list[Candidate] = []
        if sum(cost(c) for c in ordered) <= room + 1e-9:
            chosen = list(ordered)
        else:
            for c in sorted(ordered, key=lambda c: -c.priority / cost(c)):
                if cost(c) <= room + 1e-9:
                    chosen.append(c)
                    room -= cost(c)
            rank = {id(c): n for n, c in enumerate(ordered)}
            chosen.sort(key=lambda c: rank[id(c)])
        if not chosen and ordered and left >= 3 * per_run:
            # The most promise for its runs whose one round (a warm-up, the original, the
            # change and a first compile where it compiles) ends within the budget: a
            # short budget measures a fix rather than start a compile it cannot finish.
            dense = sorted(ordered, key=lambda c: -c.priority / cost(c))
            chosen = [next((c for c in dense if per_run * (2 + (first_compile_runs(per_run) if pays_once(
                c.rec.knobs or {}) else 1.0)) <= left), dense[0])]
        elif left < 3 * per_run:
            chosen = []
        taken = {id(c) for c in chosen}
        left_late = [c.rec.key for c in ordered if id(c) not in taken and pays_once(c.rec.knobs or {})]
        if late and left_late:
            advice.notes.append(f"{', '.join(left_late)} measured after the other changes, and the --budget did "
                                f"not reach {'them' if len(left_late) > 1 else 'it'}: {late}")
            self._late_note = (advice.notes[-1], left_late)
        for c in ordered:
            if id(c) in taken:
                continue
            c.rec.status = "not_measured"
            c.rec.not_measured_reason = "budget"
            c.rec.detail = (c.rec.detail + " " if c.rec.detail else "") + OUT_OF_BUDGET
        partial_before, fit_note = advice.partial, None
        if len(chosen) < len(ordered):
            advice.partial = True
            # As the fit counts: what went before, the warm-up run, the rounds of every
            # change (first compiles included) with the A/A arm, the combined run.
            needed = (self.clock() - self.started) + per_run * (1 + repeats * (3 + sum(cost(c) for c in ordered)))
            fits = (f"fits {len(chosen)} of {len(ordered)} changes ({len(ordered) - len(chosen)} not measured, "
                    "listed last)" if chosen else
                    f"left after the profile ({max(left, 0):.0f} s) holds no measurement (one change takes three "
                    f"runs: a warm-up, the original and the change)")
            fit_note = (f"the --budget {fits}; about --budget {math.ceil(needed / 60)}m would measure them "
                        f"all, at {per_run:.0f} s per run ({plural(repeats, 'interleaved round')}, each running the "
                        "original twice and every change once)")
            advice.notes.append(fit_note)
        if not chosen:
            advice.partial = True
            return
        arms = []
        for c in chosen:
            knobs = self.arms.of_change(c)
            if knobs is None:
                c.rec.status = "failed"
                c.rec.error = "the fix changed nothing when applied on its own"
                continue
            arms.append((c, knobs))
        original = self.arms.of("original", {})
        # An A/A arm: the original against itself tells how far apart two runs of the
        # same code land on this machine; a change must beat that to be chosen.
        # Under other seeds: how far its loss lands from the original's is the loss noise
        # a change that draws other random numbers (dropout under compile) is judged by.
        same = self.arms.of(AGAIN, {"seed": {"offset": 1}})
        self.progress(f"measuring {plural(len(arms), 'change')} against the original, {repeats} interleaved rounds")
        # The chosen changes are measured together afterwards: their rounds are kept
        # in reserve (the run times seen in the first round say whether they fit).
        base_arm, results, complete = measurer.compare(
            original, [same] + [k for _, k in arms], repeats, "measuring", warm=True, reserve=2 * repeats,
            settled=lambda arm, base, all_arms: arm is not all_arms[0] and self._beyond_repaying(arm, base, all_arms[0]))
        noise_arm, results = results[0], results[1:]
        self._set_noise(noise_arm, base_arm)
        cut = [c for c in ordered if id(c) not in taken]
        ended_early = measurer.ended_early
        late_keys: list[str] = []
        if (complete or ended_early is not None) and not base_arm.error and cut:
            # The fit guessed each run's length from the profiled run; the rounds just
            # run say how long runs take. Changes the guess left out are measured now,
            # against the same original, while the budget holds them: also when the
            # budget held no second round of the first ones (it may hold a first round
            # of those never measured, which says more than another of those that were).
            done = self._measure_late(measurer, base_arm, noise_arm, cut, arms, results, repeats)
            complete = complete and done
            late_keys = [c.rec.key for c in cut if c.rec.not_measured_reason != "budget"]
            if not any(c.rec.not_measured_reason == "budget" for c in cut):
                if fit_note in advice.notes:
                    advice.notes.remove(fit_note)
                advice.partial = partial_before
            elif fit_note in advice.notes and any(c.rec.not_measured_reason != "budget" for c in cut):
                advice.notes[advice.notes.index(fit_note)] = (
                    f"{fit_note} (guessed from the profiled run; at the run times measured, "
                    f"{sum(c.rec.not_measured_reason != 'budget' for c in cut)} more were measured after the others)")
        if complete and not base_arm.error:
            # Extra rounds keep room for the combined run (2 arms) and one refining
            # comparison on top of it (the original, the chosen set, the small changes).
            complete = self._more_rounds(measurer, base_arm, noise_arm, results, reserve=5 * repeats)
        self._set_loss_noise(base_arm, noise_arm)
        self._seed_time_note()
        if not complete:
            advice.partial = True
            if not any(r.ok for r in base_arm.runs) and measurer.run_seconds:
                left = measurer.remaining()
                advice.notes.append(
                    f"nothing was measured: the unmeasured first run of the original took "
                    f"{measurer.run_seconds[0]:.0f} s"
                    + (f", and the {max(left, 0):.0f} s of --budget left held no round of the original and one "
                       f"change" if left is not None else "")
                    + " (a slow start, or a busy machine: runs take longer than the profiled one); a larger "
                      "--budget, or --skip for the slowest changes (knob:compile), measures them")
            elif ended_early is not None:
                done, left, need = ended_early
                instead = (f"; it measured {', '.join(late_keys)}, which the first rounds left out, in the time "
                           f"left instead" if late_keys else "")
                advice.notes.append(
                    f"the --budget ended the rounds after {done} of {repeats}: the {left:.0f} s left held no further "
                    f"round (about {need:.0f} s at the run times so far, with room kept to measure the chosen changes "
                    f"together){instead}: some figures rest on fewer rounds")
            else:
                advice.notes.append("the --budget ran out before every planned run: some figures rest on fewer "
                                    "rounds")
        if measurer.stopped:
            names = sorted(set(measurer.stopped))
            changes = [n for n in names if n not in ("original", AGAIN)]
            for n, note in enumerate(advice.notes):
                if fit_note is not None and note.startswith(fit_note) and changes:
                    # The guess proved short: the changes stopped took longer than it.
                    advice.notes[n] = (f"{note} (guessed from the profiled run: {', '.join(changes[:4])} took longer "
                                       f"than that and {'was' if len(changes) == 1 else 'were'} stopped, so a larger "
                                       "--budget than this is needed)")
            advice.notes.append(
                f"the end of the --budget stopped {len(measurer.stopped)} run(s) before their first measured step "
                f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}; a first compile, a slow start or an "
                "evaluation pass before the steps): a larger --budget measures them")
        if base_arm.median is not None:
            advice.baseline["step_seconds_median"] = base_arm.median
            advice.baseline["source"] = "trial runs of the original, interleaved with the changes"
            advice.baseline["data_wait_fraction"] = base_arm.data_wait_fraction
            rank_runs = [run.ranks for run in base_arm.runs if run.ok and run.ranks]
            if advice.distributed is not None and rank_runs:
                advice.distributed = ranks.with_measured_rows(advice.distributed, rank_runs)
        if base_arm.error:
            raise TorchaxeError(f"the original script failed in a trial run: {base_arm.error}")
        short = [len(r.step_seconds) for r in base_arm.runs if r.ok and r.status == "completed"
                 and len(r.step_seconds) < self.steps]
        if short:
            length = job_steps_in(self.command) or job_epochs_in(self.command)
            more = (f"raise its `{length[1]}`" if length is not None
                    else "its own --steps, --epochs or --max-iters argument, say")
            advice.notes.append(
                f"the script ended before {self.options.warmup} + {self.steps} steps: its runs measured only "
                f"{min(short)} step(s) each after the warm-up; give it more steps ({more}) for steadier figures")
        self._set_memory(base_arm, base)
        for (c, _), arm in zip(arms, results):
            self._record(c.rec, arm, base_arm, noise_arm)
        split = [(c.key, arm.ratios) for (c, _), arm in zip(arms, results) if arm.ok and self.noise.split(arm.ratios)]
        if split:
            advice.notes.append(
                "the rounds disagree about " + "; ".join(
                    f"{key} ({', '.join(f'{r:.2f}' for r in ratios)} of the original's step time)"
                    for key, ratios in split)
                + f", far beyond the original against itself ({100 * self.noise.spread:.0f}%): a first compile or "
                  "a swing of the machine in one round; its median says little, and a larger --budget gives it "
                  "the rounds that decide it")
        self._accuracy_notes([c.rec for c, _ in arms])
        search = ChangeSearch(measurer, self.noise, advice.notes, arms=self.arms, findings=findings, original=original,
                              repeats=repeats, check_accuracy=self.options.check_accuracy,
                              loss_tolerance=self.options.loss_tolerance,
                              run_seconds=self.run_seconds, progress=self.progress,
                              memory_limit=self.options.memory_limit,
                              original_over_limit=bool(advice.baseline.get("over_memory_limit")),
                              job_steps=self.options.job_steps, job_source=self.job_source,
                              original_median=base_arm.median)
        try:
            search.run([c for c, _ in arms])
            for c, _ in arms:
                if c.rec.selected and c.rec.changes_optimisation:
                    advice.notes.append(f"{c.key} is chosen and changes the optimisation (more samples per step: "
                                        "fewer optimizer steps per epoch, less gradient noise; the learning rate "
                                        "may need scaling): check convergence before keeping it")
        finally:  # what was chosen until an interrupt stays in the advice
            if search.combined is not None:
                advice.combined = search.combined
            if search.partial:
                advice.partial = True

    def _set_memory(self, base_arm: ArmResult, base: BaselineProfile) -> None:
        """The original's peak memory (its trial runs', else the profiled run's) and,
        with ``--memory-limit``, whether the original itself exceeds it: said first."""
        peak = base_arm.peak_memory or profile_peak(base.profile)
        limit = self.options.memory_limit
        baseline = self.advice.baseline
        baseline["peak_memory_bytes"], baseline["memory_kind"] = peak if peak else (None, None)
        baseline["memory_limit_bytes"] = limit
        if limit is None or peak is None:
            if limit is not None:
                self.advice.notes.append("no peak memory was recorded: --memory-limit could not be checked")
            return
        baseline["over_memory_limit"] = peak[0] > limit
        if peak[0] > limit:
            self.advice.notes.insert(0, f"the original itself exceeds --memory-limit: its peak memory "
                                        f"({MEMORY_KINDS.get(peak[1], peak[1])}) is {bytes_text(peak[0])}, above "
                                        f"{bytes_text(limit)}; only changes whose measured peak fits are chosen")

    def _set_noise(self, noise_arm: ArmResult, base: ArmResult) -> None:
        if not noise_arm.ratios:
            return
        aa = Noise(max(abs(1.0 - r) for r in noise_arm.ratios), list(noise_arm.ratios), self.noise.loss)
        self.advice.baseline["aa_ratios"] = [round(r, 4) for r in noise_arm.ratios]
        own = own_runs_noise([Samples.of(r.step_seconds).median or 0.0 for r in base.runs if r.ok])
        if seed_dependent(aa.same, own):
            # The changes keep the script's seed: the original's own runs are their
            # control, not a run whose random draws gave its steps other work.
            own.loss = self.noise.loss
            self.noise = own
            self.advice.baseline["run_to_run_noise_other_seed"] = aa.spread
        else:
            self.noise = aa
            self.advice.baseline.pop("run_to_run_noise_other_seed", None)
        self.advice.baseline["run_to_run_noise"] = self.noise.spread

    def _seed_time_note(self) -> None:
        other = self.advice.baseline.get("run_to_run_noise_other_seed")
        if other is not None:
            self.advice.notes.append(
                f"the original's run under another seed took a step time up to {other:.0%} away from the original's "
                f"while the original's own runs agree within {self.noise.spread:.1%}: the work of a step depends on "
                "the random draws (an episode's length, a sampled sequence length), so the changes, which keep the "
                "script's seed, are judged against the original's own runs")

    def _set_loss_noise(self, base_arm: ArmResult, noise_arm: ArmResult) -> None:
        """How far apart the original's runs (its own and the A/A arm's) landed in
        training loss, when it was recorded."""
        if not self.options.check_accuracy:
            return
        self.noise.loss = loss_noise(base_arm, noise_arm)
        self.advice.baseline["loss_noise"] = self.noise.loss
        # Apart: the original's own runs (same seed; 0 for a deterministic script),
        # which the A/A arm's other seed widens.
        self.advice.baseline["loss_noise_same_seed"] = loss_noise(base_arm)
        self.advice.baseline["loss_tolerance"] = self.options.loss_tolerance
        same = self.advice.baseline["loss_noise_same_seed"]
        if same is not None and same > UNSEEDED_LOSS_NOISE and not (self.noise.loss or 0) > LOUD_LOSS_NOISE:
            self.advice.notes.append(
                f"the original's own runs, started alike, landed {same:.1%} apart in training loss: the script does "
                "not seem to fix its random state (torch.manual_seed), so each change's loss difference is partly "
                "chance, as large as that")
        if self.noise.loss is not None and self.noise.loss > LOUD_LOSS_NOISE:
            if same is not None and same <= UNSEEDED_LOSS_NOISE:
                # The script seeds itself: its own runs agree, and the run under
                # another seed is what moved the loss.
                self.advice.notes.append(
                    f"the original's run under another seed lands {self.noise.loss:.1%} away in training loss while "
                    "its own runs, started alike, agree: over these steps the loss depends that much on the random "
                    "draws (initialisation, data order, noise), so a change to the numerics whose loss lands within "
                    "that cannot be told from chance, and the accuracy check judges little; a longer run or "
                    "--steps averages more of the draws")
            elif same is None:
                # One run of the original went through: only the other seed's was compared.
                self.advice.notes.append(
                    f"the original's run under another seed lands {self.noise.loss:.1%} away in training loss (too "
                    "few of its own runs went through to say whether they agree): a change to the numerics whose "
                    "loss lands within that cannot be told from chance, so the accuracy check judges little; a "
                    "longer --budget compares the original's own runs too, and fixing the script's random state "
                    "(torch.manual_seed), if it does not, narrows the noise")
            else:
                self.advice.notes.append(
                    f"the original's training loss differs by {self.noise.loss:.1%} between its own runs (does the "
                    "script seed its random state?): a change to the numerics whose loss lands within that cannot be "
                    "told from chance, so the accuracy check judges little; a fixed seed (torch.manual_seed) makes "
                    "it sharp")

    def _measure_late(self, measurer: Measurer, base: ArmResult, noise_arm: ArmResult, cut: list[Candidate],
                      arms: list[tuple[Candidate, KnobSet]], results: list[ArmResult], repeats: int) -> bool:
        """Measure the changes the budget's first fit left out (``cut``, most
        promising first), in further rounds against ``base`` with the A/A arm, as
        many at a time as the budget left holds at the run times measured so far,
        keeping room for the combined run when a change measured so far is clearly
        faster (with none, a late change would be measured with nothing: the room is
        better spent measuring it). Each measured one joins ``arms`` and ``results``.
        False when the deadline cut a round short."""
        self._set_noise(noise_arm, base)
        winning = any(r.ok and self.noise.beaten_by(r.ratios) for r in results)
        sets = [(c, knobs) for c in cut if (knobs := self.arms.of_change(c)) is not None]

        def fit(rounds: int, keep: bool = True) -> list[tuple[Candidate, ArmResult]]:
            # Room for the combined run (``keep``), as many rounds as the late ones get.
            # Without that room (the last round the budget holds), no first compile: a
            # guess it outruns stops every run of the round with it.
            reserve = 2 * rounds if winning and keep else 0
            late: list[tuple[Candidate, ArmResult]] = []
            for c, knobs in sets:
                if not keep and pays_once(knobs.values) and not measurer.seconds_of.get(knobs.name):
                    continue
                trial = [*(a for _, a in late), ArmResult(knobs.name, knobs)]
                # A round of the original, the A/A arm and each late change, ``rounds`` times.
                seconds = rounds * (2 * measurer.expected_run_seconds()
                                    + sum(measurer.expected_seconds_of(a.knobs) for a in trial))
                left = measurer.remaining()
                if left is not None and left < seconds + reserve * measurer.expected_run_seconds():
                    continue
                late.append((c, trial[-1]))
            return late

        # As many rounds as the others had (fewer than asked when the budget ended
        # theirs); else one round without the room for a combined run: a change
        # measured once, ranked and perhaps kept alone, says more than one never tried.
        rounds = max(1, min(repeats, len(base.runs)))
        late = fit(rounds)
        if not late:
            rounds, late = 1, fit(1, keep=False)
        if not late:
            return True
        started = len(base.runs)
        self.progress(f"the budget left holds more changes: measuring "
                      f"{', '.join(c.rec.key for c, _ in late)} too")

        def plan() -> list[ArmResult]:
            if len(base.runs) - started >= rounds:
                return []
            return [noise_arm] + [a for _, a in late if not a.error]

        try:
            complete = measurer.more_rounds(base, plan, "measuring")
        finally:
            self._set_noise(noise_arm, base)
        for c, arm in late:
            if arm.ratios or arm.error:  # recorded with the others (status, figures)
                c.rec.not_measured_reason = None
                c.rec.detail = c.rec.detail.removesuffix(OUT_OF_BUDGET).rstrip()
                arms.append((c, arm.knobs))
                results.append(arm)
        return complete

    def _more_rounds(self, measurer: Measurer, base: ArmResult, noise_arm: ArmResult, arms: list[ArmResult],
                     reserve: int) -> bool:
        """Spend what the budget leaves on further rounds for the changes that are
        promising but not yet decided (fewer than ``DECIDE_ROUNDS`` rounds, or not
        clearly faster), always with the A/A arm, keeping ``reserve`` runs for the
        combined measurement. The reserve is kept only while two or more changes are
        chosen or still in the running: with one at most, nothing will be measured
        together, and the budget is better spent deciding that one. False when the
        deadline cut a round short."""
        def plan() -> list[ArmResult]:
            self._set_noise(noise_arm, base)  # the rounds so far
            live = [a for a in arms if a.ok and not self._beyond_repaying(a, base, noise_arm)]
            open_arms = [a for a in live if len(a.ratios) < MAX_ROUNDS
                         and ((promising(a.ratios) and (len(a.ratios) < DECIDE_ROUNDS
                                                        or not self.noise.beaten_by(a.ratios)))
                              or self.noise.split(a.ratios))]
            clear = [a for a in live if self.noise.beaten_by(a.ratios)]
            kept = reserve if len({id(a) for a in open_arms + clear}) >= 2 else 0
            if not open_arms or not measurer.fits(2 + len(open_arms) + kept):
                return []
            self.progress(f"the budget allows more: round {len(base.runs) + 1} for "
                          f"{', '.join(a.name for a in open_arms)}")
            return [noise_arm] + open_arms

        try:
            return measurer.more_rounds(base, plan, "measuring")
        finally:
            self._set_noise(noise_arm, base)

    def _beyond_repaying(self, arm: ArmResult, base: ArmResult, same: ArmResult) -> bool:
        """Whether a change's measured one-time cost (a first compile) exceeds the time
        all of the job's --job-steps take in the original: no saving per step could pay
        it back, so later rounds cannot change its verdict (held back) and are better
        spent on the changes still undecided (a 120-step Trainer job, 4 s of steps,
        gave two 11 s compiles as many rounds as the fixes it could choose, and the
        budget ended before a third round of any). ``same``: the A/A arm.

        Decided on a run after its first: the first fills torch's compile caches, and
        the job run here after advise reads them (a 21 s compile took 2 s from them).
        From two rounds on, the saving of its best round bounds what it can save: a
        Trainer's compile at 0.90 and 0.93 of a 25 ms step, 8.8 s once, cannot repay
        that in a 2,000-step job (5 s saved at 0.90), and its 9 s warm-ups each round
        had left the other changes two rounds each."""
        steps = self.options.job_steps
        if steps is None or not base.median or not arm.ratios:
            return False
        cost = one_time_cost(arm, base, 0.0, same)
        once = cost.get("one_time_seconds")
        if not once or cost.get("one_time_cold_only"):
            return False
        best = 1.0 - min(arm.ratios) if len(arm.ratios) >= 2 else 1.0
        return once > steps * base.median * max(best, 0.0)

    def _record(self, rec: Recommendation, arm: ArmResult, base: ArmResult, same: ArmResult) -> None:
        seconds = [r.seconds for r in arm.runs if r.seconds is not None]
        if seconds:
            self.run_seconds[rec.key] = statistics.median(seconds)
        if arm.error:
            rec.status = "failed"
            rec.error = arm.error
            return
        if not arm.ratios:
            rec.status = "not_measured"
            return
        wrapping = [key for key in ("compile", "autocast") if (rec.knobs or {}).get(key)]
        noted = [r.applied for r in arm.runs if r.ok and r.applied]
        if wrapping and noted and not any(isinstance(a.get(key), dict) for a in noted for key in wrapping):
            # No model was called from the loop through nn.Module.__call__ (a script that
            # calls its layers' forward directly): the knob wrapped nothing, and its
            # "speedup" would be the runs' noise.
            rec.status = "not_measured"
            rec.detail = (rec.detail + " " if rec.detail else "") + (
                f"(not measured: {' and '.join(wrapping)} found no model to apply to; the loop calls no module "
                "with parameters itself, e.g. it calls a layer's forward directly)")
            return
        rec.status = "measured"
        rec.ratios = [round(r, 4) for r in arm.ratios]
        wrapped = _wrapped_modules(arm)
        if wrapped:
            # "the model" is each module with parameters the loop called: say which ones.
            rec.detail = (rec.detail + "; " if rec.detail else "") + wrapped
            rec.applied_to = wrapped
        ratio = arm.ratio or 1.0
        rec.speedup = 1.0 / ratio if ratio > 0 else None
        if base.median is not None:
            rec.measured_seconds_saved_per_step = base.median * (1.0 - ratio)
        if pays_once(rec.knobs or {}):
            cost = one_time_cost(arm, base, rec.measured_seconds_saved_per_step or 0.0, same)
            rec.one_time_seconds, rec.break_even_steps = cost.get("one_time_seconds"), cost.get("break_even_steps")
            rec.one_time_seconds_first = cost.get("one_time_seconds_first")
            rec.one_time_cold_only = bool(cost.get("one_time_cold_only"))
        if self.options.check_accuracy and rec.accuracy.changes_numerics:
            # Against the original's own runs (same seed): the A/A arm ran under other seeds.
            self._compare_loss(rec, loss_delta(arm, base), min(sum(1 for l in arm.losses if l),
                                                                   sum(1 for l in base.losses if l)))
        self._compare_memory(rec, arm, base)
        self._compare_job_length(rec)
        self._compare_bound(rec, base)
        rec.ranks = arm.rank_figures

    def _saving_bound(self, rec: Recommendation, base: ArmResult) -> tuple[float, str] | None:
        """The most a change can save a step, from the original's own runs, and what that
        time is; None when the change has no such bound or the runs did not time it."""
        if rec.key.startswith(DDP_COMM_KNOBS):
            comms = [row.get("comm_seconds_per_step") for row in base.rank_figures or []]
            comms = [c for c in comms if isinstance(c, (int, float))]
            return (max(comms), "the gradient exchange it changes takes") if comms else None
        if rec.key.startswith(OPTIMIZER_KNOBS) and self.target == "cpu":
            seconds = base.optimizer_seconds_median
            return (seconds, "the optimizer's step() it changes takes") if seconds is not None else None
        if rec.key.startswith(LOADER_KNOBS) and not (rec.knobs or {}).get("dataloader", {}).get("pin_memory"):
            seconds = base.data_wait_seconds_median
            return (seconds, "the step waited for data") if seconds is not None else None
        return None

    def _compare_bound(self, rec: Recommendation, base: ArmResult) -> None:
        """A change to one part of the step (DDP's gradient exchange, the optimizer's
        update, the loader) can save at most the time that part takes: a measured saving
        far beyond the original's time for it is the machine's swings, not the change,
        and is held back."""
        saved = rec.measured_seconds_saved_per_step
        if not saved:
            return
        bound = self._saving_bound(rec, base)
        if bound is None or saved <= SAVING_MARGIN * bound[0] + SAVING_SLACK:
            return
        why = (f"it measured {saved * 1e3:.2f} ms saved a step, more than {bound[1]} "
               f"({bound[0] * 1e3:.2f} ms a step in the original's runs): the machine's swings, not the change; "
               f"not chosen; {apply_only(rec)} applies it")
        rec.held_back = f"{rec.held_back}; {why}" if rec.held_back else why

    def _run_in_steps(self, findings: list[Finding], context: dict[str, Any],
                      settings: dict[str, Any]) -> tuple[list[Finding], list[Finding]]:
        """Formula findings, and weight averages and hand-written updates, split into
        those in code a counted training step ran and those in code none did (a model
        class the command line did not choose, an EMA class the script never builds): a
        fix there cannot change this run's speed, and is listed only. Not when the
        script compiles its model itself: compiled code runs without the Python frames
        that say what ran."""
        from torchaxe.runtime.run_context import executed

        if settings.get("compiled_graphs"):
            return findings, []
        return self._listed_only(
            findings, lambda f: f.code.startswith(_RAN_CODE_RULES) and executed(context, f.path, f.line,
                                                                                  f.end_line) is False,
            lambda n, first: f"{n} finding(s) in code no training step of this run ran are listed but not measured "
            f"(e.g. {first.path}:{first.line} {first.code}; another model or option of the script runs it)")

    def _built_optimizers(self, findings: list[Finding], context: dict[str, Any]) -> list[Finding]:
        """Findings of optimizer calls the run made: a fix of a call it never made (in
        a branch it did not take) cannot change its speed, and is listed only."""
        from torchaxe.runtime.run_context import built_optimizer

        return self._listed_only(
            findings, lambda f: f.code in OPTIMIZER_RULES and built_optimizer(context, f.path, f.line,
                                                                               f.end_line) is False,
            lambda n, first: f"{n} optimizer finding(s) are listed but not measured: the run built no optimizer "
            f"there (a branch it did not take; e.g. {first.path}:{first.line} {first.code})")[0]

    def _training_loaders(self, findings: list[Finding], context: dict[str, Any]) -> list[Finding]:
        """DataLoader findings (AX401-AX403) on a loader the run built but whose batches
        fed no training step (an evaluation loader): its time is not in the steps
        measured, and the finding is listed only."""
        from torchaxe.runtime.run_context import built_loader, fed_training

        return self._listed_only(
            findings, lambda f: f.code in ("AX401", "AX402", "AX403")
            and built_loader(context, f.path, f.line, f.end_line) is True
            and fed_training(context, f.path, f.line, f.end_line) is False,
            lambda n, first: f"{n} DataLoader finding(s) are listed but not measured: the loaders built there fed "
            f"no training step of the run (an evaluation loader, say; its passes are not in the steps measured; "
            f"e.g. {first.path}:{first.line} {first.code})")[0]

    def _loaders_with_workers(self, findings: list[Finding], context: dict[str, Any]) -> list[Finding]:
        """AX403 findings on a loader that had no worker processes in the run (its
        ``num_workers`` expression was 0): keeping workers alive that the run never
        starts cannot change its speed, and the finding is listed only."""
        from torchaxe.runtime.run_context import loader_workers

        return self._listed_only(
            findings, lambda f: f.code == "AX403" and loader_workers(context, f.path, f.line, f.end_line) == 0,
            lambda n, first: f"{n} persistent-workers finding(s) are listed but not measured: the loaders built "
            f"there had no worker processes in this run (num_workers 0; e.g. {first.path}:{first.line} "
            f"{first.code})")[0]

    def _listed_only(self, findings: list[Finding], idle: Callable[[Finding], bool],
                     note: Callable[[int, Finding], str]) -> tuple[list[Finding], list[Finding]]:
        """``findings`` split into those to measure and those ``idle`` says the run
        cannot have been sped up by, with a note on the latter."""
        left_out = [f for f in findings if idle(f)]
        if left_out:
            self.advice.notes.append(note(len(left_out), left_out[0]))
        return [f for f in findings if f not in left_out], left_out

    def _unlikely_paid_back_last(self, ordered: list[Candidate], per_run: float,
                                 base: BaselineProfile) -> tuple[list[Candidate], str]:
        """``ordered`` with the changes that pay once moved last when, with the job's
        length known, their first compile (guessed as for the budget, at
        ``first_compile_runs``) would not be paid back within the job's steps even
        if every step saved ``LIKELY_MOST_SAVED`` of the profiled step: measured only
        when the budget holds them after the others. And why, when they were moved."""
        steps = self.options.job_steps
        median = (base.profile.get("summary") or {}).get("step_seconds_median")
        if steps is None or not median:
            return ordered, ""
        once = (first_compile_runs(per_run) - 1.0) * per_run
        if once <= steps * LIKELY_MOST_SAVED * median:
            return ordered, ""
        late = {id(c) for c in ordered if pays_once(c.rec.knobs or {})}
        if not late or len(late) == len(ordered):
            return ordered, ""
        why = (f"a first compile (guessed at {once:.0f} s, {first_compile_runs(per_run) - 1:.3g} runs' time) is "
               f"paid back within the job's {steps:,} steps ({self.job_source}) only if each {median * 1e3:.0f} ms step "
               f"saves {once / steps * 1e3:.0f} ms or more ({LIKELY_MOST_SAVED:.0%} is the most expected)")
        return [c for c in ordered if id(c) not in late] + [c for c in ordered if id(c) in late], why

    def _job_epochs(self, profile: dict[str, Any], settings: dict[str, Any], modules: Sequence[str] = ()) -> None:
        """A command that gives the job's length in epochs (``--epochs 2``) gives it in
        steps too, with the training loader's batches an epoch and the batches a step
        the profile saw: a compile that the job never pays back is then held back. Not
        when the steps drew no batch from a loader."""
        if self.options.job_steps is not None:
            self._steps_of_batches(profile, modules)
            return
        stated = job_epochs_in(self.command)
        epoch = training_epoch(profile, settings) if stated is not None else None
        if stated is None or epoch is None:
            return
        drawn = batches_per_step(s.get("batches") for s in profile.get("steps") or [] if s.get("phase") == "measured")
        if drawn == 0:
            # The steps draw no batch (the script took its data once, then trains each
            # layer for --epochs passes over it): the loader's epochs do not count them.
            return
        per_step = float(drawn) if drawn is not None else 1.0
        steps = job_steps_of_epochs(stated[0], epoch, per_step)
        self.options = replace(self.options, job_steps=steps)
        self.job_source = f"read from the command: {stated[1]}"
        self.advice.notes.append(
            f"the job's length is read from the command ({stated[1]}): {steps:,} steps of the loader built at "
            f"{epoch.get('site') or 'its line'} ({epoch['samples']:,} samples in batches of {epoch['batch_size']}"
            + (f", {per_step:g} batches a step" if per_step != 1 else "") + "); a change whose one-time cost is "
            "not paid back within them is held back (--job-steps N says otherwise)")

    def _steps_of_batches(self, profile: dict[str, Any], modules: Sequence[str] = ()) -> None:
        """A job length read from the command's steps, in a run whose optimizer step
        takes several batches (gradient accumulation): the command may count batches.
        Said, with the length it would then be; not for the ``max_steps`` of a trainer
        that counts optimizer steps by it (Hugging Face's ``Trainer``, Lightning's)."""
        if self.stated_steps is None:
            return
        if "max_steps" in self.stated_steps[1].replace("-", "_") and any(
                _counts_optimizer_steps(path) for path in modules):
            return
        drawn = batches_per_step(s.get("batches") for s in profile.get("steps") or [] if s.get("phase") == "measured")
        if drawn is None or drawn < 2:
            return
        steps, said = self.stated_steps
        self.advice.notes.append(
            f"a step here is one optimizer step, which took {drawn:g} batches (gradient accumulation): if {said} "
            f"counts batches, the job is {max(1, round(steps / drawn)):,} steps and its figures here are too "
            f"large (--job-steps {max(1, round(steps / drawn))} says so)")

    def _compare_job_length(self, rec: Recommendation) -> None:
        """With ``--job-steps``, a change whose one-time cost is not paid back by its
        saving within the job's steps is held back."""
        steps, once = self.options.job_steps, rec.one_time_seconds
        if steps is None or not once:
            return
        even = rec.break_even_steps
        if even is not None and even <= steps:
            return
        if even is None and rec.speedup is not None and rec.speedup <= 1.0:
            return  # slower per step, or no faster: not chosen for that, nothing held back
        if even is not None:
            pays = f"pays off only after {even:,} steps, more than the job's {steps:,} ({self.job_source})"
        else:
            pays = f"is never paid back: it saves no time per step (the job runs {steps:,} steps, {self.job_source})"
        cold = (", measured on its first run alone, which filled torch's compile caches: a longer --budget "
                "measures what a later run pays" if rec.one_time_cold_only else "")
        why = (f"its one-time cost ({once:.1f} s, before its first fast step{cold}) {pays}: not chosen; "
               f"{apply_only(rec)} applies it")
        rec.held_back = f"{rec.held_back}; {why}" if rec.held_back else why

    def _compare_memory(self, rec: Recommendation, arm: ArmResult, base: ArmResult) -> None:
        """A measured change's peak memory against the original's; above
        ``--memory-limit``, held back."""
        peak = arm.peak_memory
        if peak is None:
            return
        original = base.peak_memory
        same_kind = original is not None and original[1] == peak[1]
        spreads = [s for s in (arm.memory_spread, base.memory_spread if same_kind else None) if s is not None]
        rec.memory = Memory(kind=peak[1], peak_bytes=peak[0],
                            original_peak_bytes=original[0] if same_kind else None,  # type: ignore[index]
                            noise=max(spreads) if spreads else None)
        limit = self.options.memory_limit
        if limit is not None and peak[0] > limit:
            why = (f"its peak memory ({MEMORY_KINDS.get(peak[1], peak[1])}) {bytes_text(peak[0])} is above "
                   f"--memory-limit ({bytes_text(limit)}): not chosen; {apply_only(rec)} applies it")
            rec.held_back = f"{rec.held_back}; {why}" if rec.held_back else why

    def _compare_loss(self, rec: Recommendation, delta: float | None, runs: int = 2) -> None:
        """A change that may alter the numerics, its mean training loss against the
        original's: within the noise plus the tolerance, or held back. ``runs``: the
        fewer of the two sides' runs that recorded a loss."""
        acc = rec.accuracy
        if delta is None:
            return
        rec.accuracy = Accuracy(kind="max_error" if acc.kind == "max_error" else "loss", max_error=acc.max_error,
                                loss_delta=delta, loss_noise=self.noise.loss,
                                loss_tolerance=self.options.loss_tolerance,
                                detail="mean training loss over each run's steps, same seed, against the original's")
        if rec.accuracy.beyond_tolerance:
            noise = self.noise.loss or 0.0
            one = " (one run of each: a further round, with a larger --budget, tells chance apart)" if runs < 2 else ""
            rec.held_back = (f"its training loss differs from the original's by {delta:+.2%}, beyond the run-to-run "
                             f"loss noise ({noise:.2%}) by more than the {self.options.loss_tolerance:.1%} tolerance "
                             f"(--loss-tolerance){one}: not chosen; {apply_only(rec)} applies it")

    def _accuracy_notes(self, recs: Sequence[Recommendation]) -> None:
        """Say which changes were held back for their loss, with their cost, and which
        ones that alter the numerics could not be judged (no loss recorded)."""
        for rec in recs:
            if rec.held_back and rec.status == "measured":
                speed = f"{rec.speedup:.2f}x" if rec.speedup else "no faster"
                self.advice.notes.append(f"{rec.key} ({speed}) is held back: {rec.held_back}")
        if not self.options.check_accuracy:
            precision = [r.key for r in recs if r.status == "measured" and r.axis in LOSS_JUDGED_AXES
                         and r.applies == "knob" and r.accuracy.kind == "unknown"]
            if precision:
                self.advice.notes.append(f"the training loss was not compared (--no-check-accuracy): "
                                         f"{', '.join(precision)} measured but not chosen")
            return
        unjudged = [r.key for r in recs if r.status == "measured" and r.accuracy.changes_numerics
                    and r.accuracy.loss_delta is None]
        if unjudged:
            self.advice.notes.append(
                "no training loss was recorded (no scalar tensor had backward() called on it), so the accuracy of "
                f"{', '.join(unjudged)} is unknown: mixed precision, TF32 and compressed gradients are not chosen "
                "without it")


def apply_only(rec: Recommendation) -> str:
    """The command that applies one recommendation the advice did not choose (an unsafe
    code fix needs ``--unsafe-fixes`` as well)."""
    unsafe = " --unsafe-fixes" if rec.unsafe and rec.applies == "code" else ""
    return f"`torchaxe apply --only {rec.key}{unsafe}`"


def advise(command: Sequence[str], options: AdviseOptions | None = None, **kwargs: Any) -> Advice:
    """Find, measure and rank what would make this training script faster."""
    return Advisor(command, options or AdviseOptions(), **kwargs).run()


def _wrapped_modules(arm: ArmResult) -> str:
    """Which module the run's model-wrapping knobs (compile, autocast) took as the
    model, as the run noted it: a script that trains two models (a GAN) learns which."""
    applied = next((r.applied for r in arm.runs if r.ok and r.applied), None) or {}
    notes = {key: applied.get(key) for key in ("compile", "autocast")}
    parts = [f"{key} applied to {counted(note.get('modules') or [note['module']], ' and ')}"
             for key, note in notes.items() if isinstance(note, dict) and note.get("module")]
    return ", ".join(parts)
