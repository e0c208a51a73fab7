"""The memory changes worth measuring: activation checkpointing of the repeated blocks
(when a memory limit is given), expandable allocator segments (cuda, npu), and, when
the user allows it and memory leaves room, a larger micro-batch.

Each is measured like any change, its peak memory beside its speed: checkpointing
always costs time (one more forward of the blocks) and is there for the memory it
saves; a larger micro-batch is compared per sample and changes the optimisation.
"""

from __future__ import annotations

from typing import Any

from torchaxe.runtime.candidate import Accuracy, Candidate, knob_candidate
from torchaxe.units import bytes_text

#: The caching allocator's settings variable, by target.
ALLOCATOR_VARIABLES = {"cuda": "PYTORCH_CUDA_ALLOC_CONF", "npu": "PYTORCH_NPU_ALLOC_CONF"}
EXPANDABLE_SEGMENTS = "expandable_segments:True"
#: How many times the original's batch a larger micro-batch holds.
BATCH_SCALE = 2


def profile_peak(profile: dict[str, Any]) -> tuple[int, str] | None:
    """The profiled run's peak memory and its kind: the device allocator's peak where
    the run had a device (``device``), else the peak resident set (``host_rss``)."""
    summary = profile.get("summary") or {}
    if summary.get("peak_device_memory_bytes") is not None:
        return int(summary["peak_device_memory_bytes"]), "device"
    if summary.get("host_rss_peak_bytes") is not None:
        return int(summary["host_rss_peak_bytes"]), "host_rss"
    return None


def allocator_setting(settings: dict[str, Any], target: str) -> tuple[str, str, str] | None:
    """(variable, its value now, the value with expandable segments) on a target with
    a caching allocator whose settings the run's environment does not already expand;
    None otherwise."""
    var = ALLOCATOR_VARIABLES.get(target)
    if var is None:
        return None
    current = (settings.get("env") or {}).get(var, "")
    if "expandable_segments:true" in current.replace(" ", "").lower():
        return None
    return var, current, ",".join(p for p in (current, EXPANDABLE_SEGMENTS) if p)


def _loads_batches(profile: dict[str, Any]) -> bool:
    """Whether the run's steps took their batches from a DataLoader (whose batch size
    the ``dataloader`` knob can change)."""
    return any((s.get("batches") or 0) > 0 for s in profile.get("steps") or [])


def candidates(profile: dict[str, Any], target: str, settings: dict[str, Any], *, memory_limit: int | None = None,
               allow_batch_change: bool = False, notes: list[str] | None = None) -> list[Candidate]:
    """Checkpointing with a memory limit; expandable segments on cuda and npu unless
    already set; a doubled micro-batch with ``allow_batch_change`` when the original's
    peak times two stays below the limit (or no limit is given). Why an allowed batch
    change is not tried goes to ``notes``."""
    out: list[Candidate] = []
    peak = profile_peak(profile)
    over = memory_limit is not None and peak is not None and peak[0] > memory_limit
    if memory_limit is not None:
        activations = (profile.get("flops") or {}).get("activation_bytes")
        saved = f"; the profile saw {bytes_text(activations)} of activations saved for backward a step" \
            if activations else ""
        out.append(knob_candidate(
            "knob:checkpoint", "memory", "activation checkpointing of the repeated blocks (torch.utils.checkpoint, "
            "no code change)", {"checkpoint": {"blocks": "auto"}}, group="checkpoint",
            priority=4.0 if over else 0.4,
            accuracy=Accuracy(kind="exact", detail="the blocks are computed again in backward with the random "
                              "state replayed: same numerics"),
            detail="keeps the repeated blocks' activations out of memory and computes them again in backward: "
                   f"costs time (one more forward of the blocks), saves memory{saved}"))
    setting = allocator_setting(settings, target)
    if setting is not None:
        var, current, value = setting
        unverified = " (not yet verified on Ascend hardware)" if target == "npu" else ""
        out.append(knob_candidate(
            "knob:expandable-segments", "memory", f"{var}={value}: expandable allocator segments", {"env": {var: value}},
            group="allocator", priority=2.0 if over else 1.0,
            detail=f"{var} is {current or 'unset'}: expandable segments let the caching allocator grow its blocks "
                   f"instead of fragmenting them (a lower peak, fewer device allocation calls){unverified}"))
    if allow_batch_change:
        why_not = None
        if not _loads_batches(profile):
            why_not = "the run's steps took no batches from a DataLoader, whose batch size it changes"
        elif memory_limit is not None and peak is None:
            why_not = "no peak memory was recorded to judge it against --memory-limit"
        elif memory_limit is not None and peak is not None and peak[0] * BATCH_SCALE > memory_limit:
            why_not = (f"the original's peak ({bytes_text(peak[0])}) times {BATCH_SCALE} is above --memory-limit "
                       f"({bytes_text(memory_limit)})")
        if why_not:
            if notes is not None:
                notes.append(f"no larger micro-batch tried (--allow-batch-change): {why_not}")
        else:
            out.append(knob_candidate(
                f"knob:batch-x{BATCH_SCALE}", "memory", f"a {BATCH_SCALE}x larger micro-batch (DataLoader batch_size "
                f"x{BATCH_SCALE}); changes the optimisation", {"dataloader": {"batch_scale": BATCH_SCALE}},
                group="batch", priority=0.8, changes_optimisation=True,
                accuracy=Accuracy(kind="unknown", detail="a larger micro-batch changes the optimisation (fewer "
                                  "optimizer steps per epoch, less gradient noise; the learning rate may need "
                                  "scaling): its training loss is compared with the original's"),
                detail=f"ranked by samples per second: its step-time ratio divided by {BATCH_SCALE}; it changes the "
                       "optimisation, so check convergence before keeping it"))
    return out
