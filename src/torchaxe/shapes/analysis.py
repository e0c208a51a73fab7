"""From what a run recorded to the facts the compile-mode decision needs: which
operators and modules saw one shape and which several, which dimensions vary and
how, and where the variation comes from.

Every varying dimension is traced, where it can be, to a cause:

- ``partial-batch``: only the last batch of an epoch is smaller (``drop_last=False``
  with a data set the batch size does not divide); ``drop_last=True`` is the fix;
- ``collate``: the collate function pads each batch to its own longest sample, so a
  non-batch dimension of the batches varies; bucketing is the fix;
- ``batch-size``: the batch size varies otherwise (a batch sampler);
- ``packed``: the samples are concatenated into one 1-D tensor whose total length
  varies (nn.EmbeddingBag with offsets); dynamic shapes, or samples of one length;
- ``last-chunk``: without a DataLoader telling it, one step an epoch is shorter than
  all the others (a stream cut into chunks of a fixed length with a remainder: a
  language model's last BPTT chunk); leaving it out or padding it is the fix;
- ``nonzero``, ``unique``, ``boolean-mask``, ``repeat_interleave``: an operator whose
  output size depends on the data, at a line of the user's code;
- ``item``: a size read back from a tensor with ``.item()`` (or ``int(t)``);
- ``unknown``: none of those explains it.

A dimension is explained by a cause when each of its sizes is ``a * s + b`` for one of
the cause's sizes ``s``, one integer ``a >= 1`` and a small offset ``b`` (a sequence
shifted by one for next-token targets, flattened batch x length rows).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from torchaxe.shapes.observe import Observation
from torchaxe.shapes.recorder import DataDependentSite, LoaderInfo, OpTally

#: More distinct sizes than this in one dimension, or new shapes still appearing in
#: the second half of the run, make the shapes dynamic; fewer, a mix worth measuring.
FEW_SHAPES = 4
#: Offsets allowed between a cause's sizes and the sizes they explain.
OFFSETS = range(-2, 3)
DATA_KINDS = ("nonzero", "unique", "boolean-mask", "repeat_interleave")
#: Varying subjects listed in the report per kind.
MAX_LISTED = 25
#: A shorter step counts as an epoch's last chunk only with at least this many steps
#: of the common shapes for each one.
STEPS_PER_CHUNK = 10


@dataclass
class DimVariation:
    """One dimension of one input that took several sizes."""

    position: str  # "input 0", "input 1[2]", "output", "input 0 (list length)"
    dim: int | None  # None for a list's length
    values: Counter
    cause: str | None = None  # a Cause.id

    @property
    def distinct(self) -> int:
        return len(self.values)

    def to_dict(self) -> dict[str, Any]:
        ordered = sorted(self.values)
        return {"position": self.position, "dim": self.dim, "distinct": self.distinct, "min": ordered[0],
                "max": ordered[-1], "distribution": {str(v): self.values[v] for v in ordered}, "cause": self.cause}


@dataclass
class Subject:
    """An operator, a module or a loader's batches, and the shapes it saw."""

    kind: str  # op, module, batch
    name: str
    calls: int
    distinct: int
    truncated: bool = False
    #: The number of tensors or their ranks changed between calls.
    rank_varies: bool = False
    dims: list[DimVariation] = field(default_factory=list)
    #: A shape first seen in the second half of the calls: the set has not settled.
    late: bool = False
    #: A module's class name (``GRU``); empty for operators and batches.
    type: str = ""
    #: Elements of a top-level module's parameters; None when not read.
    parameters: int | None = None

    @property
    def dynamic(self) -> bool:
        return self.distinct > 1 or self.truncated

    @property
    def causes(self) -> list[str]:
        seen: list[str] = []
        for d in self.dims:
            cause = d.cause or "unknown"
            if cause not in seen:
                seen.append(cause)
        return seen

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "calls": self.calls, "distinct": self.distinct,
                "truncated": self.truncated, "rank_varies": self.rank_varies, "late": self.late,
                "causes": self.causes, "dims": [d.to_dict() for d in self.dims]}


@dataclass
class Cause:
    """Where varying sizes come from, with what to do about it."""

    id: str
    kind: str
    message: str
    sizes: tuple[int, ...]
    location: str | None = None
    code: str | None = None
    fix: str | None = None
    #: How many varying dimensions (of operators and modules) it explains.
    explains: int = 0
    #: How often each size was produced, where known: tells apart two causes whose
    #: sizes both explain a dimension.
    counts: Counter | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "message": self.message, "location": self.location,
                "code": self.code, "fix": self.fix, "explains": self.explains,
                "sizes": {"distinct": len(self.sizes), "min": min(self.sizes) if self.sizes else None,
                          "max": max(self.sizes) if self.sizes else None}}


@dataclass
class BatchSource:
    """A loader whose batches vary in non-batch dimensions: what bucketing works on."""

    loader: LoaderInfo
    tensor: int  # which tensor of the batch
    dims: tuple[int, ...]  # its varying non-batch dimensions
    points: Counter  # size tuple (one per dim) -> batches


@dataclass
class ShapeAnalysis:
    """The facts, before any verdict."""

    steps: int
    subjects: list[Subject]
    causes: list[Cause]
    sites: list[DataDependentSite]
    loaders: list[LoaderInfo]
    batch_sources: list[BatchSource]

    def of_kind(self, kind: str) -> list[Subject]:
        return [s for s in self.subjects if s.kind == kind]

    def counts(self, kind: str) -> dict[str, int]:
        subjects = self.of_kind(kind)
        dynamic = sum(1 for s in subjects if s.dynamic)
        return {"total": len(subjects), "static": len(subjects) - dynamic, "dynamic": dynamic}

    def cause(self, cause_id: str | None) -> Cause | None:
        return next((c for c in self.causes if c.id == cause_id), None)


# ------------------------------------------------------------------- variation


def _positions(signature: tuple) -> dict[str, tuple]:
    """Flatten a signature into position -> shape (lists of tensors: one position per
    item and one for the list's length)."""
    out: dict[str, tuple] = {}
    for i, shape in enumerate(signature):
        if shape and shape[0] == "out":
            out["output"] = tuple(shape[1:])
        elif shape and not isinstance(shape[0], int):
            out[f"input {i} (list length)"] = (len(shape),)
            for j, item in enumerate(shape):
                if item is not None:
                    out[f"input {i}[{j}]"] = tuple(item)
        else:
            out[f"input {i}"] = tuple(shape) if shape is not None else ()
    return out


def variations(signatures: Mapping[tuple, int]) -> tuple[bool, list[DimVariation]]:
    """(whether the inputs' number or ranks changed, the dimensions that varied)."""
    flat = [(_positions(sig), count) for sig, count in signatures.items()]
    if len(flat) < 2:
        return False, []
    keys = [set(f) for f, _ in flat]
    common = set.intersection(*keys)
    rank_varies = any(k != keys[0] for k in keys)
    out = []
    for position in sorted(common, key=_position_order):
        ranks = {len(f[position]) for f, _ in flat}
        if len(ranks) > 1:
            rank_varies = True
            continue
        for d in range(ranks.pop()):
            values: Counter = Counter()
            for f, count in flat:
                values[f[position][d]] += count
            if len(values) > 1:
                out.append(DimVariation(position=position.replace(" (list length)", ""),
                                        dim=None if position.endswith("(list length)") else d, values=values))
    return rank_varies, out


def _position_order(position: str) -> tuple:
    return (position == "output", len(position), position)


# ---------------------------------------------------------------------- causes


def explains(sizes: Iterable[int], cause_sizes: Iterable[int]) -> bool:
    """Whether every size is ``a * s + b`` for a cause size ``s``, with one ``a >= 1``
    and one ``b`` in OFFSETS."""
    values = set(sizes)
    pool = set(cause_sizes)
    if not values or not pool or len(values) < 2:
        return False
    top = max(values)
    for b in OFFSETS:
        for s in pool:
            if s <= 0 or (top - b) % s:
                continue
            a = (top - b) // s
            if a < 1:
                continue
            if all((v - b) % a == 0 and (v - b) // a in pool for v in values):
                return True
    return False


def _batch_dim(shapes: list, loader: LoaderInfo) -> int:
    """The dimension of a batch's tensor that holds its samples: 0, unless dimension 0
    never has the loader's batch size and another always does (``pad_sequence``
    without ``batch_first``: a (length, batch) tensor whose length varies is not a
    varying batch size)."""
    if not loader.batch_size or not shapes or not shapes[0]:
        return 0
    sizes = {loader.batch_size} | ({loader.remainder} if loader.remainder else set())
    if any(s[0] in sizes for s in shapes):
        return 0
    for d in range(1, len(shapes[0])):
        if all(len(s) > d and s[d] in sizes for s in shapes):
            return d
    return 0


def _packed_tensors(batches: list, loader: LoaderInfo) -> tuple[int, list[int]]:
    """The tensor of each batch that holds its samples along dimension 0 (0 unless the
    first is packed), and the packed ones: one-dimensional, of varying length, never the
    batch size, beside a tensor whose first dimension always is."""
    if not loader.batch_size or not batches or len({len(b) for b in batches}) != 1:
        return 0, []
    sizes = {loader.batch_size} | ({loader.remainder} if loader.remainder else set())
    width = len(batches[0])

    def firsts(t: int) -> set[int] | None:
        shapes = [b[t] for b in batches]
        if any(s is None or not s for s in shapes):
            return None
        return {s[0] for s in shapes}

    holders = [t for t in range(width) if (f := firsts(t)) is not None and f <= sizes]
    if not holders:
        return 0, []
    packed = [t for t in range(width) if (f := firsts(t)) is not None and len(f) > 1 and not f & sizes
              and all(len(b[t]) == 1 for b in batches)]
    return (holders[0] if packed else 0), packed


def _loader_causes(index: int, loader: LoaderInfo) -> tuple[list[Cause], list[BatchSource]]:
    causes: list[Cause] = []
    sources: list[BatchSource] = []
    batches = loader.batches
    if len(set(batches)) < 2:
        return causes, sources
    where = f" ({loader.collate_location})" if loader.collate_location else ""
    # A one-dimensional tensor whose length never is the batch size while another tensor
    # of the batch holds it: the samples concatenated into one sequence (a packed batch,
    # as nn.EmbeddingBag with offsets takes); the batch size is read from the other.
    holder, packed = _packed_tensors(batches, loader)
    for t in packed:
        lengths = Counter(b[t][0] for b in batches)
        causes.append(Cause(
            id=f"loader{index}:packed:{t}", kind="packed", sizes=tuple(sorted(lengths)), counts=lengths,
            message=f"tensor {t} of each batch is one long sequence whose length varies ({len(lengths)} lengths from "
                    f"{min(lengths)} to {max(lengths)}) while the batch size is {loader.batch_size}: the collate "
                    f"function{where} concatenates the samples (a packed batch, as nn.EmbeddingBag with offsets "
                    "takes), so the total length changes with every batch",
            fix="keep the shapes dynamic (torch.compile(dynamic=True)), or give every sample one length (truncate "
                "or pad each to a fixed or bucketed length) and pass a two-dimensional batch; a fixed batch size "
                "changes nothing"))
    # the batch dimension (dim 0, but for sequence-first batches)
    first = _batch_dim([b[holder] for b in batches if b and len(b) > holder and b[holder]], loader)
    sizes0 = Counter(b[holder][first] for b in batches if b and len(b) > holder and b[holder]
                     and len(b[holder]) > first)
    products: set[int] = set()
    for b in batches:
        if b and b[0]:
            total = 1
            for v in b[0]:
                total *= v
            products.add(total)
    if len(sizes0) > 1:
        remainder = loader.remainder
        if remainder is not None and set(sizes0) <= {loader.batch_size, remainder}:
            causes.append(Cause(
                id=f"loader{index}:partial-batch", kind="partial-batch", sizes=tuple(sorted(set(sizes0) | products)),
                message=f"only the last batch of each epoch is smaller: {loader.dataset_length} samples in batches of "
                        f"{loader.batch_size} leave {remainder} (drop_last=False)",
                fix="DataLoader(..., drop_last=True): every batch then has the same size"))
        else:
            causes.append(Cause(
                id=f"loader{index}:batch-size", kind="batch-size", sizes=tuple(sorted(sizes0)),
                message=f"the batch size varies: {len(sizes0)} sizes from {min(sizes0)} to {max(sizes0)} "
                        + ("(the loader takes whole batches, batch_size=None: from a batch sampler that groups "
                           "by length or token budget, or from a dataset that yields batches)"
                           if loader.batch_size is None else "(batches the loader's sampler made of varying size)"),
                fix="a sampler with a fixed batch size, or bucket the batch size too"))
    # the other dimensions, tensor by tensor
    ranks = {len(b) for b in batches}
    if len(ranks) != 1:
        return causes, sources
    for t in range(ranks.pop()):
        shapes = [b[t] for b in batches]
        if any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1 or not shapes[0]:
            continue
        batch = _batch_dim(shapes, loader)
        varying = tuple(d for d in range(len(shapes[0])) if d != batch and len({s[d] for s in shapes}) > 1)
        if not varying:
            continue
        points = Counter(tuple(s[d] for d in varying) for s in shapes)
        values = {v for s in shapes for d in varying for v in (s[d],)}
        per_batch = {s[batch] * s[d] for s in shapes for d in varying}
        dims_text = ", ".join(str(d) for d in varying) + (
            f" (sequence-first batches: dimension {batch} holds the batch of {loader.batch_size})" if batch else "")
        causes.append(Cause(
            id=f"loader{index}:collate:{t}", kind="collate", sizes=tuple(sorted(values | per_batch | products)),
            location=loader.collate_location,
            message=f"the collate function {loader.collate}{where} gives batches whose {loader.tensor_name(t)} varies in "
                    f"dimension {dims_text}: {len(points)} shapes, sizes {min(values)}..{max(values)}",
            fix="pad each batch to one of a few bucket sizes (torchaxe.shapes.BucketingCollate)"))
        sources.append(BatchSource(loader=loader, tensor=t, dims=varying, points=points))
    return causes, sources


def _site_cause(index: int, site: DataDependentSite) -> Cause:
    sizes = tuple(sorted(site.sizes))
    span = f"{len(sizes)} size{'s' if len(sizes) != 1 else ''}" + (f", {sizes[0]}..{sizes[-1]}" if sizes else "")
    what = {"nonzero": "nonzero() returns as many indices as there are non-zero values",
            "unique": "unique() returns as many values as there are distinct ones",
            "boolean-mask": "indexing with a boolean mask keeps as many rows as the mask has True values",
            "repeat_interleave": "repeat_interleave with a tensor of repeats has a data-dependent length",
            "item": ".item() reads a size back from a tensor"}[site.kind]
    fix = {"nonzero": "keep shapes fixed: torch.where(mask, x, 0) instead of gathering, or nonzero_static(size=...)",
           "unique": "keep it outside the compiled region, or use a fixed-size alternative (a bincount of known length)",
           "boolean-mask": "torch.where(mask, x, 0) or x * mask keeps the full shape",
           "repeat_interleave": "pass output_size=..., or pad to a known maximum",
           "item": "compute the size on the host from the data, or pad to a known maximum"}[site.kind]
    return Cause(id=f"site{index}:{site.kind}", kind=site.kind, sizes=sizes, location=site.location, code=site.code,
                 message=f"{what} ({site.location or 'unknown line'}: {span} in {site.calls} calls)", fix=fix,
                 counts=Counter(site.sizes))


def _merge(dims: list[DimVariation], more: list[DimVariation]) -> None:
    for d in more:
        same = next((e for e in dims if e.position == d.position and e.dim == d.dim and e.values == d.values), None)
        if same is None:
            dims.append(d)


def _compared_steps(op: OpTally, complete_steps: int) -> list[int]:
    """The steps whose calls of ``op`` are compared: the complete ones (all, when none
    is), without the first when there are others (it runs one-off work)."""
    steps = sorted(s for s in op.steps if s <= complete_steps) or sorted(op.steps)
    return [s for s in steps if s >= 2] or steps


def op_subject(op: OpTally, complete_steps: int) -> Subject:
    """An operator is dynamic when the shapes it is called with differ from one step
    to the next. The first step is left out when there are others (it runs one-off
    work: optimizer state, lazy modules), and so is an unfinished last step.

    Where every step makes the same number of calls, call ``k`` of one step is
    compared with call ``k`` of the others (the same place in the model); otherwise
    the shapes not seen in every step are grouped by the ranks of their inputs."""
    by_id = {i: sig for sig, i in op.ids.items()}
    considered = _compared_steps(op, complete_steps)
    seqs = [tuple(op.steps[s]) for s in considered]
    distinct = len({frozenset(q) for q in seqs})  # the same shapes, called more often, are not new shapes
    subject = Subject(kind="op", name=op.name, calls=op.calls, distinct=max(distinct, 1), truncated=op.truncated)
    if distinct <= 1:
        return subject
    dims: list[DimVariation] = []
    varying_ids: set[int] = set()
    if len({len(q) for q in seqs}) == 1:
        for k in range(len(seqs[0])):
            at = Counter(q[k] for q in seqs)
            if len(at) > 1:
                varying_ids.update(at)
                rank_varies, found = variations(Counter({by_id[i]: n for i, n in at.items() if i in by_id}))
                subject.rank_varies |= rank_varies
                _merge(dims, found)
    else:
        stable = set.intersection(*(set(q) for q in seqs))
        counts = Counter(i for q in seqs for i in q if i not in stable)
        varying_ids.update(counts)
        groups: dict[tuple, Counter] = {}
        for i, n in counts.items():
            if i not in by_id:
                continue
            pattern = tuple(sorted((p, len(shape)) for p, shape in _positions(by_id[i]).items()))
            groups.setdefault(pattern, Counter())[by_id[i]] += n
        subject.rank_varies = len(groups) > 1 or any(len(q) != len(seqs[0]) for q in seqs)
        for group in groups.values():
            _merge(dims, variations(group)[1])
    subject.dims = dims
    middle = considered[0] + (considered[-1] - considered[0]) / 2
    subject.late = any(op.first_step.get(by_id.get(i), 0) > middle for i in varying_ids if i in by_id)
    return subject


def analyse(observation: Observation) -> ShapeAnalysis:
    """The subjects, their varying dimensions and the causes they trace to."""
    causes: list[Cause] = []
    sources: list[BatchSource] = []
    subjects: list[Subject] = []
    for i, loader in enumerate(observation.loaders):
        found, batch_sources = _loader_causes(i, loader)
        causes += found
        sources += batch_sources
        rank_varies, dims = variations(Counter(loader.batches))
        for d in dims:
            index = re.fullmatch(r"input (\d+)", d.position)
            d.position = loader.tensor_name(int(index.group(1))) if index else d.position.replace("input", "tensor")
        subjects.append(Subject(kind="batch", name=f"DataLoader({loader.collate})", calls=len(loader.batches),
                                distinct=len(set(loader.batches)), truncated=loader.truncated,
                                rank_varies=rank_varies, dims=dims))
    site_causes = [_site_cause(i, s) for i, s in enumerate(observation.sites)]
    data_causes = [c for c in site_causes if c.kind in DATA_KINDS]
    item_causes = [c for c in site_causes if c.kind == "item" and len(c.sizes) > 1]
    for op in observation.ops:
        subjects.append(op_subject(op, observation.complete_steps))
    shapes = observation.profile.shapes
    for module in (shapes.modules if shapes is not None else []):
        if not module.dynamic:
            # One shape, or several at several places in the model (a shared ReLU)
            # that every step sees alike: what a compiled step sees is fixed.
            subjects.append(Subject(kind="module", name=module.name, calls=module.calls, distinct=1,
                                    truncated=False, type=module.type, parameters=module.parameters))
            continue
        counted = Counter({tuple(tuple(s) if s is not None else None for s in sig.shapes): sig.count
                           for sig in module.signatures})
        rank_varies, dims = variations(Counter({tuple(s for s in k if s is not None): v for k, v in counted.items()}))
        # Sizes the module takes at its several places every step (a shared ReLU after
        # convolutions of 32 and 64 channels) are no change from step to step.
        steady = {(f"input {i}", d) for i, d in module.steady}
        dims = [d for d in dims if (d.position, d.dim) not in steady]
        subjects.append(Subject(kind="module", name=module.name, calls=module.calls,
                                distinct=len(module.signatures), truncated=module.truncated,
                                rank_varies=rank_varies, dims=dims, type=module.type,
                                parameters=module.parameters))
    chunk = None if any(c.kind == "partial-batch" for c in causes) or data_causes else \
        last_chunk_cause(observation.ops, observation.complete_steps, subjects)
    ordered = [c for c in causes if c.kind == "partial-batch"] + [c for c in causes if c.kind != "partial-batch"] \
        + ([chunk] if chunk else []) + data_causes + item_causes
    for subject in subjects:
        if subject.kind == "batch":
            for d in subject.dims:
                d.cause = _batch_dim_cause(d, causes)
            continue
        for d in subject.dims:
            matching = [c for c in ordered if explains(d.values, c.sizes)]
            if matching:
                best = max(matching, key=lambda c: _similarity(d.values, c.counts))  # first of equals wins
                d.cause = best.id
                best.explains += 1
    used_items = [c for c in item_causes if c.explains]
    kept = causes + ([chunk] if chunk is not None and chunk.explains else []) + data_causes + used_items
    return ShapeAnalysis(steps=observation.steps, subjects=subjects, causes=kept, sites=observation.sites,
                         loaders=observation.loaders, batch_sources=sources)


def _regular(ops: list[OpTally], complete_steps: int) -> list[OpTally]:
    """The operators called in at least half the steps the most regular one was: an
    operator run only when something changed (a mask made anew when the length
    changes) is seen as often in the odd steps as in the usual ones, and its counts
    tell nothing of which size is usual."""
    counts = {id(op): len(_compared_steps(op, complete_steps)) for op in ops}
    most = max(counts.values(), default=0)
    return [op for op in ops if 2 * counts[id(op)] >= most]


def _odd_steps(ops: Iterable[OpTally], complete_steps: int) -> tuple[set[int], int]:
    """The steps in which an operator was called with other shapes than in most steps
    (of :func:`_compared_steps`), and how many steps were compared."""
    odd: set[int] = set()
    compared: set[int] = set()
    for op in ops:
        considered = _compared_steps(op, complete_steps)
        shapes = {s: frozenset(op.steps[s]) for s in considered}
        if len(set(shapes.values())) > 1:
            common = Counter(shapes.values()).most_common(1)[0][0]
            odd |= {s for s, q in shapes.items() if q != common}
        compared |= set(considered)
    return odd, len(compared)


def _sizes_outside(op: OpTally, steps: set[int], complete_steps: int) -> set[int]:
    """Every size in the shapes ``op`` was called with in its compared steps but ``steps``."""
    by_id = {i: sig for sig, i in op.ids.items()}
    return {n for s in _compared_steps(op, complete_steps) if s not in steps for i in op.steps[s] if i in by_id
            for shape in by_id[i] if isinstance(shape, tuple) for n in shape if isinstance(n, int)}


def last_chunk_cause(ops: list[OpTally], complete_steps: int, subjects: list[Subject]) -> Cause | None:
    """A ``last-chunk`` cause when the only steps with other shapes are single steps
    (or two in a row), each between steps of the common shapes (or the last recorded),
    at least ``STEPS_PER_CHUNK`` common steps apiece, and in them every varying dimension was
    smaller than its usual size: a loop without a DataLoader whose epoch ends on a
    shorter chunk. Its sizes are the varying dimensions' sizes, so that it explains
    each of them."""
    regular = _regular(ops, complete_steps)
    odd, compared = _odd_steps(regular, complete_steps)
    # One chunk's calls may fall in two steps: where steps are told apart by the
    # backward pass, a step's record ends where the next backward begins.
    runs = [s for s in sorted(odd) if s - 1 not in odd]
    if not odd or any(s + 2 in odd and s + 1 in odd for s in odd) or len(runs) * STEPS_PER_CHUNK > compared:
        return None
    if not any(s.dims for s in subjects if s.kind != "batch" and s.dynamic):
        return None
    # An operator's usual sizes are those of its steps but the odd ones; the counts of
    # one seen in a few steps only would pick them at random. One seen in none but odd
    # steps (a mask made anew when the length changes, whose next step's record holds
    # the short chunk's backward) has for usual sizes those of the regular operators.
    usual_sizes = {op.name: _sizes_outside(op, odd, complete_steps) for op in ops}
    everywhere = {n for op in regular for n in usual_sizes[op.name]}
    for op in ops:
        usual_sizes[op.name] = usual_sizes[op.name] or everywhere
    usual: dict[int, int] = {}
    sizes: set[int] = set()
    for subject in subjects:
        if subject.kind == "batch" or not subject.dynamic:
            continue
        seen = usual_sizes.get(subject.name) if subject.kind == "op" else None
        for d in subject.dims:
            if d.dim is None:
                return None
            common = max((v for v in d.values if v in seen), key=lambda v: (d.values[v], v), default=None) \
                if seen else None
            if common is None:
                common = d.values.most_common(1)[0][0]
            if any(v > common for v in d.values):
                return None
            usual[common] = min(v for v in d.values)
            sizes |= set(d.values)
    shown = min(usual)
    steps = ", ".join(str(s) for s in runs[:5]) + (" ..." if len(runs) > 5 else "")
    return Cause(
        id="steps:last-chunk", kind="last-chunk", sizes=tuple(sorted(sizes)),
        message=f"only {'one step' if len(runs) == 1 else f'{len(runs)} single steps'} (step {steps}) of "
                f"{compared} had smaller sizes ({shown} -> {usual[shown]}): an epoch's last, shorter chunk "
                f"of a stream cut into chunks of one length (no DataLoader batch explains it)",
        fix="leave out the epoch's last, shorter chunk, or pad it to the full length: every step then has the "
            "same shapes")


def _similarity(values: Counter, counts: Counter | None) -> float:
    """Overlap of the two size distributions (1: the same proportions), 0 when unknown."""
    if not counts:
        return 0.0
    total_v, total_c = sum(values.values()), sum(counts.values())
    return sum(min(values[v] / total_v, counts.get(v, 0) / total_c) for v in values)


def _batch_dim_cause(d: DimVariation, causes: list[Cause]) -> str | None:
    for cause in causes:
        index = re.match(r"tensor (\d+)", d.position)
        if d.dim == 0 and cause.kind == "packed" and index and cause.id.endswith(f":{index.group(1)}"):
            return cause.id
        if d.dim == 0 and cause.kind in ("partial-batch", "batch-size") and explains(d.values, cause.sizes):
            return cause.id
        if d.dim != 0 and cause.kind == "collate" and index and cause.id.endswith(f":{index.group(1)}"):
            return cause.id
    return None
