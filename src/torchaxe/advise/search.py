"""The search over changes once each was measured alone: choose the ones that clearly
paid off (one per group), measure them together and with each one left out, then try
the near misses on top of the choice (all at once, one by one, smaller sets), with
more rounds while the budget lasts. One step of a local search that stands in for
trying every combination."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Callable, Sequence

from torchaxe.advise.arms import ArmKnobs, merge_knobs
from torchaxe.advise.candidates import Candidate
from torchaxe.advise.measure import ArmResult, Measurer
from torchaxe.advise.stats import (DECIDE_ROUNDS, FEW_ROUNDS_GAIN, LOSS_TOLERANCE, MAX_ROUNDS, MIN_GAIN, Noise,
                                   clear_gain, loss_delta, measured_figures, paired_ratios, promising, with_one_time)
from torchaxe.runtime.knobs import KnobSet
from torchaxe.units import bytes_text

#: Changes tried one by one on top of the chosen ones (besides all of them at once).
MAX_NEAR_MISSES = 2
#: How many chosen changes are also measured with each one left out (more would cost
#: a run per change and round).
MIN_LEAVE_ONE_OUT, MAX_LEAVE_ONE_OUT = 3, 4
#: More chosen changes than that are measured with each one left out only when all of
#: them together failed, or gained less than this share of what their figures alone
#: predict (their product): one of them then likely undoes the others (a fused attention
#: that bf16 autocast sends to a CPU kernel slow in bf16).
SHORTFALL = 0.5
#: The axes whose knobs of unknown accuracy compute or sum in lower precision (mixed
#: precision, TF32, compressed gradients): chosen only with their training loss compared.
LOSS_JUDGED_AXES = ("precision", "distributed")


class ChangeSearch:
    """Chooses among the changes measured alone and measures the choice, within what
    ``measurer``'s deadline leaves. Notes for the user go to ``notes``; the choice
    measured together ends in ``combined``, and ``partial`` says whether the budget
    cut a comparison short. ``run_seconds``: each change's median run time."""

    def __init__(self, measurer: Measurer, noise: Noise, notes: list[str], *, arms: ArmKnobs, findings,
                 original: KnobSet, repeats: int, check_accuracy: bool = False,
                 loss_tolerance: float = LOSS_TOLERANCE,
                 run_seconds: dict[str, float] | None = None,
                 progress: Callable[[str], None] = lambda line: None, memory_limit: int | None = None,
                 original_over_limit: bool = False, job_steps: int | None = None,
                 job_source: str = "--job-steps", original_median: float | None = None) -> None:
        self.measurer = measurer
        #: The original's step time the report quotes: the time a set saves is a share
        #: of it, whatever the original took in the set's own rounds.
        self.original_median = original_median
        #: How far the original strayed from itself, and the A/A arm's per-round ratios.
        self.noise = noise.spread
        self.same_ratios = list(noise.same)
        self.notes = notes
        self.arms = arms
        self.findings = findings
        self.original = original
        self.repeats = repeats
        self.check_accuracy = check_accuracy
        #: How far apart the original's runs landed in training loss (None: not recorded).
        self.loss_noise = noise.loss
        self.loss_tolerance = loss_tolerance
        self.run_seconds = run_seconds or {}
        self.progress = progress
        #: The combined entry of the advice (None: nothing chosen yet).
        self.combined: dict[str, Any] | None = None
        self.partial = False
        #: Changes dropped by leave-one-out: measured on top of the others, they hurt.
        self.left_out: set[str] = set()
        #: Peak memory no chosen set may exceed (None: no limit), and whether the
        #: original itself exceeds it (then the fastest change that fits is chosen).
        self.memory_limit = memory_limit
        self.original_over_limit = original_over_limit
        #: The job's length in steps (--job-steps): a set whose one-time cost it does
        #: not pay back is not chosen (None: no length given).
        self.job_steps = job_steps
        self.job_source = job_source

    def _over_limit(self, arm: ArmResult) -> int | None:
        """The peak memory of a measured set when it exceeds the limit; None otherwise."""
        peak = arm.peak_memory
        if self.memory_limit is None or peak is None or peak[0] <= self.memory_limit:
            return None
        return peak[0]

    def _not_repaid(self, figures: dict[str, Any]) -> tuple[float, int | None] | None:
        """(one-time seconds, steps to pay them back) of a set measured together
        (``measured_figures``) whose one-time cost the job's --job-steps do not pay
        back: changes that each pay off in time can compile longer together and save
        less than their sum. None otherwise."""
        once = figures.get("one_time_seconds")
        if self.job_steps is None or not once:
            return None
        even = figures.get("break_even_steps")
        return None if even is not None and even <= self.job_steps else (once, even)

    def _clear(self, ratios: Sequence[float]) -> bool:
        return clear_gain(ratios, self.noise, self.same_ratios)

    def _changes(self, name: str, members: Sequence[Candidate]) -> KnobSet:
        return self.arms.of_changes(name, members, self.findings)

    def run(self, candidates: list[Candidate]) -> None:
        """Choose the changes that clearly paid off (one per group) and measure them together."""
        winners: dict[str, Candidate] = {}
        for c in candidates:
            r = c.rec
            if r.status != "measured" or r.speedup is None or not self._clear(r.ratios or []):
                continue  # too small, or within the run-to-run noise (clear_gain)
            if not self._may_choose(c):
                continue
            group = c.group or c.key
            if group not in winners or (winners[group].rec.speedup or 0) < r.speedup:
                winners[group] = c
        chosen, covered = _uncovered(list(winners.values()))
        for c, wider in covered:
            self.notes.append(f"{c.key} is not chosen on its own: {wider.key}, chosen, makes the same "
                              "settings and more")
        for c in chosen:
            c.rec.selected = True
        few = [c for c in chosen if len(c.rec.ratios or []) < DECIDE_ROUNDS]
        if few:
            rounds = min(len(c.rec.ratios or []) for c in few)
            self.notes.append(
                f"{', '.join(c.key for c in few)} {'was' if len(few) == 1 else 'were'} chosen on {rounds} round"
                f"{'' if rounds == 1 else 's'} (all the budget allowed), each faster in every round by more than "
                f"the original strayed from itself and by {FEW_ROUNDS_GAIN:.0%} or more; a longer --budget measures "
                f"the {DECIDE_ROUNDS} rounds or more that a median needs to confirm it")
        if not chosen and self.original_over_limit:
            fits = [c for c in candidates if c.rec.status == "measured" and c.rec.speedup and c.rec.memory is not None
                    and self._may_choose(c) and not c.rec.changes_optimisation]
            if fits:
                # The original does not fit: the fastest change that does is chosen, slower or not.
                best = max(fits, key=lambda c: c.rec.speedup or 0.0)
                best.rec.selected = True
                self.combined = alone(best)
                self.notes.append(f"{best.key} is chosen because the original exceeds --memory-limit and it fits "
                                  f"({best.rec.memory.text}, {best.rec.speedup:.2f}x the original's speed)")
                return
            self.notes.append("no measured change brought the peak memory under --memory-limit")
        if not chosen:
            noise = (f"beyond the run-to-run noise (below the original's own rounds beyond chance, or faster in "
                     f"every round by more than the {self.noise:.0%} the original strayed)" if self.same_ratios else
                     "beyond the run-to-run noise (not measured: the original's second run, which measures it, did "
                     "not fit the budget)")
            self.notes.append(f"no change saved at least {MIN_GAIN:.0%} of the step on the median {noise}")
            self._refine([], candidates)
            return
        fragments = [c.knobs for c in chosen if c.rec.applies == "knob"]
        if len(chosen) == 1:
            self.combined = alone(chosen[0])
            self._refine(chosen, candidates)
            return
        combined = self._changes("combined", chosen)
        without = self._leave_one_out(chosen)
        self.progress(f"measuring the {len(chosen)} chosen changes together"
                      + (", and with each one left out" if without else ""))
        base_arm, arms, complete = self.measurer.compare(self.original, [combined, *without], self.repeats, "combined")
        if not complete:
            self.partial = True
        arm = arms[0]
        if not without and len(chosen) > MAX_LEAVE_ONE_OUT and self._falls_short(chosen, arm):
            without = self._leave_one_out(chosen, wide=True)
            if without:
                self.notes.append(f"the {len(chosen)} chosen changes together "
                                  + (f"failed ({arm.error})" if arm.error else
                                     f"measured {1.0 / arm.ratio:.2f}x where their figures alone predicted "
                                     f"{self._predicted(chosen):.2f}x")
                                  + ": they were measured again, with each one left out")
                self.progress(f"measuring the {len(chosen)} chosen changes together again, with each one left out")
                base_arm, arms, complete = self.measurer.compare(self.original, [combined, *without], self.repeats,
                                                                 "each left out")
                if not complete:
                    self.partial = True
                arm = arms[0]
        dropped = self._dropped(chosen, arm, arms[1:]) if without else None
        rescued = self._rescued(arm, arms[1:]) if without and dropped is None else None
        if rescued is not None:
            # All of them together broke the run (two settings DDP cannot combine, say),
            # and leaving one out did not: the fastest such set is the choice.
            left_out = chosen[rescued]
            left_out.rec.selected = False
            self.left_out.add(left_out.key)
            error = arm.error
            chosen = [c for c in chosen if c is not left_out]
            arm, combined = arms[1 + rescued], without[rescued]
            fragments = [c.knobs for c in chosen if c.rec.applies == "knob"]
            self.notes.append(f"{left_out.rec.key} was left out of the chosen changes: with all of them together the "
                              f"run failed ({error}); without it the others went through")
        elif dropped is not None:
            # One change made the others slower (bf16 autocast with a CPU attention
            # kernel that is slow in bf16, say): the rest, measured in the same rounds, win.
            index, paired = dropped
            left_out = chosen[index]
            left_out.rec.selected = False
            self.left_out.add(left_out.key)
            chosen = [c for c in chosen if c is not left_out]
            arm, combined = arms[1 + index], without[index]
            fragments = [c.knobs for c in chosen if c.rec.applies == "knob"]
            self.notes.append(
                f"{left_out.rec.key} was left out of the chosen changes: without it the others took "
                f"{statistics.median(paired):.2f} of the step time of all of them together "
                f"({', '.join(f'{r:.2f}' for r in paired)} per round), though on its own it saved time")
        entry: dict[str, Any] = {"keys": [c.key for c in chosen], "status": "not_measured",
                                 "knobs": merge_knobs(fragments)}
        if arm.error:
            entry.update(status="failed", error=arm.error)
        elif arm.ratio:
            entry.update(_members_one_time(measured_figures(arm, base_arm, self.original_median), chosen))
        best = max(chosen, key=lambda c: c.rec.speedup or 0.0)
        loss = self._loss_beyond(arm, base_arm)
        over = None if arm.error else self._over_limit(arm)
        late = self._not_repaid(entry) if arm.ratio else None
        # Together they must not be slower than the best of them alone by more than the
        # runs' own noise allows: one round of the set against the best's rounds, on a
        # machine whose original strays by 20%, differs by more than 3% by chance alone.
        slack = 1.0 + max(MIN_GAIN, self.noise / 2)
        if arm.ratio and slack / arm.ratio >= (best.rec.speedup or 0.0) and loss is None \
                and over is None and late is None:
            self.combined = entry
            # The refining runs measure the same set again: its fixed files are reused.
            self._refine(chosen, candidates, replace(combined, name="chosen"))
            return
        # Not measured together (out of --budget), failed together, or slower together
        # than the best of them alone (changes can interfere: two ways of compiling, a
        # loader setting that starves a compiled step): keep that one alone, whose
        # figure was measured.
        for c in chosen:
            c.rec.selected = c is best
        if not arm.ratio and not arm.error:
            self.notes.append(f"the --budget ended before the chosen changes finished a round together (out of "
                              f"--budget): only {best.rec.key} is kept")
        elif over is not None:
            self.notes.append(f"the {len(chosen)} chosen changes together peaked at {bytes_text(over)}, above "
                              f"--memory-limit ({bytes_text(self.memory_limit)}): only {best.rec.key} is kept")
        elif late is not None:
            once, even = late
            if even is not None:
                pays = f"pays off only after {even:,} steps, more than the job's {self.job_steps:,} ({self.job_source})"
            else:
                pays = f"is never paid back, as they save no time per step ({self.job_source})"
            self.notes.append(f"the {len(chosen)} chosen changes together cost {once:.1f} s once, before their first "
                              f"fast step, which {pays}: only {best.rec.key} is kept")
        elif loss is not None:
            self.notes.append(f"the {len(chosen)} chosen changes together changed the training loss by {loss:+.2%}, "
                              f"beyond the run-to-run loss noise by more than the {self.loss_tolerance:.1%} "
                              f"tolerance: only {best.rec.key} is kept")
        else:
            together = f"failed ({arm.error})" if arm.error else f"{1.0 / arm.ratio:.2f}x"
            self.notes.append(f"the {len(chosen)} chosen changes together measured {together}, less than "
                              f"{best.rec.key} alone ({best.rec.speedup:.2f}x): only that one is kept")
        self.combined = {**alone(best), "together": {
            "keys": entry["keys"], "status": entry["status"], "speedup": entry.get("speedup"),
            "error": entry.get("error")}}
        # The near misses may still pay off on top of the one kept (bf16 autocast, no
        # gain alone, fused into a compiled graph); the others chosen with it were
        # just measured on top of it.
        self.left_out.update(c.key for c in chosen if c is not best)
        self._refine([best], candidates)

    def _loss_beyond(self, arm: ArmResult, base: ArmResult) -> float | None:
        """The difference of a set's training loss from the original's (same rounds)
        when it lands beyond the run-to-run loss noise by more than the tolerance:
        changes each within it can add up beyond it. None otherwise."""
        if not self.check_accuracy:
            return None
        delta = loss_delta(arm, base)
        if delta is None or abs(delta) <= (self.loss_noise or 0.0) + self.loss_tolerance:
            return None
        return delta

    def _chosen_run_seconds(self, chosen: Sequence[Candidate]) -> float:
        """How long one run making the chosen changes takes: as long as the slowest of
        theirs (a compiled run far longer than the original's), the usual run at least."""
        return max([self.measurer.expected_run_seconds()] + [self.run_seconds.get(c.key, 0.0) for c in chosen])

    @staticmethod
    def _predicted(chosen: Sequence[Candidate]) -> float:
        """The speed-up the chosen changes would give together if each kept its gain
        alone: the product of their measured speed-ups."""
        predicted = 1.0
        for c in chosen:
            predicted *= c.rec.speedup or 1.0
        return predicted

    def _falls_short(self, chosen: Sequence[Candidate], together: ArmResult) -> bool:
        """Whether the chosen changes measured together failed, or gained less than
        ``SHORTFALL`` of what their figures alone predict."""
        if together.error:
            return True
        if not together.ratio:
            return False
        predicted = self._predicted(chosen)
        return predicted > 1.0 and 1.0 / together.ratio - 1.0 < SHORTFALL * (predicted - 1.0)

    def _leave_one_out(self, chosen: list[Candidate], wide: bool = False) -> list[KnobSet]:
        """With three to ``MAX_LEAVE_ONE_OUT`` chosen changes (``wide``: three or
        more), the sets that leave one of them out, to be measured in the same rounds
        as all of them: changes that each save time can still cost time together.
        None when the budget has no room for them."""
        if len(chosen) < MIN_LEAVE_ONE_OUT or (len(chosen) > MAX_LEAVE_ONE_OUT and not wide):
            return []
        if self.measurer.deadline is not None:
            per_run = self._chosen_run_seconds(chosen)
            runs = (2 + len(chosen)) * max(self.repeats, 1)
            if (self.measurer.remaining() or 0.0) < runs * per_run:
                self.notes.append("the chosen changes were not also measured with each one left out "
                                  "(out of --budget)")
                return []
        return [self._changes("without-" + c.key.replace(":", "-"), [o for o in chosen if o is not c])
                for c in chosen]

    def _rescued(self, together: ArmResult, without: Sequence[ArmResult]) -> int | None:
        """When all the chosen changes together failed: the index of the left-out
        change whose set went through fastest (within the memory limit); None when the
        set did not fail or no set without one of them went through."""
        if not together.error:
            return None
        fine = [(statistics.median(arm.ratios), index) for index, arm in enumerate(without)
                if not arm.error and arm.ratios and self._over_limit(arm) is None]
        return min(fine)[1] if fine else None

    def _dropped(self, chosen: list[Candidate], together: ArmResult,
                 without: Sequence[ArmResult]) -> tuple[int, list[float]] | None:
        """The change whose leaving out made the rest clearly faster than all of them
        together (per round, the test a change passes against the original), and the
        per-round ratios; None when every one pulls its weight."""
        if together.error or len(together.ratios) < 2:
            return None
        best: tuple[float, int, list[float]] | None = None
        for index, arm in enumerate(without):
            if arm.error or len(arm.ratios) < len(together.ratios) or self._over_limit(arm) is not None:
                continue
            paired = paired_ratios(arm, together.ratios)
            share = statistics.median(paired)
            if self._clear(paired) and (best is None or share < best[0]):
                best = (share, index, paired)
        return None if best is None else (best[1], best[2])

    def _refining_variants(self, chosen: list[Candidate],
                           candidates: list[Candidate]) -> tuple[list[Candidate], list[list[Candidate]]]:
        """The small changes (measured, not chosen, not slower alone than the noise
        allows; the best of each group) and the variants to try: all of them at once,
        and the most promising one by one on top of a choice.

        With nothing chosen, the set is tried on the original: only the changes that
        were faster alone by median go in, gains too small to be clear alone that may
        add up. One that saved nothing alone adds only its rounds' noise (and, for a
        compile, its one-time cost): on a 10 ms LSTM step bfloat16 (0.93 alone) with
        compile (1.00 alone) passed on three lucky rounds and ran 0.95x when applied."""
        taken = {c.group or c.key for c in chosen}
        pool: dict[str, Candidate] = {}
        slack = 1.0 + max(MIN_GAIN, self.noise / 2) if chosen else 1.0 - MIN_GAIN / 3
        for c in candidates:
            group = c.group or c.key
            if c in chosen or group in taken or c.key in self.left_out or c.rec.status != "measured" \
                    or not c.rec.ratios or not self._may_choose(c) or statistics.median(c.rec.ratios) > slack:
                continue
            if group not in pool or statistics.median(c.rec.ratios) < statistics.median(pool[group].rec.ratios):
                pool[group] = c
        # knob:compile beside knob:compile-dropout-packed: tried together, the two are the wider.
        small = sorted(_uncovered(list(pool.values()))[0], key=lambda c: statistics.median(c.rec.ratios or [1.0]))
        near = [c for c in small if promising(c.rec.ratios or [])][:MAX_NEAR_MISSES]
        variants: list[list[Candidate]] = [small] if len(small) >= 2 else []
        if chosen:  # with nothing chosen, one alone again would only be another round of its own
            variants += [[c] for c in near if [c] not in variants]
        return small, variants

    def _refine(self, chosen: list[Candidate], candidates: list[Candidate], chosen_set: KnobSet | None = None,
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
        repeats = self.repeats
        if self.measurer.deadline is not None:
            per_run = self._chosen_run_seconds(chosen)
            room = int((self.measurer.remaining() or 0.0) / max(per_run, 1e-9))
            fit = room // max(repeats, 1) - 2
        else:
            fit = len(variants)
        tried, left_out = variants[:max(fit, 0)], variants[max(fit, 0):]
        if left_out:
            names = sorted({c.key for v in left_out for c in v} - {c.key for v in tried for c in v})
            if names:
                self.notes.append(("not tried on top of the chosen changes" if chosen else "not tried together")
                                  + " (out of --budget): " + ", ".join(names))
        if not tried:
            return
        sets = [self._changes("chosen+" + "+".join(c.key.replace(":", "-") for c in v), chosen + v)
                for v in tried]
        if chosen:
            self.progress(f"trying {', '.join(c.key for c in small)} on top of the {len(chosen)} chosen change(s)")
            sets.insert(0, chosen_set or self._changes("chosen", chosen))
        else:
            self.progress(f"trying {', '.join(c.key for c in small)} together")
        base_arm, arms, complete = self.measurer.compare(self.original, sets, repeats, "refining")
        if not complete:
            self.partial = True
        set_arm = arms[0] if chosen else None
        variant_arms = arms[1:] if chosen else arms
        if set_arm is not None and (set_arm.error or not set_arm.ratios):
            return
        if complete and not self._more_refining_rounds(base_arm, set_arm, variant_arms):
            self.partial = True
        # Against the chosen set in the same rounds, or the original itself.
        against = set_arm.ratios if set_arm is not None else [1.0] * len(base_arm.runs)
        best: tuple[float, list[Candidate], ArmResult, list[float]] | None = None
        hurting: list[Candidate] = []
        all_at_once: float | None = None  # the small changes together, on top: their share
        cut: list[tuple[list[Candidate], float | None]] = []
        for v, arm in zip(tried, variant_arms):
            if arm.error or len(arm.ratios) < min(repeats, 2):
                # A single round cut short by the budget decides nothing; said below.
                if not arm.error:
                    cut.append((v, statistics.median(paired_ratios(arm, against)) if arm.ratios else None))
                continue
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
            if self._clear(paired) and (best is None or share < best[0]) and self._loss_beyond(arm, base_arm) is None \
                    and self._over_limit(arm) is None \
                    and self._not_repaid(measured_figures(arm, base_arm, self.original_median)) is None:
                best = (share, v, arm, paired)
            if len(v) == 1 and share > 1.0 + max(MIN_GAIN, self.noise / 2):
                hurting.append(v[0])
        if best is None and cut:
            where = "on top of the chosen changes" if chosen else "together"
            whose = "their" if chosen else "the original's"
            for v, share in cut:
                seen = (f"{share:.2f} of {whose} step time in the one round made" if share is not None
                        else "no round finished")
                self.notes.append(f"{' + '.join(c.key for c in v)} {'were' if len(v) > 1 else 'was'} tried {where} "
                                  f"but the --budget ended before a second round ({seen}): too little to add "
                                  f"{'them' if len(v) > 1 else 'it'} (out of --budget)")
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
                self.notes.append(f"{why}: smaller sets of them were tried on top: "
                                  + "; ".join(" + ".join(c.key for c in v) for v in retry))
                self._refine(chosen, candidates, sets[0], only=retry)
            elif all_at_once is not None:
                # Said, not only put in each change's detail: the report's table shows no detail.
                where = "on top of the chosen changes" if chosen else "together"
                whose = "their" if chosen else "the original's"
                self.notes.append(f"{', '.join(c.key for c in small)} were tried {where}: {all_at_once:.2f} of "
                                  f"{whose} step time, not clearly faster (not chosen)")
            return
        share, added, arm, paired = best
        for c in added:
            c.rec.selected = True
        members = chosen + added
        figures = measured_figures(arm, base_arm, self.original_median)
        self.combined = {"keys": [m.key for m in members], **_members_one_time(figures, members),
                         "knobs": merge_knobs([m.knobs for m in members if m.rec.applies == "knob"])}
        names = ", ".join(c.key for c in added)
        per_round = f"({', '.join(f'{r:.2f}' for r in paired)} per round)"
        if chosen:
            self.notes.append(
                f"{names} {'was' if len(added) == 1 else 'were'} added to the chosen changes: on top of them "
                f"{'it' if len(added) == 1 else 'together they'} took {share:.2f} of their step "
                f"time {per_round}, though on its own no such gain was clear")
        else:
            self.notes.append(
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

    def _more_refining_rounds(self, base: ArmResult, set_arm: ArmResult | None,
                              variants: Sequence[ArmResult]) -> bool:
        """Further rounds, while the budget lasts, for the variants that look faster
        than the chosen set (or the original) but not yet clearly: a variant of small
        changes gains a few percent, which two rounds on a noisy machine seldom show.
        A variant dropped from a round is not taken up again, so that its ratios stay
        paired with the chosen set's round by round. False when the deadline cut a
        round short."""
        live = [a for a in variants if a.ok]

        def plan() -> list[ArmResult]:
            nonlocal live
            against = set_arm.ratios if set_arm is not None else [1.0] * len(base.runs)
            live = [a for a in live if a.ok and len(a.ratios) == len(against) and len(a.ratios) < MAX_ROUNDS
                    and promising(paired_ratios(a, against))
                    and not self._clear(paired_ratios(a, against))]
            if not live or (set_arm is not None and not set_arm.ok):
                return []
            arms = ([set_arm] if set_arm is not None else []) + live
            if not self.measurer.fits(1 + len(arms)):
                return []
            self.progress(f"refining: the budget allows more: round {len(base.runs) + 1} for "
                          f"{', '.join(a.name for a in live)}")
            return arms

        return self.measurer.more_rounds(base, plan, "refining")

    def _may_choose(self, c: Candidate) -> bool:
        """Lower precision (autocast, TF32, compressed gradients) and a larger batch
        are chosen only with their accuracy measured, and no change held back (its
        training loss beyond the noise by more than the tolerance, its peak memory
        above the limit)."""
        r = c.rec
        if r.accuracy.beyond_tolerance or r.held_back:
            return False
        if r.changes_optimisation and r.accuracy.kind == "unknown":
            return False  # a larger batch without its loss compared
        return not (r.applies == "knob" and r.accuracy.kind == "unknown" and r.axis in LOSS_JUDGED_AXES)


def _uncovered(chosen: list[Candidate]) -> tuple[list[Candidate], list[tuple[Candidate, Candidate]]]:
    """``chosen`` less each knob change that another of them makes and more
    (knob:compile beside knob:compile-dropout-packed, which compiles too; of two
    alike, the later goes), and the (left out, wider) pairs."""
    covering = {id(c): o for i, c in enumerate(chosen) for j, o in enumerate(chosen)
                if i != j and _contains(o, c) and not (j > i and _contains(c, o))}
    return ([c for c in chosen if id(c) not in covering],
            [(c, covering[id(c)]) for c in chosen if id(c) in covering])


def _contains(wider: Candidate, c: Candidate) -> bool:
    """Whether knob change ``wider`` sets every knob ``c`` sets, to the same value."""
    if wider.rec.applies != "knob" or c.rec.applies != "knob" or not c.knobs:
        return False
    return all(key in wider.knobs and wider.knobs[key] == value for key, value in c.knobs.items())


def alone(c: Candidate) -> dict[str, Any]:
    """The ``combined`` entry of one change on its own: its own measured figures, its
    one-time cost among them (a compile's, which a job's total counts)."""
    r = c.rec
    once = {key: value for key, value in (
        ("one_time_seconds", r.one_time_seconds), ("break_even_steps", r.break_even_steps),
        ("one_time_seconds_first", r.one_time_seconds_first),
        ("one_time_cold_only", r.one_time_cold_only or None)) if value is not None}
    return {"keys": [r.key], "speedup": r.speedup, "ratios": r.ratios,
            "measured_seconds_saved_per_step": r.measured_seconds_saved_per_step, "status": "measured",
            "knobs": c.knobs if r.applies == "knob" else {}, **({"ranks": r.ranks} if r.ranks else {}), **once}


def _members_one_time(figures: dict[str, Any], members: Sequence[Candidate]) -> dict[str, Any]:
    """A set's figures with a one-time cost when its own runs showed none but one of
    its changes did alone: the set's runs come after the changes' own, whose compiles
    filled the compiler's caches, while a job compiles again (from those caches, on
    this machine: the members' costs are what their runs after the first paid). The
    largest of the members' costs, and the steps the set's saving takes to pay it back."""
    if figures.get("one_time_seconds"):
        return figures
    once = max((m.rec.one_time_seconds or 0.0 for m in members), default=0.0)
    if not once:
        return figures
    return with_one_time(figures, once, figures.get("measured_seconds_saved_per_step") or 0.0)
