"""The kernel swaps worth measuring: fused optimizers where an installed package builds
them unfused (cpu, cuda), and on a CPU target dropout with a packed-bits mask
when the profiled run spent a visible share of its operator time drawing dropout
masks (``aten::bernoulli_``). Where torch's own draw is fast (an MKL build on an Intel
CPU), that share stays small and nothing is proposed. The masks differ from torch's,
so the training loss is compared before the change may be chosen.

Compiled, such a model draws its masks with the compiler's own element-wise draw,
slower than torch's eager one on a CPU: compile alone then measures slower than eager.
Packed dropout inside the compiled graph keeps the fast draw, so compile with packed
dropout is measured as one more candidate of the same group (the faster one is kept)."""

from __future__ import annotations

import os
from typing import Any, Sequence

from torchaxe.runtime.candidate import Accuracy, Candidate, knob_candidate
from torchaxe.runtime.opstats import op_share
from torchaxe.shapes.candidates import (COMPILE_ACCURACY_DETAIL, compile_knob, last_batch_text, seen_last_batch,
                                       unseen_last_batch)
from torchaxe.units import package_path

#: The operator torch's CPU dropout spends its time in (one Bernoulli draw an element).
DROPOUT_DRAW = "aten::bernoulli_"
#: Below this share of the operator time, a faster draw cannot save a measurable step.
MIN_SHARE = 0.03
#: The group of the dropout candidates: one of them goes into a combined run.
GROUP = "dropout"


def candidates(profile: dict[str, Any], target: str, settings: dict[str, Any]) -> list[Candidate]:
    """The dropout candidates (:func:`dropout_candidates`); ``knob:fused-optimizer``
    needs the scan's optimizer fixes and is asked for apart
    (:func:`fused_optimizer_candidates`)."""
    return dropout_candidates(profile, target, settings)


def _local(site: str) -> str:
    """``path:line`` with the path relative to the working folder when it is inside."""
    path, _, line = site.rpartition(":")
    relative = os.path.relpath(path)
    return f"{path if relative.startswith('..') else relative}:{line}"


def fused_optimizer_candidates(target: str, settings: dict[str, Any],
                               fixes: Sequence[tuple[str, int, int]] = ()) -> list[Candidate]:
    """``knob:fused-optimizer`` on a cpu or cuda target when the run built a torch
    optimizer that has a fused implementation, unfused, with no implementation chosen,
    where no code fix reaches it: in an installed package (a framework's or library's
    optimizer factory), or in the user's code where the scan proposed no fix
    (``fixes``: the lines of the scan's optimizer fixes), such as nanoGPT's and
    llama2.c's ``AdamW(..., **extra_args)``, whose keywords ask for ``fused=True``
    on cuda only."""
    from torchaxe.kernels.optimizer import FUSED_CLASSES
    from torchaxe.runtime.run_context import site_within

    if target not in ("cpu", "cuda"):
        return []
    unfused = [o for o in settings.get("optimizers") or []
               if o.get("class") in FUSED_CLASSES and str(o.get("module", "")).startswith("torch.optim")
               and not o.get("fused") and not o.get("chosen") and o.get("site")
               and not any(site_within(o["site"], *fix) for fix in fixes)]
    if not unfused:
        return []
    names = ", ".join(sorted({f"torch.optim.{o['class']}" for o in unfused}))
    site = unfused[0]["site"]
    shown = package_path(site)
    installed = shown != site  # site-packages, or a folder pip installed into
    if not installed:
        shown = _local(site)
    where = (f"in an installed package ({shown}), which no code fix edits" if installed else
             f"at {shown}, where the scan has no fix to make (its keywords come from elsewhere, or the call is "
             "not one it reads)")
    return [knob_candidate(
        "knob:fused-optimizer", "fused_ops", f"{names} built with fused=True (built {'in' if installed else 'at'} "
        f"{shown})",
        {"kernels": {"optimizer": "fused"}}, priority=0.9,
        accuracy=Accuracy(kind="unknown", detail="the fused kernels round differently in the last bits; the "
                                                 "training loss is compared with the original's"),
        detail=f"the run built {names} unfused {where}: the knob builds it with fused=True, one kernel per step "
               "for all parameters")]


def dropout_candidates(profile: dict[str, Any], target: str, settings: dict[str, Any]) -> list[Candidate]:
    """``knob:dropout-packed`` on a CPU target whose run drew dropout masks for at
    least ``MIN_SHARE`` of its operator time; with it ``knob:compile-dropout-packed``
    (torch.compile of the model with the packed draw inside its graph) unless the
    script compiles its model itself."""
    if target != "cpu":
        return []
    share = op_share(profile, DROPOUT_DRAW)
    if share < MIN_SHARE:
        return []
    masks = "other dropout masks from the same seed (the rate within 2**-17 of p)"
    spent = (f"the run spent {share:.0%} of its operator time drawing dropout masks one element at a time "
             f"({DROPOUT_DRAW})")
    packed = {"kernels": {"dropout": "packed"}}
    out = [knob_candidate(
        "knob:dropout-packed", "fused_ops",
        "dropout's mask drawn from packed 64-bit random draws (a quarter of the generator calls)",
        packed, group=GROUP, priority=0.8 + 2 * share,
        accuracy=Accuracy(kind="unknown", detail=f"{masks}; its training loss is compared with the original's"),
        detail=spent)]
    if not settings.get("compiled_graphs"):
        shapes = profile.get("shapes") or {}
        dynamic = True if shapes and not shapes.get("static", True) else None
        seen = seen_last_batch(profile, settings) if dynamic else None
        if seen is not None:
            dynamic = None  # only the epoch's last batch varied: as if the steps had ended before it
        last = seen or unseen_last_batch(profile, settings) if dynamic is None else None
        if last is not None:
            dynamic = False
        out.append(knob_candidate(
            "knob:compile-dropout-packed", "compile",
            "torch.compile(model) with packed dropout inside its graph"
            + ("" if dynamic is None else f" (dynamic={dynamic})"),
            {**compile_knob(mode="default", dynamic=dynamic), **packed}, group=GROUP, priority=2.0 + share,
            accuracy=Accuracy(kind="unknown", detail=f"{masks}, and {COMPILE_ACCURACY_DETAIL}"),
            detail=f"{spent}; compiled, the model would draw them with the compiler's own element-wise draw, "
                   "slower on a CPU, so the packed draw is kept as one operator of the compiled graph"
                   + (f"; {last_batch_text(last)}" if last is not None else "")))
    return out
