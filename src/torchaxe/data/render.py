"""The text form of a data report (``torchaxe data``); the JSON form is ``DataReport.to_dict``."""

from __future__ import annotations

from typing import TextIO

from torchaxe.data.analysis import DataReport, ms, pct
from torchaxe.runtime.stats import Samples
from torchaxe.units import plural

#: Per-step rows shown (the JSON has them all).
STEP_ROWS = 12


def render_data_report(report: DataReport, out: TextIO, rank: tuple[int, int] | None = None) -> None:
    """The report for people. ``rank``: (this rank, world size) under torchrun, where
    the other ranks print their verdicts on stderr."""
    w = out.write
    w(f"data: {' '.join(report.command)}\n")
    if rank is not None:
        w(f"  rank        {rank[0]} of {rank[1]}; the other ranks' verdicts are on stderr\n")
    w(f"  run         {report.status}: {report.detail} (target {report.target}, {plural(report.cores, 'core')} for this rank)\n")
    if report.error:
        w(f"  error       {report.error}\n")
    verdict = report.verdict
    if verdict is not None:
        w(f"\nverdict: {verdict.headline}\n")
        for reason in verdict.reasons:
            w(f"  - {reason}\n")
        for suggestion in verdict.suggestions:
            w(f"  try: {suggestion}\n")

    if report.steps:
        w("\nsteps (measured)   step       data wait  compute    wait %\n")
        for s in report.steps[:STEP_ROWS]:
            w(f"  {s.index:>4}            {ms(s.seconds):>9}  {ms(s.wait_seconds):>9}  {ms(s.compute_seconds):>9}  "
              f"{pct(s.wait_fraction):>6}\n")
        if len(report.steps) > STEP_ROWS:
            w(f"  ... {len(report.steps) - STEP_ROWS} more in --format json\n")
        computes = Samples.of(s.compute_seconds for s in report.steps)
        w(f"  median compute {ms(computes.median)} per step; data wait {pct(report.wait_fraction)} of all step time\n")

    copies = report.copies
    if copies:
        if copies.get("applicable"):
            w(f"  host-to-device copies: {ms(copies.get('host_to_device_seconds_per_step'))} per step "
              f"({pct(copies.get('host_to_device_fraction'))}), {copies.get('blocking_copies')} blocking; "
              f"pinning {ms(copies.get('pin_seconds_per_batch'))} per batch over {copies.get('pinned_batches')} batches\n")
        else:
            w("  host-to-device copies: none on the cpu (the device is the host); pinning: n/a\n")

    if report.loaders:
        w("\nloaders\n")
        for line in report.loader_lines:
            w(f"  {line}\n")
        for record in report.loaders:
            stages = report.stages.get(record.index)
            if stages is None:
                continue
            st = stages.stage_seconds()
            w(f"  loader {record.index} ({stages.dataset_type}): {len(stages.sample_seconds)} samples: "
              f"{ms(stages.per_sample_seconds)} per sample, {ms(stages.per_batch_seconds)} per batch of "
              f"{stages.batch_size} in one process\n")
            if stages.sample_seconds:
                w("    stages: " + ", ".join(f"{name} {ms(st[name])}" for name in ("read", "decode", "transform", "collate"))
                  + " (per sample)\n")
            if record.iterator_seconds:
                w(f"    iterator starts: {len(record.iterator_seconds)}, median "
                  f"{ms(Samples.of(record.iterator_seconds).median)}\n")
            for error in stages.errors:
                w(f"    error: {error.text()}\n")
            if stages.collate_error:
                w(f"    error: {stages.collate_error}\n")
            if stages.hung:
                w(f"    hung: {stages.hung}\n")

    if report.joined:
        w("\ncode and measurement\n")
        for joined in report.joined:
            w(f"  {joined.message}\n")

    decoders = report.decoders
    if decoders is not None:
        w(f"\ndecoders on {len(decoders.files)} of your image files ({', '.join(f'{k} {v}' for k, v in sorted(decoders.formats.items()))}), "
          f"{decoders.repeats} repeats, bytes already in memory\n")
        for result in decoders.results:
            speed = decoders.speedup(result.name)
            w(f"  {result.name:<12} median {ms(result.median_seconds):>9} per image   "
              f"{('%.2fx PIL' % speed) if speed else 'n/a':>10}   {result.agreement()}"
              + (f"; {result.failures} failed (first: {result.first_failure})" if result.failures else "") + "\n")
        if decoders.unavailable:
            w(f"  not installed here: {', '.join(decoders.unavailable)}\n")
        fastest = decoders.fastest
        if fastest is not None:
            speed = decoders.speedup(fastest.name)
            w(f"  fastest: {fastest.name}" + (f", {speed:.2f}x PIL" if speed else "") + "\n")
        for path, reason in decoders.undecodable[:5]:
            w(f"  cannot decode {path}: {reason}\n")
        if len(decoders.undecodable) > 5:
            w(f"  ... {len(decoders.undecodable) - 5} more undecodable files\n")

    tuning = report.tuning
    if tuning is not None:
        w(f"\nloader tuning ({tuning.mode}): {tuning.trials} trial runs; {tuning.stopped_because}\n")
        est = tuning.estimate
        if est:
            w(f"  estimate: load {ms(est.get('load_seconds_per_batch'))} per batch / compute "
              f"{ms(est.get('compute_seconds_per_step'))} per step -> {est.get('workers')} workers "
              f"(of {plural(est['cores'], 'core') if est.get('cores') else 'an unknown number of cores'})\n")
        w("  #   settings                                                    throughput   mean step      wait\n")
        best = tuning.best
        for r in tuning.results:
            mark = "*" if r is best else " "
            rate = f"{r.throughput:.1f} {'samples/s' if r.batch_size else 'steps/s'}" if r.throughput else "FAILED"
            w(f" {mark}{r.order:<3} {r.point.label:<58}  {rate:>16}  {ms(r.mean_step_seconds):>9}  "
              f"{pct(r.wait_fraction):>6}\n")
            if not r.ok:
                w(f"      {r.error}\n")
        if best is not None:
            speed = tuning.speedup()
            w(f"  best: {best.point.label}" + (f", {speed:.2f}x the script as written" if speed else "") + "\n")
    if report.stored is not None:
        w(f"  stored in the knowledge base as the dataloader setting of this command: "
          f"{report.stored['setting'] or '(as written)'}\n")
    for warning in report.warnings:
        w(f"warning: {warning}\n")
