"""The compile settings the shapes axis offers to measure.

Two callers ask: ``advise`` (:func:`candidates`: the settings the profile's shapes call
for, each one candidate) and ``torchaxe shapes --try`` (:func:`trial_settings`: every
setting on the target, baseline first, measured against each other). Both lists are
built here from the same knob fragments and the same per-target rules (online
compilation on the NPU, ``torch.compile`` elsewhere, cuDNN benchmarking with static
shapes on cuda, bucketing only with a plan), so that they cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from torchaxe.runtime.candidate import Accuracy, Candidate, knob_candidate
from torchaxe.shapes.buckets import optimal_boundaries
from torchaxe.shapes.verdict import RECURRENT_MODULES

#: The priority of compiling a model with recurrent layers whose shapes vary: below
#: every other change's (1 and up), measured when the budget holds it after them.
RECURRENT_COMPILE_PRIORITY = 0.5

#: Compiled kernels can sum in another order than eager ones.
COMPILE_ACCURACY_DETAIL = ("compiled kernels may reorder floating-point sums; the training loss is compared "
                           "with the original's")


def compile_knob(*, mode: str | None = None, dynamic: bool | None = None, backend: str | None = None) -> dict[str, Any]:
    """The ``compile`` knob-set fragment with the given settings (absent ones keep the
    knob's defaults)."""
    settings = {"mode": mode, "dynamic": dynamic, "backend": backend}
    return {"compile": {k: v for k, v in settings.items() if v is not None}}


def npu_compile_knob(jit: bool) -> dict[str, Any]:
    """``torch_npu.npu.set_compile_mode(jit_compile=jit)``: online operator compilation
    pays off for fixed shapes and recompiles for every new one."""
    return {"npu": {"jit_compile": jit}}


def cudnn_benchmark_knob() -> dict[str, Any]:
    """``torch.backends.cudnn.benchmark = True``: with fixed shapes cuDNN times its
    algorithms once and keeps the fastest."""
    return {"torch": {"cudnn_benchmark": True}}


def bucketing_knob(batches: dict[str, Any], max_shapes: int = 4) -> dict[str, Any] | None:
    """Bucket boundaries for the one batch dimension that varies (sequence length,
    image size), from the batch shapes the profile saw: at most ``max_shapes``
    sizes, least padding (torchaxe.shapes.buckets)."""
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


def _batch_sizes(profile: dict[str, Any]) -> set[int]:
    """The leading sizes of the training batches the profile saw."""
    batches = (profile.get("shapes") or {}).get("batches") or {}
    return {sig["shapes"][0][0] for sig in batches.get("signatures") or [] if sig.get("shapes") and sig["shapes"][0]}


def training_epoch(profile: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any] | None:
    """The epoch of the DataLoader the training steps drew from (runtime/run_context.py
    ``loader_epochs``): the one whose batch size the profile's training batches had
    (the largest data set among several), or the only loader when the batches were not
    recorded. None when it cannot be told."""
    epochs = [e for e in settings.get("loader_epochs") or [] if e.get("batch_size") and e.get("samples")]
    sizes = _batch_sizes(profile)
    if sizes:
        epochs = [e for e in epochs if e["batch_size"] in sizes]
    elif len(epochs) != 1:
        return None
    return max(epochs, key=lambda e: e["samples"]) if epochs else None


def unseen_last_batch(profile: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any] | None:
    """The epoch of a DataLoader whose training batches the profile saw at full size
    only, while its epoch ends in a smaller batch (``drop_last=False``) that came after
    the steps watched: static so far, but compiled code compiles once more for it.
    None when no such loader was noted (runtime/run_context.py ``loader_epochs``).
    Of the loaders whose batch size the steps saw, the largest epoch is taken for the
    training one: a validation loader of the same batch size, whose smaller epoch ends
    in a short batch, says nothing of the training steps (ImageNet's example: 2,000
    training samples in full batches of 16, 200 validation samples ending in 8)."""
    sizes = _batch_sizes(profile)
    epochs = [e for e in settings.get("loader_epochs") or [] if e.get("batch_size") in sizes]
    if not epochs:
        return None
    epoch = max(epochs, key=lambda e: e.get("samples") or 0)
    last = epoch.get("last_batch_samples")
    return epoch if last and last not in sizes else None


def seen_last_batch(profile: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any] | None:
    """The epoch of a DataLoader whose smaller last batch the profile saw, when it is
    all that made the shapes vary: the batches had two signatures, alike but for their
    first dimension (the batch size and the last batch's), and no module saw more than
    two sets of shapes over the steps (the full batches' and the last one's). Then the
    shapes are as static as when the steps end before that batch, and the compile
    choice must not depend on whether a short profile reached it."""
    shapes = profile.get("shapes") or {}
    signatures = [s.get("shapes") for s in (shapes.get("batches") or {}).get("signatures") or []]
    if len(signatures) != 2 or not all(signatures) or len(signatures[0]) != len(signatures[1]):
        return None
    firsts: set[int] = set()
    for a, b in zip(*signatures):
        if (a is None) != (b is None):
            return None
        if a is None:
            continue
        if len(a) != len(b) or not a or a[1:] != b[1:]:
            return None
        firsts |= {a[0], b[0]}
    if any(m.get("dynamic") and (m.get("step_sets") or 3) > 2 for m in shapes.get("modules") or []):
        return None
    for epoch in settings.get("loader_epochs") or []:
        if epoch.get("last_batch_samples") and {epoch.get("batch_size"), epoch["last_batch_samples"]} == firsts:
            return {**epoch, "seen": True}
    return None


def last_batch_text(epoch: dict[str, Any]) -> str:
    """The sentence that says what an epoch's smaller last batch does to compiled code."""
    when = ("reached within the steps profiled" if epoch.get("seen") else
            "after the steps measured: compiled code compiles once more for it, which the measured one-time cost "
            "leaves out;")
    return (f"the last batch of each epoch has {epoch['last_batch_samples']} samples, not {epoch['batch_size']} "
            f"({epoch['samples']} samples, drop_last=False), {when}"
            + (": compiled code compiles once more for it;" if epoch.get("seen") else "")
            + " dynamic=False compiles it as a graph of its own and keeps the full batches on their static kernels "
              "(torch would otherwise recompile the model for any batch size); DataLoader(..., drop_last=True) keeps "
              "every batch one size")


def trial_settings(target: str, bucketing: dict[str, Any] | None = None,
                   backend: str = "inductor") -> list[dict[str, Any]]:
    """The named knob sets ``torchaxe shapes --try`` compares on ``target``, baseline
    first: every compile mode, each measured, whatever the verdict."""
    if target == "npu":
        sets = [{"name": "jit-compile-off", **npu_compile_knob(False)},
                {"name": "jit-compile-on", **npu_compile_knob(True)}]
        if bucketing:
            sets.append({"name": "jit-compile-on+bucketing", **npu_compile_knob(True), "bucketing": bucketing})
        return sets
    static: dict[str, Any] = compile_knob(dynamic=False, backend=backend)
    if target == "cuda":
        static.update(cudnn_benchmark_knob())
    sets = [{"name": "eager"},
            {"name": "compile-static", **static},
            {"name": "compile-dynamic", **compile_knob(dynamic=True, backend=backend)}]
    if bucketing:
        sets.append({"name": "compile-static+bucketing", **static, "bucketing": bucketing})
    return sets


def candidates(profile: dict[str, Any], target: str, settings: dict[str, Any]) -> list[Candidate]:
    """The compile settings worth measuring on ``target`` for the shapes the profile
    saw: dynamic compilation and bucketing when they vary, cuDNN benchmarking when
    they do not, the NPU's compile mode either way. Nothing the script already
    compiles itself (see :func:`own_speedups`)."""
    out: list[Candidate] = []
    shapes = profile.get("shapes") or {}
    dynamic = bool(shapes) and not shapes.get("static", True)
    seen = seen_last_batch(profile, settings) if dynamic else None
    dynamic = dynamic and seen is None
    bucketing = bucketing_knob(shapes.get("batches") or {}) if dynamic else None
    compile_accuracy = Accuracy(kind="unknown", detail=COMPILE_ACCURACY_DETAIL)
    first = len(out)
    if target in ("cpu", "cuda") and not settings.get("compiled_graphs"):
        if dynamic:
            out.append(knob_candidate(
                "knob:compile-dynamic", "compile", "torch.compile(model, dynamic=True): shapes vary between steps",
                compile_knob(mode="default", dynamic=True), group="compile", accuracy=compile_accuracy,
                detail="the profile saw several input shapes; dynamic=True compiles once for all of them",
                priority=2.0))
        if bucketing is not None:
            out.append(knob_candidate(
                "knob:compile-bucketing", "compile",
                f"torch.compile(model) with batches padded to {len(bucketing['boundaries'])} sizes "
                f"(torchaxe.shapes.BucketingCollate, dim {bucketing['dim']}: {bucketing['boundaries']})",
                {**compile_knob(mode="default"), "bucketing": bucketing}, group="compile", accuracy=Accuracy(
                    kind="unknown", detail="padding changes results unless the script masks it; "
                    "the training loss is compared with the original's"), priority=1.9,
                detail="few distinct shapes: each compiles once, then every batch reuses one of them"))
        last = None if dynamic else seen or unseen_last_batch(profile, settings)
        detail = "fuses the model's operators into generated kernels; the first steps pay the compile time"
        if last is not None:
            out.append(knob_candidate(
                "knob:compile", "compile",
                f"torch.compile(model, dynamic=False) (shapes are static but for the epoch's last batch of "
                f"{last['last_batch_samples']})", compile_knob(mode="default", dynamic=False), group="compile",
                accuracy=compile_accuracy, detail=f"{detail}; {last_batch_text(last)}", priority=2.0))
        elif not dynamic:
            # With shapes that vary, torch.compile(model) recompiles for the second
            # shape with the varying sizes made symbolic (automatic dynamic shapes):
            # what knob:compile-dynamic measures, less one recompile. Not a run of its own.
            out.append(knob_candidate(
                "knob:compile", "compile", "torch.compile(model) (shapes are static)",
                compile_knob(mode="default"), group="compile", accuracy=compile_accuracy, detail=detail,
                priority=2.0))
        recurrent = sorted({m.get("type") for m in shapes.get("modules") or []} & RECURRENT_MODULES)
        if recurrent and dynamic:
            # As the shapes verdict says: keep eager. Still measured, last.
            for c in out[first:]:
                c.priority = RECURRENT_COMPILE_PRIORITY
                c.rec.detail += (f"; measured after the other changes: torch.compile does not trace into the "
                                 f"recurrent layers ({', '.join(recurrent)}) and recompiles the rest for each new "
                                 f"shape (`torchaxe shapes` says keep eager)")
    if target == "cuda" and not dynamic and not settings.get("cudnn_benchmark"):
        out.append(knob_candidate(
            "knob:cudnn-benchmark", "compile", "torch.backends.cudnn.benchmark = True (static shapes)",
            cudnn_benchmark_knob(), priority=0.8,
            detail="with fixed shapes cuDNN can time its algorithms once and keep the fastest"))
    if target == "npu":
        jit = not dynamic
        out.append(knob_candidate(
            f"knob:npu-jit-{'on' if jit else 'off'}", "compile",
            f"torch_npu.npu.set_compile_mode(jit_compile={jit}) ({'static' if jit else 'dynamic'} shapes)",
            npu_compile_knob(jit), priority=2.0,
            detail="online operator compilation pays off for fixed shapes and recompiles for every new shape "
                   "(NPU path unverified on hardware)"))
    return out


def own_speedups(settings: dict[str, Any]) -> list[str]:
    """A note when the run showed the script compiling its model itself, which is why
    no compile candidate is offered."""
    if not settings.get("compiled_graphs"):
        return []
    return [f"the script compiles its model itself ({settings['compiled_graphs']} graph(s) made by torch.compile in "
            f"the profiled run): torch.compile settings were not tried again"]
