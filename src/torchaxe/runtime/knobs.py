"""Knob sets: the settings a trial runs the user's script under, read from JSON.

A knob-set file is one JSON object (docs/trial.md)::

    {"name": "two-threads",
     "env": {"OMP_NUM_THREADS": "2", "SOME_VAR": null},
     "torch": {"cudnn_benchmark": true, "matmul_precision": "high",
               "num_threads": 2, "interop_threads": 1},
     "compile": {"mode": "default", "dynamic": null, "backend": "inductor", "fullgraph": false},
     "dataloader": {"num_workers": 2, "pin_memory": true, "persistent_workers": true, "prefetch_factor": 4,
                    "multiprocessing_context": "fork", "timeout": 60},
     "cpu_affinity": [0, 1],
     "npu": {"jit_compile": false}}

Every key is optional; ``{}`` is the untouched run. Validation is strict: an unknown
key or a value of the wrong kind is refused with one line naming the file and the key.
This module imports neither torch nor anything else heavy: the bootstrap reads the file
before torch is imported, so that environment variables and CPU affinity take effect
on torch's own start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchaxe.errors import TorchaxeError

TOP_KEYS = ("name", "env", "torch", "compile", "dataloader", "cpu_affinity", "npu", "sources", "autocast", "bucketing", "tune",
            "observe", "bind")
MATMUL_PRECISIONS = ("highest", "high", "medium")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: DataLoader worker start methods (``dataloader.multiprocessing_context``).
START_METHODS = ("fork", "spawn", "forkserver")


class KnobError(TorchaxeError):
    """A knob-set file that cannot be used, in one line: ``FILE: KEY: what is wrong``."""


@dataclass(frozen=True)
class TorchKnobs:
    cudnn_benchmark: bool | None = None
    matmul_precision: str | None = None
    num_threads: int | None = None
    interop_threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class CompileKnobs:
    """``torch.compile`` of the model: the first module with parameters that the
    script calls from outside any other module (see bootstrap.py)."""

    mode: str | None = None
    dynamic: bool | None = None
    backend: str = "inductor"
    fullgraph: bool = False

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None and self.mode != "default":
            out["mode"] = self.mode
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "dynamic": self.dynamic, "backend": self.backend, "fullgraph": self.fullgraph}


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

    def overrides(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    to_dict = overrides


@dataclass(frozen=True)
class NpuKnobs:
    jit_compile: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


AUTOCAST_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class AutocastKnobs:
    """Mixed precision: the model's forward runs under ``torch.autocast`` with this dtype."""

    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype}


@dataclass(frozen=True)
class KnobSet:
    """One set of knobs. ``env`` maps a variable to its value, or to ``None`` to unset it."""

    name: str
    env: dict[str, str | None] = field(default_factory=dict)
    torch: TorchKnobs = field(default_factory=TorchKnobs)
    compile: CompileKnobs | None = None
    dataloader: DataLoaderKnobs = field(default_factory=DataLoaderKnobs)
    cpu_affinity: tuple[int, ...] | None = None
    npu: NpuKnobs = field(default_factory=NpuKnobs)
    #: Source files read in place of the user's (original path -> replacement path):
    #: how a code fix is measured before it is applied (runtime/overlay.py).
    sources: dict[str, str] = field(default_factory=dict)
    autocast: AutocastKnobs | None = None
    #: Record the training loss of every step (the scalar ``backward()`` is called
    #: on) into the profile's applied knobs: how ``advise --check-accuracy`` compares runs.
    observe_loss: bool = False
    #: Pad every DataLoader's batches to a few sizes (torchaxe.shapes.knob).
    bucketing: Any = None
    #: Apply the knowledge base's tuned winners to the model (torchaxe.tune.knob).
    tune: dict[str, Any] | None = None
    #: Bind the run as a one-rank core-binding plan says (torchaxe.bind.knob).
    bind: Any = None
    #: The file it was read from, for messages.
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the file format, with every given key; ``name`` included)."""
        out: dict[str, Any] = {"name": self.name}
        if self.env:
            out["env"] = dict(self.env)
        if self.torch.to_dict():
            out["torch"] = self.torch.to_dict()
        if self.compile is not None:
            out["compile"] = self.compile.to_dict()
        if self.dataloader.to_dict():
            out["dataloader"] = self.dataloader.to_dict()
        if self.cpu_affinity is not None:
            out["cpu_affinity"] = list(self.cpu_affinity)
        if self.npu.to_dict():
            out["npu"] = self.npu.to_dict()
        if self.sources:
            out["sources"] = dict(self.sources)
        if self.autocast is not None:
            out["autocast"] = self.autocast.to_dict()
        if self.observe_loss:
            out["observe"] = {"loss": True}
        if self.bucketing is not None:
            out["bucketing"] = self.bucketing.to_dict()
        if self.tune is not None:
            out["tune"] = dict(self.tune)
        if self.bind is not None:
            out["bind"] = self.bind.to_dict()
        return out

    @property
    def summary(self) -> str:
        """A short description of what the set changes, for tables."""
        d = self.to_dict()
        d.pop("name")
        if not d:
            return "(no knobs)"
        return json.dumps(d, separators=(",", ":"), sort_keys=True)


# ------------------------------------------------------------------ validation


class _Check:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, message: str):
        raise KnobError(f"{self.where}: {key}: {message}")

    def obj(self, value: Any, key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(key, f"expected an object, got {_kind(value)}")
        for k in value:
            if k not in allowed:
                self.fail(f"{key}.{k}" if key else k, f"unknown key (expected one of {', '.join(allowed)})")
        return value

    def bool(self, value: Any, key: str, optional: bool = True) -> bool | None:
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {_kind(value)}")
        return value

    def int(self, value: Any, key: str, minimum: int) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer, got {_kind(value)}")
        if value < minimum:
            self.fail(key, f"{value} is below the minimum {minimum}")
        return value

    def choice(self, value: Any, key: str, choices: tuple[str, ...]) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or value not in choices:
            self.fail(key, f"{json.dumps(value)} is not one of {', '.join(choices)}")
        return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {json.dumps(value)}"
    if isinstance(value, (int, float)):
        return f"number {value!r}"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, list):
        return "a list"
    return "an object"


def knob_set_from_dict(data: Any, where: str, default_name: str = "knobs") -> KnobSet:
    """Validate one knob set; ``where`` (usually the file name) starts every error."""
    c = _Check(where)
    if not isinstance(data, dict):
        raise KnobError(f"{where}: expected a JSON object of knobs, got {_kind(data)}")
    c.obj(data, "", TOP_KEYS)

    name = data.get("name", default_name)
    if not isinstance(name, str) or not name.strip():
        c.fail("name", f"expected a non-empty string, got {_kind(name)}")

    env: dict[str, str | None] = {}
    raw_env = data.get("env", {})
    if not isinstance(raw_env, dict):
        c.fail("env", f"expected an object of variable names to strings, got {_kind(raw_env)}")
    for var, value in raw_env.items():
        if not var or "=" in var or "\0" in var:
            c.fail(f"env.{var}", "not a valid environment variable name")
        if value is not None and not isinstance(value, str):
            c.fail(f"env.{var}", f"expected a string (or null to unset it), got {_kind(value)}")
        env[var] = value

    t = c.obj(data.get("torch", {}), "torch", ("cudnn_benchmark", "matmul_precision", "num_threads", "interop_threads"))
    torch_knobs = TorchKnobs(
        cudnn_benchmark=c.bool(t.get("cudnn_benchmark"), "torch.cudnn_benchmark"),
        matmul_precision=c.choice(t.get("matmul_precision"), "torch.matmul_precision", MATMUL_PRECISIONS),
        num_threads=c.int(t.get("num_threads"), "torch.num_threads", 1),
        interop_threads=c.int(t.get("interop_threads"), "torch.interop_threads", 1),
    )

    compile_knobs = None
    if "compile" in data and data["compile"] is not None:
        raw = data["compile"]
        if raw is True:
            raw = {}
        m = c.obj(raw, "compile", ("mode", "dynamic", "backend", "fullgraph"))
        backend = m.get("backend", "inductor")
        if not isinstance(backend, str) or not backend:
            c.fail("compile.backend", f"expected a backend name such as \"inductor\" or \"eager\", got {_kind(backend)}")
        compile_knobs = CompileKnobs(
            mode=c.choice(m.get("mode"), "compile.mode", COMPILE_MODES),
            dynamic=c.bool(m.get("dynamic"), "compile.dynamic"),
            backend=backend,
            fullgraph=bool(c.bool(m.get("fullgraph"), "compile.fullgraph")),
        )

    dl = c.obj(data.get("dataloader", {}), "dataloader",
               ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "multiprocessing_context",
                "timeout"))
    loader_timeout = dl.get("timeout")
    if loader_timeout is not None and (isinstance(loader_timeout, bool) or not isinstance(loader_timeout, (int, float))
                                       or not loader_timeout > 0 or loader_timeout == float("inf")):
        c.fail("dataloader.timeout", f"expected a positive number of seconds, got {_kind(loader_timeout)}")
    loader = DataLoaderKnobs(
        num_workers=c.int(dl.get("num_workers"), "dataloader.num_workers", 0),
        pin_memory=c.bool(dl.get("pin_memory"), "dataloader.pin_memory"),
        persistent_workers=c.bool(dl.get("persistent_workers"), "dataloader.persistent_workers"),
        prefetch_factor=c.int(dl.get("prefetch_factor"), "dataloader.prefetch_factor", 1),
        multiprocessing_context=c.choice(dl.get("multiprocessing_context"), "dataloader.multiprocessing_context",
                                         START_METHODS),
        timeout=float(loader_timeout) if loader_timeout is not None else None,
    )

    affinity = None
    raw_aff = data.get("cpu_affinity")
    if raw_aff is not None:
        if not isinstance(raw_aff, list) or not raw_aff:
            c.fail("cpu_affinity", f"expected a non-empty list of CPU numbers, got {_kind(raw_aff)}")
        for i, cpu in enumerate(raw_aff):
            c.int(cpu, f"cpu_affinity[{i}]", 0)
        affinity = tuple(sorted(set(raw_aff)))

    n = c.obj(data.get("npu", {}), "npu", ("jit_compile",))
    npu = NpuKnobs(jit_compile=c.bool(n.get("jit_compile"), "npu.jit_compile"))

    raw_sources = data.get("sources", {})
    if not isinstance(raw_sources, dict):
        c.fail("sources", f"expected an object of original path to replacement path, got {_kind(raw_sources)}")
    sources: dict[str, str] = {}
    for original, replacement in raw_sources.items():
        if not original or not isinstance(replacement, str) or not replacement:
            c.fail(f"sources.{original}", f"expected a replacement file path, got {_kind(replacement)}")
        sources[original] = replacement

    observe = c.obj(data.get("observe", {}), "observe", ("loss",))
    c.bool(observe.get("loss"), "observe.loss")

    autocast = None
    if data.get("autocast") is not None:
        a = c.obj(data["autocast"], "autocast", ("dtype",))
        dtype = c.choice(a.get("dtype", "bfloat16"), "autocast.dtype", AUTOCAST_DTYPES)
        autocast = AutocastKnobs(dtype=dtype or "bfloat16")

    bucketing = None
    if data.get("bucketing") is not None:
        from torchaxe.shapes.knob import bucketing_from_dict

        bucketing = bucketing_from_dict(data["bucketing"], c.fail)

    tune = None
    if data.get("tune") is not None:
        from torchaxe.tune.knob import parse_tune_knob

        tune = parse_tune_knob(data["tune"], where)

    bind = None
    if data.get("bind") is not None:
        from torchaxe.bind.knob import bind_from_dict

        bind = bind_from_dict(data["bind"], c.fail)
        if affinity is not None:
            c.fail("bind", "cpu_affinity pins the process too: give one of them")

    return KnobSet(name=name.strip(), env=env, torch=torch_knobs, compile=compile_knobs, dataloader=loader,
                   cpu_affinity=affinity, npu=npu, sources=sources, autocast=autocast,
                   observe_loss=bool(observe.get("loss")), bucketing=bucketing, source=where, tune=tune,
                   bind=bind)


def load_knob_set(path: str | Path) -> KnobSet:
    """Read and validate one knob-set file (its name defaults to the file's stem)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KnobError(f"{path}: knob file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KnobError(f"{path}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KnobError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    return knob_set_from_dict(data, str(path), default_name=p.stem)
