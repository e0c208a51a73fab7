"""The tune axis's candidates: the winners ``torchaxe tune`` kept in the knowledge
base, swapped into the model where its subgraphs match; and the recognised formulas
of installed packages, swapped for fused operators at run time (the ``replace`` knob)."""

from __future__ import annotations

import os
from typing import Collection, Sequence

from torchaxe.findings import Finding
from torchaxe.kb import KnowledgeBase
from torchaxe.runtime.candidate import Accuracy, Candidate, Recommendation
from torchaxe.tune.swaps import FunctionSwap, file_swaps, module_name


def stored_candidates(command: Sequence[str], static_shapes: bool | None, notes: list[str],
                      classes_run: Collection[str] | None = None) -> list[Candidate]:
    """The ``tune`` knob when the knowledge base holds tuned signatures -- with
    ``classes_run`` (the module classes the profile saw called), only signatures of
    those classes: the knowledge base is the machine's, and another model's winners
    match nothing here; otherwise, for a model with static shapes, a note in ``notes``
    that tuning it could pay. Raises :class:`~torchaxe.errors.TorchaxeError` when the
    knowledge base cannot be read."""
    with KnowledgeBase.open() as kb:
        records = kb.tuned()
    signatures = {r.signature for r in records}
    if classes_run is not None:
        mine = {r.signature for r in records if r.describe.get("module") in classes_run}
        if signatures and not mine:
            others = sorted({str(r.describe.get("module")) for r in records if r.describe.get("module")})
            notes.append(f"the knowledge base's {len(signatures)} tuned signature(s) are of other modules "
                         f"({', '.join(others[:4])}{', ...' if len(others) > 4 else ''}), none of which this run "
                         "called: `torchaxe run` would swap nothing in, so the tune knob was not tried")
        signatures = mine
    tuned = len(signatures)
    if not tuned:
        if static_shapes:
            notes.append("shapes are static: `torchaxe tune -- " + " ".join(command)
                         + "` can tune the model's subgraphs and keep the winners for `torchaxe run`")
        return []
    rec = Recommendation(
        key="knob:tune", axis="tune", title=f"tuned subgraphs from the knowledge base ({tuned} tuned "
        "signatures; those matching this model are swapped in)", applies="knob", knobs={"tune": {}},
        detail="the winners `torchaxe tune` measured and checked against eager (docs/tune.md)",
        accuracy=Accuracy(kind="unknown", detail="each winner matched eager within its dtype's tolerance "
                          "when tuned; the training loss is compared with the original's"))
    return [Candidate(rec=rec, knobs={"tune": {}}, group="compile", priority=1.8)]


def replace_candidates(findings: Sequence[Finding],
                       classes_run: Collection[str] | None = None) -> tuple[list[Candidate], dict[str, str]]:
    """The ``replace`` knob for the recognised formulas of installed packages (code
    the user does not edit): one candidate per formula, covering every function in
    those files that returns it whole -- with ``classes_run`` (the module classes the
    profile saw called), only the methods of those classes. Also returns, for findings
    no replacement covers, why (finding path:line -> reason)."""
    by_formula: dict[str, list[tuple[Finding, FunctionSwap, str]]] = {}
    why_not: dict[str, str] = {}
    for path in sorted({f.path for f in findings}):
        in_file = [f for f in findings if f.path == path]
        module = module_name(path)
        found = file_swaps(os.path.realpath(path))
        for f in in_file:
            swap = next((s for s in found.swaps if s.line == f.line and s.category == f.category), None)
            if swap is None:
                why_not[f"{f.path}:{f.line}"] = next(
                    (reason.split(": ", 1)[1] for reason in found.skipped if f":{f.line})" in reason),
                    "no runtime replacement for this finding")
            elif classes_run is not None and swap.owner is not None and swap.owner not in classes_run:
                why_not[f"{f.path}:{f.line}"] = f"no {swap.owner} module ran in the profiled steps"
            elif module is None:
                why_not[f"{f.path}:{f.line}"] = "its module's import name is not known from its folder"
            else:
                by_formula.setdefault(f.category, []).append((f, swap, f"{module}:{swap.scope}"))
    out = []
    for formula, group in sorted(by_formula.items()):
        table = {target: formula for _, _, target in group}
        error = max(swap.max_error for _, swap, _ in group)
        accuracy = (Accuracy(kind="exact", detail="the fused operator computes the same formula")
                    if error == 0 else
                    Accuracy(kind="max_error", max_error=error,
                             detail="largest difference of the fused operator from the hand-written form on probes"))
        first = group[0][0]
        rec = Recommendation(
            key=f"knob:replace-{formula}", axis="fused_ops",
            title=f"{first.code} {formula.replace('_', ' ')} in installed packages: swapped at run time for "
                  f"{first.replacement or 'the fused operator'} ({', '.join(sorted(table))})",
            applies="knob", knobs={"replace": table}, location=f"{first.path}:{first.line}",
            rules=sorted({f.code for f, _, _ in group}), files=sorted({f.path for f, _, _ in group}),
            detail="the package's files are not edited: `torchaxe run` replaces the function when it is imported "
                   "(the `replace` knob, docs/tune.md)", accuracy=accuracy)
        out.append(Candidate(rec=rec, knobs={"replace": table}, findings=[f for f, _, _ in group], priority=1.0))
    return out, why_not
