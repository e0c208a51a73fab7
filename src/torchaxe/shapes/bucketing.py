"""Pad batches to a few fixed sizes, so that a model with variable-length inputs
sees a handful of shapes instead of one per batch.

``pad_to_bucket(x, boundaries, dim)`` pads one tensor along ``dim`` up to the
smallest boundary that holds it. ``BucketingCollate`` is a DataLoader ``collate_fn``
that does this for whole batches: given samples of different lengths it pads them to
the bucket of the longest and returns the attention mask (True at real positions);
wrapped around an existing collate function it pads that function's output instead.
Boundaries come from ``torchaxe shapes`` (``--max-shapes K``), which picks them from
the observed lengths with the least padding.

    loader = DataLoader(data, batch_size=32,
                        collate_fn=BucketingCollate([24, 40, 64], pad_value=0))
    for tokens, labels, mask in loader: ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

from torchaxe.errors import TorchaxeError
from torchaxe.shapes.buckets import bucket_of

OVERSIZE = ("error", "keep")
#: ``pad_value`` of a wrapped collate function: learn the padding it uses.
AUTO = "auto"


class BucketingError(TorchaxeError, ValueError):
    """Boundaries or batches that cannot be bucketed, in one line."""


def _check_boundaries(boundaries: Any, what: str = "boundaries") -> tuple[int, ...]:
    if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence) or not boundaries:
        raise BucketingError(f"{what}: expected a non-empty list of sizes, got {boundaries!r}")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in boundaries):
        raise BucketingError(f"{what}: sizes must be positive integers, got {list(boundaries)}")
    return tuple(sorted(set(boundaries)))


def _normalise(boundaries: Any, dim: int | Sequence[int]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(dims, boundaries per dim) from either one dim and one list, or several of each."""
    if isinstance(dim, int) and not isinstance(dim, bool):
        return (dim,), (_check_boundaries(boundaries),)
    dims = tuple(dim)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise BucketingError(f"dim: expected an integer or a list of integers, got {dim!r}")
    if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence) or len(boundaries) != len(dims):
        raise BucketingError(f"boundaries: with dim={list(dims)} give one list of sizes per dimension")
    return dims, tuple(_check_boundaries(b, f"boundaries[{i}]") for i, b in enumerate(boundaries))


def _target_size(size: int, bounds: tuple[int, ...], dim: int, oversize: str) -> int:
    bucket = bucket_of(size, bounds)
    if bucket is not None:
        return bucket
    if oversize == "keep":
        return size
    raise BucketingError(f"size {size} along dim {dim} is above the largest bucket {bounds[-1]} "
                         f"(add a larger boundary, or pass oversize='keep')")


def learned_padding(tensor: Any, dim: int) -> float | None:
    """The value a collate function padded ``tensor`` (a batch) with along ``dim``:
    what fills the end of the row with the longest run of one value at its end that
    is not the whole row (a real row of a mask is all ones), when that run is at least
    two long and some row ends otherwise (the longest row ends in real data). None
    without such evidence (every row as long as the longest, say)."""
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        return None
    d = dim % tensor.dim()
    if d == 0:
        return None
    rows = tensor.movedim(d, 1).reshape(tensor.shape[0], tensor.shape[d], -1)
    count, length = rows.shape[0], rows.shape[1]
    if count < 2 or length < 3:
        return None
    ends: list[float | None] = []
    best_run, best = 1, None
    for row in rows:
        last = row[-1]
        if not bool((last == last[0]).all()):
            ends.append(None)
            continue
        value = last[0].item()
        ends.append(value)
        same = (row == last[0]).all(dim=-1).flip(0).to(torch.int64)
        run = int(same.cumprod(0).sum())
        if best_run < run < length:
            best_run, best = run, value
    if best is None or all(e == best for e in ends):
        return None
    return best


def pad_to_bucket(tensor: Any, boundaries: Sequence[int] | Sequence[Sequence[int]], dim: int | Sequence[int] = -1,
                  value: float = 0, oversize: str = "error") -> Any:
    """Pad ``tensor`` at the end of ``dim`` up to the smallest boundary that holds it.

    ``dim`` may be a list of dimensions with one list of boundaries each (image
    height and width). A size above the largest boundary raises
    :class:`BucketingError`, or is left as it is with ``oversize="keep"``. The
    padding is ``value``; a tensor already at a boundary is returned unchanged."""
    import torch.nn.functional as F

    if oversize not in OVERSIZE:
        raise BucketingError(f"oversize: {oversize!r} is not one of {', '.join(OVERSIZE)}")
    dims, bounds = _normalise(boundaries, dim)
    ndim = tensor.dim()
    pads = [0] * (2 * ndim)  # F.pad order: last dimension first, (left, right) pairs
    for d, b in zip(dims, bounds):
        if not -ndim <= d < ndim:
            raise BucketingError(f"dim {d}: the tensor has only {ndim} dimensions (shape {tuple(tensor.shape)})")
        d = d % ndim
        size = tensor.shape[d]
        pads[2 * (ndim - 1 - d) + 1] = _target_size(size, b, d, oversize) - size
    if not any(pads):
        return tensor
    return F.pad(tensor, pads, value=value)


class BucketingCollate:
    """A DataLoader ``collate_fn`` that pads every batch to a bucket size.

    Without ``collate_fn``: each sample is a tensor, a tuple/list or a dict whose
    sequence fields (``fields``: positions or keys; default the tensor itself, the
    first item of a tuple, or ``input_ids`` of a dict) have their length along
    ``dim`` (default 0, the sample's first dimension). Those fields are padded with
    ``pad_value`` to the bucket of the batch's longest and stacked; the other fields
    go through torch's ``default_collate``. With ``return_mask`` (the default here)
    the attention mask, bool ``[batch, *padded sizes]`` and True at real positions,
    is appended: ``(tokens, mask)``, ``(tokens, label, mask)``, or
    ``{..., "attention_mask": mask}``.

    With ``collate_fn``: the samples go through it first, and the tensors of its
    output (the output itself, or the items of a tuple/list/dict; ``fields`` picks
    them, default every tensor with more than ``dim`` dimensions that is as long along
    ``dim`` as the longest of them: a fixed-width target ``[batch, 3]`` is left alone)
    are padded along ``dim`` (default 1: batch-first sequences). This is how
    ``torchaxe trial`` adds bucketing to a script's own collate function without
    editing it. The padding value is by default (``pad_value="auto"``) the one the
    inner function uses, learned per tensor from its batches (-100 for labels, 0 for
    an attention mask): the value that fills the end of a row shorter than the
    longest. Until every tensor to pad has shown its value, a batch is passed on
    unpadded (another shape, not another loss). The mask is off by default in this
    form, since the script's own code does not expect one; when asked for, it marks
    the positions the bucketing added (the inner function's own padding is not
    known).
    """

    def __init__(self, boundaries: Sequence[int] | Sequence[Sequence[int]], *, dim: int | Sequence[int] | None = None,
                 pad_value: float | str | None = None, collate_fn: Callable[[list], Any] | None = None,
                 fields: Sequence[int | str] | None = None, return_mask: bool | None = None,
                 mask_key: str = "attention_mask", oversize: str = "error") -> None:
        if dim is None:
            dim = 0 if collate_fn is None else 1
        if oversize not in OVERSIZE:
            raise BucketingError(f"oversize: {oversize!r} is not one of {', '.join(OVERSIZE)}")
        self.dims, self.boundaries = _normalise(boundaries, dim)
        self.dim = dim
        if pad_value is None:
            pad_value = 0 if collate_fn is None else AUTO
        if pad_value == AUTO and collate_fn is None:
            raise BucketingError("pad_value='auto' learns the padding of a collate_fn: give collate_fn, or a number")
        if pad_value != AUTO and (isinstance(pad_value, bool) or not isinstance(pad_value, (int, float))):
            raise BucketingError(f"pad_value: expected a number or 'auto', got {pad_value!r}")
        self.pad_value = pad_value
        #: pad_value="auto": the padding value learned per tensor (dict key or position).
        self.learned: dict[Any, float] = {}
        #: Batches passed on unpadded while a tensor's padding value was not known yet.
        self.unpadded_batches = 0
        self.collate_fn = collate_fn
        self.fields = tuple(fields) if fields is not None else None
        self.return_mask = (collate_fn is None) if return_mask is None else bool(return_mask)
        self.mask_key = mask_key
        self.oversize = oversize

    def __repr__(self) -> str:
        inner = f", collate_fn={getattr(self.collate_fn, '__qualname__', self.collate_fn)!r}" if self.collate_fn else ""
        return f"BucketingCollate(boundaries={[list(b) for b in self.boundaries]}, dim={self.dim!r}{inner})"

    def _bounds_arg(self) -> Any:
        return list(self.boundaries[0]) if len(self.dims) == 1 else [list(b) for b in self.boundaries]

    def _dim_arg(self) -> Any:
        return self.dims[0] if len(self.dims) == 1 else list(self.dims)

    # ------------------------------------------------------------------ calls

    def __call__(self, samples: list) -> Any:
        if self.collate_fn is not None:
            return self._wrap(self.collate_fn(samples))
        return self._collate(samples)

    def _wrap(self, batch: Any) -> Any:
        import torch

        def shaped(value: Any) -> bool:
            # dim 0 is the batch: a tensor is padded only when it has the dimensions asked for
            return isinstance(value, torch.Tensor) and all(
                value.dim() > d if d >= 0 else value.dim() >= max(2, -d) for d in self.dims)

        if isinstance(batch, Mapping):
            entries = list(batch.items())
        elif isinstance(batch, (tuple, list)):
            entries = list(enumerate(batch))
        else:
            entries = [(0, batch)]
        if self.fields is not None:
            chosen = {k for k, v in entries if isinstance(v, torch.Tensor) and k in self.fields}
        else:
            candidates = [(k, v) for k, v in entries if shaped(v)]
            longest = max((v.shape[self.dims[0]] for _, v in candidates), default=0)
            chosen = {k for k, v in candidates if v.shape[self.dims[0]] == longest}
        values: dict[Any, Any] = {}
        for key, value in entries:
            if key not in chosen:
                continue
            if self.pad_value != AUTO:
                values[key] = self.pad_value
                continue
            if key not in self.learned:
                found = learned_padding(value, self.dims[0])
                if found is not None:
                    self.learned[key] = found
            if key in self.learned:
                values[key] = self.learned[key]
            elif self._needs_padding(value):
                # Its padding is not known yet: padded with a guess it could change the loss.
                self.unpadded_batches += 1
                return batch

        mask_of: list = []

        def pad(key: Any, value: Any) -> Any:
            if key not in chosen:
                return value
            padded = pad_to_bucket(value, self._bounds_arg(), self._dim_arg(), values[key], self.oversize)
            if self.return_mask and not mask_of:
                mask_of.append(self._mask_added(value, padded))
            return padded

        if isinstance(batch, torch.Tensor):
            out: Any = pad(0, batch)
            return (out, mask_of[0]) if self.return_mask and mask_of else out
        if isinstance(batch, Mapping):
            out = {k: pad(k, v) for k, v in batch.items()}
            if self.return_mask and mask_of:
                out[self.mask_key] = mask_of[0]
            return out
        if isinstance(batch, (tuple, list)):
            items = [pad(i, v) for i, v in enumerate(batch)]
            if self.return_mask and mask_of:
                items.append(mask_of[0])
            if isinstance(batch, list):
                return items
            if hasattr(batch, "_fields") and len(items) == len(batch):  # a namedtuple keeps its type
                return type(batch)(*items)
            return tuple(items)
        return batch

    def _needs_padding(self, value: Any) -> bool:
        """Whether ``value`` is off its bucket in any of the dimensions (its sizes
        read, nothing padded)."""
        ndim = value.dim()
        for d, bounds in zip(self.dims, self.boundaries):
            if not -ndim <= d < ndim:
                raise BucketingError(f"dim {d}: the tensor has only {ndim} dimensions (shape {tuple(value.shape)})")
            if _target_size(value.shape[d], bounds, d % ndim, self.oversize) != value.shape[d]:
                return True
        return False

    def _mask_added(self, before: Any, after: Any) -> Any:
        """True where the original batch had a position (the inner padding included)."""
        import torch

        ndim = before.dim()
        dims = [d % ndim for d in self.dims]
        shape = [after.shape[0]] + [after.shape[d] for d in dims]
        mask = torch.ones(shape, dtype=torch.bool)
        for i, d in enumerate(dims):
            index = [slice(None)] * len(shape)
            index[i + 1] = slice(before.shape[d], None)
            mask[tuple(index)] = False
        return mask

    def _sequence_fields(self, sample: Any) -> tuple:
        if self.fields is not None:
            return self.fields
        if isinstance(sample, Mapping):
            if "input_ids" in sample:
                return ("input_ids",)
            raise BucketingError("BucketingCollate: dict samples need fields=[...] naming the sequence fields "
                                 f"(keys: {', '.join(map(str, sample))})")
        return (0,)

    def _collate(self, samples: list) -> Any:
        import torch
        from torch.utils.data import default_collate

        if not samples:
            raise BucketingError("BucketingCollate: an empty batch")
        first = samples[0]
        if isinstance(first, torch.Tensor):
            padded, mask = self._stack([s for s in samples])
            return (padded, mask) if self.return_mask else padded
        if isinstance(first, Mapping):
            keys = list(first)
            fields = self._sequence_fields(first)
            missing = [f for f in fields if f not in first]
            if missing:
                raise BucketingError(f"BucketingCollate: no field {missing[0]!r} in the samples (keys: {', '.join(map(str, keys))})")
            out: dict = {}
            mask = None
            for key in keys:
                column = [s[key] for s in samples]
                if key in fields:
                    out[key], field_mask = self._stack(column)
                    mask = field_mask if mask is None else mask
                else:
                    out[key] = default_collate(column)
            if self.return_mask:
                out[self.mask_key] = mask
            return out
        if isinstance(first, (tuple, list)):
            fields = self._sequence_fields(first)
            bad = [f for f in fields if not isinstance(f, int) or not -len(first) <= f < len(first)]
            if bad:
                raise BucketingError(f"BucketingCollate: field {bad[0]!r} is not a position in samples of {len(first)} items")
            fields = tuple(f % len(first) for f in fields)
            items = []
            mask = None
            for i in range(len(first)):
                column = [s[i] for s in samples]
                if i in fields:
                    stacked, field_mask = self._stack(column)
                    items.append(stacked)
                    mask = field_mask if mask is None else mask
                else:
                    items.append(default_collate(column))
            if self.return_mask:
                items.append(mask)
            return tuple(items)
        raise BucketingError(f"BucketingCollate: samples must be tensors, tuples, lists or dicts, got {type(first).__name__}")

    def _stack(self, tensors: list) -> tuple[Any, Any]:
        """Pad each sample to the batch's bucket and stack; the mask marks real positions."""
        import torch

        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise BucketingError("BucketingCollate: a sequence field holds something other than a tensor")
        ndim = tensors[0].dim()
        if ndim == 0 or any(t.dim() != ndim for t in tensors):
            raise BucketingError("BucketingCollate: sequence fields must have the same number of dimensions, at least one")
        dims = []
        for d in self.dims:
            if not -ndim <= d < ndim:
                raise BucketingError(f"dim {d}: the samples have only {ndim} dimensions")
            dims.append(d % ndim)
        target = {d: _target_size(max(t.shape[d] for t in tensors), b, d, self.oversize)
                  for d, b in zip(dims, self.boundaries)}
        bounds = [[target[d]] for d in dims]
        padded = torch.stack([pad_to_bucket(t, bounds, dims, self.pad_value) for t in tensors])
        mask = None
        if self.return_mask:
            mask = torch.ones([len(tensors)] + [target[d] for d in dims], dtype=torch.bool)
            for i, d in enumerate(dims):
                positions = torch.arange(target[d])
                lengths = torch.tensor([t.shape[d] for t in tensors])
                inside = positions.unsqueeze(0) < lengths.unsqueeze(1)  # [batch, size]
                view = [len(tensors)] + [1] * len(dims)
                view[i + 1] = target[d]
                mask &= inside.reshape(view)
        return padded, mask
