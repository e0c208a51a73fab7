"""The changes ``advise`` will measure: code fixes from the scan, runtime knobs from
what the profile and the environment show.

Each axis package proposes its own runtime settings (``<axis>/candidates.py``); this
module only collects them, in a fixed order. Code candidates are made here from the
scan's findings in the user's code and the profile's evidence; findings in installed
packages, which are never edited, become the tune axis's ``replace`` knob where a
fused operator can replace the function at run time, advice otherwise.

A code candidate is measured without touching the user's files: the fixed text of
each file is written to a temporary folder and the trial run reads it in place of the
original (``sources`` knob, runtime/overlay.py). A knob candidate is a knob-set
fragment (runtime/knobs.py).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from torchaxe.advise.evidence import evidence_for, optimizer_evidence
from torchaxe.advise.recommendation import Accuracy, Recommendation
from torchaxe.bind.candidates import candidates as bind_candidates
from torchaxe.data.candidates import candidates as data_candidates
from torchaxe.data.candidates import stored_candidates as data_stored_candidates
from torchaxe.distributed.candidates import candidates as distributed_candidates
from torchaxe.errors import TorchaxeError
from torchaxe.findings import Applicability, Finding
from torchaxe.kernels.candidates import candidates as kernels_candidates, fused_optimizer_candidates
from torchaxe.memory.candidates import candidates as memory_candidates
from torchaxe.precision.candidates import candidates as precision_candidates
from torchaxe.precision.candidates import own_speedups as precision_own_speedups
from torchaxe.runtime.candidate import Candidate
from torchaxe.shapes.candidates import candidates as shapes_candidates
from torchaxe.shapes.candidates import own_speedups as shapes_own_speedups
from torchaxe.tune.candidates import replace_candidates
from torchaxe.tune.candidates import stored_candidates as tune_stored_candidates

__all__ = ["Candidate", "code_candidates", "fixed_sources", "installed_candidates", "knob_candidates",
           "run_by_the_job", "script_speedups", "stored_candidates"]

_MAX_ERROR = re.compile(r"max error ([0-9.]+e[-+]?\d+|[0-9.]+)")


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
    return Accuracy(kind="unknown", detail="numerics may change (unsafe fix); the training loss is compared with "
                    "the original's")


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
        evidence, seconds, shapes = _runtime_evidence(group, profile, base)
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


def _runtime_evidence(group: Sequence[Finding], profile: dict[str, Any],
                      base: str) -> tuple[list[str], float, list[list[int]]]:
    """What the profile saw of the findings' code: one line each, their share of the
    operator time, the input shapes they ran on."""
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
    return evidence, seconds, shapes


#: Rules whose finding is a DataLoader call: kept when the run built a loader there.
_LOADER_CALL_RULES = ("AX401", "AX402", "AX403")
#: Rules whose code runs in the training step: kept when a counted step executed it
#: (a moving average of the weights, a hand-written update, a per-step collective,
#: a loss: a framework's EMA class the job never switched on is not its code).
_STEP_RULE_PREFIXES = ("AX1", "AX3", "AX202", "AX203", "AX205", "AX601", "AX603", "AX703")
#: Rules whose findings are in a dataset's code.
_DATASET_RULES = ("AX404",)
#: Rules whose finding is an optimizer call: kept (and measured) only where the run
#: built an optimizer.
OPTIMIZER_RULES = ("AX201", "AX204")


def run_by_the_job(findings: Sequence[Finding], context: dict[str, Any]) -> tuple[list[Finding], list[Finding]]:
    """Findings in installed packages split into those whose code the run executed
    (or that the run could not tell about) and those it never ran: a DataLoader call
    that built no loader, a formula or a host sync in a function no counted training
    step called (a datamodule helper, a metric the job does not compute), an image
    decode in a dataset class no loader of the run was built on, an optimizer call
    that built none (a framework's demo module the job imported but did not train)."""
    from torchaxe.runtime.run_context import built_loader, built_optimizer, executed, used_dataset

    kept: list[Finding] = []
    idle: list[Finding] = []
    for f in findings:
        if f.code in _LOADER_CALL_RULES:
            ran = built_loader(context, f.path, f.line, f.end_line)
        elif f.code in OPTIMIZER_RULES:
            ran = built_optimizer(context, f.path, f.line, f.end_line)
        elif f.code in _DATASET_RULES:
            # A dataset's __getitem__ may run in loader workers, out of the traced
            # step: what counts is whether a loader of the run was built on its class.
            ran = used_dataset(context, f.path, f.line, f.end_line)
        elif f.code.startswith(_STEP_RULE_PREFIXES):
            ran = executed(context, f.path, f.line, f.end_line)
        else:
            ran = None
        (idle if ran is False else kept).append(f)
    return kept, idle


def installed_candidates(findings: Sequence[Finding],
                         profile: dict[str, Any]) -> tuple[list[Candidate], list[Recommendation]]:
    """Findings in installed packages, which are never edited: the recognised formulas
    a fused operator can replace at run time become ``replace`` knob candidates (the
    tune axis), measured like any knob; the others are advice, with the reason."""
    modules = (profile.get("shapes") or {}).get("modules") or []
    replace, why_not = replace_candidates(findings, {m.get("type") for m in modules} if modules else None)
    for c in replace:
        # The profile counts a package's operators at the line of the user's code that
        # calls it: what it saw of the function itself is the shapes its module ran on.
        for f in c.findings:
            ev = evidence_for(f, profile)
            if ev is None:
                continue
            c.shapes.extend(s for s in ev.shapes if s and s not in c.shapes)
            if ev.ops:
                c.rec.evidence.append(f"{f.path}:{f.line} {ev.describe()}")
                c.priority += min(ev.share or 0.0, 1.0)
            elif ev.shapes:
                c.rec.evidence.append(f"{f.path}:{f.line} {ev.function}: its module ran on "
                                      f"{', '.join(str(s) for s in ev.shapes[:2])} in the profiled steps")
    covered = {id(f) for c in replace for f in c.findings}
    advice = []
    for f in findings:
        if id(f) in covered:
            continue
        why = why_not.get(f"{f.path}:{f.line}")
        advice.append(Recommendation(
            key=f"installed:{f.code}:{f.path}:{f.line}", axis="fused_ops",
            title=f"{f.code} {f.category.replace('_', ' ')} in an installed package: {f.replacement or ''}".rstrip(": "),
            applies="code", location=f"{f.path}:{f.line}", status="advice",
            detail=f.message + (f" (not replaced at run time: {why})" if why else ""), rules=[f.code], files=[f.path]))
    return replace, advice


def _axis_of_code(code: str) -> str:
    return {"AX1": "fused_ops", "AX2": "fused_ops", "AX3": "data", "AX4": "data", "AX5": "compile",
            "AX6": "distributed", "AX7": "precision"}.get(code[:3], "environment")


#: The axes' runtime-setting candidates, collected in this order (the order they are
#: listed and, at equal priority, measured in).
RUN_CANDIDATES = (shapes_candidates, precision_candidates, kernels_candidates, bind_candidates, data_candidates)


def knob_candidates(target: str, profile: dict[str, Any], settings: dict[str, Any], *,
                    memory_limit: int | None = None, allow_batch_change: bool = False,
                    notes: list[str] | None = None, optimizer_fixes: Sequence[Finding] = ()) -> list[Candidate]:
    """Runtime settings worth measuring on this target, given what the run showed:
    what each axis proposes (compile modes and bucketing, precision, binding, loader
    settings), fused optimizers where no code fix (``optimizer_fixes``, the scan's)
    reaches the call, then the distributed axis's (DDP's settings, the npu
    communication settings; none unless the run was distributed), then the memory
    axis's, which also depend on the memory limit and on whether a larger
    micro-batch is allowed."""
    out = [c for propose in RUN_CANDIDATES for c in propose(profile, target, settings)]
    out += fused_optimizer_candidates(target, settings, [(os.path.realpath(f.path), f.line, f.end_line or f.line)
                                                         for f in optimizer_fixes])
    out += distributed_candidates(profile, target, settings, notes=notes)
    return out + memory_candidates(profile, target, settings, memory_limit=memory_limit,
                                   allow_batch_change=allow_batch_change, notes=notes)


def script_speedups(settings: dict[str, Any], target: str) -> list[str]:
    """Notes on the speed-ups the run showed the script making itself, or that this
    machine cannot make (bfloat16 on a CPU without it), whose knob candidates are
    therefore left out."""
    return shapes_own_speedups(settings) + precision_own_speedups(settings, target)


def stored_candidates(command: Sequence[str], static_shapes: bool | None, notes: list[str],
                      profile: dict[str, Any] | None = None) -> list[Candidate]:
    """Settings measured for this very command before and kept in the knowledge base
    (tuned subgraphs, the loader setting of ``torchaxe data --tune``): measured again
    here, against this run. An unreadable knowledge base is a note, not an error."""
    try:
        loader = data_stored_candidates(command)
        modules = ((profile or {}).get("shapes") or {}).get("modules") or []
        tuned = tune_stored_candidates(command, static_shapes, notes, modules or None)
    except TorchaxeError as exc:
        notes.append(f"knowledge base not read: {exc}")
        return []
    return tuned + loader


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
