"""What ``torchaxe shapes`` records while the script runs, besides the harness's own
module and batch shapes: the input shapes of every operator call, the operators
whose output size depends on the data, and the DataLoaders the batches came from.

- :class:`OpShapeRecorder` is a ``TorchDispatchMode``: it sees every aten operator
  call of the training thread (forward and backward) with its tensors, so it counts
  each operator's distinct input shapes over every step (not a profiler window; calls
  with gradients off outside the backward pass, evaluation and the optimizer's
  update, are counted apart), and
  it catches the calls whose output size depends on the values: ``nonzero``,
  ``unique``, ``masked_select``, indexing with a boolean mask, ``repeat_interleave``
  with a tensor of repeats, and ``.item()`` of an integer tensor (a size read back
  to the host). For those it keeps the user's line and the sizes produced.
- :class:`LoaderProbe` notes, for every DataLoader that yields a batch, its collate
  function, batch size, ``drop_last`` and data-set length, and every batch's shapes
  in order (the harness keeps at most 32 distinct batch signatures; bucketing needs
  the whole distribution).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torchaxe.runtime.dynamo import OneShotModuleHook
from torchaxe.runtime.run_context import partial_batch

#: Distinct input signatures kept per operator; more marks it ``truncated``.
MAX_OP_SIGNATURES = 512
#: Batches whose shapes are kept per loader (the distribution for bucketing).
MAX_BATCHES = 100_000

#: Operators whose output size depends on the values of their inputs, and the cause
#: each stands for in the report.
DATA_DEPENDENT = {
    "aten.nonzero.default": "nonzero",
    "aten.argwhere.default": "nonzero",
    "aten.masked_select.default": "boolean-mask",
    "aten._unique.default": "unique",
    "aten._unique2.default": "unique",
    "aten.unique_dim.default": "unique",
    "aten.unique_consecutive.default": "unique",
    "aten.unique_dim_consecutive.default": "unique",
    "aten.repeat_interleave.Tensor": "repeat_interleave",
    "aten.repeat_interleave.self_Tensor": "repeat_interleave",
}
INDEX_OPS = ("aten.index.Tensor",)
ITEM_OP = "aten._local_scalar_dense.default"


@dataclass
class OpTally:
    """The input shapes one operator was called with, step by step.

    An operator called at several places of the model (``aten.mm`` in every layer)
    sees several shapes in every step without being dynamic; what makes it dynamic
    is that the shapes it is called with change from one step to the next. So the
    signatures of each step are kept in call order (as small ids)."""

    name: str
    calls: int = 0
    signatures: Counter = field(default_factory=Counter)
    #: Signature -> id, and the step (1-based) it was first seen in.
    ids: dict = field(default_factory=dict)
    first_step: dict = field(default_factory=dict)
    #: Step -> the ids of that step's calls, in order.
    steps: dict = field(default_factory=dict)
    truncated: bool = False

    def add(self, signature: tuple, step: int) -> None:
        self.calls += 1
        sig_id = self.ids.get(signature)
        if sig_id is None:
            if len(self.ids) >= MAX_OP_SIGNATURES:
                self.truncated = True
                sig_id = -1
            else:
                sig_id = self.ids[signature] = len(self.ids)
                self.first_step[signature] = step
        if sig_id >= 0:
            self.signatures[signature] += 1
        calls = self.steps.get(step)
        if calls is None:
            calls = self.steps[step] = []
        calls.append(sig_id)

    def varies(self) -> bool:
        """Whether the shapes it was called with differ from one step to another (or
        outgrew the tally); not how many times a step called it."""
        return self.truncated or len({frozenset(calls) for calls in self.steps.values()}) > 1

    def merged(self, other: "OpTally") -> "OpTally":
        """This tally and ``other`` (the same operator, counted apart) as one: each
        step's calls are this tally's, then the other's."""
        out = OpTally(self.name, truncated=self.truncated or other.truncated)
        steps = sorted(set(self.steps) | set(other.steps))
        by_id = [{i: sig for sig, i in tally.ids.items()} for tally in (self, other)]
        for step in steps:
            for tally, names in zip((self, other), by_id):
                for sig_id in tally.steps.get(step, ()):
                    if sig_id < 0:
                        out.calls += 1
                        out.truncated = True
                        out.steps.setdefault(step, []).append(-1)
                    else:
                        out.add(names[sig_id], step)
        return out


@dataclass
class DataDependentSite:
    """One line of the user's code that produced data-dependent sizes."""

    kind: str  # nonzero, unique, boolean-mask, repeat_interleave, item
    op: str
    location: str | None
    code: str | None
    calls: int = 0
    #: Sizes produced (dim 0 of the output; the value for .item()), with counts.
    sizes: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        values = sorted(self.sizes)
        return {"kind": self.kind, "op": self.op, "location": self.location, "code": self.code, "calls": self.calls,
                "distinct_sizes": len(values), "min": values[0] if values else None,
                "max": values[-1] if values else None}


def _shape_of(value: Any, tensor_type: type) -> Any:
    if isinstance(value, tensor_type):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, tensor_type) for v in value):
        return tuple(tuple(v.shape) if isinstance(v, tensor_type) else None for v in value)
    return None


def signature_of(args: tuple, kwargs: dict, tensor_type: type) -> tuple:
    """The shapes of an operator call's tensor arguments (lists of tensors nested), in
    order; ``None`` for non-tensor arguments is left out (their number is fixed by the
    schema and says nothing about shapes)."""
    out = [_shape_of(a, tensor_type) for a in args]
    if kwargs:
        out += [_shape_of(v, tensor_type) for v in kwargs.values()]
    return tuple(s for s in out if s is not None)


def make_op_recorder(codes: Any):
    """An :class:`OpShapeRecorder` (built here so that torch is imported only when used)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    tensor_type = torch.Tensor
    grad_enabled = torch.is_grad_enabled
    in_backward = torch._C._current_autograd_node  # not None while autograd runs a backward function
    int_dtypes = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
    mask_dtypes = {torch.bool, torch.uint8}

    class OpShapeRecorder(TorchDispatchMode):
        """Counts each operator's input shapes and finds data-dependent sizes."""

        def __init__(self) -> None:
            super().__init__()
            #: Off until training starts (the first batch or model call), and while
            #: a DataLoader fetches (its collate function is not the model).
            self.active = False
            self.paused = 0
            #: The step clock: optimizer steps, or batches when no optimizer steps.
            self.step = 1
            self.saw_optimizer = False
            #: The harness's list of finished steps, when it shares it: then a step is
            #: exactly the harness's (optimizer step or --step-marker).
            self.harness_steps: list | None = None
            self.harness_clock: Any = None
            self.ops: dict[str, OpTally] = {}
            #: Calls with gradients off outside the backward pass (evaluation, the
            #: optimizer's update): apart, so that a validation pass over other
            #: lengths does not make training's shapes look dynamic.
            self.eval_ops: dict[str, OpTally] = {}
            #: Training's calls apart by where they ran: inside a module's forward
            #: (``ops``), in the backward pass, and with gradients on outside every
            #: module (the loss, bookkeeping, ``state_dict()``), which torch.compile of
            #: the model does not compile (see :meth:`training_ops`).
            self.backward_ops: dict[str, OpTally] = {}
            self.outside_ops: dict[str, OpTally] = {}
            #: Modules whose forward is running (global module hooks, :meth:`watch_modules`).
            self.depth = 0
            self.saw_module = False
            self._module_hooks: list = []
            self.sites: dict[tuple[str, str | None], DataDependentSite] = {}
            self._names: dict[Any, str] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not self.active:
                clock = self.harness_clock
                if clock is None or not (clock.started or clock.steps):
                    return out
                self.active = True  # the harness saw training start (a step marker's first call)
            if self.paused:
                return out
            name = self._names.get(func)
            if name is None:
                name = self._names[func] = str(func)
            signature = signature_of(args, kwargs, tensor_type)
            if not signature:  # a factory (arange, zeros): its size is its output's
                first = out[0] if isinstance(out, (tuple, list)) and out else out
                if isinstance(first, tensor_type):
                    signature = (("out",) + tuple(first.shape),)
            if in_backward() is not None:
                ops = self.backward_ops
            elif not grad_enabled():
                ops = self.eval_ops
            else:
                ops = self.ops if self.depth > 0 else self.outside_ops
            tally = ops.get(name)
            if tally is None:
                tally = ops[name] = OpTally(name)
            steps = self.harness_steps
            tally.add(signature, len(steps) + 1 if steps is not None else self.step)
            kind = DATA_DEPENDENT.get(name)
            if kind is None and name in INDEX_OPS and len(args) > 1:
                indices = args[1] if isinstance(args[1], (list, tuple)) else ()
                if any(isinstance(i, tensor_type) and i.dtype in mask_dtypes for i in indices):
                    kind = "boolean-mask"
            if kind is not None:
                first = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(first, tensor_type) and first.dim() > 0:
                    self._site(kind, name).sizes[int(first.shape[0])] += 1
            elif name == ITEM_OP and args and isinstance(args[0], tensor_type) and args[0].dtype in int_dtypes:
                self._site("item", name).sizes[int(out)] += 1
            return out

        def watch_modules(self) -> None:
            """Count the modules whose forward is running (global forward hooks)."""
            from torch.nn.modules import module as module_mod

            def enter(module, args):
                self.depth += 1
                self.saw_module = True

            def leave(module, args, output):
                self.depth = max(self.depth - 1, 0)

            self._module_hooks = [module_mod.register_module_forward_pre_hook(enter),
                                  module_mod.register_module_forward_hook(leave, always_call=True)]

        def unwatch_modules(self) -> None:
            for handle in self._module_hooks:
                handle.remove()
            self._module_hooks = []

        def training_ops(self) -> list[OpTally]:
            """Training's operators, as torch.compile of the model sees them: those
            inside its modules' forward and, when any of those saw its shapes change,
            the backward's. When every one of them saw the same shapes each step, the
            model's backward did too, and a backward operator whose shapes change is
            the backward of code outside the model (a loss over a varying number of
            terms). A script whose model is no module counts every call."""
            if not self.saw_module:
                parts = [self.ops, self.backward_ops, self.outside_ops]
            elif any(t.varies() for t in self.ops.values()):
                parts = [self.ops, self.backward_ops]
            else:
                parts = [self.ops, {n: t for n, t in self.backward_ops.items() if not t.varies()}]
            out: dict[str, OpTally] = {}
            for part in parts:
                for name, tally in part.items():
                    out[name] = out[name].merged(tally) if name in out else tally
            return list(out.values())

        @property
        def complete_steps(self) -> int:
            return len(self.harness_steps) if self.harness_steps is not None else self.step - 1

        def tick(self, source: str) -> None:
            """A step boundary: ``optimizer`` (a step ended) or ``batch`` (a batch was
            fetched; a boundary only while no optimizer has stepped)."""
            if not self.active:
                return
            if source == "optimizer":
                self.saw_optimizer = True
                self.step += 1
            elif not self.saw_optimizer:
                self.step += 1

        def _site(self, kind: str, op: str) -> DataDependentSite:
            location, code = user_line(codes)
            key = (kind, location)
            site = self.sites.get(key)
            if site is None:
                site = self.sites[key] = DataDependentSite(kind=kind, op=op, location=location, code=code)
            site.calls += 1
            return site

    return OpShapeRecorder()


def user_line(codes: Any) -> tuple[str | None, str | None]:
    """``file:line`` and the source text of the innermost frame of the user's code."""
    import linecache

    frame = sys._getframe(1)
    hops = 0
    while frame is not None and hops < 200:
        filename = frame.f_code.co_filename
        if codes.kind(filename) == "user":
            line = frame.f_lineno
            text = linecache.getline(filename, line).strip() or None
            return f"{codes.show(filename)}:{line}", text
        frame = frame.f_back
        hops += 1
    return None, None


# -------------------------------------------------------------------- loaders


@dataclass
class LoaderInfo:
    """One DataLoader (one data set, collate function and batch sampler) and the batches it
    gave; ``dataset_length``: the samples of an epoch (its sampler's count when it has one)."""

    collate: str
    collate_location: str | None
    batch_size: int | None
    drop_last: bool | None
    dataset_length: int | None
    #: Every batch's signature, in order: a tuple of (shape or None) per tensor.
    batches: list = field(default_factory=list)
    truncated: bool = False
    #: The names of a mapping batch's tensors, in the batches' order (None: a tuple).
    fields: tuple | None = None
    #: The collate function is an object of a class (a collator), not a function.
    collate_instance: bool = False
    #: The trainer class that built the loader from the collator the user passed it
    #: (a ``transformers.Trainer``, as ``Seq2SeqTrainer``: its ``data_collator``), None
    #: for the user's own loader.
    built_by: str | None = None

    def collate_code(self) -> str:
        """The collate function as code to pass on: ``MLMCollator(...)`` for an object
        of the user's collator class, the function's name otherwise."""
        return f"{self.collate}(...)" if self.collate_instance else self.collate

    def tensor_name(self, index: int) -> str:
        """``tensor 1``, or ``tensor 1 (attention_mask)`` for a mapping batch."""
        name = self.fields[index] if self.fields is not None and index < len(self.fields) else None
        return f"tensor {index}" + (f" ({name})" if name else "")

    @property
    def remainder(self) -> int | None:
        """Samples in the last, partial batch of an epoch (None when there is none or
        it cannot be known)."""
        return partial_batch(self.dataset_length, self.batch_size, bool(self.drop_last))

    def to_dict(self) -> dict[str, Any]:
        return {"collate_fn": self.collate, "collate_location": self.collate_location, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "dataset_length": self.dataset_length,
                "last_batch_samples": self.remainder, "batches": len(self.batches), "fields": self.fields,
                "collate_instance": self.collate_instance, "built_by": self.built_by}


#: The files of trainers that build the training DataLoader from a collate function
#: the user passes them (``data_collator=``), by path suffix.
LOADER_BUILDERS = (os.path.join("transformers", "trainer.py"),)


def loader_builder(frame: Any) -> str | None:
    """The class of the trainer whose code iterates the loader, from the stack at its
    first batch (``frame`` and its callers): ``Trainer``, ``Seq2SeqTrainer``, ... (the
    object's own class, a subclass the script uses), or None."""
    while frame is not None:
        if frame.f_code.co_filename.endswith(LOADER_BUILDERS):
            owner = frame.f_locals.get("self")
            return type(owner).__name__ if owner is not None else "Trainer"
        frame = frame.f_back
    return None


def describe_callable(fn: Any, codes: Any) -> tuple[str, str | None]:
    """A collate function's name and, when it is the user's, where it is defined."""
    target = fn
    if not inspect.isfunction(target) and not inspect.ismethod(target) and callable(target):
        target = type(fn)
    name = getattr(target, "__qualname__", None) or type(fn).__name__
    module = getattr(target, "__module__", "") or ""
    if module.startswith("torch.utils.data"):
        return f"torch.utils.data.{name}", None
    try:
        filename = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (TypeError, OSError):
        return name, None
    if filename and codes.kind(filename) == "user":
        return name, f"{codes.show(filename)}:{line}"
    return f"{module}.{name}" if module else name, None


class LoaderProbe:
    """Wraps ``_BaseDataLoaderIter.__next__`` to note each loader and its batches."""

    def __init__(self, codes: Any, recorder: Any = None) -> None:
        self.codes = codes
        #: The OpShapeRecorder to switch on at the first batch and pause during fetches.
        self.recorder = recorder
        self.loaders: dict[tuple[int, int], LoaderInfo] = {}
        self._saved = None
        self._hook = None
        self._step_hook = None

    def install(self) -> None:
        import torch
        from torch.utils.data import dataloader

        from torchaxe.runtime.probes import batch_fields, input_signature

        owner = dataloader._BaseDataLoaderIter
        original = owner.__dict__["__next__"]
        self._saved = (owner, original)
        probe = self
        tensor_type = torch.Tensor

        recorder = self.recorder

        def __next__(iterator):
            if recorder is not None:
                if recorder.active:
                    recorder.tick("batch")
                recorder.active = True
                recorder.paused += 1
            try:
                batch = original(iterator)
            finally:
                if recorder is not None:
                    recorder.paused -= 1
            try:
                info = probe._info(iterator)
                if not info.batches:
                    info.fields = batch_fields(batch)
                if len(info.batches) < MAX_BATCHES:
                    info.batches.append(tuple(s for s, _ in input_signature(batch, tensor_type)))
                else:
                    info.truncated = True
            except Exception:  # a loader torchaxe does not understand: its batches still flow
                pass
            return batch

        __next__.__wrapped__ = original  # type: ignore[attr-defined]
        owner.__next__ = __next__
        if recorder is not None:
            def first_forward() -> None:
                recorder.active = True

            self._hook = OneShotModuleHook(first_forward)
            self._hook.install()
            from torch.optim.optimizer import register_optimizer_step_post_hook

            # Installed before the harness's own hook, so it runs first (the
            # harness's may stop the script from inside the step).
            self._step_hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: recorder.tick("optimizer"))

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.uninstall()
            self._hook = None

    def _info(self, iterator: Any) -> LoaderInfo:
        dataset = getattr(iterator, "_dataset", None)
        collate = getattr(iterator, "_collate_fn", None)
        sampler = getattr(iterator, "_index_sampler", None)
        # The loader's own batch sampler tells two loaders over one dataset apart (an
        # evaluation loader beside the training one); it is the same for every epoch.
        key = (id(dataset), id(collate), id(sampler))
        info = self.loaders.get(key)
        if info is None:
            # The Trainer's wrapper that drops the columns the model does not take: the
            # user's collator is inside it.
            if type(collate).__name__ == "RemoveColumnsCollator" and callable(getattr(collate, "data_collator", None)):
                collate = collate.data_collator
            name, location = describe_callable(collate, self.codes) if collate is not None else ("(none)", None)
            batched = getattr(iterator, "_auto_collation", False)
            batch_size = getattr(sampler, "batch_size", None) if batched else None
            try:
                # The samples of an epoch are the sampler's (one drawing with replacement
                # sets its own count, a DistributedSampler this rank's share), else the dataset's.
                inner = getattr(sampler, "sampler", None) if batched else sampler
                length = len(inner if inner is not None else dataset)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - no length (an iterable dataset, a sampler without one)
                length = None
            instance = collate is not None and callable(collate) and not (
                inspect.isfunction(collate) or inspect.ismethod(collate) or inspect.isbuiltin(collate))
            info = self.loaders[key] = LoaderInfo(
                collate=name, collate_location=location, batch_size=batch_size if isinstance(batch_size, int) else None,
                drop_last=getattr(iterator, "_drop_last", None), dataset_length=length, collate_instance=instance,
                built_by=loader_builder(sys._getframe(1)))
        return info

    def uninstall(self) -> None:
        self._remove_hook()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._saved is not None:
            owner, original = self._saved
            owner.__next__ = original
            self._saved = None


class SharedStepClock:
    """A harness probe (``Harness(probes=...)``) that hands the harness's own step
    list to the operator recorder, so that its steps are the harness's."""

    def __init__(self, step_recorder: Any, op_recorder: Any) -> None:
        self.step_recorder = step_recorder
        self.op_recorder = op_recorder

    def install(self) -> None:
        self.op_recorder.harness_steps = self.step_recorder.steps
        self.op_recorder.harness_clock = self.step_recorder

    def uninstall(self) -> None:
        self.op_recorder.harness_steps = list(self.step_recorder.steps)
        self.op_recorder.harness_clock = None
