"""Capturing a model on its real shapes, and cutting it into subgraphs.

While the model runs (one forward of ``example_inputs``, or the first steps of the
user's script), forward hooks note, for every submodule, which module called it
(the *call tree*: a ``ModuleList`` that is iterated, never called, does not count as
a level) and the shapes of every call. The subgraphs are the modules at the chosen
depth of the call tree (depth 1: the modules the model's ``forward`` calls itself,
e.g. the embeddings, each transformer block, the final norm and the head). A module
whose calls came with different shapes is *dynamic*: it is left alone, with the
shapes seen, and ``torchaxe shapes`` is the tool that makes such shapes fixed. The
first call's inputs are kept (detached copies) as the example to tune on. With
``whole``, the model itself (depth 0) is a subgraph too: compiling it whole can fuse
across the blocks' boundaries, and the tuner keeps whichever level saves more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torchaxe.tune.measure import Example, clone_value
from torchaxe.tune.signature import value_spec

SHAPES_HINT = "see `torchaxe shapes` to make them fixed (bucketing, padding)"


@dataclass
class ModuleCalls:
    name: str
    module: nn.Module
    depth: int
    specs: list[str] = field(default_factory=list)
    example: Example | None = None
    #: value_spec of the first call's (args, kwargs), for the signature.
    first_spec: list[Any] | None = None
    #: The autocast regions the first call ran in: ``(device type, dtype)`` pairs.
    autocast: tuple[tuple[str, str], ...] = ()
    calls: int = 0

    @property
    def dynamic(self) -> bool:
        """Called with inputs of more than one shape or dtype. Calls that differ only
        in ``requires_grad`` or memory layout (a GAN's discriminator on real and on
        generated images) have fixed shapes: the first call's signature is tuned, and
        a compiled winner serves the others too."""
        return len({_shapes_only(spec) for spec in self.specs}) > 1


@dataclass
class Subgraph:
    """One module chosen for tuning (or left alone, with ``skipped`` saying why)."""

    name: str
    module: nn.Module
    example: Example | None
    skipped: str | None = None
    #: value_spec of the inputs, as ``signature_parts`` takes them.
    spec: list[Any] | None = None
    #: Depth in the call tree: 0 is the whole model.
    depth: int = 1
    #: The autocast regions the script ran it in (``(device type, dtype)`` pairs):
    #: part of its signature, and every run of the tuner is made in them.
    autocast: tuple[tuple[str, str], ...] = ()


class CallRecorder:
    """Forward hooks on every submodule of ``model`` that record the call tree."""

    def __init__(self, model: nn.Module, depth: int, keep_examples: bool = True, whole: bool = False) -> None:
        self.model = model
        self.depth = depth
        #: The depths whose modules are subgraphs: ``depth``, and 0 (the whole model) with ``whole``.
        self.levels = {depth, 0} if whole else {depth}
        self.keep_examples = keep_examples
        self.calls: dict[int, ModuleCalls] = {}
        self._names = {id(m): n for n, m in model.named_modules()}
        self._stack: list[int] = []
        self._handles: list[Any] = []

    def install(self) -> "CallRecorder":
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    def __enter__(self) -> "CallRecorder":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        key = id(module)
        depth = len(self._stack)
        self._stack.append(key)
        record = self.calls.get(key)
        if record is None:
            record = self.calls[key] = ModuleCalls(self._names.get(key, "?"), module, depth)
        record.calls += 1
        if record.depth != depth:
            record.depth = min(record.depth, depth)
        spec = json.dumps([value_spec(list(args)), value_spec(dict(kwargs))], sort_keys=True)
        if spec not in record.specs:
            record.specs.append(spec)
        if record.first_spec is None:
            record.first_spec = json.loads(spec)
            record.autocast = active_autocast(module, args, kwargs)
        if record.example is None and self.keep_examples and depth in self.levels:
            record.example = Example(clone_value(tuple(args)), clone_value(dict(kwargs)), autocast=record.autocast)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._stack and self._stack[-1] == id(module):
            self._stack.pop()

    def subgraphs(self) -> list[Subgraph]:
        """The modules at the chosen depth (and the whole model, first, when asked),
        in call order; dynamic ones skipped."""
        out = []
        for record in self.calls.values():
            if record.depth not in self.levels:
                continue
            name = record.name or type(record.module).__name__
            if record.dynamic and not any(True for _ in record.module.parameters()):
                # A module without parameters reused at several places (one Dropout
                # after attention and after the MLP): not a shape problem to fix.
                out.append(Subgraph(name, record.module, None, depth=record.depth,
                                    skipped=f"no parameters, called with {len(record.specs)} input shapes (reused at "
                                            "several places, or with inputs that vary): nothing of its own to tune"))
                continue
            if record.dynamic:
                shapes = " vs ".join(_short(s) for s in record.specs[:2])
                more = f" (+{len(record.specs) - 2} more)" if len(record.specs) > 2 else ""
                out.append(Subgraph(name, record.module, None, depth=record.depth,
                                    skipped=f"dynamic: called with {len(record.specs)} different input shapes "
                                            f"({shapes}{more}); {SHAPES_HINT}"))
                continue
            if not any(True for _ in record.module.parameters()) and not _has_float_input(record.example):
                out.append(Subgraph(name, record.module, record.example, depth=record.depth,
                                    skipped="no parameters and no floating-point input: nothing to tune"))
                continue
            out.append(Subgraph(name, record.module, record.example, spec=record.first_spec, depth=record.depth,
                                autocast=record.autocast))
        return out


def active_autocast(module: nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None
                    ) -> tuple[tuple[str, str], ...]:
    """The autocast regions enabled now, for the device types of ``module``'s
    parameters, its tensor inputs and the CPU: ``(("cuda", "bfloat16"),)`` inside a
    script's ``torch.autocast("cuda", dtype=torch.bfloat16)``."""
    import torch

    from torchaxe.tune.measure import tensors_in

    kinds = {"cpu"} | {p.device.type for p in module.parameters()}
    kinds |= {t.device.type for t in tensors_in((args, kwargs or {}))}
    out = []
    for kind in sorted(kinds):
        try:
            if torch.is_autocast_enabled(kind):
                out.append((kind, str(torch.get_autocast_dtype(kind)).removeprefix("torch.")))
        except (RuntimeError, TypeError, AttributeError):  # a device type without autocast, or an older torch
            continue
    return tuple(out)


def _has_float_input(example: Example | None) -> bool:
    from torchaxe.tune.measure import tensors_in

    return example is not None and any(t.is_floating_point() for t in tensors_in((example.args, example.kwargs)))


def _shapes_only(spec: str) -> str:
    """A call spec with each tensor reduced to its shape and dtype."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict) and "tensor" in value:
            return {"tensor": value["tensor"][:2]}
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(json.loads(spec)), sort_keys=True)


def _short(spec: str) -> str:
    """Input shapes of one call spec, compactly: ``[8,57] long``."""
    data = json.loads(spec)
    parts = []

    def walk(value: Any) -> None:
        if isinstance(value, dict) and "tensor" in value:
            shape, dtype = value["tensor"][0], value["tensor"][1]
            parts.append(f"[{','.join(str(d) for d in shape)}] {dtype}")
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(data)
    return ", ".join(parts) or "no tensors"


def capture(model: nn.Module, example_inputs: Any, depth: int = 1, whole: bool = False) -> CallRecorder:
    """Run one forward of ``model`` on ``example_inputs`` (a tuple of positional
    arguments, or a single tensor) under the recorder. Autograd stays on, so that
    each subgraph's inputs keep the ``requires_grad`` they have in training."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    recorder = CallRecorder(model, depth, whole=whole)
    with recorder:
        model(*args)
    return recorder
