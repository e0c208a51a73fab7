"""``torchaxe advise``: scan, profile, check, measure, rank.

1. **Profile** the unchanged script for a few steps in a subprocess (op times with
   the user lines they came from, shapes, data wait; the files it imported and the
   settings it left on).
2. **Scan** the script's folder and the installed third-party files the run actually
   imported.
3. **Check** the environment (environment.py).
4. **Candidates**: a code candidate per rule with an automatic fix, knob candidates
   from what the profile showed (candidates.py).
5. **Measure** every candidate against the original, interleaved, within the budget;
   then the chosen ones together (measure.py).
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

from torchaxe.advise.baseline import (DEFAULT_STEPS, BaselineProfile, ProfileRunner, check_profile, plot_data,
                                      profile_in_subprocess)
from torchaxe.advise.candidates import (LOADER_ACCURACY, Candidate, code_candidates, fixed_sources,
                                        knob_candidates, script_speedups)
from torchaxe.advise.environment import environment_checks
from torchaxe.advise.measure import ArmResult, Measurer, OutOfTime
from torchaxe.advise.options import AdviseOptions
from torchaxe.advise.recommendation import Accuracy, Advice, Recommendation
from torchaxe.advise.stats import (DECIDE_ROUNDS, MAX_ROUNDS, MIN_GAIN, clear_gain, loss_delta, measured_figures,
                                   paired_ratios, promising)
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.knobs import KnobSet, knob_set_from_dict
from torchaxe.runtime.trials import Runner, run_in_subprocess

#: Changes tried one by one on top of the chosen ones (besides all of them at once).
MAX_NEAR_MISSES = 2
#: How many chosen changes are also measured with each one left out (more would cost
#: a run per change and round).
MIN_LEAVE_ONE_OUT, MAX_LEAVE_ONE_OUT = 3, 4


def scan_for_advice(folder: Path, installed: Sequence[str], target: str, progress: Callable[[str], None]):
    """Findings in the script's folder and in the imported files outside it."""
    from torchaxe.scan.engine import ScanOptions, scan_paths

    options = ScanOptions(target=target)
    progress(f"scanning {folder}")
    own = scan_paths([folder], options)
    prefix = str(folder).rstrip(os.sep) + os.sep
    outside = [p for p in installed if not p.startswith(prefix) and os.path.isfile(p)]
    extra = None
    if outside:
        progress(f"scanning {len(outside)} imported files outside the script's folder")
        extra = scan_paths(list(outside), options)
    return own, extra


def _merge_knobs(fragments: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for frag in fragments:
        for key, value in frag.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
    return out


class Advisor:
    """One ``advise`` run. Collaborators are injectable for tests: ``runner`` runs
    one trial, ``profiler`` the first profiled run, ``clock`` keeps the budget."""

    def __init__(self, command: Sequence[str], options: AdviseOptions, *,
                 progress: Callable[[str], None] = lambda line: None, runner: Runner | None = None,
                 profiler: ProfileRunner | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        from torchaxe.backends import resolve_target
        from torchaxe.runtime.command import check_module, parse_command

        self.command = list(command)
        self.script = parse_command(command)
        check_module(self.script)
        self.options = options
        self.target = resolve_target(options.target)
        self.progress = progress
        self.runner = runner or run_in_subprocess
        self.profiler = profiler or profile_in_subprocess
        self.clock = clock
        self.started = clock()
        self.deadline = self.started + options.budget
        self.workdir = Path(tempfile.mkdtemp(prefix="torchaxe-advise-"))
        #: How far apart two runs of the unchanged script landed (A/A), as a fraction,
        #: and the A/A arm's per-round ratios.
        self.noise = 0.0
        self.same_ratios: list[float] = []
        #: Measured steps per trial run (``options.steps``, or chosen after the profile).
        self.steps = options.steps or DEFAULT_STEPS
        #: Median wall seconds of a trial run, by the change it made.
        self.run_seconds: dict[str, float] = {}
        #: The run table of torchaxe.toml, under which every arm runs (see _against_run_knobs).
        self.run_knobs: dict[str, Any] = {}
        #: Changes dropped by leave-one-out: measured on top of the others, they hurt.
        self.left_out: set[str] = set()
        self.advice = Advice(command=self.command, target=self.target, budget_seconds=options.budget,
                             repeats=options.repeats)

    # ------------------------------------------------------------------ phases

    def run(self) -> Advice:
        try:
            self._run()
        except KeyboardInterrupt:
            self.advice.partial = True
            self.advice.notes.append("interrupted (Ctrl-C): the advice holds what was measured until then")
        finally:
            self.advice.elapsed_seconds = self.clock() - self.started
            shutil.rmtree(self.workdir, ignore_errors=True)
        return self.advice

    def _run(self) -> None:
        advice = self.advice
        self.progress("profiling the original script")
        base = self.profiler(self.command, self.options, self.target)
        check_profile(base.profile, self.options)
        summary = base.profile.get("summary") or {}
        step = summary.get("step_seconds_median")
        self.steps = base.steps_per_run(self.options)
        advice.baseline = {"step_seconds_median": step, "data_wait_fraction": summary.get("data_wait_fraction"),
                           "host_syncs_per_step": summary.get("host_syncs_per_step"),
                           "gc_fraction": summary.get("gc_fraction"), "profile_run_seconds": base.seconds,
                           "source": "profiled run (with op recording on some steps)",
                           "steps_per_run": self.steps, "warmup_per_run": self.options.warmup}
        advice.profile = plot_data(base.profile)

        folder = self.script.folder
        own, extra = scan_for_advice(folder, base.context.get("modules") or [] if self.options.scan_installed
                                     else [], self.target, self.progress)
        findings = list(own.findings)
        advice.findings = [f.to_dict() for f in findings]
        advice.scanned = {"folder": str(folder), "files": own.stats.files_scanned, "installed_files": 0,
                          "installed_findings": []}
        if extra is not None:
            advice.scanned["installed_files"] = len(base.context.get("modules") or [])
            advice.scanned["installed_findings"] = [f.to_dict() for f in extra.findings]

        settings = base.context.get("settings") or {}
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
        codes, advice_recs = code_candidates(measured_findings, base.profile, step)
        self._micro_benchmarks(codes)
        for f in (extra.findings if extra is not None else []):
            advice_recs.append(Recommendation(
                key=f"installed:{f.code}:{f.path}:{f.line}", axis="fused_ops",
                title=f"{f.code} {f.category.replace('_', ' ')} in an installed package: {f.replacement or ''}".rstrip(": "),
                applies="code", location=f"{f.path}:{f.line}", status="advice", detail=f.message, rules=[f.code],
                files=[f.path]))
        candidates = codes + knob_candidates(self.target, base.profile, settings) + env_candidates
        advice.notes.extend(script_speedups(settings))
        candidates += self._stored_candidates()
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
        self.run_knobs = knobs

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
        against the original files kept by apply, interleaved."""
        from torchaxe.advise.apply import kept_originals, read_run_knobs

        key = self.script.target if self.script.kind == "path" else self.script.folder
        originals = kept_originals(key)
        if not originals:
            return
        knobs, _ = read_run_knobs(self.script.folder)
        try:
            now = self._knob_set("applied", knobs)
        except TorchaxeError as exc:
            self.advice.achieved = {"status": "failed", "error": str(exc)}
            return
        before = self._knob_set("original-before-apply", {"sources": originals}, run_knobs=False)
        measurer = Measurer(self.command, base.trial_options(self.options, self.steps, self.target), deadline=self.deadline, runner=self.runner,
                            clock=self.clock, progress=self.progress)
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

    def _stored_candidates(self) -> list[Candidate]:
        """Settings measured for this very command before and kept in the knowledge
        base (``torchaxe data --tune``): measured again here, against this run."""
        from torchaxe.data.tuning import stored_loader_knobs
        from torchaxe.tune.kb import KnowledgeBase

        out: list[Candidate] = []
        try:
            stored = stored_loader_knobs(self.command)
            with KnowledgeBase.open() as kb:
                tuned = len(kb.signatures())
        except TorchaxeError as exc:
            self.advice.notes.append(f"knowledge base not read: {exc}")
            return []
        if tuned:
            rec = Recommendation(
                key="knob:tune", axis="tune", title=f"tuned subgraphs from the knowledge base ({tuned} tuned "
                "signatures; those matching this model are swapped in)", applies="knob", knobs={"tune": {}},
                detail="the winners `torchaxe tune` measured and checked against eager (docs/tune.md)",
                accuracy=Accuracy(kind="unknown", detail="each winner matched eager within its dtype's tolerance "
                                  "when tuned; use --check-accuracy for the loss"))
            out.append(Candidate(rec=rec, knobs={"tune": {}}, group="compile", priority=1.8))
        elif (self.advice.profile or {}).get("static_shapes"):
            self.advice.notes.append("shapes are static: `torchaxe tune -- " + " ".join(self.command)
                                     + "` can tune the model's subgraphs and keep the winners for `torchaxe run`")
        if not stored:
            return out
        loader = stored["dataloader"]
        settings = ", ".join(f"{k}={v}" for k, v in sorted(loader.items()))
        rec = Recommendation(key="knob:dataloader-tuned", axis="data", title=f"DataLoader({settings}) "
                             "(found by `torchaxe data --tune`)", applies="knob", knobs={"dataloader": loader},
                             detail="the loader setting the knowledge base holds for this command",
                             accuracy=replace(LOADER_ACCURACY))
        out.append(Candidate(rec=rec, knobs={"dataloader": loader}, group="dataloader", priority=2.5))
        return out

    def _micro_benchmarks(self, candidates: list[Candidate]) -> None:
        """A formula fix's replacement against the hand-written form on the shapes the
        run used (``torchaxe verify``), in this process: seconds, not a whole run."""
        from torchaxe.scan.formulas.verify import formula_rules, verify

        formula_codes = {rule.code for rule in formula_rules()}
        for c in candidates:
            code = c.rec.rules[0] if c.rec.rules else ""
            if code not in formula_codes or not c.shapes or self.clock() > self.deadline:
                continue
            shape = tuple(max(d, 1) for d in c.shapes[0])
            self.progress(f"micro-benchmark of {code} on {list(shape)}")
            try:
                (result,) = verify((code,), device=self.target, shape=shape, repeats=3)
            except (TorchaxeError, RuntimeError, ValueError) as exc:
                c.rec.evidence.append(f"micro-benchmark on {list(shape)} not run: {exc}")
                continue
            if result.error or result.speedup is None:
                c.rec.evidence.append(f"micro-benchmark on {list(shape)}: {result.error or 'no fused form here'}")
                continue
            c.rec.evidence.append(
                f"micro-benchmark on {list(shape)} {result.dtype}, forward: hand-written "
                f"{result.hand.median * 1e3:.3f} ms, replacement {result.fused.median * 1e3:.3f} ms "
                f"({result.speedup:.1f}x); max error {result.max_abs:.1e}")
            if result.max_abs is not None and c.rec.accuracy.kind in ("max_error", "exact", "unknown"):
                c.rec.accuracy.kind = "max_error"
                c.rec.accuracy.max_error = max(c.rec.accuracy.max_error or 0.0, result.max_abs)
                c.rec.accuracy.detail = "largest difference from the hand-written form, on the run's shapes"

    def _knob_set(self, name: str, fragment: dict[str, Any], run_knobs: bool = True) -> KnobSet:
        """The knob set of one arm: ``fragment`` on top of the run table, if any
        (``run_knobs=False``: the fragment alone)."""
        data = _merge_knobs([self.run_knobs, fragment]) if run_knobs and self.run_knobs else dict(fragment)
        if self.options.check_accuracy:
            data["observe"] = {"loss": True}
        return knob_set_from_dict({"name": name, **data}, f"advise:{name}")

    def _measure(self, candidates: list[Candidate], findings, base: BaselineProfile) -> None:
        advice = self.advice
        repeats = self.options.repeats
        measurer = Measurer(self.command, base.trial_options(self.options, self.steps, self.target), deadline=self.deadline, runner=self.runner,
                            clock=self.clock, progress=self.progress)
        # Fit the candidates into the budget: each run is about as long as the profiled
        # one; keep room for the combined run (2 arms x repeats).
        per_run = base.expected_run_seconds(self.options.warmup, self.steps)
        left = self.deadline - self.clock()
        fit = int((left - per_run) / per_run / repeats) - 1 - 2  # one warm-up run first
        ordered = sorted(candidates, key=lambda c: -c.priority)
        chosen = ordered[:max(fit, 1)]
        for c in ordered[len(chosen):]:
            c.rec.status = "not_measured"
            c.rec.detail = (c.rec.detail + " " if c.rec.detail else "") + "(not measured: out of --budget)"
        if len(chosen) < len(ordered):
            # Profile, warm-up run, the rounds of every change with the A/A arm, the combined run.
            needed = (self.clock() - self.started) + per_run * (1 + repeats * (2 + len(ordered)) + 2 * repeats)
            advice.notes.append(
                f"the --budget fits {len(chosen)} of {len(ordered)} changes ({len(ordered) - len(chosen)} not "
                f"measured, listed last); about --budget {math.ceil(needed / 60)}m would measure them all, at "
                f"{per_run:.0f} s per run")
        arms = []
        for c in chosen:
            fragment = dict(c.knobs)
            if c.rec.applies == "code":
                folder = self.workdir / c.key.replace(":", "-")
                folder.mkdir(parents=True, exist_ok=True)
                sources = fixed_sources(c.findings, c.rec.rules, folder, target=self.target)
                if not sources:
                    c.rec.status = "failed"
                    c.rec.error = "the fix changed nothing when applied on its own"
                    continue
                fragment["sources"] = sources
            arms.append((c, self._knob_set(c.key, fragment)))
        original = self._knob_set("original", {})
        # An A/A arm: the original against itself tells how far apart two runs of the
        # same code land on this machine; a change must beat that to be chosen.
        same = self._knob_set("original-again", {})
        self.progress(f"measuring {len(arms)} changes against the original, {repeats} interleaved rounds")
        # The chosen changes are measured together afterwards: their rounds are kept
        # in reserve (the run times seen in the first round say whether they fit).
        base_arm, results, complete = measurer.compare(original, [same] + [k for _, k in arms], repeats,
                                                       "measuring", warm=True, reserve=2 * repeats)
        noise_arm, results = results[0], results[1:]
        self._set_noise(noise_arm)
        if complete and not base_arm.error:
            # Extra rounds keep room for the combined run (2 arms) and one refining
            # comparison on top of it (the original, the chosen set, the small changes).
            complete = self._more_rounds(measurer, base_arm, noise_arm, results, reserve=5 * repeats)
        if not complete:
            advice.partial = True
            advice.notes.append("the --budget ran out before every planned run: some figures rest on fewer rounds")
        if base_arm.median is not None:
            advice.baseline["step_seconds_median"] = base_arm.median
            advice.baseline["source"] = "trial runs of the original, interleaved with the changes"
            advice.baseline["data_wait_fraction"] = base_arm.data_wait_fraction
        if base_arm.error:
            raise TorchaxeError(f"the original script failed in a trial run: {base_arm.error}")
        short = [len(r.step_seconds) for r in base_arm.runs if r.ok and r.status == "completed"
                 and len(r.step_seconds) < self.steps]
        if short:
            advice.notes.append(
                f"the script ended before {self.options.warmup} + {self.steps} steps: its runs measured only "
                f"{min(short)} step(s) each after the warm-up; give it more steps (its own --steps, --epochs or "
                f"--max-iters argument) for steadier figures")
        for (c, _), arm in zip(arms, results):
            self._record(c.rec, arm, base_arm)
        self._combine([c for c, _ in arms], findings, measurer, original)

    def _set_noise(self, noise_arm: ArmResult) -> None:
        if noise_arm.ratios:
            self.same_ratios = list(noise_arm.ratios)
            self.noise = max(abs(1.0 - r) for r in noise_arm.ratios)
            self.advice.baseline["run_to_run_noise"] = self.noise
            self.advice.baseline["aa_ratios"] = [round(r, 4) for r in noise_arm.ratios]

    def _more_rounds(self, measurer: Measurer, base: ArmResult, noise_arm: ArmResult, arms: list[ArmResult],
                     reserve: int) -> bool:
        """Spend what the budget leaves on further rounds for the changes that are
        promising but not yet decided (fewer than ``DECIDE_ROUNDS`` rounds, or not
        clearly faster), always with the A/A arm, keeping ``reserve`` runs for the
        combined measurement. False when the deadline cut a round short."""
        extra = 0
        while True:
            open_arms = [a for a in arms if a.ok and len(a.ratios) < MAX_ROUNDS and promising(a.ratios)
                         and (len(a.ratios) < DECIDE_ROUNDS
                              or not clear_gain(a.ratios, self.noise, self.same_ratios))]
            if not open_arms:
                return True
            if not measurer.fits(2 + len(open_arms) + reserve):
                return True
            extra += 1
            self.progress(f"the budget allows more: round {len(base.runs) + 1} for "
                          f"{', '.join(a.name for a in open_arms)}")
            try:
                if not measurer.round(base, [noise_arm] + open_arms, f"measuring: extra round {extra}"):
                    return True
            except OutOfTime:
                return False
            finally:
                self._set_noise(noise_arm)

    def _record(self, rec: Recommendation, arm: ArmResult, base: ArmResult) -> None:
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
        rec.status = "measured"
        rec.ratios = [round(r, 4) for r in arm.ratios]
        ratio = arm.ratio or 1.0
        rec.speedup = 1.0 / ratio if ratio > 0 else None
        if base.median is not None:
            rec.measured_seconds_saved_per_step = base.median * (1.0 - ratio)
        if self.options.check_accuracy:
            delta, noise = loss_delta(arm, base)
            if delta is not None:
                acc = rec.accuracy
                rec.accuracy = Accuracy(kind="loss" if acc.kind != "max_error" else "max_error",
                                        max_error=acc.max_error, loss_delta=delta, loss_noise=noise,
                                        detail="training loss over the measured steps, same seed")

    def _combine(self, candidates: list[Candidate], findings, measurer: Measurer, original: KnobSet) -> None:
        """Choose the changes that clearly paid off (one per group) and measure them together."""
        winners: dict[str, Candidate] = {}
        for c in candidates:
            r = c.rec
            if r.status != "measured" or r.speedup is None or not clear_gain(r.ratios or [], self.noise,
                                                                              self.same_ratios):
                continue  # too small, or within the run-to-run noise (clear_gain)
            if not self._may_choose(c):
                continue
            group = c.group or c.key
            if group not in winners or (winners[group].rec.speedup or 0) < r.speedup:
                winners[group] = c
        chosen = list(winners.values())
        for c in chosen:
            c.rec.selected = True
        if not chosen:
            noise = (f"beyond the run-to-run noise (below the original's own rounds beyond chance, or faster in "
                     f"every round by more than the {self.noise:.0%} the original strayed)" if self.same_ratios else
                     "beyond the run-to-run noise (not measured: the original's own runs did not fit the budget)")
            self.advice.notes.append(f"no change saved at least {MIN_GAIN:.0%} of the step on the median {noise}")
            self._refine([], candidates, findings, measurer, original)
            return
        fragments = [c.knobs for c in chosen if c.rec.applies == "knob"]
        if len(chosen) == 1:
            self.advice.combined = _alone(chosen[0])
            self._refine(chosen, candidates, findings, measurer, original)
            return
        combined = self._set_knobs("combined", chosen, findings)
        without = self._leave_one_out(chosen, findings, measurer)
        self.progress(f"measuring the {len(chosen)} chosen changes together"
                      + (", and with each one left out" if without else ""))
        base_arm, arms, complete = measurer.compare(original, [combined, *without], self.options.repeats, "combined")
        if not complete:
            self.advice.partial = True
        arm = arms[0]
        dropped = self._dropped(chosen, arm, arms[1:]) if without else None
        if dropped is not None:
            # One change made the others slower (bf16 autocast with a CPU attention
            # kernel that is slow in bf16, say): the rest, measured in the same rounds, win.
            index, paired = dropped
            left_out = chosen[index]
            left_out.rec.selected = False
            self.left_out.add(left_out.key)
            chosen = [c for c in chosen if c is not left_out]
            arm, combined = arms[1 + index], without[index]
            fragments = [c.knobs for c in chosen if c.rec.applies == "knob"]
            self.advice.notes.append(
                f"{left_out.rec.key} was left out of the chosen changes: without it the others took "
                f"{statistics.median(paired):.2f} of the step time of all of them together "
                f"({', '.join(f'{r:.2f}' for r in paired)} per round), though on its own it saved time")
        entry: dict[str, Any] = {"keys": [c.key for c in chosen], "status": "not_measured",
                                 "knobs": _merge_knobs(fragments)}
        if arm.error:
            entry.update(status="failed", error=arm.error)
        elif arm.ratio:
            entry.update(measured_figures(arm, base_arm))
        best = max(chosen, key=lambda c: c.rec.speedup or 0.0)
        if arm.ratio and 1.0 / arm.ratio >= (best.rec.speedup or 0.0) * (1.0 - MIN_GAIN):
            self.advice.combined = entry
            # The refining runs measure the same set again: its fixed files are reused.
            self._refine(chosen, candidates, findings, measurer, original, replace(combined, name="chosen"))
            return
        # Not measured together (out of --budget), failed together, or slower together
        # than the best of them alone (changes can interfere: two ways of compiling, a
        # loader setting that starves a compiled step): keep that one alone, whose
        # figure was measured.
        for c in chosen:
            c.rec.selected = c is best
        if not arm.ratio and not arm.error:
            self.advice.notes.append(f"the chosen changes were not measured together (out of --budget): only "
                                     f"{best.rec.key} is kept")
        else:
            together = f"failed ({arm.error})" if arm.error else f"{1.0 / arm.ratio:.2f}x"
            self.advice.notes.append(f"the {len(chosen)} chosen changes together measured {together}, less than "
                                     f"{best.rec.key} alone ({best.rec.speedup:.2f}x): only that one is kept")
        self.advice.combined = {**_alone(best), "together": {
            "keys": entry["keys"], "status": entry["status"], "speedup": entry.get("speedup"),
            "error": entry.get("error")}}

    def _chosen_run_seconds(self, chosen: Sequence[Candidate], measurer: Measurer) -> float:
        """How long one run making the chosen changes takes: as long as the slowest of
        theirs (a compiled run far longer than the original's), the usual run at least."""
        return max([measurer.expected_run_seconds()] + [self.run_seconds.get(c.key, 0.0) for c in chosen])

    def _leave_one_out(self, chosen: list[Candidate], findings, measurer: Measurer) -> list[KnobSet]:
        """With three or more chosen changes, the sets that leave one of them out, to
        be measured in the same rounds as all of them: changes that each save time
        can still cost time together. None when the budget has no room for them."""
        if not MIN_LEAVE_ONE_OUT <= len(chosen) <= MAX_LEAVE_ONE_OUT:
            return []
        if measurer.deadline is not None:
            per_run = self._chosen_run_seconds(chosen, measurer)
            runs = (2 + len(chosen)) * max(self.options.repeats, 1)
            if (measurer.remaining() or 0.0) < runs * per_run:
                self.advice.notes.append("the chosen changes were not also measured with each one left out "
                                         "(out of --budget)")
                return []
        return [self._set_knobs("without-" + c.key.replace(":", "-"), [o for o in chosen if o is not c], findings)
                for c in chosen]

    def _dropped(self, chosen: list[Candidate], together: ArmResult,
                 without: Sequence[ArmResult]) -> tuple[int, list[float]] | None:
        """The change whose leaving out made the rest clearly faster than all of them
        together (per round, the test a change passes against the original), and the
        per-round ratios; None when every one pulls its weight."""
        if together.error or len(together.ratios) < 2:
            return None
        best: tuple[float, int, list[float]] | None = None
        for index, arm in enumerate(without):
            if arm.error or len(arm.ratios) < len(together.ratios):
                continue
            paired = paired_ratios(arm, together.ratios)
            share = statistics.median(paired)
            if clear_gain(paired, self.noise, self.same_ratios) and (best is None or share < best[0]):
                best = (share, index, paired)
        return None if best is None else (best[1], best[2])

    def _set_knobs(self, name: str, members: Sequence[Candidate], findings) -> KnobSet:
        """The knob set that makes all of ``members``' changes at once (their knobs
        merged, their code fixes applied to copies of the files)."""
        fragment = _merge_knobs([c.knobs for c in members if c.rec.applies == "knob"])
        codes = [code for c in members if c.rec.applies == "code" for code in c.rec.rules]
        if codes:
            folder = self.workdir / name
            folder.mkdir(parents=True, exist_ok=True)
            fragment["sources"] = fixed_sources(findings, codes, folder, target=self.target)
        return self._knob_set(name, fragment)

    def _refining_variants(self, chosen: list[Candidate],
                           candidates: list[Candidate]) -> tuple[list[Candidate], list[list[Candidate]]]:
        """The small changes (measured, not chosen, not slower alone than the noise
        allows; the best of each group) and the variants to try: all of them at once,
        and the most promising one by one on top of a choice."""
        taken = {c.group or c.key for c in chosen}
        pool: dict[str, Candidate] = {}
        slack = 1.0 + max(MIN_GAIN, self.noise / 2)
        for c in candidates:
            group = c.group or c.key
            if c in chosen or group in taken or c.key in self.left_out or c.rec.status != "measured" \
                    or not c.rec.ratios or not self._may_choose(c) or statistics.median(c.rec.ratios) > slack:
                continue
            if group not in pool or statistics.median(c.rec.ratios) < statistics.median(pool[group].rec.ratios):
                pool[group] = c
        small = sorted(pool.values(), key=lambda c: statistics.median(c.rec.ratios or [1.0]))
        near = [c for c in small if promising(c.rec.ratios or [])][:MAX_NEAR_MISSES]
        variants: list[list[Candidate]] = [small] if len(small) >= 2 else []
        if chosen:  # with nothing chosen, one alone again would only be another round of its own
            variants += [[c] for c in near if [c] not in variants]
        return small, variants

    def _refine(self, chosen: list[Candidate], candidates: list[Candidate], findings, measurer: Measurer,
                original: KnobSet, chosen_set: KnobSet | None = None,
                only: list[list[Candidate]] | None = None) -> None:
        """Try the near misses on top of what was chosen, while the budget lasts.

        A change that saved time on its own but not clearly enough to be chosen may
        still belong in the best combination: its gain was within the noise of a few
        rounds, or it saves a fixed time per step (a fused optimizer) that is a larger
        share of the faster step the chosen changes make. Measured in the same rounds
        as the chosen set: the small changes all at once (those not slower alone by
        more than the noise allows), then each promising one on its own. The variant
        clearly faster than the chosen set (per round, the test a change passes
        against the original) joins the choice. One step of a local search that
        stands in for trying every combination."""
        if only is not None:
            small, variants = only[0], only
        else:
            small, variants = self._refining_variants(chosen, candidates)
        if not variants:
            return
        repeats = self.options.repeats
        if measurer.deadline is not None:
            per_run = self._chosen_run_seconds(chosen, measurer)
            room = int((measurer.remaining() or 0.0) / max(per_run, 1e-9))
            fit = room // max(repeats, 1) - 2
        else:
            fit = len(variants)
        tried, left_out = variants[:max(fit, 0)], variants[max(fit, 0):]
        if left_out:
            names = sorted({c.key for v in left_out for c in v} - {c.key for v in tried for c in v})
            if names:
                self.advice.notes.append("not tried on top of the chosen changes (out of --budget): "
                                         + ", ".join(names))
        if not tried:
            return
        sets = [self._set_knobs("chosen+" + "+".join(c.key.replace(":", "-") for c in v), chosen + v, findings)
                for v in tried]
        if chosen:
            self.progress(f"trying {', '.join(c.key for c in small)} on top of the {len(chosen)} chosen change(s)")
            sets.insert(0, chosen_set or self._set_knobs("chosen", chosen, findings))
        else:
            self.progress(f"trying {', '.join(c.key for c in small)} together")
        base_arm, arms, complete = measurer.compare(original, sets, repeats, "refining")
        if not complete:
            self.advice.partial = True
        set_arm = arms[0] if chosen else None
        variant_arms = arms[1:] if chosen else arms
        if set_arm is not None and (set_arm.error or not set_arm.ratios):
            return
        if complete and not self._more_refining_rounds(measurer, base_arm, set_arm, variant_arms):
            self.advice.partial = True
        # Against the chosen set in the same rounds, or the original itself.
        against = set_arm.ratios if set_arm is not None else [1.0] * len(base_arm.runs)
        best: tuple[float, list[Candidate], ArmResult, list[float]] | None = None
        hurting: list[Candidate] = []
        all_at_once: float | None = None  # the small changes together, on top: their share
        for v, arm in zip(tried, variant_arms):
            if arm.error or len(arm.ratios) < min(repeats, 2):
                continue  # a single round cut short by the budget decides nothing
            paired = paired_ratios(arm, against)
            share = statistics.median(paired)
            if v is small:
                all_at_once = share
            for c in v:
                others = ", ".join(o.key for o in v if o is not c)
                where = "on top of the chosen changes" + (f" with {others}" if others else "") if chosen \
                    else f"together with {others}"
                whose = "their" if chosen else "the original's"
                c.rec.detail = (c.rec.detail + " " if c.rec.detail else "") + f"({where}: {share:.2f} of {whose} step time)"
            if clear_gain(paired, self.noise, self.same_ratios) and (best is None or share < best[0]):
                best = (share, v, arm, paired)
            if len(v) == 1 and share > 1.0 + max(MIN_GAIN, self.noise / 2):
                hurting.append(v[0])
        if best is None:
            retry = self._smaller_sets(small, hurting, all_at_once, tried) if only is None and chosen \
                and small in tried else []
            if retry:
                # All at once was held back: by one that is slower on top of the chosen
                # changes (a fused kernel slow in the chosen precision), or by one not
                # tried alone. Smaller sets, in the same rounds, tell which.
                why = (f"{', '.join(c.key for c in hurting)} made the chosen changes slower on top of them"
                       if hurting else f"the small changes at once made the chosen changes slower "
                       f"({all_at_once:.2f} of their step time)")
                self.advice.notes.append(f"{why}: smaller sets of them were tried on top: "
                                         + "; ".join(" + ".join(c.key for c in v) for v in retry))
                self._refine(chosen, candidates, findings, measurer, original, sets[0], only=retry)
            return
        share, added, arm, paired = best
        for c in added:
            c.rec.selected = True
        members = chosen + added
        self.advice.combined = {"keys": [m.key for m in members], **measured_figures(arm, base_arm),
                                "knobs": _merge_knobs([m.knobs for m in members if m.rec.applies == "knob"])}
        names = ", ".join(c.key for c in added)
        per_round = f"({', '.join(f'{r:.2f}' for r in paired)} per round)"
        if chosen:
            self.advice.notes.append(
                f"{names} {'was' if len(added) == 1 else 'were'} added to the chosen changes: on top of them "
                f"{'it' if len(added) == 1 else 'together they'} took {share:.2f} of their step "
                f"time {per_round}, though on its own no such gain was clear")
        else:
            self.advice.notes.append(
                f"{names} were chosen together: together they took {share:.2f} of the "
                f"original's step time {per_round}, though on its own no such gain was clear")

    def _smaller_sets(self, small: list[Candidate], hurting: list[Candidate], all_at_once: float | None,
                      tried: list[list[Candidate]]) -> list[list[Candidate]]:
        """When the small changes all at once did not make the chosen set clearly
        faster, and one of them tried alone on top made it slower (or all at once
        did): the sets to try next. Without the ones that hurt; without the one that
        gained least alone; the better half by their gains alone. At most three."""
        slower = all_at_once is not None and all_at_once > 1.0 + max(MIN_GAIN, self.noise / 2)
        if not hurting and not slower:
            return []
        ranked = sorted((c for c in small if c not in hurting), key=lambda c: statistics.median(c.rec.ratios or [1.0]))
        options = [ranked] if hurting else []
        if len(ranked) >= 3:
            options.append(ranked[:-1])
        if len(ranked) >= 4:
            options.append(ranked[:(len(ranked) + 1) // 2])
        out: list[list[Candidate]] = []
        for v in options:
            if v and v != small and v not in out and v not in tried:
                out.append(v)
        return out[:3]

    def _more_refining_rounds(self, measurer: Measurer, base: ArmResult, set_arm: ArmResult | None,
                              variants: Sequence[ArmResult]) -> bool:
        """Further rounds, while the budget lasts, for the variants that look faster
        than the chosen set (or the original) but not yet clearly: a variant of small
        changes gains a few percent, which two rounds on a noisy machine seldom show.
        A variant dropped from a round is not taken up again, so that its ratios stay
        paired with the chosen set's round by round. False when the deadline cut a
        round short."""
        live = [a for a in variants if a.ok]
        extra = 0
        while True:
            against = set_arm.ratios if set_arm is not None else [1.0] * len(base.runs)
            live = [a for a in live if a.ok and len(a.ratios) == len(against) and len(a.ratios) < MAX_ROUNDS
                    and promising(paired_ratios(a, against))
                    and not clear_gain(paired_ratios(a, against), self.noise, self.same_ratios)]
            if not live or (set_arm is not None and not set_arm.ok):
                return True
            arms = ([set_arm] if set_arm is not None else []) + live
            if not measurer.fits(1 + len(arms)):
                return True
            extra += 1
            self.progress(f"refining: the budget allows more: round {len(base.runs) + 1} for "
                          f"{', '.join(a.name for a in live)}")
            try:
                if not measurer.round(base, arms, f"refining: extra round {extra}"):
                    return True
            except OutOfTime:
                return False

    def _may_choose(self, c: Candidate) -> bool:
        """Lower precision is chosen only with its accuracy measured."""
        r = c.rec
        return not (r.applies == "knob" and r.accuracy.kind == "unknown" and r.axis == "precision"
                    and not self.options.check_accuracy)


def _alone(c: Candidate) -> dict[str, Any]:
    """The ``combined`` entry of one change on its own: its own measured figures."""
    r = c.rec
    return {"keys": [r.key], "speedup": r.speedup, "ratios": r.ratios,
            "measured_seconds_saved_per_step": r.measured_seconds_saved_per_step, "status": "measured",
            "knobs": c.knobs if r.applies == "knob" else {}}


def advise(command: Sequence[str], options: AdviseOptions | None = None, **kwargs: Any) -> Advice:
    """Find, measure and rank what would make this training script faster."""
    return Advisor(command, options or AdviseOptions(), **kwargs).run()
