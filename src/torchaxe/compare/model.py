"""Two runs side by side: where the step time went in each, and what changed.

A run is a Profile JSON file (``torchaxe profile``), a torch.profiler Chrome trace or
a torch_npu profiler folder, in any mix: traces are read into a Profile first
(``runtime/traces``). The comparison aligns the two

* by step: median step time, model FLOPs utilisation where the profile counted FLOPs;
* by phase, per step: data wait, backward, the rest of the step (forward, loss,
  optimizer, host work), optimizer and communication where the op table shows them,
  garbage collection, host syncs, compile and dynamic-shape findings;
* by operator: the time per step of every aten operator (host self time, or device
  time where the live run recorded it) and its calls per step, largest change first,
  with the input shapes where recorded and the user's line that led to the calls;
  what appears in one run only is listed apart (a fused kernel on one side, a CPU
  fallback or an extra cast on the other). Device kernels, whose names differ from
  one device to another, are not aligned by name: where a trace links each kernel to
  the operator that launched it (torch_npu's launch flows, see ``runtime/traces``),
  the kernels are listed under that operator's row and their device time is the
  operator's time; kernels linked to no operator are listed per run, apart.

The result is plain data with a stable JSON form (schema ``torchaxe.compare/1``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.profile import OpKernel, OpStat, Profile

SCHEMA = "torchaxe.compare/1"

#: Operators (and kernels) whose time is communication between processes.
COMMUNICATION = re.compile(r"c10d|nccl|hccl|gloo|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all"
                           r"|send|recv|barrier", re.IGNORECASE)
#: ``record_function`` ranges of an optimizer step (``Optimizer.step#AdamW.step``).
OPTIMIZER = re.compile(r"^Optimizer\.step#")
#: Operators listed in the table (the rest are summed as "other").
MAX_OPERATORS = 60
#: Kernels listed per run.
MAX_KERNELS = 10
#: Phases, in the order they are shown, with what each covers.
PHASES = (
    ("step", "step time (median)"),
    ("data_wait", "data wait"),
    ("backward", "backward"),
    ("outside_backward", "forward, loss, optimizer and host work"),
    ("optimizer", "optimizer step (op window)"),
    ("communication", "communication (op window)"),
    ("gc", "garbage collection"),
)


@dataclass
class RunSide:
    """One of the two runs, summarised."""

    label: str
    path: str
    source: str
    target: str
    steps_measured: int
    step_seconds_median: float | None
    mfu_table: float | None
    mfu_measured: float | None
    flops_per_step: int | None
    #: Which time the operator figures are: "device" or "host".
    operator_time: str
    phases: dict[str, float | None]
    host_syncs_per_step: float | None
    dynamic_modules: list[str]
    findings: list[dict[str, Any]]
    warnings: list[str]
    #: Device kernels (traces), most time first: ``{name, seconds_per_step, calls_per_step}``.
    kernels: list[dict[str, Any]] = field(default_factory=list)
    #: The kernels' launches (and time) that the trace links to no operator, same form;
    #: all of ``kernels`` when the trace links none.
    unlinked_kernels: list[dict[str, Any]] = field(default_factory=list)
    #: Whether operator rows carry the device time of the kernels the trace links to them.
    kernels_linked: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass
class OperatorRow:
    name: str
    kind: str
    a_seconds_per_step: float | None
    b_seconds_per_step: float | None
    a_calls_per_step: float | None
    b_calls_per_step: float | None
    a_shapes: list[str] = field(default_factory=list)
    b_shapes: list[str] = field(default_factory=list)
    a_source: str | None = None
    b_source: str | None = None
    #: The kernels the trace links to this operator, most time first:
    #: ``{name, seconds_per_step, calls_per_step}``.
    a_kernels: list[dict[str, Any]] = field(default_factory=list)
    b_kernels: list[dict[str, Any]] = field(default_factory=list)

    @property
    def change(self) -> float:
        return (self.b_seconds_per_step or 0.0) - (self.a_seconds_per_step or 0.0)

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["change_seconds_per_step"] = self.change
        return data


@dataclass
class Comparison:
    a: RunSide
    b: RunSide
    operators: list[OperatorRow]
    only_in_a: list[OperatorRow]
    only_in_b: list[OperatorRow]
    notes: list[str]

    @property
    def step_ratio(self) -> float | None:
        """B's median step time over A's."""
        a, b = self.a.step_seconds_median, self.b.step_seconds_median
        return b / a if a and b else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "step_ratio": self.step_ratio,
            "phases": [{"name": key, "title": title, "a_seconds_per_step": self.a.phases.get(key),
                        "b_seconds_per_step": self.b.phases.get(key)} for key, title in PHASES],
            "operators": [row.to_dict() for row in self.operators],
            "only_in_a": [row.to_dict() for row in self.only_in_a],
            "only_in_b": [row.to_dict() for row in self.only_in_b],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"


# ----------------------------------------------------------------------- loading


def load_run(path: str | Path) -> Profile:
    """A Profile from a torchaxe profile file, a torch.profiler trace or a torch_npu
    profiler folder; one clear line when it is none of them."""
    from torchaxe.runtime.profile import load_profile
    from torchaxe.runtime.traces import load_trace

    path = Path(path)
    if not path.exists():
        raise TorchaxeError(f"{path}: no such file or folder")
    if path.is_file() and path.suffix == ".json" and _is_profile(path):
        return load_profile(path)
    return load_trace(path)


def _is_profile(path: Path) -> bool:
    """Whether a JSON file is a torchaxe profile (read only its start: traces are large)."""
    try:
        with path.open("r", encoding="utf-8", errors="replace") as handle:
            head = handle.read(4096)
    except OSError as exc:
        raise TorchaxeError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return bool(re.search(r'"schema"\s*:\s*"torchaxe\.profile/', head))


# ---------------------------------------------------------------------- building


def _ops_steps(profile: Profile) -> int:
    """How many steps the op table covers (1 when the trace had no step marks)."""
    return max(1, len(profile.ops_steps))


def _op_seconds(op: OpStat, device: bool) -> float:
    if device:
        return op.device_self_seconds or 0.0
    return op.self_seconds if op.kind != "range" else op.total_seconds


def _uses_device_time(profile: Profile) -> bool:
    """Whether the operator rows carry device time (a live cuda run with --ops)."""
    return any(op.kind == "op" and op.device_self_seconds for op in profile.ops)


def _side(profile: Profile, label: str, path: str) -> RunSide:
    s = profile.summary
    per = _ops_steps(profile)
    device = _uses_device_time(profile)
    ops = [op for op in profile.ops if op.kind == "op"]
    kernels = [op for op in profile.ops if op.kind == "kernel"]
    ranges = [op for op in profile.ops if op.kind == "range"]
    has_ops = bool(profile.ops)
    communication = None
    if has_ops:
        # Device time of communication kernels where the run has them, else the operators'.
        rows = ([k.device_self_seconds or 0.0 for k in kernels if COMMUNICATION.search(k.name)] if kernels else
                [_op_seconds(op, device) for op in ops if COMMUNICATION.search(op.name)])
        communication = sum(rows) if rows else None
    optimizer = sum(op.total_seconds for op in ranges if OPTIMIZER.match(op.name)) if ranges else None
    phases: dict[str, float | None] = {
        "step": s.step_seconds_median,
        "data_wait": s.data_wait_seconds_median,
        "backward": s.backward_seconds_median,
        "outside_backward": s.outside_backward_seconds_median,
        "optimizer": optimizer / per if optimizer is not None else None,
        "communication": communication / per if communication is not None else None,
        "gc": s.gc_seconds_per_step,
    }
    linked = [k for op in ops for k in op.kernels]
    dynamic = list(profile.shapes.dynamic_modules) if profile.shapes is not None else []
    findings = [{"kind": f.kind, "message": f.message, "count": f.count} for f in profile.findings
                if f.kind in ("dynamic-shape", "online-compile", "host-sync", "unfused-optimizer")]
    return RunSide(
        label=label, path=path, source=profile.run.source, target=profile.run.target,
        steps_measured=s.steps_measured, step_seconds_median=s.step_seconds_median,
        mfu_table=s.mfu_table, mfu_measured=s.mfu_measured, flops_per_step=s.flops_per_step,
        operator_time="device" if device else "host", phases=phases,
        host_syncs_per_step=s.host_syncs_per_step, dynamic_modules=dynamic, findings=findings,
        warnings=list(profile.warnings),
        kernels=[{"name": k.name, "seconds_per_step": (k.device_self_seconds or 0.0) / per,
                  "calls_per_step": k.calls / per} for k in kernels[:MAX_KERNELS]],
        unlinked_kernels=_unlinked(kernels, linked, per), kernels_linked=bool(linked),
    )


def _unlinked(kernels: list[OpStat], linked: list[OpKernel], per: int) -> list[dict[str, Any]]:
    """Each kernel's launches and time less those linked to an operator, most time first."""
    calls: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for k in linked:
        calls[k.name] = calls.get(k.name, 0) + k.calls
        seconds[k.name] = seconds.get(k.name, 0.0) + k.device_seconds
    rows = []
    for k in kernels:
        left = (k.device_self_seconds or 0.0) - seconds.get(k.name, 0.0)
        n = k.calls - calls.get(k.name, 0)
        # Rounding of summed times, or a kernel table read from another file than the timeline.
        if n > 0 and left > 1e-12:
            rows.append({"name": k.name, "seconds_per_step": left / per, "calls_per_step": n / per})
    rows.sort(key=lambda r: (-r["seconds_per_step"], r["name"]))
    return rows[:MAX_KERNELS]


def _kernels(op: OpStat, per: int) -> list[dict[str, Any]]:
    return [{"name": k.name, "seconds_per_step": k.device_seconds / per, "calls_per_step": k.calls / per}
            for k in op.kernels[:MAX_KERNELS]]


def _shapes(op: OpStat, limit: int = 3) -> list[str]:
    out = []
    for group in op.input_shapes[:limit]:
        dims = ", ".join("[" + ", ".join(str(d) for d in shape) + "]" if shape is not None else "-"
                         for shape in group.input_shapes)
        out.append(f"({dims}) x{group.calls}")
    return out


def _source(op: OpStat) -> str | None:
    if not op.sources:
        return None
    first = op.sources[0]
    return f"{first.function} ({first.location})" if first.function else first.location


def _table(profile: Profile) -> dict[str, OpStat]:
    """The operator rows by name: aten operators, the names every run shares (device
    kernels differ from device to device and are listed apart)."""
    table: dict[str, OpStat] = {}
    for op in profile.ops:
        if op.kind == "op":
            table.setdefault(op.name, op)
    return table


def compare_profiles(a: Profile, b: Profile, a_label: str = "A", b_label: str = "B",
                     a_path: str = "", b_path: str = "") -> Comparison:
    side_a, side_b = _side(a, a_label, a_path), _side(b, b_label, b_path)
    table_a, table_b = _table(a), _table(b)
    per_a, per_b = _ops_steps(a), _ops_steps(b)
    device_a, device_b = side_a.operator_time == "device", side_b.operator_time == "device"
    rows = []
    for name in sorted(set(table_a) | set(table_b)):
        op_a, op_b = table_a.get(name), table_b.get(name)
        rows.append(OperatorRow(
            name=name, kind=(op_a or op_b).kind,
            a_seconds_per_step=_op_seconds(op_a, device_a) / per_a if op_a else None,
            b_seconds_per_step=_op_seconds(op_b, device_b) / per_b if op_b else None,
            a_calls_per_step=op_a.calls / per_a if op_a else None,
            b_calls_per_step=op_b.calls / per_b if op_b else None,
            a_shapes=_shapes(op_a) if op_a else [], b_shapes=_shapes(op_b) if op_b else [],
            a_source=_source(op_a) if op_a else None, b_source=_source(op_b) if op_b else None,
            a_kernels=_kernels(op_a, per_a) if op_a else [], b_kernels=_kernels(op_b, per_b) if op_b else [],
        ))
    only_a = [r for r in rows if r.b_seconds_per_step is None]
    only_b = [r for r in rows if r.a_seconds_per_step is None]
    only_a.sort(key=lambda r: -(r.a_seconds_per_step or 0.0))
    only_b.sort(key=lambda r: -(r.b_seconds_per_step or 0.0))
    rows.sort(key=lambda r: (-abs(r.change), r.name))
    notes = []
    if not a.ops or not b.ops:
        missing = " and ".join(label for label, p in ((a_label, a), (b_label, b)) if not p.ops)
        notes.append(f"{missing} has no operator table: profile with --ops (or give a torch.profiler trace) to "
                     "compare operators")
    if side_a.operator_time != side_b.operator_time and a.ops and b.ops:
        notes.append(f"operator times are {side_a.operator_time} time in {a_label} and {side_b.operator_time} time "
                     f"in {b_label}: compare their order more than their size")
    if a.run.target != b.run.target:
        notes.append(f"{a_label} ran on {a.run.target}, {b_label} on {b.run.target}: operator names that differ "
                     "only because each device has its own kernels show up as 'only in' one run")
    for side in (side_a, side_b):
        if side.kernels_linked:
            unverified = ". NPU paths are unverified on Ascend hardware" if side.target == "npu" else ""
            notes.append(f"{side.label}'s operator times are the device time of the kernels its trace links to "
                         f"each operator (the innermost aten operator around each launch); kernels linked to none "
                         f"are listed apart{unverified}")
    for label, p in ((a_label, a), (b_label, b)):
        if p.summary.steps_measured == 0:
            notes.append(f"{label} has no measured steps: its per-step figures are over the whole run or missing")
    return Comparison(a=side_a, b=side_b, operators=rows[:MAX_OPERATORS], only_in_a=only_a, only_in_b=only_b,
                      notes=notes)


def compare_paths(path_a: str | Path, path_b: str | Path) -> Comparison:
    a, b = load_run(path_a), load_run(path_b)
    return compare_profiles(a, b, "A", "B", str(path_a), str(path_b))
