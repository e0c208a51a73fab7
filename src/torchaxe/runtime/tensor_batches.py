"""Which DataLoaders take their batches sample by sample from tensors in memory: a
``TensorDataset`` (or a ``Subset`` of one) collated by torch's ``default_collate``.
The run records it for each loader (``loader_epochs[].batched_fetch``); the
dataloader knob's ``batched_fetch`` (data/knob.py) takes such batches with one
indexing per tensor. torch is imported when called."""

from __future__ import annotations

from typing import Any


def tensor_rows(dataset: Any) -> tuple[tuple[Any, ...], Any] | None:
    """``(tensors, rows)`` when ``dataset`` is a ``TensorDataset`` whose ``__getitem__``
    is torch's, or a ``Subset`` (torch's) of one: sample ``i`` is ``t[rows[i]]`` of
    each tensor (``rows`` None: ``t[i]``). None for any other dataset."""
    from torch.utils.data import Subset, TensorDataset

    rows = None
    if isinstance(dataset, Subset) and type(dataset).__getitem__ is Subset.__getitem__ \
            and getattr(type(dataset), "__getitems__", None) is getattr(Subset, "__getitems__", None):
        rows, dataset = dataset.indices, dataset.dataset
    if not isinstance(dataset, TensorDataset) or type(dataset).__getitem__ is not TensorDataset.__getitem__ \
            or hasattr(dataset, "__getitems__"):
        return None
    return tuple(dataset.tensors), rows


def batchable(loader: Any) -> bool:
    """Whether the knob's batched fetch takes ``loader``'s batches: batched by a sampler
    over a dataset :func:`tensor_rows` reads, with torch's ``default_collate``."""
    from torch.utils.data._utils.collate import default_collate

    return (bool(getattr(loader, "_auto_collation", False)) and getattr(loader, "collate_fn", None) is default_collate
            and tensor_rows(getattr(loader, "dataset", None)) is not None)
