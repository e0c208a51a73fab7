"""The Profile: what one training run was measured to do, as plain data.

A Profile is written by the harness (``torchaxe profile -- python train.py``), and
later by trace import, and read by ``merge``, the advisor and the tests. It is JSON
with a versioned schema (``"schema": "torchaxe.profile/1"``; docs/profile.md
describes every field). Within a major version fields are only ever added, so a
reader ignores keys it does not know; a change that would mislead an older reader
bumps the major version, and a reader refuses a major version it does not know.

Everything here is plain and stdlib-only: building, reading and validating a
Profile never imports torch. Times are seconds, memory is bytes, step indices are
1-based and count every step the run made, warmup included.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.stats import Samples

SCHEMA_NAME = "torchaxe.profile"
SCHEMA_MAJOR = 1
SCHEMA = f"{SCHEMA_NAME}/{SCHEMA_MAJOR}"

#: How the run ended. ``completed``: the script ran to its end by itself;
#: ``stopped``: torchaxe stopped it after the steps asked for; ``exited``: the script
#: called ``sys.exit``; ``error``: it raised; ``timeout``: ``--timeout`` ran out;
#: ``interrupted``: Ctrl-C (SIGINT).
STATUSES = ("completed", "stopped", "exited", "error", "timeout", "interrupted")

#: What a step was for. Only ``measured`` steps enter the summary: ``warmup`` steps
#: pay one-off costs (lazy initialisation, allocator growth, autotuning) and ``ops``
#: steps run under torch.profiler, which slows them down.
PHASES = ("warmup", "ops", "measured")

#: What a row of the op table is.
OP_KINDS = ("op", "range", "kernel")

#: Where a profile's data came from; trace import adds its own values.
SOURCES = ("harness", "torch-trace", "ascend-trace")


class ProfileFormatError(TorchaxeError):
    """A file that is not a valid profile (of a version this torchaxe reads)."""


T = TypeVar("T")


class _Reader:
    """Typed access to one JSON object, with the path to each value kept for errors."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ProfileFormatError(f"{where or 'top level'}: expected an object, got {_kind(data)}")
        self.data = data
        self.where = where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str, optional: bool) -> Any:
        if key not in self.data or self.data[key] is None:
            if optional:
                return None
            raise ProfileFormatError(f"{self._path(key)}: missing")
        return self.data[key]

    def str(self, key: str, optional: bool = False, choices: tuple[str, ...] | None = None) -> Any:
        value = self._get(key, optional)
        if value is None:
            return None
        if not isinstance(value, str):
            raise ProfileFormatError(f"{self._path(key)}: expected a string, got {_kind(value)}")
        if choices is not None and value not in choices:
            raise ProfileFormatError(f"{self._path(key)}: {value!r} is not one of {', '.join(choices)}")
        return value

    def int(self, key: str, optional: bool = False, minimum: int | None = 0) -> Any:
        value = self._get(key, optional)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProfileFormatError(f"{self._path(key)}: expected an integer, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise ProfileFormatError(f"{self._path(key)}: {value} is below {minimum}")
        return value

    def float(self, key: str, optional: bool = False, minimum: float | None = 0.0) -> Any:
        value = self._get(key, optional)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProfileFormatError(f"{self._path(key)}: expected a finite number, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise ProfileFormatError(f"{self._path(key)}: {value} is below {minimum}")
        return float(value)

    def bool(self, key: str, default: bool = False) -> bool:
        value = self._get(key, optional=True)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ProfileFormatError(f"{self._path(key)}: expected true or false, got {_kind(value)}")
        return value

    def list(self, key: str, item: Callable[[Any, str], T], optional: bool = True) -> list[T]:
        value = self._get(key, optional)
        if value is None:
            return []
        if not isinstance(value, list):
            raise ProfileFormatError(f"{self._path(key)}: expected a list, got {_kind(value)}")
        return [item(v, f"{self._path(key)}[{i}]") for i, v in enumerate(value)]

    def object(self, key: str, build: Callable[[Any, str], T], optional: bool = True) -> T | None:
        value = self._get(key, optional)
        if value is None:
            return None
        return build(value, self._path(key))

    def dict(self, key: str) -> dict[str, Any]:
        value = self._get(key, optional=True)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ProfileFormatError(f"{self._path(key)}: expected an object, got {_kind(value)}")
        return dict(value)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _shape(value: Any, where: str) -> list[int] | None:
    """A tensor shape (list of non-negative ints) or null for a non-tensor input."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise ProfileFormatError(f"{where}: expected a shape (a list of non-negative integers), got {_kind(value)}")
    return list(value)


def _opt_str(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ProfileFormatError(f"{where}: expected a string or null, got {_kind(value)}")
    return value


# --------------------------------------------------------------------------- parts


@dataclass
class StepRecord:
    """One training step: the time from the end of the previous step (or, for the
    first, from the first sign of training: a DataLoader fetch or a module's forward)
    to the end of this one, with what the step spent it on."""

    index: int
    seconds: float
    phase: str = "measured"
    #: Blocked in the DataLoader (creating the iterator, or waiting in ``__next__``).
    data_wait_seconds: float | None = 0.0
    #: Batches fetched from DataLoaders during the step.
    batches: int | None = 0
    #: Host time inside ``backward()``; in data-parallel training this includes
    #: waiting for the other ranks' gradients.
    backward_seconds: float | None = None
    #: Host-device synchronisations (on cpu: calls that would synchronise on a device).
    host_syncs: int | None = 0
    gc_seconds: float | None = 0.0
    gc_collections: int | None = 0
    #: Highest device memory allocated during the step (cuda, npu); null on cpu.
    peak_device_memory_bytes: int | None = None
    #: Resident set size of the process at the end of the step.
    host_rss_bytes: int | None = None
    #: When the step started, in seconds since the run started.
    start_seconds: float | None = None
    #: Host time in the script's own torch.distributed collectives (distributed runs).
    comm_seconds: float | None = None
    #: Passes without gradients (``torch.no_grad``/``inference_mode`` spans that called a
    #: module with parameters: evaluation, generation) and their time.
    no_grad_seconds: float | None = None
    no_grad_passes: int | None = None
    #: Host time inside ``torch.optim`` optimizers' ``step()`` (every optimizer's).
    optimizer_seconds: float | None = None

    def own_work_seconds(self) -> float | None:
        """The step's time outside ``backward()`` and outside the script's own
        collectives: a rank's own work, which in data-parallel training the other ranks
        wait for (in backward's gradient exchange, or in a collective such as a
        per-step ``barrier()`` or loss ``all_reduce``); None when backward was not timed."""
        if self.backward_seconds is None:
            return None
        return max(self.seconds - self.backward_seconds - (self.comm_seconds or 0.0), 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "seconds": self.seconds,
            "data_wait_seconds": self.data_wait_seconds,
            "batches": self.batches,
            "backward_seconds": self.backward_seconds,
            "host_syncs": self.host_syncs,
            "gc_seconds": self.gc_seconds,
            "gc_collections": self.gc_collections,
            "peak_device_memory_bytes": self.peak_device_memory_bytes,
            "host_rss_bytes": self.host_rss_bytes,
            "start_seconds": self.start_seconds,
            "comm_seconds": self.comm_seconds,
            "no_grad_seconds": self.no_grad_seconds,
            "no_grad_passes": self.no_grad_passes,
            "optimizer_seconds": self.optimizer_seconds,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "step") -> "StepRecord":
        r = _Reader(data, where)
        return cls(
            index=r.int("index", minimum=1),
            seconds=r.float("seconds"),
            phase=r.str("phase", optional=True, choices=PHASES) or "measured",
            data_wait_seconds=r.float("data_wait_seconds", optional=True),
            batches=r.int("batches", optional=True),
            backward_seconds=r.float("backward_seconds", optional=True),
            host_syncs=r.int("host_syncs", optional=True),
            gc_seconds=r.float("gc_seconds", optional=True),
            gc_collections=r.int("gc_collections", optional=True),
            peak_device_memory_bytes=r.int("peak_device_memory_bytes", optional=True),
            host_rss_bytes=r.int("host_rss_bytes", optional=True),
            start_seconds=r.float("start_seconds", optional=True, minimum=None),
            comm_seconds=r.float("comm_seconds", optional=True),
            no_grad_seconds=r.float("no_grad_seconds", optional=True),
            no_grad_passes=r.int("no_grad_passes", optional=True),
            optimizer_seconds=r.float("optimizer_seconds", optional=True),
        )


@dataclass
class HostSyncSite:
    """A line of code that read a tensor back to the host (``.item()``, ``.cpu()``,
    ``float(t)``, ``if t:``, ``print(t)``, ...), and how often it did."""

    file: str
    line: int
    call: str
    count: int
    function: str | None = None
    #: The source line, stripped.
    code: str | None = None
    #: Where in third-party code the read happened, when that is not the user's file.
    via: str | None = None

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "location": self.location,
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "call": self.call,
            "count": self.count,
            "code": self.code,
            "via": self.via,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "host_sync") -> "HostSyncSite":
        r = _Reader(data, where)
        return cls(
            file=r.str("file"),
            line=r.int("line"),
            call=r.str("call"),
            count=r.int("count"),
            function=r.str("function", optional=True),
            code=r.str("code", optional=True),
            via=r.str("via", optional=True),
        )


@dataclass
class OpShapeGroup:
    """The calls of one operator with one combination of input shapes."""

    input_shapes: list[list[int] | None]
    calls: int
    self_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"input_shapes": self.input_shapes, "calls": self.calls, "self_seconds": self.self_seconds}

    @classmethod
    def from_dict(cls, data: Any, where: str = "shape_group") -> "OpShapeGroup":
        r = _Reader(data, where)
        return cls(
            input_shapes=r.list("input_shapes", _shape, optional=False),
            calls=r.int("calls"),
            self_seconds=r.float("self_seconds"),
        )


@dataclass
class OpSource:
    """The user's function that led to an operator (the innermost one of theirs on
    the Python stack), and how many calls of the operator came from it. ``location``
    is ``file:line`` of the line the function starts on (torch.profiler's Python
    tracer records functions, not lines)."""

    location: str
    count: int
    function: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "function": self.function, "count": self.count}

    @classmethod
    def from_dict(cls, data: Any, where: str = "source") -> "OpSource":
        r = _Reader(data, where)
        return cls(location=r.str("location"), count=r.int("count"), function=r.str("function", optional=True))


@dataclass
class OpKernel:
    """A device kernel an operator launched (traces whose flows link the two), its
    launches and its device time."""

    name: str
    calls: int
    device_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "calls": self.calls, "device_seconds": self.device_seconds}

    @classmethod
    def from_dict(cls, data: Any, where: str = "kernel") -> "OpKernel":
        r = _Reader(data, where)
        return cls(name=r.str("name"), calls=r.int("calls"), device_seconds=r.float("device_seconds"))


@dataclass
class OpStat:
    """One operator over the op-profiling window (``ops_steps``): host time spent in
    the operator itself (``self``) and including its children (``total``), and the
    device's own time where the profiler saw the device."""

    name: str
    calls: int
    self_seconds: float
    total_seconds: float
    device_self_seconds: float | None = None
    #: ``op`` (an operator), ``range`` (a ``record_function`` range such as
    #: ``Optimizer.step#AdamW.step``) or ``kernel`` (a device kernel, from traces).
    kind: str = "op"
    #: Only with ``--shapes``: the calls split by input shapes, most time first.
    input_shapes: list[OpShapeGroup] = field(default_factory=list)
    #: Lines of the user's code that led to the calls, most frequent first.
    sources: list[OpSource] = field(default_factory=list)
    #: Traces: the device kernels this operator launched (innermost operator of the
    #: launch), most device time first; their sum is ``device_self_seconds``.
    kernels: list[OpKernel] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "calls": self.calls,
            "self_seconds": self.self_seconds,
            "total_seconds": self.total_seconds,
            "device_self_seconds": self.device_self_seconds,
            "input_shapes": [g.to_dict() for g in self.input_shapes],
            "sources": [s.to_dict() for s in self.sources],
            "kernels": [k.to_dict() for k in self.kernels],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "op") -> "OpStat":
        r = _Reader(data, where)
        return cls(
            name=r.str("name"),
            calls=r.int("calls"),
            self_seconds=r.float("self_seconds"),
            total_seconds=r.float("total_seconds"),
            device_self_seconds=r.float("device_self_seconds", optional=True),
            kind=r.str("kind", optional=True, choices=OP_KINDS) or "op",
            input_shapes=r.list("input_shapes", OpShapeGroup.from_dict),
            sources=r.list("sources", OpSource.from_dict),
            kernels=r.list("kernels", OpKernel.from_dict),
        )


@dataclass
class InputSignature:
    """One combination of input shapes and dtypes (null for an input that is not a
    tensor), and how many calls had it."""

    shapes: list[list[int] | None]
    dtypes: list[str | None]
    count: int

    def to_dict(self) -> dict[str, Any]:
        return {"shapes": self.shapes, "dtypes": self.dtypes, "count": self.count}

    @classmethod
    def from_dict(cls, data: Any, where: str = "signature") -> "InputSignature":
        r = _Reader(data, where)
        shapes = r.list("shapes", _shape, optional=False)
        dtypes = r.list("dtypes", _opt_str, optional=False)
        if len(dtypes) != len(shapes):
            raise ProfileFormatError(f"{where}: {len(shapes)} shapes but {len(dtypes)} dtypes")
        return cls(shapes=shapes, dtypes=dtypes, count=r.int("count"))


@dataclass
class ShapeTally:
    """The distinct input signatures one module (or the DataLoader's batches) saw.

    ``name`` is the module's dotted path from its root model (``GPT.blocks.0.attn``),
    ``type`` its class name. At most a fixed number of distinct signatures are kept;
    ``truncated`` says more were seen (the module's shapes are certainly dynamic).
    """

    name: str
    type: str
    calls: int
    signatures: list[InputSignature] = field(default_factory=list)
    truncated: bool = False
    #: How many different sets of signatures the steps saw (the first step and an
    #: unfinished last one left out); None when not tallied per step. A module called
    #: at several places with fixed shapes has several signatures and one set.
    step_sets: int | None = None
    #: Elements of the module's parameters (its children's included); None when not read.
    parameters: int | None = None
    #: ``[input, dim]`` (inputs numbered without those that are no tensor) that take
    #: several sizes within each step, the same ones every step: a module called at
    #: several places (a ReLU after convolutions of two widths), not a changing shape.
    steady: list[list[int]] = field(default_factory=list)

    @property
    def dynamic(self) -> bool:
        if self.truncated:
            return True
        if self.step_sets is not None:
            return self.step_sets > 1
        return len(self.signatures) > 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "calls": self.calls,
            "distinct": len(self.signatures),
            "step_sets": self.step_sets,
            "parameters": self.parameters,
            "dynamic": self.dynamic,
            "truncated": self.truncated,
            "signatures": [s.to_dict() for s in self.signatures],
            "steady": [list(pair) for pair in self.steady],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "module") -> "ShapeTally":
        r = _Reader(data, where)
        return cls(
            name=r.str("name"),
            type=r.str("type"),
            calls=r.int("calls"),
            signatures=r.list("signatures", InputSignature.from_dict),
            truncated=r.bool("truncated"),
            step_sets=r.int("step_sets", optional=True, minimum=1),
            parameters=r.int("parameters", optional=True, minimum=0),
            steady=r.list("steady", _dim_pair),
        )


def _dim_pair(value: Any, where: str) -> list[int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v >= 0 for v in value)):
        raise ProfileFormatError(f"{where}: expected [input, dim], got {_kind(value)}")
    return list(value)


@dataclass
class ShapeReport:
    """Input shapes per module (a global forward pre-hook) and of the batches the
    DataLoaders produced: the facts the compile-mode axis needs."""

    modules: list[ShapeTally] = field(default_factory=list)
    batches: ShapeTally | None = None

    @property
    def dynamic_modules(self) -> list[str]:
        return [m.name for m in self.modules if m.dynamic]

    def to_dict(self) -> dict[str, Any]:
        return {
            "static": not self.dynamic_modules and not (self.batches and self.batches.dynamic),
            "dynamic_modules": self.dynamic_modules,
            "batches": self.batches.to_dict() if self.batches else None,
            "modules": [m.to_dict() for m in self.modules],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "shapes") -> "ShapeReport":
        r = _Reader(data, where)
        return cls(modules=r.list("modules", ShapeTally.from_dict), batches=r.object("batches", ShapeTally.from_dict))


@dataclass
class ErrorInfo:
    """The exception that ended the user's script (status ``error``)."""

    type: str
    message: str
    file: str | None = None
    line: int | None = None
    #: The user's traceback, with torchaxe's and runpy's frames left out (but those
    #: of a change torchaxe made to the computation, below the user's last frame).
    traceback: str = ""
    #: The torchaxe function, of a change it made (a knob's wrapper), the error was
    #: raised through, below the user's last frame: ``"attention (torchaxe/runtime/knob_specs.py:421)"``.
    through: str | None = None

    @property
    def location(self) -> str | None:
        return f"{self.file}:{self.line}" if self.file and self.line else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "message": self.message,
            "location": self.location,
            "file": self.file,
            "line": self.line,
            "traceback": self.traceback,
            "through": self.through,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "error") -> "ErrorInfo":
        r = _Reader(data, where)
        return cls(
            type=r.str("type"),
            message=r.str("message", optional=True) or "",
            file=r.str("file", optional=True),
            line=r.int("line", optional=True),
            traceback=r.str("traceback", optional=True) or "",
            through=r.str("through", optional=True),
        )


@dataclass
class ProfileFinding:
    """Something an analysis of the profile found worth changing (trace import: host
    syncs, host-to-device copies, dynamic-shape operators, an optimizer stepped op by
    op), with what to do about it. Findings are data; the text summary renders them."""

    #: What was found: ``host-sync``, ``host-to-device-copy``, ``dynamic-shape``,
    #: ``unfused-optimizer``, ``online-compile``, ``launches`` (new kinds may be added).
    kind: str
    message: str
    #: What to change, or null when the finding is information only.
    suggestion: str | None = None
    #: How many events the finding rests on (calls, kernels), where it is a count.
    count: int | None = None
    #: The operator or kernel names involved, most frequent first.
    ops: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "suggestion": self.suggestion,
                "count": self.count, "ops": list(self.ops)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "finding") -> "ProfileFinding":
        r = _Reader(data, where)
        return cls(
            kind=r.str("kind"),
            message=r.str("message"),
            suggestion=r.str("suggestion", optional=True),
            count=r.int("count", optional=True),
            ops=r.list("ops", lambda v, w: v if isinstance(v, str) else _bad(w, "a string", v)),
        )


@dataclass
class FlopCount:
    """The FLOPs of one step of the run and the peaks they are measured against
    (``runtime/flops.py``): model FLOPs utilisation is achieved FLOP/s over a peak."""

    #: FLOPs of one step (forward and backward), counted on step ``counted_step``.
    flops_per_step: int | None = None
    counted_step: int | None = None
    #: The dtype that carried most of the FLOPs (``float32``, ``bfloat16``...).
    dtype: str | None = None
    #: The device as its runtime names it (a CPU's model name).
    device_name: str | None = None
    #: The published peak for the device and dtype (``backends/peaks.py``); null when unknown.
    peak_flops_per_second_table: float | None = None
    peak_table_source: str | None = None
    #: The best FLOP/s of square matrix products in that dtype on this device.
    peak_flops_per_second_measured: float | None = None
    #: Bytes of the tensors autograd saved for backward in the counted step (each
    #: storage once, parameters left out): an estimate of activation memory.
    activation_bytes: int | None = None
    #: Why a figure is missing, for the reader.
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: Any, where: str = "flops") -> "FlopCount":
        r = _Reader(data, where)
        return cls(
            flops_per_step=r.int("flops_per_step", optional=True),
            counted_step=r.int("counted_step", optional=True, minimum=1),
            dtype=r.str("dtype", optional=True),
            device_name=r.str("device_name", optional=True),
            peak_flops_per_second_table=r.float("peak_flops_per_second_table", optional=True),
            peak_table_source=r.str("peak_table_source", optional=True),
            peak_flops_per_second_measured=r.float("peak_flops_per_second_measured", optional=True),
            activation_bytes=r.int("activation_bytes", optional=True),
            note=r.str("note", optional=True),
        )


@dataclass
class DistributedInfo:
    """One rank of a distributed run: who it is, and where its step went on
    communication (``runtime/comm.py``). Times are seconds per optimizer step."""

    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    #: Nodes of the job (WORLD_SIZE over LOCAL_WORLD_SIZE where every node runs as many ranks).
    nnodes: int | None = None
    host: str | None = None
    #: The process group's backend (gloo, nccl, hccl).
    backend: str | None = None
    #: The first DistributedDataParallel module the script built: its settings and
    #: DDP's own timing (forward and backward compute, backward communication and
    #: the part of it overlapped with compute); null without DDP.
    ddp: dict[str, Any] | None = None
    #: The script's own torch.distributed calls, by name: calls and host seconds per step.
    collectives: dict[str, Any] = field(default_factory=dict)
    #: Communication per step: DDP's gradient exchange plus the script's collectives.
    comm_seconds_per_step: float | None = None
    #: The part of it not hidden behind compute (the step waits for it).
    comm_exposed_seconds_per_step: float | None = None
    #: DDP's forward and backward compute per step.
    compute_seconds_per_step: float | None = None
    #: Backward passes per optimizer step (gradient accumulation), and how many of
    #: them exchanged gradients.
    backwards_per_step: float | None = None
    synced_backwards_per_step: float | None = None
    #: CPUs this rank may run on.
    cpus: int | None = None
    #: Distinct input shapes the model was called with.
    input_signatures: int | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: Any, where: str = "distributed") -> "DistributedInfo":
        r = _Reader(data, where)
        ddp = data.get("ddp") if isinstance(data, dict) else None
        if ddp is not None and not isinstance(ddp, dict):
            _bad(f"{where}.ddp", "an object or null", ddp)
        return cls(
            rank=r.int("rank", optional=True), local_rank=r.int("local_rank", optional=True),
            world_size=r.int("world_size", optional=True, minimum=1),
            local_world_size=r.int("local_world_size", optional=True, minimum=1),
            nnodes=r.int("nnodes", optional=True, minimum=1), host=r.str("host", optional=True),
            backend=r.str("backend", optional=True), ddp=ddp,
            collectives=r.dict("collectives"),
            comm_seconds_per_step=r.float("comm_seconds_per_step", optional=True),
            comm_exposed_seconds_per_step=r.float("comm_exposed_seconds_per_step", optional=True),
            compute_seconds_per_step=r.float("compute_seconds_per_step", optional=True),
            backwards_per_step=r.float("backwards_per_step", optional=True),
            synced_backwards_per_step=r.float("synced_backwards_per_step", optional=True),
            cpus=r.int("cpus", optional=True), input_signatures=r.int("input_signatures", optional=True),
            note=r.str("note", optional=True),
        )


@dataclass
class RunInfo:
    """What was run, where, and with which settings."""

    command: list[str]
    target: str
    source: str = "harness"
    started_at: str | None = None
    torchaxe_version: str | None = None
    torch_version: str | None = None
    python_version: str | None = None
    hostname: str | None = None
    pid: int | None = None
    #: Distributed runs: this process's rank, local rank and the world size.
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    #: The harness settings (steps, warmup, ops, shapes, timeout, step_marker).
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": list(self.command),
            "target": self.target,
            "source": self.source,
            "started_at": self.started_at,
            "torchaxe_version": self.torchaxe_version,
            "torch_version": self.torch_version,
            "python_version": self.python_version,
            "hostname": self.hostname,
            "pid": self.pid,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "options": dict(self.options),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "run") -> "RunInfo":
        r = _Reader(data, where)
        command = r.list("command", lambda v, w: v if isinstance(v, str) else _bad(w, "a string", v), optional=False)
        info = cls(
            command=command,
            target=r.str("target"),
            source=r.str("source", optional=True, choices=SOURCES) or "harness",
            started_at=r.str("started_at", optional=True),
            torchaxe_version=r.str("torchaxe_version", optional=True),
            torch_version=r.str("torch_version", optional=True),
            python_version=r.str("python_version", optional=True),
            hostname=r.str("hostname", optional=True),
            pid=r.int("pid", optional=True),
            rank=r.int("rank", optional=True),
            local_rank=r.int("local_rank", optional=True),
            world_size=r.int("world_size", optional=True, minimum=1),
            options=r.dict("options"),
        )
        if info.rank is not None and info.world_size is not None and info.rank >= info.world_size:
            raise ProfileFormatError(f"{where}: rank {info.rank} is not below world_size {info.world_size}")
        return info


def _bad(where: str, expected: str, value: Any):
    raise ProfileFormatError(f"{where}: expected {expected}, got {_kind(value)}")


# ------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Summary:
    """Figures over the measured steps (warmup and op-profiling steps left out).

    Always computed from the steps, never stored separately from them, so a summary
    cannot disagree with the raw samples it came from.
    """

    steps_total: int
    steps_measured: int
    step_seconds_median: float | None
    step_seconds_p90: float | None
    step_seconds_p10: float | None
    step_seconds_min: float | None
    step_seconds_max: float | None
    step_seconds_mean: float | None
    #: Interquartile range of the step time over its median.
    step_seconds_spread: float | None
    noisy: bool
    data_wait_seconds_median: float | None
    #: Time blocked on data over total step time.
    data_wait_fraction: float | None
    backward_seconds_median: float | None
    #: Median of (step time - backward time): what the rank spends on its own
    #: (data, forward, optimizer, host work) outside the gradient exchange.
    outside_backward_seconds_median: float | None
    host_syncs_per_step: float | None
    gc_seconds_per_step: float | None
    gc_fraction: float | None
    peak_device_memory_bytes: int | None
    host_rss_peak_bytes: int | None
    #: FLOPs of one step, and FLOPs per step over the median step time.
    flops_per_step: int | None = None
    achieved_flops_per_second: float | None = None
    #: The device's published peak for the run's dtype (null when the table lacks it),
    #: and the peak a matrix-product probe reached on it.
    peak_flops_per_second_table: float | None = None
    peak_flops_per_second_measured: float | None = None
    #: Model FLOPs utilisation: achieved over each peak.
    mfu_table: float | None = None
    mfu_measured: float | None = None
    #: Activation memory of one step, estimated from what autograd saved for backward.
    activation_bytes_estimate: int | None = None
    #: Passes without gradients (evaluation, generation) per step (mean), and their
    #: share of the step time.
    no_grad_passes_per_step: float | None = None
    no_grad_fraction: float | None = None
    #: Host time in optimizers' ``step()`` a step (median) and its share of the step
    #: time; null when no ``torch.optim`` optimizer stepped in every measured step.
    optimizer_seconds_median: float | None = None
    optimizer_fraction: float | None = None

    @classmethod
    def of(cls, steps: list[StepRecord], host_rss_peak_bytes: int | None = None,
           flops: "FlopCount | None" = None) -> "Summary":
        measured = [s for s in steps if s.phase == "measured"]
        seconds = Samples.of(s.seconds for s in measured)
        waits = Samples.of(s.data_wait_seconds for s in measured)
        syncs = Samples.of(s.host_syncs for s in measured)
        gcs = Samples.of(s.gc_seconds for s in measured)
        backwards = Samples.of(s.backward_seconds for s in measured)
        outside = Samples.of(s.seconds - s.backward_seconds for s in measured if s.backward_seconds is not None)
        no_grad = Samples.of(s.no_grad_seconds for s in measured)
        passes = Samples.of(s.no_grad_passes for s in measured)
        optimizer = Samples.of(s.optimizer_seconds for s in measured)
        total = seconds.total

        def fraction(part: Samples) -> float | None:
            if not part or len(part) != len(seconds) or total <= 0:
                return None
            return min(1.0, part.total / total)

        memories = [s.peak_device_memory_bytes for s in steps if s.peak_device_memory_bytes is not None]
        rss = [s.host_rss_bytes for s in steps if s.host_rss_bytes is not None]
        if host_rss_peak_bytes is not None:
            rss.append(host_rss_peak_bytes)
        count = flops.flops_per_step if flops is not None else None
        achieved = count / seconds.median if count and seconds.median else None
        table = flops.peak_flops_per_second_table if flops is not None else None
        probe = flops.peak_flops_per_second_measured if flops is not None else None
        return cls(
            steps_total=len(steps),
            steps_measured=len(measured),
            step_seconds_median=seconds.median,
            step_seconds_p90=seconds.p90,
            step_seconds_p10=seconds.p10,
            step_seconds_min=seconds.min,
            step_seconds_max=seconds.max,
            step_seconds_mean=seconds.mean,
            step_seconds_spread=seconds.relative_spread,
            noisy=seconds.is_noisy(),
            data_wait_seconds_median=waits.median,
            data_wait_fraction=fraction(waits),
            backward_seconds_median=backwards.median,
            outside_backward_seconds_median=outside.median if len(outside) == len(seconds) else None,
            host_syncs_per_step=syncs.mean,
            gc_seconds_per_step=gcs.mean,
            gc_fraction=fraction(gcs),
            peak_device_memory_bytes=max(memories) if memories else None,
            host_rss_peak_bytes=max(rss) if rss else None,
            flops_per_step=count,
            achieved_flops_per_second=achieved,
            peak_flops_per_second_table=table,
            peak_flops_per_second_measured=probe,
            mfu_table=achieved / table if achieved and table else None,
            mfu_measured=achieved / probe if achieved and probe else None,
            activation_bytes_estimate=flops.activation_bytes if flops is not None else None,
            no_grad_passes_per_step=passes.mean if len(passes) == len(seconds) else None,
            no_grad_fraction=fraction(no_grad),
            optimizer_seconds_median=optimizer.median if len(optimizer) == len(seconds) else None,
            optimizer_fraction=fraction(optimizer),
        )

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


# ------------------------------------------------------------------------- profile


@dataclass
class Profile:
    """Everything one run measured. ``to_dict`` gives the JSON form; ``from_dict``
    reads it back, refusing (with a one-line :class:`ProfileFormatError`) anything
    that does not match the schema."""

    status: str
    run: RunInfo
    steps: list[StepRecord] = field(default_factory=list)
    host_syncs: list[HostSyncSite] = field(default_factory=list)
    ops: list[OpStat] = field(default_factory=list)
    #: Indices of the steps the op table covers (empty without ``--ops``).
    ops_steps: list[int] = field(default_factory=list)
    shapes: ShapeReport | None = None
    error: ErrorInfo | None = None
    #: The script's exit code when it called ``sys.exit`` (status ``exited``).
    exit_code: int | None = None
    #: One human-readable sentence on how the run ended.
    detail: str = ""
    #: Things the reader of the figures should know (few steps, noisy, no steps seen...).
    warnings: list[str] = field(default_factory=list)
    #: Wall time from the start of the script to the end of the measurement.
    seconds: float | None = None
    #: Highest resident set size the process reached (getrusage).
    host_rss_peak_bytes: int | None = None
    #: What an analysis found worth changing (trace import fills it), most important first.
    findings: list[ProfileFinding] = field(default_factory=list)
    #: Where the step boundaries came from: ``optimizer`` (an optimizer's ``step()``),
    #: ``backward`` (the backward pass after an update, for loops without an optimizer)
    #: or ``marker`` (``--step-marker``); None without steps or for traces.
    step_source: str | None = None
    #: FLOPs per step and the device's peaks (null when not counted).
    flops: FlopCount | None = None
    #: This rank's part in a distributed run (null for one process).
    distributed: DistributedInfo | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ProfileFormatError(f"status: {self.status!r} is not one of {', '.join(STATUSES)}")

    @property
    def summary(self) -> Summary:
        return Summary.of(self.steps, self.host_rss_peak_bytes, self.flops)

    @property
    def measured_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.phase == "measured"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "status": self.status,
            "detail": self.detail,
            "exit_code": self.exit_code,
            "error": self.error.to_dict() if self.error else None,
            "run": self.run.to_dict(),
            "seconds": self.seconds,
            "host_rss_peak_bytes": self.host_rss_peak_bytes,
            "summary": self.summary.to_dict(),
            "warnings": list(self.warnings),
            "step_source": self.step_source,
            "findings": [f.to_dict() for f in self.findings],
            "steps": [s.to_dict() for s in self.steps],
            "host_syncs": [s.to_dict() for s in self.host_syncs],
            "ops_steps": list(self.ops_steps),
            "ops": [o.to_dict() for o in self.ops],
            "shapes": self.shapes.to_dict() if self.shapes else None,
            "flops": self.flops.to_dict() if self.flops else None,
            "distributed": self.distributed.to_dict() if self.distributed else None,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> "Profile":
        r = _Reader(data, "")
        check_schema(r.str("schema"))
        steps = r.list("steps", StepRecord.from_dict, optional=False)
        indices = [s.index for s in steps]
        if indices != sorted(set(indices)):
            raise ProfileFormatError("steps: indices must be unique and increasing")
        r.dict("summary")  # present for readers without torchaxe; recomputed from the steps
        return cls(
            status=r.str("status", choices=STATUSES),
            run=r.object("run", RunInfo.from_dict, optional=False),
            steps=steps,
            host_syncs=r.list("host_syncs", HostSyncSite.from_dict),
            ops=r.list("ops", OpStat.from_dict),
            ops_steps=r.list("ops_steps", lambda v, w: v if isinstance(v, int) and not isinstance(v, bool) else _bad(w, "a step index", v)),
            shapes=r.object("shapes", ShapeReport.from_dict),
            error=r.object("error", ErrorInfo.from_dict),
            exit_code=r.int("exit_code", optional=True, minimum=None),
            detail=r.str("detail", optional=True) or "",
            warnings=r.list("warnings", lambda v, w: v if isinstance(v, str) else _bad(w, "a string", v)),
            seconds=r.float("seconds", optional=True),
            host_rss_peak_bytes=r.int("host_rss_peak_bytes", optional=True),
            findings=r.list("findings", ProfileFinding.from_dict),
            step_source=r.str("step_source", optional=True),
            flops=r.object("flops", FlopCount.from_dict),
            distributed=r.object("distributed", DistributedInfo.from_dict),
        )


def check_schema(schema: str, name: str = SCHEMA_NAME, major: int = SCHEMA_MAJOR) -> None:
    """Accept ``name/major`` (and ``name/major.minor``); refuse anything else in one line."""
    prefix, _, version = schema.partition("/")
    if prefix != name:
        raise ProfileFormatError(f"schema: {schema!r} is not a {name} file")
    try:
        found = int(version.split(".", 1)[0])
    except ValueError:
        raise ProfileFormatError(f"schema: {schema!r} has no version number") from None
    if found != major:
        newer = "a newer" if found > major else "an older"
        raise ProfileFormatError(f"schema: {schema!r} is from {newer} torchaxe (this one reads {name}/{major})")


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; every problem is one line naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ProfileFormatError(f"{path}: is a folder, not a profile") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileFormatError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileFormatError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    try:
        return Profile.from_dict(data)
    except ProfileFormatError as exc:
        raise ProfileFormatError(f"{path}: not a valid torchaxe profile: {exc.message}") from None


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write the profile atomically (a temporary file, then a rename)."""
    from torchaxe.atomic import write_text_atomic
    from torchaxe.console import writable_path

    path = writable_path(path, "--out")
    write_text_atomic(path, profile.to_json())
    return path


def rank_path(path: str | Path, rank: int | None, world_size: int | None) -> Path:
    """The file one rank writes: ``profile.json`` becomes ``profile.rank1.json`` when
    the run has more than one process; a single process keeps the name it was given."""
    path = Path(path)
    if rank is None or not world_size or world_size <= 1:
        return path
    suffix = path.suffix or ".json"
    stem = path.name[: -len(path.suffix)] if path.suffix else path.name
    return path.with_name(f"{stem}.rank{rank}{suffix}")
