"""The ``dataloader`` knob: DataLoader settings for every loader the script builds,
without editing the script::

    {"dataloader": {"num_workers": 2, "pin_memory": true, "persistent_workers": true,
                    "prefetch_factor": 4, "multiprocessing_context": "fork", "timeout": 60}}
    {"dataloader": {"batch_scale": 2}}

``batched_fetch`` takes each batch of a loader over an in-memory ``TensorDataset`` (or
a ``Subset`` of one, as ``random_split`` gives) with one indexing of each tensor,
instead of one ``dataset[i]`` per sample stacked by ``default_collate``: the same
batch, the same values and order, without a Python call and a small tensor per sample
(:class:`BatchedFetch`). Loaders with a collate function of their own are left alone.

``batch_scale`` multiplies the batch size of every loader that batches by a
``batch_size`` (not a ``batch_sampler`` of its own): a larger micro-batch, which
changes the optimisation (fewer steps per epoch). The run then notes
``samples_scale`` among what it applied, so that its step times are compared per
original batch.

The bootstrap patches ``DataLoader.__init__`` while the script runs
(:class:`DataLoaderOverride`). Parsing imports nothing heavy; torch is imported when
the patch is installed.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed, kind
from torchaxe.runtime.loader_patch import LoaderPatch
from torchaxe.runtime.tensor_batches import tensor_rows

#: DataLoader worker start methods (``dataloader.multiprocessing_context``).
START_METHODS = ("fork", "spawn", "forkserver")
KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "multiprocessing_context", "timeout")
#: What a loader's record shows besides KEYS.
RECORDED = (*KEYS, "batch_size")


@dataclass(frozen=True)
class DataLoaderKnobs:
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None
    #: The workers' start method (``fork``, ``spawn``, ``forkserver``).
    multiprocessing_context: str | None = None
    #: Seconds a worker batch may take before the loader raises (a hung loader).
    timeout: float | None = None
    #: Multiplies the batch size of every loader batched by ``batch_size``.
    batch_scale: int | None = None
    #: One indexing per tensor for each batch of an in-memory TensorDataset.
    batched_fetch: bool | None = None

    def overrides(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    to_dict = overrides


class DataLoaderOverride:
    """Patches ``DataLoader.__init__`` so that every loader the script builds gets the
    knob's keywords, whether the script passed them by position, by name or not at all.
    ``prefetch_factor``, ``persistent_workers`` and ``multiprocessing_context`` need
    worker processes: on a loader that ends up with ``num_workers=0`` they are left out
    (torch refuses them there). The worker count of a loader over an
    ``IterableDataset`` is never changed: each worker iterates such a dataset whole
    unless it splits itself by ``get_worker_info()``, so another count could repeat or
    drop samples."""

    def __init__(self, overrides: dict[str, Any], applied: AppliedKnobs) -> None:
        self.overrides = overrides
        self.applied = applied
        self.loaders: list[dict[str, Any]] = []
        self._patch = LoaderPatch(self._edit)

    def install(self) -> None:
        if self.overrides:
            self._patch.install()

    def uninstall(self) -> None:
        self._patch.uninstall()

    def _edit(self, arguments: dict[str, Any], signature: inspect.Signature) -> None:
        from torch.utils.data import IterableDataset

        settings = dict(self.overrides)
        scale = settings.pop("batch_scale", None)
        if scale and scale != 1 and arguments.get("batch_sampler") is None:
            size = arguments.get("batch_size", signature.parameters["batch_size"].default)
            if size is not None:  # None: the loader hands out single samples
                arguments["batch_size"] = size * scale
                self.applied.note("samples_scale", scale)
        if isinstance(arguments.get("dataset"), IterableDataset) and "num_workers" in settings \
                and settings["num_workers"] != arguments.get("num_workers", 0):
            # Each worker of an iterable dataset iterates it whole unless the
            # dataset splits itself by get_worker_info(): another worker count
            # could repeat or drop samples. Left as the script wrote it.
            settings.pop("num_workers")
        workers = settings.get("num_workers", arguments.get("num_workers", 0))
        if not workers:
            settings.pop("prefetch_factor", None)
            settings.pop("persistent_workers", None)
            settings.pop("multiprocessing_context", None)
        arguments.update(settings)
        final = {k: arguments.get(k, signature.parameters[k].default) for k in RECORDED if k in signature.parameters}
        context = final.get("multiprocessing_context")
        if context is not None and not isinstance(context, str):  # a context object: its method's name
            final["multiprocessing_context"] = getattr(context, "get_start_method", lambda: str(context))()
        self.loaders.append(final)
        self.applied.note("dataloader", {"overrides": self.overrides, "loaders": self.loaders})


class BatchedFetch:
    """Patches torch's map-style fetcher: a batch of a dataset :func:`tensor_rows`
    reads, collated by ``default_collate``, is taken as ``[t[index] for t in
    tensors]`` (``default_collate`` turns a batch of tuples into a list of stacked
    tensors: the same list, values and order). Every other fetch is torch's own. In
    worker processes started by fork the patch is inherited; spawned workers fetch as
    torch does (the same batches)."""

    def __init__(self, applied: AppliedKnobs) -> None:
        self.applied = applied
        self._saved: Any = None

    def install(self) -> None:
        import torch
        from torch.utils.data._utils import fetch
        from torch.utils.data._utils.collate import default_collate

        owner = fetch._MapDatasetFetcher
        original = owner.fetch
        self._saved = (owner, original)
        applied = self.applied

        def batched(fetcher, possibly_batched_index):
            # Decided once per fetcher (one an iterator: an epoch, or a worker's life).
            found = fetcher.__dict__.get("_torchaxe_rows", False)
            if found is False:
                found = tensor_rows(fetcher.dataset) if fetcher.auto_collation \
                    and fetcher.collate_fn is default_collate else None
                if found is not None:
                    tensors, rows = found
                    found = (tensors, None if rows is None else torch.as_tensor(rows, dtype=torch.long))
                    applied.note("batched_fetch", True)
                fetcher.__dict__["_torchaxe_rows"] = found
            if found is None:
                return original(fetcher, possibly_batched_index)
            tensors, rows = found
            index = torch.as_tensor(possibly_batched_index, dtype=torch.long)
            if rows is not None:
                index = rows[index]
            return [t[index.to(t.device)] for t in tensors]

        batched.__wrapped__ = original  # type: ignore[attr-defined]
        owner.fetch = batched

    def uninstall(self) -> None:
        if self._saved is not None:
            owner, original = self._saved
            owner.fetch = original
            self._saved = None


class DataLoaderKnob(Knob):
    """``dataloader``: worker count, pinning, persistence, prefetch depth, start method,
    timeout and batch-size multiple of every DataLoader the script builds."""

    key = "dataloader"
    example = {"num_workers": 2, "pin_memory": True, "multiprocessing_context": "spawn"}

    def default(self) -> DataLoaderKnobs:
        return DataLoaderKnobs()

    def parse(self, raw: Any, check: KnobCheck) -> DataLoaderKnobs:
        dl = check.obj(raw, "dataloader", (*KEYS, "batch_scale", "batched_fetch"))
        timeout = dl.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0 or timeout == float("inf")):
            check.fail("dataloader.timeout", f"expected a positive number of seconds, got {kind(timeout)}")
        return DataLoaderKnobs(
            num_workers=check.int(dl.get("num_workers"), "dataloader.num_workers", 0),
            pin_memory=check.bool(dl.get("pin_memory"), "dataloader.pin_memory"),
            persistent_workers=check.bool(dl.get("persistent_workers"), "dataloader.persistent_workers"),
            prefetch_factor=check.int(dl.get("prefetch_factor"), "dataloader.prefetch_factor", 1),
            multiprocessing_context=check.choice(dl.get("multiprocessing_context"), "dataloader.multiprocessing_context",
                                                 START_METHODS),
            timeout=float(timeout) if timeout is not None else None,
            batch_scale=check.int(dl.get("batch_scale"), "dataloader.batch_scale", 1),
            batched_fetch=check.bool(dl.get("batched_fetch"), "dataloader.batched_fetch"),
        )

    def patch(self, value: DataLoaderKnobs, applied: AppliedKnobs):
        overrides = value.overrides()
        fetch = bool(overrides.pop("batched_fetch", False))
        stack = ExitStack()
        if overrides:
            stack.enter_context(installed(DataLoaderOverride(overrides, applied)))
        if fetch:
            stack.enter_context(installed(BatchedFetch(applied)))
        return stack


SPEC = DataLoaderKnob()
