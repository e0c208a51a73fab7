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

Every key but ``name`` belongs to one knob, a plugin (:class:`KnobSpec`) registered by
import string in :data:`KNOB_SPECS`: it parses its own value, writes it back, and
installs and uninstalls its own patch in the trial bootstrap. Adding a knob is one
spec in its axis package and one line here; nothing else changes. Every key is
optional; ``{}`` is the untouched run. Validation is strict: an unknown key or a value
of the wrong kind is refused with one line naming the file and the key.

This module imports neither torch nor any knob's axis package at import: the bootstrap
reads the file before torch is imported, so that environment variables and CPU
affinity take effect on torch's own start-up. Specs are imported on first use, and
their modules import nothing heavy either.
"""

from __future__ import annotations

import importlib
import json
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from torchaxe.errors import TorchaxeError

#: The knobs, in the order the bootstrap applies them (and the order of a knob set's
#: JSON form). The ones that must act before torch is imported come first. The three
#: model patches (autocast, compile, tune) each find the model at its first call; the
#: one applied last sees it first.
KNOB_SPECS: tuple[str, ...] = (
    "torchaxe.runtime.knob_specs:ENV",
    "torchaxe.runtime.knob_specs:CPU_AFFINITY",
    "torchaxe.bind.knob:SPEC",
    "torchaxe.runtime.knob_specs:NPU",
    "torchaxe.runtime.knob_specs:TORCH",
    "torchaxe.data.knob:SPEC",
    "torchaxe.distributed.knob:SPEC",
    "torchaxe.runtime.knob_specs:OBSERVE",
    "torchaxe.runtime.knob_specs:SEED",
    "torchaxe.shapes.knob:SPEC",
    "torchaxe.memory.knob:SPEC",
    "torchaxe.kernels.knob:SPEC",
    "torchaxe.tune.replace:SPEC",
    "torchaxe.runtime.knob_specs:AUTOCAST",
    "torchaxe.runtime.knob_specs:COMPILE",
    "torchaxe.tune.knob:SPEC",
    "torchaxe.runtime.knob_specs:SOURCES",
)


class KnobError(TorchaxeError):
    """A knob-set file that cannot be used, in one line: ``FILE: KEY: what is wrong``."""


class AppliedKnobs:
    """What the bootstrap actually did, for the profile (tests and users check it)."""

    def __init__(self, knobs: "KnobSet") -> None:
        self._record: dict[str, Any] = {"name": knobs.name, "requested": knobs.to_dict()}
        self._later: dict[str, Callable[[], Any]] = {}

    def note(self, key: str, value: Any) -> None:
        self._record[key] = value

    def note_later(self, key: str, read: Callable[[], Any]) -> None:
        """``key`` is noted as ``read()`` when the record is taken, once the run has
        stopped: for a value whose reading would stall the device while it runs."""
        self._later[key] = read

    @property
    def record(self) -> dict[str, Any]:
        for key, read in self._later.items():
            self._record[key] = read()
        return self._record


class KnobSpec(Protocol):
    """One knob: a top-level key of a knob set and everything torchaxe does with it."""

    #: The key in the knob-set JSON.
    key: str
    #: The :class:`KnobSet` attribute that holds the parsed value (usually ``key``).
    attribute: str
    #: Applied before torch is imported (environment variables, CPU affinity).
    before_torch: bool
    #: Other keys this knob cannot be given with, each with the one-line reason.
    conflicts: Mapping[str, str]
    #: A value as a knob-set file gives it, written back unchanged (the tests read it).
    example: Any

    def default(self) -> Any:
        """The value of a knob set that does not give the key (the untouched run)."""

    def parse(self, raw: Any, check: "KnobCheck") -> Any:
        """The validated, immutable value of ``raw``; errors through ``check.fail``."""

    def to_json(self, value: Any) -> Any:
        """The JSON form of ``value``, as the file gives it; ``None`` or empty to leave it out."""

    def patch(self, value: Any, applied: AppliedKnobs) -> AbstractContextManager[Any]:
        """Apply ``value`` on enter (noting what was done in ``applied``), undo it on exit."""


class Knob:
    """Defaults for a :class:`KnobSpec`: a knob with no conflicts, applied after torch
    is imported, whose default is ``None`` and whose value writes itself back with
    ``to_dict()``."""

    key: str = ""
    attribute: str = ""
    before_torch: bool = False
    conflicts: Mapping[str, str] = {}
    example: Any = None

    def __init__(self) -> None:
        if not self.attribute:
            self.attribute = self.key

    def default(self) -> Any:
        return None

    def to_json(self, value: Any) -> Any:
        return None if value is None else value.to_dict()

    def __repr__(self) -> str:
        return f"<knob {self.key}>"


def _load(reference: str) -> KnobSpec:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


_SPECS: list[KnobSpec] = []
_BY_ATTRIBUTE: dict[str, KnobSpec] = {}


def knob_specs() -> Sequence[KnobSpec]:
    """Every registered knob, in application order (imported on first use)."""
    if not _SPECS:
        _SPECS.extend(_load(reference) for reference in KNOB_SPECS)
    return _SPECS


def _by_attribute() -> dict[str, KnobSpec]:
    if not _BY_ATTRIBUTE:
        _BY_ATTRIBUTE.update((spec.attribute, spec) for spec in knob_specs())
    return _BY_ATTRIBUTE


def top_keys() -> tuple[str, ...]:
    """The keys a knob-set object may have."""
    return ("name",) + tuple(spec.key for spec in knob_specs())


@dataclass(frozen=True, init=False)
class KnobSet:
    """One set of knobs: a name and, for each knob the set gives, its parsed value.

    Each knob's value is read as an attribute named after it (``knobs.env``,
    ``knobs.compile``, ``knobs.observe_loss``); a knob the set does not give reads as
    its spec's default. ``KnobSet(name="x", env={...})`` builds one from parsed values,
    and ``dataclasses.replace(knobs, name="y")`` renames one.
    """

    name: str
    #: attribute -> parsed value, for the knobs this set gives.
    values: Mapping[str, Any]
    #: The file it was read from, for messages.
    source: str | None

    def __init__(self, name: str, values: Mapping[str, Any] | None = None, source: str | None = None,
                 **knobs: Any) -> None:
        merged = {**(values or {}), **knobs}
        specs = _by_attribute()
        for attribute in merged:
            if attribute not in specs:
                raise TypeError(f"KnobSet: no knob holds {attribute!r} (knobs: {', '.join(specs)})")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "values", merged)
        object.__setattr__(self, "source", source)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") or attribute in ("name", "values", "source"):
            raise AttributeError(attribute)
        spec = _by_attribute().get(attribute)
        if spec is None:
            raise AttributeError(f"KnobSet has no knob {attribute!r}")
        return self.values[attribute] if attribute in self.values else spec.default()

    def active(self, *, before_torch: bool) -> list[tuple[KnobSpec, Any]]:
        """The knobs this set gives whose patch runs in the given phase, in order."""
        return [(spec, self.values[spec.attribute]) for spec in knob_specs()
                if spec.attribute in self.values and spec.before_torch == before_torch]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the file format, with every given key; ``name`` included)."""
        out: dict[str, Any] = {"name": self.name}
        for spec in knob_specs():
            if spec.attribute in self.values:
                value = spec.to_json(self.values[spec.attribute])
                if value is not None and value != {} and value != []:
                    out[spec.key] = value
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


class KnobCheck:
    """The one error convention of knob parsing: ``fail(key, message)`` raises a
    :class:`KnobError` that starts with where the knobs came from and the key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, message: str):
        raise KnobError(f"{self.where}: {key}: {message}")

    def obj(self, value: Any, key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(key, f"expected an object, got {kind(value)}")
        for k in value:
            if k not in allowed:
                self.fail(f"{key}.{k}" if key else k, f"unknown key (expected one of {', '.join(allowed)})")
        return value

    def bool(self, value: Any, key: str, optional: bool = True) -> bool | None:
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {kind(value)}")
        return value

    def int(self, value: Any, key: str, minimum: int) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer, got {kind(value)}")
        if value < minimum:
            self.fail(key, f"{value} is below the minimum {minimum}")
        return value

    def choice(self, value: Any, key: str, choices: tuple[str, ...]) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or value not in choices:
            self.fail(key, f"{json.dumps(value)} is not one of {', '.join(choices)}")
        return value


def kind(value: Any) -> str:
    """How a JSON value reads in an error message ("string \\"2\\"", "a list")."""
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


def pays_once(values: Mapping[str, Any]) -> bool:
    """Whether knobs do work once before their first fast step (compiling, tuning,
    the NPU's operator compilation, cudnn's search for kernels), so that a first run
    is longer than the next: ``values`` a knob file's mapping or a
    :class:`KnobSet`'s parsed ``values``. A thread count or a loader setting has none."""
    def setting(key: str, name: str) -> Any:
        value = values.get(key)
        return value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)

    return any(values.get(key) is not None for key in ("compile", "tune")) \
        or bool(setting("npu", "jit_compile")) or bool(setting("torch", "cudnn_benchmark"))


def knob_set_from_dict(data: Any, where: str, default_name: str = "knobs") -> KnobSet:
    """Validate one knob set; ``where`` (usually the file name) starts every error."""
    c = KnobCheck(where)
    if not isinstance(data, dict):
        raise KnobError(f"{where}: expected a JSON object of knobs, got {kind(data)}")
    c.obj(data, "", top_keys())

    name = data.get("name", default_name)
    if not isinstance(name, str) or not name.strip():
        c.fail("name", f"expected a non-empty string, got {kind(name)}")

    values: dict[str, Any] = {}
    for spec in knob_specs():
        if spec.key in data:
            values[spec.attribute] = spec.parse(data[spec.key], c)
    for spec in knob_specs():
        for other, reason in spec.conflicts.items():
            if data.get(spec.key) is not None and data.get(other) is not None:
                c.fail(spec.key, reason)
    return KnobSet(name.strip(), values, where)


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


@contextmanager
def installed(patch: Any) -> Iterator[Any]:
    """Calls ``patch.install()`` on enter and ``patch.uninstall()`` on exit."""
    patch.install()
    try:
        yield patch
    finally:
        patch.uninstall()
