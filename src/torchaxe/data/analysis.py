"""The data report: what the run waited for, why, and what the code says about it.

:func:`build_report` puts together the profile (per-step data wait and compute), the
loader probes (settings, worker start-ups, worker CPU use, per-loader wait), the copy
probe (host-to-device copies, pinning), the stage sampling of each loader's dataset,
the decoder benchmark, the scanner's AX4xx findings and, when tuning ran, the tuned
settings; :func:`judge` turns the evidence into a verdict with its reasons. All of it
is plain data (``to_dict``, schema ``torchaxe.data/1``); rendering is in
``torchaxe.data.render``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torchaxe.runtime.stats import Samples
from torchaxe.units import duration, plural

SCHEMA = "torchaxe.data/1"
#: At or above this fraction of the step spent waiting for data, the run is data-bound.
DATA_BOUND = 0.10
#: Below this, the device hardly waits (the tuning search stops here too).
WAIT_TARGET = 0.02
#: Worker CPU use above this means the workers cannot keep up.
BUSY_WORKERS = 0.80
#: Codes whose findings are joined with runtime evidence.
SCAN_CODES = ("AX4", "AX306")


@dataclass
class StepSplit:
    index: int
    seconds: float
    wait_seconds: float
    copy_seconds: float

    @property
    def compute_seconds(self) -> float:
        return max(0.0, self.seconds - self.wait_seconds)

    @property
    def wait_fraction(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "seconds": self.seconds, "data_wait_seconds": self.wait_seconds,
                "compute_seconds": self.compute_seconds, "wait_fraction": self.wait_fraction,
                "copy_seconds": self.copy_seconds}


@dataclass
class Verdict:
    level: str  # data-bound, partly data-bound, not data-bound, unknown
    headline: str
    reasons: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def data_bound(self) -> bool:
        return self.level in ("data-bound", "partly data-bound")

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "data_bound": self.data_bound, "headline": self.headline,
                "reasons": list(self.reasons), "suggestions": list(self.suggestions)}


@dataclass
class JoinedFinding:
    """A scanner finding with the runtime evidence of the loader it is about."""

    finding: Any  # torchaxe.findings.Finding
    loader: int | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.finding.code, "location": f"{self.finding.path}:{self.finding.line}",
                "loader": self.loader, "message": self.message, "finding": self.finding.to_dict()}


@dataclass
class DataReport:
    command: list[str]
    target: str
    status: str
    detail: str
    steps: list[StepSplit]
    loaders: list[Any]  # LoaderRecord
    stages: dict[int, Any]  # loader index -> StageReport
    copies: dict[str, Any]
    decoders: Any = None  # DecoderReport
    joined: list[JoinedFinding] = field(default_factory=list)
    loader_lines: list[str] = field(default_factory=list)
    tuning: Any = None  # TuneReport
    stored: dict[str, Any] | None = None
    verdict: Verdict | None = None
    cores: int = 1
    estimate: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    profile_summary: dict[str, Any] = field(default_factory=dict)

    @property
    def wait_fraction(self) -> float | None:
        total = sum(s.seconds for s in self.steps)
        return min(1.0, sum(s.wait_seconds for s in self.steps) / total) if total > 0 else None

    @property
    def main_loader(self) -> Any:
        """The loader the measured steps fetched most batches from."""
        if not self.loaders:
            return None
        return max(self.loaders, key=lambda r: (r.batches_measured, r.batches, -r.index))

    def to_dict(self) -> dict[str, Any]:
        waits = Samples.of(s.wait_seconds for s in self.steps)
        computes = Samples.of(s.compute_seconds for s in self.steps)
        main = self.main_loader
        return {
            "schema": SCHEMA,
            "command": list(self.command),
            "target": self.target,
            "status": self.status,
            "detail": self.detail,
            "error": self.error,
            "cores": self.cores,
            "verdict": self.verdict.to_dict() if self.verdict else None,
            "summary": {
                "steps_measured": len(self.steps),
                "step_seconds_median": Samples.of(s.seconds for s in self.steps).median,
                "data_wait_seconds_median": waits.median,
                "compute_seconds_median": computes.median,
                "data_wait_fraction": self.wait_fraction,
                "main_loader": main.index if main is not None else None,
            },
            "estimate": dict(self.estimate),
            "copies": dict(self.copies),
            "loaders": [dict(r.to_dict(), stages=self.stages[r.index].to_dict() if r.index in self.stages else None)
                        for r in self.loaders],
            "loader_lines": list(self.loader_lines),
            "findings": [j.to_dict() for j in self.joined],
            "decoders": self.decoders.to_dict() if self.decoders is not None else None,
            "tuning": self.tuning.to_dict() if self.tuning is not None else None,
            "stored": self.stored,
            "warnings": list(self.warnings),
            "steps": [s.to_dict() for s in self.steps],
        }


#: A __getitem__ up to this long per item is mostly the interpreter's per-item work
#: (an index into tensors in memory), which indexing a whole batch at once removes;
#: a longer one computes its item, and batching helps only where items can be built
#: together.
PER_ITEM_OVERHEAD = 30e-6


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


#: Durations in the data reports: milliseconds however long (a data wait in seconds
#: still reads against the per-step compute beside it).
ms = partial(duration, in_seconds=False)


def step_splits(profile: Any, copies: Any = None) -> list[StepSplit]:
    out = []
    for step in profile.measured_steps:
        copy = copies.steps.get(step.index) if copies is not None else None
        out.append(StepSplit(step.index, step.seconds, step.data_wait_seconds or 0.0,
                             copy.seconds if copy is not None else 0.0))
    return out


def copy_summary(copies: Any, steps: list[StepSplit], target: str) -> dict[str, Any]:
    if copies is None:
        return {}
    measured = [copies.steps[s.index] for s in steps if s.index in copies.steps]
    total_steps = sum(s.seconds for s in steps)
    seconds = sum(c.seconds for c in measured)
    count = sum(c.copies for c in measured)
    return {
        "host_to_device_seconds_per_step": seconds / len(steps) if steps else None,
        "host_to_device_fraction": seconds / total_steps if total_steps > 0 else None,
        "host_to_device_bytes_per_step": sum(c.bytes for c in measured) / len(steps) if steps else None,
        "copies_per_step": count / len(steps) if steps else None,
        "blocking_copies": sum(c.blocking for c in measured),
        "pin_seconds_per_batch": copies.pin_seconds / copies.pinned_batches if copies.pinned_batches else None,
        "pinned_batches": copies.pinned_batches,
        "applicable": target != "cpu",
    }


# ------------------------------------------------------------------ static meets runtime


def _same_file(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    return os.path.realpath(a) == os.path.realpath(b)


def _covers(finding: Any, record: Any) -> bool:
    return (_same_file(finding.path, record.file) and record.line is not None
            and finding.line <= record.line <= max(finding.end_line, finding.line))


def _inside_dataset(finding: Any, record: Any) -> bool:
    source = record.dataset_source
    return bool(source) and _same_file(finding.path, source[0]) and source[1] <= finding.line <= source[2]


def _measured_share(record: Any, steps: list[StepSplit]) -> float | None:
    total = sum(s.seconds for s in steps)
    if total <= 0 or not record.batches_measured:
        return None
    return min(1.0, record.wait_measured_seconds / total)


def _what(finding: Any, record: Any, stages: Any, decoders: Any) -> str:
    code = finding.code
    if code == "AX401":
        return f"num_workers={record.num_workers}"
    if code == "AX402":
        return f"pin_memory={record.pin_memory}"
    if code == "AX403":
        starts = record.iterator_seconds
        extra = f" (workers started {len(starts)} times, median {ms(Samples.of(starts).median)} each)" if starts else ""
        return f"persistent_workers={record.persistent_workers}{extra}"
    if code == "AX404":
        extra = ""
        if stages is not None:
            st = stages.stage_seconds()
            if st.get("decode") is not None and stages.per_sample_seconds:
                extra = f" (decode {ms(st['decode'])} of {ms(stages.per_sample_seconds)} per sample"
                fastest = decoders.fastest if decoders is not None else None
                if fastest is not None and fastest.name != "pil" and decoders.speedup(fastest.name):
                    extra += f"; {fastest.name} decodes {decoders.speedup(fastest.name):.2f}x faster"
                extra += ")"
        return f"PIL decoding in __getitem__{extra}"
    return finding.message.split(":")[0]


def join_findings(findings: list[Any], records: list[Any], steps: list[StepSplit], stages: dict[int, Any],
                  decoders: Any = None, tuning: Any = None) -> tuple[list[JoinedFinding], list[str]]:
    """Each AX4xx/AX306 finding with the measured wait of the loader built on its line,
    and one line per loader: its settings, its measured wait and, after tuning, the
    wait with the tuned settings."""
    tuned = ""
    if tuning is not None and tuning.best is not None and tuning.best.point.overrides():
        best = tuning.best
        tuned = f"; with {best.point.label} measured {pct(best.wait_fraction)}"
        if tuning.speedup():
            tuned += f" ({tuning.speedup():.2f}x the throughput)"
    joined: list[JoinedFinding] = []
    matched: set[int] = set()
    for finding in findings:
        record = next((r for r in records if _covers(finding, r)), None)
        inside = None if record is not None else next((r for r in records if _inside_dataset(finding, r)), None)
        if inside is not None:
            what = _what(finding, inside, stages.get(inside.index), decoders)
            share = _measured_share(inside, steps)
            joined.append(JoinedFinding(finding, inside.index,
                                        f"Dataset {inside.dataset_type} (DataLoader at {inside.site}) has {what} at "
                                        f"{finding.path}:{finding.line}; measured data wait {pct(share)} of the step"
                                        f"{tuned} [{finding.code}]"))
            continue
        if record is None:
            joined.append(JoinedFinding(finding, None, f"{finding.path}:{finding.line} {finding.code}: "
                                        f"{finding.message.split(':')[0]} (no loader built on this line ran)"))
            continue
        matched.add(id(finding))
        what = _what(finding, record, stages.get(record.index), decoders)
        share = _measured_share(record, steps)
        joined.append(JoinedFinding(finding, record.index,
                                    f"DataLoader at {record.site} has {what}; measured data wait {pct(share)} of the step"
                                    f"{tuned} [{finding.code}]"))
    lines = []
    for record in records:
        if not record.batches:
            lines.append(f"DataLoader at {record.site or '?'} ({record.settings_text()}): built, never iterated")
            continue
        util = record.worker_utilisation
        busy = f", workers busy {pct(util)} of their time" if util is not None else ""
        lines.append(f"DataLoader at {record.site or '?'} ({record.settings_text()}): measured data wait "
                     f"{pct(_measured_share(record, steps))} of the step{busy}{tuned}")
    return joined, lines


def scan_for_loaders(files: list[str], target: str) -> list[Any]:
    """The AX4xx and AX306 findings in the files that built the loaders."""
    from torchaxe.scan.engine import ScanOptions, scan_paths

    existing = sorted({os.path.realpath(f) for f in files if f and os.path.isfile(f)})
    if not existing:
        return []
    result = scan_paths(list(existing), ScanOptions(target=target, select=SCAN_CODES, jobs=1))
    return list(result.findings)


# ------------------------------------------------------------------ the verdict


def estimate(report: DataReport) -> dict[str, Any]:
    """The figures the tuning search starts from."""
    from torchaxe.data.tuning import estimate_workers

    main = report.main_loader
    stages = report.stages.get(main.index) if main is not None else None
    load = stages.per_batch_seconds if stages is not None else None
    compute = Samples.of(s.compute_seconds for s in report.steps).median
    return {"load_seconds_per_batch": load, "compute_seconds_per_step": compute, "cores": report.cores,
            "workers": estimate_workers(load, compute, report.cores)}


def _level(fraction: float) -> str:
    if fraction >= DATA_BOUND:
        return "data-bound"
    if fraction >= WAIT_TARGET:
        return "partly data-bound"
    return "not data-bound"


def _one_step_decides(steps: list[StepSplit]) -> tuple[StepSplit, float] | None:
    """The step whose wait alone sets the level, and the wait fraction of the others;
    None when the level holds without any one step (or there are too few to say)."""
    if len(steps) < 3:
        return None
    worst = max(steps, key=lambda s: s.wait_seconds)
    total = sum(s.seconds for s in steps)
    rest = total - worst.seconds
    if total <= 0 or rest <= 0:
        return None
    fraction = min(1.0, sum(s.wait_seconds for s in steps) / total)
    others = min(1.0, (sum(s.wait_seconds for s in steps) - worst.wait_seconds) / rest)
    return (worst, others) if _level(others) != _level(fraction) else None


def judge(report: DataReport) -> Verdict:
    """Data-bound or not, and why, from the evidence in the report."""
    fraction = report.wait_fraction
    if fraction is None:
        return Verdict("unknown", "no measured steps: nothing to judge", [report.error or report.detail])
    steps = report.steps
    wait = Samples.of(s.wait_seconds for s in steps).median or 0.0
    compute = Samples.of(s.compute_seconds for s in steps).median or 0.0
    reasons: list[str] = []
    level = _level(fraction)
    outlier = _one_step_decides(steps)
    if outlier is not None:
        # One step's wait (a first batch, a stall of the file system) is not what the
        # run's steps do: the level is what the others say, and the one step is told.
        worst, others = outlier
        level = _level(others)
        reasons.append(f"one step (step {worst.index}) waited {ms(worst.wait_seconds)} for data, "
                       f"{pct(worst.wait_seconds / sum(s.wait_seconds for s in steps))} of all the waiting: with it "
                       f"the step waits {pct(fraction)} of the time, without it {pct(others)}; the verdict is the "
                       "other steps' (a one-off such as a first batch; measure more steps (--steps) to see whether "
                       "it recurs)")
        fraction = others
    headline = (f"{level}: the step waits for data {pct(fraction)} of the time "
                f"(median {ms(wait)} waiting, {ms(compute)} computing per step)")
    suggestions: list[str] = []
    main = report.main_loader
    if main is None:
        # The wait is timed inside torch DataLoaders only: 0% here says nothing.
        return Verdict("unknown", f"data wait not measured: no torch DataLoader was iterated (median {ms(compute)} "
                       "per step)",
                       ["the batches come from elsewhere (a tensor in memory, a function of the script such as "
                        "get_batch, a custom iterator): the time they take is in the step, not told apart; "
                        "`torchaxe profile` shows the step's lines by time"], suggestions)
    stages = report.stages.get(main.index)
    load = stages.per_batch_seconds if stages is not None else None
    cores = report.cores
    workers = main.num_workers
    needed = report.estimate.get("workers")
    data_bound = level != "not data-bound"
    if load is not None and compute > 0:
        per = f"one batch takes {ms(load)} to load in one process (sampled) against {ms(compute)} of compute per step"
        if workers == 0:
            reasons.append(f"batches are loaded in the training process (num_workers=0): {per}")
        else:
            reasons.append(f"{per}: {workers} worker{'s' if workers != 1 else ''} deliver a batch every "
                           f"{ms(load / workers)}")
        if data_bound and needed and needed > workers:
            shared = (f"; on {plural(cores, 'core')} a worker shares them with the step's own threads, so it may "
                      "not pay" if cores is not None and cores <= 2 else "")
            suggestions.append(f"num_workers={needed} (load / compute, bounded by the {plural(cores, 'core')} of "
                               f"this rank{shared}; `torchaxe data --tune` measures it)")
    elif workers == 0 and data_bound:
        reasons.append("batches are loaded in the training process (num_workers=0)")
    if data_bound and main.dataset_type == "TensorDataset":
        # Nothing is read or decoded: a batch is rows of tensors in memory, indexed and stacked.
        reasons.append("the dataset is a TensorDataset: its batches are tensors already in memory, indexed and "
                       "stacked one sample at a time; worker processes help only when that takes time, and "
                       "indexing the tensors a whole batch at a time (a BatchSampler) usually helps more")
    util = main.worker_utilisation
    if util is not None:
        if util >= BUSY_WORKERS and data_bound:
            reasons.append(f"the workers are busy {pct(util)} of their time: they cannot keep up")
        elif data_bound:
            reasons.append(f"the workers are busy only {pct(util)} of their time: they are held back elsewhere "
                           f"(start-up, too short a prefetch queue, cores shared with training)")
    starts = main.iterator_seconds
    if workers and not main.persistent_workers and len(starts) > 1:
        start_total = sum(starts)
        total_wait = sum(s.wait_seconds for s in steps) or 0.0
        reasons.append(f"workers are started again every epoch (persistent_workers=False): {len(starts)} starts, "
                       f"median {ms(Samples.of(starts).median)} each")
        if data_bound and total_wait and start_total >= 0.2 * total_wait:
            suggestions.append("persistent_workers=True (keeps the workers between epochs)")
    if workers + 1 > cores and workers:
        reasons.append(f"{workers} workers and the training process share {plural(cores, 'core')}")
        if data_bound and cores > 1 and not any(x.startswith("num_workers=") for x in suggestions):
            suggestions.append(f"num_workers={cores - 1} (one core left to the training process)")
    if stages is not None and stages.per_sample_seconds:
        st = stages.stage_seconds()
        total = stages.per_sample_seconds
        # Nothing read from a file or decoded: what __getitem__ does is its own Python
        # work on data in memory (indexing), not a transform.
        in_memory = not (st.get("read") or st.get("decode"))
        label = {"transform": "__getitem__" if in_memory else "transform"}
        parts = [(name, st[name]) for name in ("read", "decode", "transform") if st.get(name) is not None]
        if parts:
            top_name, top = max(parts + ([("collate", st["collate"])] if st.get("collate") is not None else []),
                                key=lambda kv: kv[1])
            reasons.append("per sample: " + ", ".join(f"{label.get(n, n)} {ms(v)}" for n, v in parts)
                           + f" of {ms(total)}"
                           + (f"; collate {ms(st['collate'])}" if st.get("collate") is not None else ""))
            if data_bound and top_name == "decode" and top >= 0.3 * total:
                fastest = report.decoders.fastest if report.decoders is not None else None
                if fastest is not None and fastest.name != "pil":
                    suggestions.append(f"decode with {fastest.name} (torchaxe.data.decode_image): "
                                       f"{report.decoders.speedup(fastest.name):.2f}x faster on your files, "
                                       f"{fastest.agreement()}")
            if data_bound and top_name == "read" and top >= 0.3 * total:
                suggestions.append("file reads dominate: faster or local storage, larger files (shards), or caching")
            if data_bound and top_name == "transform" and top >= 0.5 * total and not in_memory:
                suggestions.append("transforms dominate: vectorise them per batch, or move them to the device")
            elif data_bound and top_name == "transform" and top >= 0.5 * total and main.batched_fetch:
                suggestions.append("__getitem__ dominates, on tensors in memory (a TensorDataset): "
                                   "`[run] dataloader = {batched_fetch = true}` in torchaxe.toml takes each batch "
                                   "with one indexing per tensor, the same batches, under `torchaxe run` (advise "
                                   "measures it as knob:dataloader-batched-fetch); in code, a BatchSampler as the "
                                   "sampler with batch_size=None")
            elif data_bound and top_name == "transform" and top >= 0.5 * total and not main.map_style:
                suggestions.append("the dataset's iterator dominates (an IterableDataset, its items made in "
                                   "memory): make each item in fewer, larger tensor operations (a whole batch at "
                                   "once), or have it split itself among worker processes by "
                                   "torch.utils.data.get_worker_info()")
            elif data_bound and top_name == "transform" and top >= 0.5 * total and top <= PER_ITEM_OVERHEAD:
                suggestions.append("__getitem__ dominates, on data in memory: index a whole batch at once (a "
                                   "BatchSampler as the sampler with batch_size=None, and a __getitem__ that takes "
                                   "a list of indices)")
            elif data_bound and top_name == "transform" and top >= 0.5 * total:
                suggestions.append(f"__getitem__ dominates, its items computed in memory ({ms(top)} each): make "
                                   "each with fewer, larger tensor operations, or a whole batch at once where the "
                                   "items allow it (a BatchSampler as the sampler with batch_size=None)")
    copies = report.copies
    share = copies.get("host_to_device_fraction")
    if copies.get("applicable") and share is not None and share >= 0.05:
        reasons.append(f"host-to-device copies take {pct(share)} of the step ({copies.get('blocking_copies')} blocking)")
        suggestions.append("pin_memory=True and .to(device, non_blocking=True), or torchaxe.data.DevicePrefetcher")
    if not data_bound:
        reasons.insert(0, "the loader has batches ready when the step asks for them")
    return Verdict(level, headline, reasons, suggestions)

