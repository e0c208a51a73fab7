"""The verdict (static, dynamic or mixed) and what to do about it on each target.

- **static**: every operator and module saw one shape. Compile for it: on the NPU
  ``torch_npu.npu.set_compile_mode(jit_compile=True)`` (online compilation: each
  operator compiled once for its shape, reused every step); on cuda and cpu
  ``torch.compile(model)``, and ``torch.backends.cudnn.benchmark = True`` on cuda.
- **dynamic**: a dimension took more than ``FEW_SHAPES`` sizes, or new shapes were
  still appearing in the second half of the run, or sizes depend on the data. On the
  NPU ``jit_compile=False`` (binary kernels that take any shape; with online
  compilation every new shape compiles again); on cuda and cpu
  ``torch.compile(model, dynamic=True)`` or ``torch._dynamo.mark_dynamic`` on the
  varying dimensions. Where a collate function is the cause and bucketing to
  ``--max-shapes`` sizes costs little padding, bucketing comes first: it turns the
  case into a static one.
- **mixed**: shapes vary, but among a few sizes (the last partial batch, batches
  already bucketed): the compile cost is paid a few times, not every step, so the
  answer depends on the model and the device: measure (``--try``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torchaxe.shapes.analysis import FEW_SHAPES, BatchSource, ShapeAnalysis
from torchaxe.shapes.buckets import BucketPlan, bucket_table
from torchaxe.shapes.stream_chunks import ChunkSite
from torchaxe.units import counted

VERDICTS = ("static", "dynamic", "mixed")
TARGETS = ("npu", "cuda", "cpu")
#: Bucketing is recommended before dynamic compilation when its extra padding is at most this.
MAX_BUCKET_PADDING = 0.15
#: torch.nn's recurrent layers: dynamo does not trace into them by default
#: (``torch._dynamo.config.allow_rnn`` is False), so they break a compiled graph.
RECURRENT_MODULES = frozenset({"RNN", "GRU", "LSTM"})


@dataclass
class Recommendation:
    """One setting or change, for one target, with why."""

    target: str
    kind: str  # compile-mode, compile, cudnn, mark-dynamic, bucketing, drop-last, data-dependent, measure
    setting: str
    reason: str
    #: The trial candidate (``--try``) that measures this setting, where there is one.
    candidate: str | None = None
    unverified_on_hardware: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "kind": self.kind, "setting": self.setting, "reason": self.reason,
                "candidate": self.candidate, "unverified_on_hardware": self.unverified_on_hardware}


@dataclass
class BucketAdvice:
    """Bucketing for one loader's varying batches: the K = 1..8 table and the plan
    for ``--max-shapes``."""

    loader: str
    location: str | None
    tensor: int
    dims: tuple[int, ...]
    table: list[BucketPlan]
    chosen: BucketPlan
    #: The batches' shapes as they are (distinct), for the comparison.
    current_shapes: int
    #: The tensor's name in a mapping batch (None: a tuple's).
    field: str | None = None
    #: The loader's whole bucketing, when its batches hold tensors that vary apart
    #: (a seq2seq batch's inputs and labels): one wrapper per group of them, nested.
    whole: str | None = None
    #: The collate function as code to wrap (``MLMCollator(...)`` for a collator object).
    collate_code: str | None = None
    #: The trainer class that built the loader (``Seq2SeqTrainer``), None for the user's.
    built_by: str | None = None

    def knob(self, pad_value: float | str = "auto") -> dict[str, Any]:
        """The ``bucketing`` knob of a trial that applies the chosen plan."""
        if len(self.dims) == 1:
            return {"boundaries": list(self.chosen.boundaries[0]), "dim": self.dims[0], "pad_value": pad_value}
        return {"boundaries": [list(b) for b in self.chosen.boundaries], "dim": list(self.dims), "pad_value": pad_value}

    def snippet(self) -> str:
        if self.whole is not None:
            return self.whole
        knob = self.knob()
        return loader_call(f"torchaxe.shapes.BucketingCollate({knob['boundaries']}, "
                           f"collate_fn={self.collate_code or self.loader}, dim={knob['dim']})", self.built_by)

    def to_dict(self) -> dict[str, Any]:
        return {"collate_fn": self.loader, "location": self.location, "tensor": self.tensor, "field": self.field,
                "dims": list(self.dims),
                "current_shapes": self.current_shapes, "chosen": self.chosen.to_dict(),
                "table": [p.to_dict() for p in self.table], "snippet": self.snippet()}


def loader_call(collate: str, built_by: str | None) -> str:
    """Where the wrapped collate function goes: the DataLoader the user builds, or the
    argument of the trainer that builds it (``Seq2SeqTrainer(..., data_collator=...)``)."""
    if built_by is not None:
        return f"{built_by}(..., data_collator={collate})"
    return f"DataLoader(..., collate_fn={collate})"


def _nested_snippet(plans: list[BucketAdvice], fields: tuple | None) -> str | None:
    """One loader's plans as nested ``BucketingCollate`` wrappers, one per group of
    tensors with the same plan, each padding its own (``fields``): a wrapper pads only
    the tensors as long as the longest of the batch, so that tensors whose lengths
    vary apart need one each. None when one wrapper does (a single group), or a tensor
    cannot be named to ``fields`` (one level inside a batch's entry)."""
    groups: dict[tuple, list[BucketAdvice]] = {}
    for plan in plans:
        groups.setdefault((plan.dims, plan.chosen.boundaries), []).append(plan)
    if len(groups) < 2:
        return None
    inner = plans[0].collate_code or plans[0].loader
    for group in groups.values():
        names = [fields[p.tensor] if fields is not None else p.tensor for p in group]
        if any(isinstance(n, str) and ("." in n or "[" in n) for n in names):
            return None
        knob = group[0].knob()
        inner = (f"torchaxe.shapes.BucketingCollate({knob['boundaries']}, collate_fn={inner}, dim={knob['dim']}, "
                 f"fields={[n for n in names]!r})")
    return loader_call(inner, plans[0].built_by)


@dataclass
class Verdict:
    verdict: str
    reasons: list[str]
    recommendations: list[Recommendation] = field(default_factory=list)
    buckets: list[BucketAdvice] = field(default_factory=list)
    #: The trial candidate the verdict picks for each target (None: measure).
    picks: dict[str, str | None] = field(default_factory=dict)


def bucket_advice(analysis: ShapeAnalysis, max_shapes: int) -> list[BucketAdvice]:
    out = []
    for source in analysis.batch_sources:
        table = bucket_table(source.points, source.dims)
        chosen = next((p for p in table if p.k == max_shapes), None)
        if chosen is None:
            from torchaxe.shapes.buckets import plan_buckets

            chosen = plan_buckets(source.points, max_shapes, source.dims)
        out.append(BucketAdvice(loader=source.loader.collate, location=source.loader.collate_location,
                                tensor=source.tensor, dims=source.dims, table=table, chosen=chosen,
                                current_shapes=len(source.points), collate_code=source.loader.collate_code(),
                                built_by=source.loader.built_by,
                                field=(source.loader.fields or ())[source.tensor]
                                if source.tensor < len(source.loader.fields or ()) else None))
    by_loader: dict[int, list[tuple[BatchSource, BucketAdvice]]] = {}
    for source, plan in zip(analysis.batch_sources, out):
        by_loader.setdefault(id(source.loader), []).append((source, plan))
    for pairs in by_loader.values():
        whole = _nested_snippet([plan for _, plan in pairs], pairs[0][0].loader.fields)
        for _, plan in pairs:
            plan.whole = whole
    return out


def _dims_text(analysis: ShapeAnalysis) -> str:
    spots = []
    for source in analysis.batch_sources:
        spots += [f"{source.loader.tensor_name(source.tensor)} of the batch, dim {d}" for d in source.dims]
    return "; ".join(spots) if spots else "the varying dimensions of the model's inputs"


def decide(analysis: ShapeAnalysis, max_shapes: int = 4, job_batches: int | None = None,
           chunks: Sequence[ChunkSite] = ()) -> Verdict:
    """The verdict with its reasons, the recommendations for every target and the
    bucketing plans. ``job_batches``: the batches the whole job draws, when its command
    says (``--max_iters 300``): an epoch's last batch that comes after them never runs.
    ``chunks``: where the script's code cuts a stream into chunks whose last is
    shorter (:mod:`torchaxe.shapes.stream_chunks`), a chunk the steps may not reach."""
    ops = analysis.of_kind("op")
    modules = analysis.of_kind("module")
    batches = analysis.of_kind("batch")
    dynamic_ops = [s for s in ops if s.dynamic]
    dynamic_modules = [s for s in modules if s.dynamic]
    varying_batches = [s for s in batches if s.dynamic]
    reasons: list[str] = []
    data_causes = [c for c in analysis.causes if c.kind in ("nonzero", "unique", "boolean-mask", "repeat_interleave", "item")
                   and (c.explains or len(c.sizes) > 1)]
    partial_only = {c.id for c in analysis.causes if c.kind in ("partial-batch", "last-chunk")}

    if not dynamic_ops and not dynamic_modules and not varying_batches:
        verdict = "static"
        reasons.append(f"all {len(ops)} operators and {len(modules)} modules saw one input shape each over "
                       f"{analysis.steps} steps")
    else:
        widest = max((d.distinct for s in dynamic_ops + dynamic_modules + varying_batches for d in s.dims), default=0)
        # Late shapes count unless the epoch's smaller last batch is all that caused them.
        late = [s for s in dynamic_ops if s.late and not (s.causes and set(s.causes) <= partial_only)]
        truncated = [s for s in dynamic_ops + dynamic_modules if s.truncated]
        varying = dynamic_ops + dynamic_modules + varying_batches
        # Only the epoch's smaller last batch changed the shapes: the same verdict as when
        # the steps watched end before it (static, compiled once more for it), not one
        # that depends on whether the profile reached the epoch's end.
        last_batch_only = (not data_causes and not truncated
                           and any(c.kind == "partial-batch" for c in analysis.causes)
                           and all(s.dims and not s.rank_varies and set(s.causes) <= partial_only for s in varying))
        if last_batch_only:
            reasons.append("static but for the epoch's last, smaller batch: every other step saw the same shapes")
        reasons.append(f"{len(dynamic_ops)} of {len(ops)} operators and {len(dynamic_modules)} of {len(modules)} "
                       f"modules saw more than one input shape over {analysis.steps} steps")
        if last_batch_only:
            verdict = "static"
        elif widest > FEW_SHAPES or late or truncated or data_causes:
            verdict = "dynamic"
            if widest > FEW_SHAPES:
                reasons.append(f"a dimension took {widest} different sizes (more than {FEW_SHAPES})")
            if late:
                reasons.append(f"new shapes were still appearing in the second half of the run "
                               f"({len(late)} operators): each new shape compiles again")
            if truncated:
                reasons.append(f"{len(truncated)} operators or modules saw more shapes than torchaxe keeps")
            for c in data_causes:
                reasons.append(f"data-dependent sizes: {c.message}")
        else:
            verdict = "mixed"
            varied = (f"every dimension took at most {widest} sizes" if widest else
                      "the number or rank of their tensors changed, no dimension's size")
            reasons.append(f"but {varied} and the set settled early: "
                           f"compiling a few shapes once each may pay off; measure (--try)")
        for cause in analysis.causes:
            if cause.kind in ("partial-batch", "last-chunk", "collate", "batch-size", "packed"):
                reasons.append(f"cause: {cause.message}")

    # The epoch's last batch, smaller, may come after the steps watched (a few steps
    # of a long epoch): static so far, but compiled code compiles once more for it.
    seen_partial = {c.id.split(":")[0] for c in analysis.causes if c.kind == "partial-batch"}
    unseen_partial = [(i, loader) for i, loader in enumerate(analysis.loaders)
                      if loader.remainder and f"loader{i}" not in seen_partial
                      and not (job_batches is not None and loader.batch_size
                               and job_batches <= loader.dataset_length // loader.batch_size)]
    last_batch = ""
    if verdict == "static" and seen_partial:
        last_batch = next(c.message for c in analysis.causes if c.kind == "partial-batch")
    for _, loader in unseen_partial[:1]:
        last_batch = (f"the last batch of each epoch has {loader.remainder} samples, not {loader.batch_size} "
                      f"({loader.dataset_length} samples, drop_last=False), after the steps watched: compiled "
                      f"code compiles once more for it; DataLoader(..., drop_last=True) keeps every batch one size")
        reasons.append(last_batch)
    unseen_chunk = chunk_where = ""
    if chunks and not seen_partial and not any(c.kind == "last-chunk" for c in analysis.causes):
        chunk_where = "; ".join(f"{Path(c.path).name}:{c.line} `{c.text}`" for c in chunks)
        unseen_chunk = (f"the script cuts its data into chunks of one length ({chunk_where}): each epoch's last chunk is "
                        "shorter unless the length divides, after the steps watched: compiled code compiles once more "
                        "for it; leaving that chunk out (or padding it) keeps every step one shape")
        reasons.append(unseen_chunk)

    buckets = bucket_advice(analysis, max_shapes) if verdict != "static" else []
    recs: list[Recommendation] = []
    picks: dict[str, str | None] = {}
    cheap_buckets = [b for b in buckets if b.chosen.extra_fraction <= MAX_BUCKET_PADDING]
    dims_text = _dims_text(analysis)
    recurrent = sorted({f"{s.name} ({s.type})" for s in modules if s.type in RECURRENT_MODULES})
    # cudnn.benchmark chooses convolution algorithms: a model without convolutions has none to choose.
    convolutions = any("convolution" in s.name for s in ops) or any(
        s.type.startswith(("Conv", "LazyConv")) for s in modules)
    if recurrent and verdict != "static":
        reasons.append(f"recurrent layers ({', '.join(recurrent)}): torch.compile does not trace into them "
                       f"(torch._dynamo.config.allow_rnn is False), so compiling gains little and still "
                       f"recompiles the rest for new shapes; keep eager on cpu and cuda")
    for target in TARGETS:
        npu = target == "npu"
        eager = bool(recurrent) and verdict != "static" and not npu
        if eager:
            recs.append(Recommendation(target, "compile", "keep the model eager (no torch.compile)",
                                       f"the recurrent layers ({', '.join(recurrent)}) break the graph and run as "
                                       f"they are; with varying shapes the rest recompiles for each new shape",
                                       "eager"))
            picks[target] = "eager"
        if verdict == "static":
            if npu:
                recs.append(Recommendation(target, "compile-mode", "torch_npu.npu.set_compile_mode(jit_compile=True)",
                                           "fixed shapes: each operator is compiled once for its shape and the "
                                           "compiled kernel reused every step", "jit-compile-on", True))
                picks[target] = "jit-compile-on"
            else:
                last = "batch" if last_batch else "chunk" if unseen_chunk else ""
                avoid = "drop_last=True avoids it" if last_batch else "leaving that chunk out avoids it"
                recs.append(Recommendation(target, "compile", "model = torch.compile(model)" if not last
                                           else "model = torch.compile(model, dynamic=False)",
                                           "fixed shapes: one graph, compiled once, no recompilation" if not last
                                           else f"fixed shapes but the epoch's last {last}: one graph, compiled "
                                           f"once more for that {last}, as a graph of its own with dynamic=False "
                                           "(else torch recompiles for any size and runs the full ones on that "
                                           f"graph too); {avoid}",
                                           "compile-static"))
                picks[target] = "compile-static"
                if target == "cuda" and convolutions:
                    recs.append(Recommendation(target, "cudnn", "torch.backends.cudnn.benchmark = True",
                                               "fixed shapes: cuDNN picks its fastest convolution algorithm once "
                                               "per shape, so once; mode=\"reduce-overhead\" (CUDA graphs) also "
                                               "replays one recorded graph", "compile-static"))
            if last_batch:
                recs.append(Recommendation(target, "drop-last", "DataLoader(..., drop_last=True)",
                                           f"{last_batch}: with drop_last=True every batch has the same size",
                                           None, npu))
            continue
        if cheap_buckets and verdict == "dynamic" and not eager:
            b = cheap_buckets[0]
            picks[target] = "jit-compile-on+bucketing" if npu else "compile-static+bucketing"
            recs.append(Recommendation(
                target, "bucketing", b.snippet(),
                f"pads the batches to {b.chosen.shapes} shape(s) for {100 * b.chosen.extra_fraction:.1f}% more "
                f"elements than padding each batch to its own longest ({b.current_shapes} shapes now); the shapes "
                f"are then static: use " + ("jit_compile=True" if npu else "torch.compile(model)") + " with it",
                picks[target], npu))
        if eager:
            pass
        elif npu:
            if verdict == "dynamic":
                recs.append(Recommendation(target, "compile-mode", "torch_npu.npu.set_compile_mode(jit_compile=False)",
                                           "dynamic shapes: with jit_compile=True every new shape compiles the "
                                           "operators again (one report: a 600 s first run with it on, 40 s off); "
                                           "the precompiled binary kernels take any shape", "jit-compile-off", True))
                picks.setdefault(target, "jit-compile-off")
            else:
                recs.append(Recommendation(target, "measure", "torchaxe shapes --try --target npu -- ...",
                                           "a few shapes: jit_compile=True compiles each once, which can pay off; "
                                           "measure jit_compile=True against False", None, True))
                picks.setdefault(target, None)
        else:
            if verdict == "dynamic":
                recs.append(Recommendation(target, "compile", "model = torch.compile(model, dynamic=True)",
                                           "dynamic shapes: one graph with symbolic sizes instead of a recompile "
                                           "for every new shape (and a fall-back to eager after the recompile "
                                           "limit)", "compile-dynamic"))
                recs.append(Recommendation(target, "mark-dynamic", f"torch._dynamo.mark_dynamic(tensor, dim) on {dims_text}",
                                           "marks only the dimensions that vary as symbolic; the rest stay "
                                           "specialised", "compile-dynamic"))
                picks.setdefault(target, "compile-dynamic")
                if target == "cuda" and convolutions:
                    recs.append(Recommendation(target, "cudnn", "leave torch.backends.cudnn.benchmark off",
                                               "it benchmarks the convolution algorithms again for every new shape"))
            else:
                recs.append(Recommendation(target, "measure", f"torchaxe shapes --try --target {target} -- ...",
                                           "a few shapes: torch.compile(model) recompiles once per shape, then "
                                           "marks the dimension dynamic; measure eager, compile static and "
                                           "compile dynamic", None))
                picks.setdefault(target, None)
        for cause in analysis.causes:
            if cause.kind == "partial-batch":
                recs.append(Recommendation(target, "drop-last", "DataLoader(..., drop_last=True)",
                                           cause.message + ": with drop_last=True every batch has the same size",
                                           None, npu))
            elif cause.kind == "last-chunk":
                recs.append(Recommendation(target, "drop-last", "leave out (or pad) the epoch's last, shorter chunk",
                                           f"{cause.message}: every step then has the same shapes", None, npu))
        if unseen_chunk:
            recs.append(Recommendation(target, "drop-last", "leave out (or pad) the epoch's last, shorter chunk",
                                       f"each epoch's last chunk is shorter ({chunk_where}): every step then has "
                                       "the same shapes",
                                       None, npu))
        if verdict == "mixed" and buckets and not eager:
            b = buckets[0]
            recs.append(Recommendation(target, "bucketing", b.snippet(),
                                       f"{b.chosen.shapes} shape(s) for {100 * b.chosen.extra_fraction:.1f}% more "
                                       f"elements ({b.current_shapes} shapes now)",
                                       "jit-compile-on+bucketing" if npu else "compile-static+bucketing", npu))
        for cause in analysis.causes:
            if cause.kind in ("nonzero", "unique", "boolean-mask", "repeat_interleave") or (
                    cause.kind == "item" and cause.explains):
                recs.append(Recommendation(target, "data-dependent", cause.fix or "",
                                           f"{cause.message}: such sizes are unknown until the operator has run, "
                                           f"so they cannot be compiled for ahead", None, npu))
    models = _models(analysis)
    if len(models) > 1:
        # A GAN's generator and discriminator: "model" is each of them.
        named = counted(sorted(models))
        for rec in recs:
            if rec.kind == "compile" and rec.setting.startswith("model = torch.compile(model"):
                rec.setting += f"  (each of the {len(models)} models the loop trains: {named})"
    return Verdict(verdict=verdict, reasons=reasons, recommendations=recs, buckets=buckets, picks=picks)


def _models(analysis: ShapeAnalysis) -> list[str]:
    """The class of each top-level module the loop called (one entry per instance:
    ``Sequential#2`` is a second ``Sequential``), losses left out (a model that builds
    ``CrossEntropyLoss()`` in its forward makes one a step), as are modules without
    parameters (a contrastive loss written as a module): the models that ``model`` in
    a setting stands for."""
    classes = (s.name.split("#", 1)[0] for s in analysis.subjects
               if s.kind == "module" and "." not in s.name and s.parameters != 0)
    return sorted(name for name in classes if not name.endswith("Loss"))
