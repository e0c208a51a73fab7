"""The tune axis's candidates: the winners ``torchaxe tune`` kept in the knowledge
base, swapped into the model where its subgraphs match; and the recognised formulas
of installed packages, swapped for fused operators at run time (the ``replace`` knob)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Collection, Sequence

from torchaxe import units
from torchaxe.findings import Finding
from torchaxe.kb import KnowledgeBase
from torchaxe.runtime.candidate import Accuracy, Candidate, Recommendation
from torchaxe.tune.swaps import FunctionSwap, file_swaps, module_name


def stored_candidates(command: Sequence[str], static_shapes: bool | None, notes: list[str],
                      modules_run: Sequence[dict[str, Any]] | None = None) -> list[Candidate]:
    """The ``tune`` knob when the knowledge base holds tuned winners -- with
    ``modules_run`` (the profile's ``shapes.modules``: each module's class and input
    shapes), only winners of a module class this run called on the same first input
    shape and dtype, and only those whose winner is not eager: the knowledge base is
    the machine's, and another model's winners (a ``Linear`` head of another width)
    would swap nothing in here. Otherwise, for a model with static shapes, a note in
    ``notes`` that tuning it could pay. Raises :class:`~torchaxe.errors.TorchaxeError`
    when the knowledge base cannot be read."""
    with KnowledgeBase.open() as kb:
        records = kb.tuned()
        by_signature: dict[str, list[Any]] = {}
        for r in records:
            by_signature.setdefault(r.signature, []).append(r)
        winning = {sig for sig in by_signature
                   if (kb.winner(sig, DEFAULT_MIN_GAIN) or _EAGER).strategy != "eager"}
    signatures = set(by_signature)
    if modules_run is not None:
        seen = _inputs_run(modules_run)
        mine = {sig for sig, rows in by_signature.items() if sig in winning and _matches(rows[-1].describe, seen)}
        # The knowledge base is the machine's: another project's modules are no news here,
        # only this run's module classes that were tuned (on other inputs, or to eager).
        shared = sorted({str(r.describe.get("module")) for r in records if r.describe.get("module")} & set(seen))
        if signatures and not mine and shared:
            count = sum(1 for rows in by_signature.values() if str(rows[-1].describe.get("module")) in shared)
            notes.append(f"the knowledge base holds {units.plural(count, 'tuned signature')} of this run's "
                         f"{', '.join(shared[:4])}{', ...' if len(shared) > 4 else ''}, none with a winner for the "
                         "inputs this run called them with: `torchaxe run` would swap nothing in, so the tune knob "
                         "was not tried")
        signatures = mine
    tuned = len(signatures)
    if not tuned:
        if static_shapes:
            notes.append("shapes are static: `torchaxe tune -- " + " ".join(command)
                         + "` can tune the model's subgraphs and keep the winners for `torchaxe run`")
        return []
    rec = Recommendation(
        key="knob:tune", axis="tune", title=f"tuned subgraphs from the knowledge base ({units.plural(tuned, 'tuned signature')} "
        "matching this model, swapped in)", applies="knob", knobs={"tune": {}},
        detail="the winners `torchaxe tune` measured and checked against eager (docs/tune.md)",
        accuracy=Accuracy(kind="unknown", detail="each winner matched eager within its dtype's tolerance "
                          "when tuned; the training loss is compared with the original's"))
    return [Candidate(rec=rec, knobs={"tune": {}}, group="compile", priority=1.8)]


#: The gain over eager a stored winner must have to be swapped in (the knob's default).
DEFAULT_MIN_GAIN = 0.05
_EAGER = SimpleNamespace(strategy="eager")


def _first_tensor(value: Any) -> tuple[tuple[int, ...], str] | None:
    """(shape, dtype) of the first tensor in a stored signature's ``inputs``."""
    if isinstance(value, dict) and "tensor" in value:
        shape, dtype = value["tensor"][0], value["tensor"][1]
        return tuple(shape), str(dtype)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _inputs_run(modules: Sequence[dict[str, Any]]) -> dict[str, set[tuple[tuple[int, ...], str] | None]]:
    """Per module class the profile saw, the (shape, dtype) of the first tensor input
    of each of its calls' signatures (None for a class whose shapes are not known)."""
    out: dict[str, set[tuple[tuple[int, ...], str] | None]] = {}
    for module in modules:
        kinds = out.setdefault(str(module.get("type")), set())
        signatures = module.get("signatures") or []
        if not signatures:
            kinds.add(None)
        for sig in signatures:
            pairs = zip(sig.get("shapes") or [], sig.get("dtypes") or [])
            kinds.add(next(((tuple(shape), str(dtype)) for shape, dtype in pairs if shape is not None), None))
    return out


def _matches(describe: dict[str, Any], seen: dict[str, set[tuple[tuple[int, ...], str] | None]]) -> bool:
    """Whether a stored signature's module ran in the profile with its first input."""
    inputs = seen.get(str(describe.get("module")))
    if inputs is None:
        return False
    first = _first_tensor(describe.get("inputs"))
    return first is None or None in inputs or first in inputs


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
