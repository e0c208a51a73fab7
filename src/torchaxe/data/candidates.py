"""The loader settings worth measuring: worker processes when the run waited for
data, and the setting ``torchaxe data --tune`` found and kept for this command.

The worker count is the data axis's one estimate (:func:`torchaxe.data.tuning.
estimate_workers`), the same the tuning search starts from, fed with the profile's
data wait and step time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from torchaxe.data.tuning import cores_for_this_rank, estimate_workers, stored_loader_knobs
from torchaxe.runtime.candidate import Accuracy, Candidate, Recommendation, knob_candidate

#: Loader settings compute the same thing on each batch, but worker processes seed
#: their own random state (augmentation), and persistent workers stop drawing a base
#: seed from the global generator each epoch (the shuffle order after the first).
LOADER_ACCURACY = Accuracy(kind="data_order", detail="same computation per batch; with worker processes the "
                           "shuffle order and random augmentation may differ")
#: Below this fraction of the step spent waiting for data, loader settings are not tried.
MIN_WAIT_FRACTION = 0.05


def candidates(profile: dict[str, Any], target: str, settings: dict[str, Any]) -> list[Candidate]:
    """Worker processes (persistent, with pinned memory on a device) when the profile
    shows the step waiting for data (not when every loader iterates an
    ``IterableDataset``, whose worker count the knob keeps); and, when a loader the run
    built takes its batches sample by sample from in-memory tensors, one indexing per
    batch."""
    wait = (profile.get("summary") or {}).get("data_wait_fraction") or 0.0
    if wait <= MIN_WAIT_FRACTION:
        return []
    kinds = settings.get("loader_kinds") or {}
    if kinds.get("iterable") and not kinds.get("map"):
        # Every loader iterates an IterableDataset, whose worker count the knob keeps
        # (each worker would iterate it whole): a worker setting would change nothing.
        return _batched_fetch(settings, wait)
    return [*_batched_fetch(settings, wait), _workers(profile, target, settings, wait)]


def _batched_fetch(settings: dict[str, Any], wait: float) -> list[Candidate]:
    """``dataloader.batched_fetch`` when a loader over a TensorDataset (or a Subset of
    one) collates by default (runtime/run_context.py ``loader_epochs``)."""
    sites = [e.get("site") or "its line" for e in settings.get("loader_epochs") or [] if e.get("batched_fetch")]
    if not sites:
        return []
    return [knob_candidate(
        "knob:dataloader-batched-fetch", "data",
        "DataLoader batches of a TensorDataset taken with one indexing per tensor, not sample by sample",
        {"dataloader": {"batched_fetch": True}}, group="dataloader-fetch", priority=1.0 + 4 * wait,
        detail=(f"the loader built at {sites[0]} fetches each sample of in-memory tensors with its own "
                f"dataset[i] and stacks them; the step waited for data {wait:.0%} of the time. In code: "
                "DataLoader(dataset, sampler=BatchSampler(RandomSampler(dataset), batch_size, drop_last=False), "
                "batch_size=None) gives the batches as tuples by one indexing"),
        accuracy=Accuracy(kind="exact", detail="the same batches: the same samples, in the same order"))]


def _workers(profile: dict[str, Any], target: str, settings: dict[str, Any], wait: float) -> Candidate:
    """Worker processes, their count estimated from the profile's data wait and step."""
    # The CPUs the run's process was allowed (its affinity), else this process's,
    # shared among the ranks of a node: no worker count above them.
    cores = settings.get("allowed_cpus") or cores_for_this_rank()
    # Loading in the script's own process, a batch takes about the step's data wait;
    # the rest of the step is what a worker's batch has to arrive within.
    summary = profile.get("summary") or {}
    load, step = summary.get("data_wait_seconds_median"), summary.get("step_seconds_median")
    compute = step - load if load and step and step > load else None
    workers = estimate_workers(load if compute else None, compute, cores)
    knobs: dict[str, Any] = {"num_workers": workers, "persistent_workers": True}
    if target in ("cuda", "npu"):
        knobs["pin_memory"] = True
    return knob_candidate(
        "knob:dataloader", "data", f"DataLoader(num_workers={workers}, persistent_workers=True"
        + (", pin_memory=True)" if "pin_memory" in knobs else ")"), {"dataloader": knobs},
        group="dataloader", priority=1.0 + 4 * wait, detail=f"in the profiled run the step waited for data {wait:.0%} of the time",
        accuracy=replace(LOADER_ACCURACY))


def stored_candidates(command: Sequence[str]) -> list[Candidate]:
    """The loader setting the knowledge base holds for this command (found by
    ``torchaxe data --tune``), to measure again against this run. Raises
    :class:`~torchaxe.errors.TorchaxeError` when the knowledge base cannot be read."""
    stored = stored_loader_knobs(command)
    if not stored:
        return []
    loader = stored["dataloader"]
    settings = ", ".join(f"{k}={v}" for k, v in sorted(loader.items()))
    rec = Recommendation(key="knob:dataloader-tuned", axis="data", title=f"DataLoader({settings}) "
                         "(found by `torchaxe data --tune`)", applies="knob", knobs={"dataloader": loader},
                         detail="the loader setting the knowledge base holds for this command",
                         accuracy=replace(LOADER_ACCURACY))
    return [Candidate(rec=rec, knobs={"dataloader": loader}, group="dataloader", priority=2.5)]
