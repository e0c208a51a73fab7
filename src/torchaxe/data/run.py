"""``analyse``: one ``torchaxe data`` run, from the command to the report.

1. the script runs in-process under the profile harness with the loader and copy
   probes (:mod:`torchaxe.data.probes`);
2. each loader that fed the steps has its dataset sampled, stage by stage
   (:mod:`torchaxe.data.sampling`);
3. the decoders are benchmarked on the image files the samples opened (or
   ``--images``) (:mod:`torchaxe.data.decoders`);
4. the scanner's AX4xx/AX306 findings in the files that built the loaders are joined
   with the runtime evidence (:mod:`torchaxe.data.analysis`);
5. with ``--tune``, the loader search runs trials on the script and the best setting
   is stored in the knowledge base (:mod:`torchaxe.data.tuning`).

Whatever the script does (raises in ``__getitem__``, hangs, exits), what was measured
is reported, with the harness's exit code; nothing is stored from a failed run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torchaxe.errors import TorchaxeError


@dataclass(frozen=True)
class DataOptions:
    steps: int = 10
    warmup: int = 2
    timeout: float | None = 300.0
    target: str = "auto"
    samples: int = 24
    sample_timeout: float = 30.0
    images: str | None = None
    decode_files: int = 24
    decode_repeats: int = 5
    decoders: bool = True
    scan: bool = True
    tune: bool = False
    grid: bool = False
    trial_steps: int = 8
    trial_warmup: int = 3
    repeats: int = 1
    max_trials: int = 12
    trial_timeout: float | None = 180.0
    kb_path: str | None = None
    store: bool = True


@contextlib.contextmanager
def _script_output_to_stderr() -> Iterator[None]:
    """The report is this command's output on stdout: while the script runs, what it
    prints (and what its worker processes print) goes to stderr instead."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedded interpreter): Python-level only
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            try:
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 1)
            os.close(saved)


def _spread(files: list[Any], count: int) -> list[Any]:
    """``count`` files spread evenly over the list (deterministic)."""
    if len(files) <= count:
        return list(files)
    step = len(files) / count
    return [files[int(i * step)] for i in range(count)]


def analyse(argv: list[str], options: DataOptions | None = None,
            progress: Callable[[str], None] = lambda line: None) -> tuple[Any, int | None]:
    """Run the whole analysis; returns the report and the exit code when the run did
    not end well (None when it was measured)."""
    from torchaxe.data.analysis import (
        DataReport, copy_summary, estimate, join_findings, judge, scan_for_loaders, step_splits,
    )
    from torchaxe.data.probes import CopyProbe, LoaderProbe
    from torchaxe.data.sampling import sample_loader
    from torchaxe.data.tuning import cores_for_this_rank
    from torchaxe.runtime.command import parse_command
    from torchaxe.runtime.harness import DEFAULT_FIRST_STEP_TIMEOUT, Harness, HarnessOptions, exit_code_for
    from torchaxe.runtime.probes import CodeMap

    options = options or DataOptions()
    script = parse_command(argv)
    harness_options = HarnessOptions(steps=options.steps, warmup=options.warmup, timeout=options.timeout,
                                     target=options.target, first_step_timeout=DEFAULT_FIRST_STEP_TIMEOUT)
    codes = CodeMap()
    loaders = LoaderProbe(codes=codes)
    copies = CopyProbe()

    def abandon(measured) -> None:
        sys.stderr.write(f"torchaxe data: error: {measured.detail}; the script ignored the interrupt, "
                         "nothing more can be measured\n")
        sys.stderr.flush()
        os._exit(exit_code_for(measured))

    progress(f"running {script.display} under the harness ({options.warmup} warmup + {options.steps} steps) ...")
    with _script_output_to_stderr():
        profile = Harness(harness_options, abandon=abandon, probes=[loaders.attach, copies.attach]).run(script)
    code = exit_code_for(profile)
    failed = code != 0
    if profile.error is not None and profile.error.traceback:
        sys.stderr.write(profile.error.traceback)
    steps = step_splits(profile, copies)
    target = profile.run.target
    report = DataReport(
        command=list(argv), target=target, status=profile.status, detail=profile.detail, steps=steps,
        loaders=list(loaders.records), stages={}, copies=copy_summary(copies, steps, target),
        cores=cores_for_this_rank(), warnings=list(profile.warnings),
        error=f"{profile.detail}" if failed else None,
        profile_summary=profile.summary.to_dict(),
    )

    # 2. sampling: the loaders that fed the run (the first one when none did)
    fed = [r for r in loaders.records if r.batches] or loaders.records[:1]
    for record in fed:
        if not options.samples or record.dataset is None:
            continue
        progress(f"sampling {options.samples} items of loader {record.index} ({record.dataset_type}) ...")
        report.stages[record.index] = sample_loader(record, options.samples, timeout=options.sample_timeout,
                                                    codes=codes)
    # 3. decoders
    if options.decoders:
        from torchaxe.data.decoders import benchmark_decoders, find_image_files

        if options.images is not None:
            files: list[Any] = find_image_files(options.images)
            if not files:
                report.warnings.append(f"--images {options.images}: no image files there")
        else:
            files = []
            for stages in report.stages.values():
                files.extend(f for f in stages.image_files if f not in files)
        if files:
            chosen = _spread(files, options.decode_files)
            progress(f"benchmarking the decoders on {len(chosen)} image files ...")
            report.decoders = benchmark_decoders(chosen, repeats=options.decode_repeats)
    # 4. static meets runtime (the tuned figures are added after tuning)
    findings: list[Any] = []
    if options.scan:
        files_to_scan = [r.file for r in loaders.records if r.file]
        if script.kind == "path":
            files_to_scan.append(script.target)
        try:
            findings = scan_for_loaders(files_to_scan, target)
        except TorchaxeError as exc:
            report.warnings.append(f"scan: {exc.message}")
    report.estimate = estimate(report)
    report.verdict = judge(report)
    # 5. tuning
    if options.tune:
        if failed or not steps:
            report.warnings.append("--tune skipped: the run was not measured (see the error above)")
        else:
            report.tuning = _tune(argv, options, report, progress)
            if report.tuning.best is not None and options.store:
                from torchaxe.data.tuning import store_best

                import torch

                try:
                    report.stored = store_best(report.tuning, argv, kb_path=options.kb_path, env={
                        "target": target, "cores": report.cores, "torch": torch.__version__,
                        "hostname": profile.run.hostname})
                except TorchaxeError as exc:
                    report.warnings.append(f"knowledge base: {exc.message}")
    report.joined, report.loader_lines = join_findings(findings, report.loaders, steps, report.stages,
                                                       report.decoders, report.tuning)
    return report, (code if failed else None)


def _tune(argv: list[str], options: DataOptions, report: Any, progress: Callable[[str], None]) -> Any:
    from torchaxe.data.tuning import LoaderTuner, TuneOptions

    main = report.main_loader
    tuner = LoaderTuner(
        argv,
        TuneOptions(steps=options.trial_steps, warmup=options.trial_warmup, repeats=options.repeats,
                    timeout=options.trial_timeout, target=options.target, max_trials=options.max_trials),
        cores=report.cores,
        batch_size=main.batch_size if main is not None else None,
        accelerator=report.target != "cpu",
        progress=progress,
    )
    if options.grid:
        progress(f"measuring the full grid ({len(tuner.space()) + 1} points) ...")
        return tuner.grid(report.estimate)
    progress(f"searching loader settings from {report.estimate.get('workers')} workers "
             f"(at most {options.max_trials} trials) ...")
    return tuner.search(report.estimate)
