"""The changes ``advise`` will measure: code fixes from the scan, runtime knobs from
what the profile and the environment show.

A code candidate is measured without touching the user's files: the fixed text of
each file is written to a temporary folder and the trial run reads it in place of the
original (``sources`` knob, runtime/overlay.py). A knob candidate is a knob-set
fragment (runtime/knobs.py).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from torchaxe.advise.evidence import evidence_for, optimizer_evidence
from torchaxe.advise.recommendation import Accuracy, Recommendation
from torchaxe.findings import Applicability, Finding

_MAX_ERROR = re.compile(r"max error ([0-9.]+e[-+]?\d+|[0-9.]+)")


@dataclass
class Candidate:
    """A change to measure, and the recommendation it will become."""

    rec: Recommendation
    #: Knob-set fragment (without ``name``); code candidates get ``sources`` at run time.
    knobs: dict[str, Any] = field(default_factory=dict)
    #: Only one candidate of a group goes into the combined run (the fastest).
    group: str | None = None
    #: Code candidates: the findings whose fixes it applies.
    findings: list[Finding] = field(default_factory=list)
    #: Higher is measured first when the budget is short.
    priority: float = 0.0
    #: Input shapes the code ran on in the profile (code candidates).
    shapes: list[list[int]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.rec.key


def _location(findings: Sequence[Finding]) -> str:
    first = min(findings, key=lambda f: f.sort_key)
    more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
    return f"{first.path}:{first.line}{more}"


def _fix_accuracy(findings: Sequence[Finding]) -> Accuracy:
    errors = [float(m.group(1)) for f in findings for m in [_MAX_ERROR.search(f.message)] if m]
    unsafe = any(f.fix is not None and f.fix.applicability == Applicability.UNSAFE for f in findings)
    if errors:
        return Accuracy(kind="max_error", max_error=max(errors),
                        detail="largest difference of the replacement from the hand-written form on random probes")
    if not unsafe:
        return Accuracy(kind="exact", detail="the fix keeps the numerics")
    return Accuracy(kind="unknown", detail="numerics may change (unsafe fix); use --check-accuracy to measure the loss")


def code_candidates(findings: Iterable[Finding], profile: dict[str, Any], step_seconds: float | None,
                    base: str = ".") -> tuple[list[Candidate], list[Recommendation]]:
    """One candidate per rule with an automatic fix; advice-only findings become
    recommendations that are not measured (there is nothing to apply)."""
    by_code: dict[str, list[Finding]] = defaultdict(list)
    advice: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.fix is not None and f.fix.applicability in (Applicability.SAFE, Applicability.UNSAFE):
            by_code[f.code].append(f)
        else:
            advice[f.code].append(f)
    out = []
    for code, group in sorted(by_code.items()):
        evidence = []
        seconds = 0.0
        shapes: list[list[int]] = []
        for f in group:
            ev = evidence_for(f, profile, base)
            if ev is not None:
                evidence.append(f"{f.path}:{f.line} {ev.describe()}")
                seconds += ev.share or 0.0
                shapes.extend(s for s in ev.shapes if s and s not in shapes)
            elif f.code.startswith("AX2"):
                line = optimizer_evidence(f, profile)
                if line:
                    evidence.append(f"{f.path}:{f.line} {line}")
        unsafe = any(f.fix.applicability == Applicability.UNSAFE for f in group)  # type: ignore[union-attr]
        first = group[0]
        title = f"{code} {first.category.replace('_', ' ')}: {first.fix.title if first.fix else first.replacement}"  # type: ignore[union-attr]
        rec = Recommendation(
            key=f"code:{code}", axis="fused_ops" if code.startswith(("AX1", "AX2")) else _axis_of_code(code),
            title=title, applies="code", location=_location(group), accuracy=_fix_accuracy(group),
            evidence=evidence, detail=first.message, rules=[code], files=sorted({f.path for f in group}),
            unsafe=unsafe)
        share = min(seconds, 1.0)
        out.append(Candidate(rec=rec, findings=list(group), priority=1.0 + share, shapes=shapes))
    recs = []
    for code, group in sorted(advice.items()):
        first = group[0]
        evidence = []
        for f in group:
            ev = evidence_for(f, profile, base)
            if ev is not None:
                evidence.append(f"{f.path}:{f.line} {ev.describe()}")
        recs.append(Recommendation(
            key=f"advice:{code}", axis=_axis_of_code(code), title=f"{code} {first.category.replace('_', ' ')}: "
            f"{first.replacement or 'change by hand'}", applies="code", location=_location(group), status="advice",
            evidence=evidence, detail=first.message, rules=[code], files=sorted({f.path for f in group})))
    return out, recs


def _axis_of_code(code: str) -> str:
    return {"AX1": "fused_ops", "AX2": "fused_ops", "AX3": "data", "AX4": "data", "AX5": "compile"}.get(code[:3],
                                                                                                     "environment")


#: Loader settings compute the same thing on each batch, but worker processes seed
#: their own random state (augmentation), and persistent workers stop drawing a base
#: seed from the global generator each epoch (the shuffle order after the first).
LOADER_ACCURACY = Accuracy(kind="data_order", detail="same computation per batch; with worker processes the "
                           "shuffle order and random augmentation may differ; use --check-accuracy for the loss")


def knob_candidates(target: str, profile: dict[str, Any], settings: dict[str, Any]) -> list[Candidate]:
    """Runtime settings worth measuring on this target, given what the run showed."""
    out: list[Candidate] = []
    shapes = profile.get("shapes") or {}
    dynamic = bool(shapes) and not shapes.get("static", True)
    summary = profile.get("summary") or {}

    def add(key: str, axis: str, title: str, knobs: dict[str, Any], *, group: str | None = None,
            accuracy: Accuracy | None = None, detail: str = "", priority: float = 0.5) -> None:
        rec = Recommendation(key=key, axis=axis, title=title, applies="knob", knobs=knobs, detail=detail,
                             accuracy=accuracy or Accuracy(kind="exact", detail="same computation"))
        out.append(Candidate(rec=rec, knobs=knobs, group=group, priority=priority))

    bucketing = bucketing_knob(shapes.get("batches") or {}) if dynamic else None
    # What the script already does itself is not tried again (see script_speedups).
    own_compile = bool(settings.get("compiled_graphs"))
    own_autocast = bool(settings.get("autocast"))
    compile_accuracy = Accuracy(kind="unknown", detail="compiled kernels may reorder floating-point sums; "
                                "use --check-accuracy to measure the loss")
    if target in ("cpu", "cuda") and not own_compile:
        if dynamic:
            add("knob:compile-dynamic", "compile", "torch.compile(model, dynamic=True): shapes vary between steps",
                {"compile": {"mode": "default", "dynamic": True}}, group="compile", accuracy=compile_accuracy,
                detail="the profile saw several input shapes; dynamic=True compiles once for all of them",
                priority=2.0)
        if bucketing is not None:
            add("knob:compile-bucketing", "compile",
                f"torch.compile(model) with batches padded to {len(bucketing['boundaries'])} sizes "
                f"(torchaxe.shapes.BucketingCollate, dim {bucketing['dim']}: {bucketing['boundaries']})",
                {"compile": {"mode": "default"}, "bucketing": bucketing}, group="compile", accuracy=Accuracy(
                    kind="unknown", detail="padding changes results unless the script masks it; "
                    "use --check-accuracy"), priority=1.9,
                detail="few distinct shapes: each compiles once, then every batch reuses one of them")
        add("knob:compile", "compile", "torch.compile(model)" + (" (shapes are static)" if not dynamic else ""),
            {"compile": {"mode": "default"}}, group="compile", accuracy=compile_accuracy,
            detail="fuses the model's operators into generated kernels; the first steps pay the compile time",
            priority=2.0)
    if target == "cuda" and not dynamic and not settings.get("cudnn_benchmark"):
        add("knob:cudnn-benchmark", "compile", "torch.backends.cudnn.benchmark = True (static shapes)",
            {"torch": {"cudnn_benchmark": True}}, priority=0.8,
            detail="with fixed shapes cuDNN can time its algorithms once and keep the fastest")
    if target == "npu":
        jit = not dynamic
        add(f"knob:npu-jit-{'on' if jit else 'off'}", "compile",
            f"torch_npu.npu.set_compile_mode(jit_compile={jit}) ({'static' if jit else 'dynamic'} shapes)",
            {"npu": {"jit_compile": jit}}, priority=2.0,
            detail="online operator compilation pays off for fixed shapes and recompiles for every new shape "
                   "(NPU path unverified on hardware)")
    # On a GPU or NPU lower precision is the largest change a budget can try (tensor
    # cores), ahead of code fixes the profile found no time in; on a cpu it often is not.
    device = target in ("cuda", "npu")
    precision = Accuracy(kind="unknown", detail="lower precision in matmuls and convolutions; "
                         "use --check-accuracy to measure the loss")
    if target == "cuda" and settings.get("matmul_precision", "highest") == "highest":
        add("knob:tf32", "precision", "torch.set_float32_matmul_precision('high'): float32 matmuls on TF32 tensor cores",
            {"torch": {"matmul_precision": "high"}}, priority=1.4,
            accuracy=Accuracy(kind="unknown", detail="float32 matmul inputs rounded to a 10-bit mantissa; "
                              "use --check-accuracy to measure the loss"),
            detail="Ampere and newer GPUs run float32 matmuls on tensor cores when TF32 is allowed; "
                   "PyTorch leaves it off for matmuls by default")
    if target in ("cpu", "cuda", "npu") and not own_autocast:
        add("knob:autocast-bf16", "precision", "mixed precision: the model's forward under torch.autocast(bfloat16)",
            {"autocast": {"dtype": "bfloat16"}}, group="precision", accuracy=precision,
            priority=1.5 if device else 1.0,
            detail="matmuls and convolutions in bfloat16 (fp32 range, 8-bit mantissa)")
    if target in ("cuda", "npu") and not own_autocast:
        add("knob:autocast-fp16", "precision", "mixed precision: the model's forward under torch.autocast(float16)",
            {"autocast": {"dtype": "float16"}}, group="precision", accuracy=precision, priority=1.3,
            detail="float16 needs a GradScaler for training; measure the loss with --check-accuracy")
    if target == "cpu":
        allowed = settings.get("allowed_cpus") or os.cpu_count() or 1
        threads = settings.get("num_threads")
        if threads and allowed and threads != allowed and "OMP_NUM_THREADS" not in (settings.get("env") or {}):
            add("knob:threads", "binding", f"torch.set_num_threads({allowed}): use every core this process may use",
                {"torch": {"num_threads": allowed}}, priority=0.6)
    allowed_cpus = settings.get("allowed_cpus") or os.cpu_count() or 1
    if allowed_cpus >= 4:
        add("knob:bind", "binding", "bind the process to the cores near its device (torchaxe bind, exclusive mode)",
            {"bind": {"mode": "exclusive"}}, priority=0.4,
            detail="pins the main and compute threads, and the DataLoader workers apart from them, to the "
                   "device's NUMA node, so the scheduler does not migrate them (docs/bind.md)")
    wait = summary.get("data_wait_fraction") or 0.0
    if wait > 0.05:
        cores = settings.get("allowed_cpus") or os.cpu_count() or 1
        workers = max(1, min(4, cores - 1))
        knobs: dict[str, Any] = {"num_workers": workers, "persistent_workers": True}
        if target in ("cuda", "npu"):
            knobs["pin_memory"] = True
        add("knob:dataloader", "data", f"DataLoader(num_workers={workers}, persistent_workers=True"
            + (", pin_memory=True)" if "pin_memory" in knobs else ")"), {"dataloader": knobs},
            group="dataloader", priority=1.0 + 4 * wait, detail=f"the step waited for data {wait:.0%} of the time",
            accuracy=replace(LOADER_ACCURACY))
    return out


def script_speedups(settings: dict[str, Any]) -> list[str]:
    """Notes on the speed-ups the run showed the script making itself, whose knob
    candidates are therefore left out."""
    notes = []
    if settings.get("compiled_graphs"):
        notes.append(f"the script compiles its model itself ({settings['compiled_graphs']} graph(s) made by "
                     f"torch.compile in the profiled run): torch.compile settings were not tried again")
    if settings.get("autocast"):
        notes.append(f"the script runs its model under autocast ({settings['autocast']}) itself: mixed "
                     f"precision was not tried again")
    return notes


def bucketing_knob(batches: dict[str, Any], max_shapes: int = 4) -> dict[str, Any] | None:
    """Bucket boundaries for the one batch dimension that varies (sequence length,
    image size), from the batch shapes the profile saw: at most ``max_shapes``
    sizes, least padding (torchaxe.shapes.buckets)."""
    from torchaxe.shapes.buckets import optimal_boundaries

    signatures = [sig for sig in batches.get("signatures") or [] if sig.get("shapes")]
    firsts = [(sig["shapes"][0], sig.get("count") or 1) for sig in signatures if sig["shapes"][0]]
    if len(firsts) < 2:
        return None
    rank = len(firsts[0][0])
    if any(len(shape) != rank for shape, _ in firsts):
        return None
    varying = [d for d in range(1, rank) if len({shape[d] for shape, _ in firsts}) > 1]
    if len(varying) != 1:
        return None  # only the batch dimension (a last partial batch), or several at once
    dim = varying[0]
    counts: dict[int, int] = {}
    for shape, count in firsts:
        counts[shape[dim]] = counts.get(shape[dim], 0) + count
    boundaries = optimal_boundaries(counts, max_shapes)
    if len(boundaries) >= len(counts):
        return None
    return {"boundaries": list(boundaries), "dim": dim}


def fixed_sources(findings: Sequence[Finding], codes: Sequence[str], folder: Path, base: str = ".",
                  target: str = "cpu") -> dict[str, str]:
    """Write the files of ``findings`` fixed by the rules ``codes`` (safe and unsafe
    fixes) into ``folder``; return original real path -> fixed copy."""
    from torchaxe.scan.engine import ScanOptions, decode_source
    from torchaxe.scan.fix import fix_source
    from torchaxe.scan.rules import select_rules

    rules = [cls() for cls in select_rules(tuple(codes), ())]
    options = ScanOptions(target=target).with_capabilities()
    out: dict[str, str] = {}
    paths = sorted({f.path for f in findings if f.code in codes})
    for n, shown in enumerate(paths):
        real = os.path.realpath(os.path.join(base, shown))
        source = decode_source(Path(real).read_bytes())
        result = fix_source(source, shown, options, unsafe=True, rules=rules)
        if result.error or not result.changed:
            continue
        copy = folder / f"{n}-{Path(real).name}"
        copy.write_text(result.fixed, encoding="utf-8")
        out[real] = str(copy)
    return out
