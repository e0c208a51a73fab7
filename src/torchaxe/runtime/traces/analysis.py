"""Turn a trace (timeline and tables) into a Profile: steps, op and kernel tables, and
findings — host syncs, host-to-device copies, dynamic-shape operators, an optimizer
stepped op by op, operators compiled during the run.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from torchaxe.runtime.profile import OpKernel, OpShapeGroup, OpStat, Profile, ProfileFinding, RunInfo, StepRecord
from torchaxe.runtime.traces.ascend import KernelRow, OpTypeRow
from torchaxe.runtime.traces.events import Event, Timeline
from torchaxe.units import duration

MAX_OPS = 100
MAX_KERNELS = 50
MAX_SHAPE_GROUPS = 10

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_OPTIMIZER_STEP = re.compile(r"^Optimizer\.step#([A-Za-z0-9_]+)\.step$")

#: Operators that read a device value back to the host (the outermost one counts).
SYNC_OPS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                      "aten::unique", "aten::_unique2", "aten::equal", "aten::is_nonzero"})
#: Runtime calls that block the host until the device is done.
RUNTIME_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                 "aclrtSynchronizeStream", "aclrtSynchronizeDevice", "aclrtSynchronizeEvent",
                 "aclrtSynchronizeStreamWithTimeout")
#: Runtime copy calls (their direction is not recorded in the trace).
RUNTIME_COPIES = ("aclrtMemcpy", "aclrtMemcpyAsync", "cudaMemcpy", "cudaMemcpyAsync")
COPY_OPS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_"})
#: The elementwise operators an unfused Adam-like optimizer runs per parameter.
ELEMENTWISE = frozenset({"aten::add_", "aten::add", "aten::mul_", "aten::mul", "aten::addcmul_", "aten::addcdiv_",
                         "aten::sqrt", "aten::sqrt_", "aten::div", "aten::div_", "aten::lerp_", "aten::sub_",
                         "aten::maximum", "aten::neg", "aten::clone"})
#: Views and bookkeeping: their shapes follow the compute operators', not worth a line.
VIEW_OPS = frozenset({"aten::as_strided", "aten::resolve_conj", "aten::resolve_neg", "aten::t", "aten::transpose",
                      "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::expand", "aten::permute",
                      "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::detach_", "detach", "detach_",
                      "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::result_type", "aten::slice",
                      "aten::select", "aten::alias", "aten::contiguous"})
#: What replaces each optimizer, fused: (Ascend, elsewhere).
FUSED = {
    "Adam": ("torch_npu.optim.NpuFusedAdam", "torch.optim.Adam(..., fused=True)"),
    "AdamW": ("torch_npu.optim.NpuFusedAdamW", "torch.optim.AdamW(..., fused=True)"),
    "SGD": ("torch_npu.optim.NpuFusedSGD", "torch.optim.SGD(..., fused=True)"),
    "RMSprop": ("torch_npu.optim.NpuFusedRMSprop", "torch.optim.RMSprop(..., foreach=True)"),
    "Adadelta": ("torch_npu.optim.NpuFusedAdadelta", "torch.optim.Adadelta(..., foreach=True)"),
}
NPU_UNVERIFIED = ("NPU analysis was developed on sample torch_npu.profiler output and has not been verified on "
                  "Ascend hardware")


def _runtime_name(name: str) -> str:
    """``AscendCL@aclrtMemcpy`` -> ``aclrtMemcpy``."""
    return name.rsplit("@", 1)[-1]


def _is_range(event: Event) -> bool:
    return event.cat == "user_annotation" or bool(_STEP.match(event.name)) or event.name.startswith(
        ("Optimizer.step#", "Optimizer.zero_grad#"))


def _is_host_op(event: Event) -> bool:
    """Rows of the op table: operators and ranges, not runtime calls or task-queue rows."""
    if "@" in event.name or event.cat in ("enqueue", "dequeue", "python_function", "cuda_runtime", "cuda_driver",
                                          "Trace", "overhead", "gpu_user_annotation"):
        return False
    return event.cat in ("cpu_op", "user_annotation", "") and event.name not in ("Enqueue", "Dequeue")


def _kernel_name(event: Event) -> str:
    return event.name


@dataclass
class TraceData:
    """What a reader found, before analysis."""

    source: str
    path: Path
    files: list[Path]
    timeline: Timeline | None = None
    kernels: list[KernelRow] = field(default_factory=list)
    op_types: list[OpTypeRow] = field(default_factory=list)


def build_profile(data: TraceData) -> Profile:
    timeline = data.timeline
    ascend = data.source == "ascend-trace"
    warnings: list[str] = []
    findings: list[ProfileFinding] = []
    steps: list[StepRecord] = []
    ops: list[OpStat] = []
    kernels: list[OpStat] = []
    step_events: list[Event] = []
    seconds = None
    if timeline is not None:
        step_events = sorted((e for e in timeline.host if _STEP.match(e.name)), key=lambda e: e.start)
        steps = _steps(timeline, step_events)
        if not steps:
            warnings.append("no ProfilerStep#N annotations in the trace (the profiler was not stepped with "
                            "prof.step()): no steps, and the op table covers the whole trace")
        ops = _op_table(timeline.host, timeline.device)
        if not data.kernels and timeline.device:
            kernels = _kernels_from_events(timeline.device)
        first = min((e.start for e in timeline.host + timeline.device), default=0.0)
        last = max((e.end for e in timeline.host + timeline.device), default=0.0)
        seconds = (last - first) / 1e6
        findings += _sync_findings(timeline, len(steps), ascend)
        findings += _copy_findings(timeline, len(steps), ascend)
        findings += _optimizer_findings(timeline, ascend)
        findings += _dynamic_from_steps(timeline, step_events)
        findings += _compile_findings(timeline)
        launches = timeline.flows.get("HostToDevice", 0)
        if launches:
            findings.append(ProfileFinding(
                kind="launches", count=launches,
                message=f"{launches} HostToDevice flows: in torch_npu's timeline these link each host launch to "
                        f"its device task (one per task), they are not data copies"))
    if data.kernels:
        kernels = _kernels_from_rows(data.kernels)
        findings += _dynamic_from_kernels(data.kernels)
    elif data.op_types and not kernels:
        kernels = [OpStat(name=r.type, kind="kernel", calls=r.count, self_seconds=0.0, total_seconds=0.0,
                          device_self_seconds=r.total_us / 1e6) for r in data.op_types]
        kernels.sort(key=lambda k: (-(k.device_self_seconds or 0.0), k.name))
    if timeline is None:
        warnings.append("no timeline (trace_view.json) read: no steps, host operators, host syncs or copies")
    if ascend:
        warnings.append(NPU_UNVERIFIED)
    target = "npu" if ascend else ("cuda" if kernels or (timeline and timeline.device) else "cpu")
    run = RunInfo(command=[], target=target, source=data.source,
                  options={"trace": str(data.path), "files": [str(f) for f in data.files]})
    detail = (f"imported from {'torch_npu' if ascend else 'torch'}.profiler output {data.path}: "
              f"{len(steps)} step{'s' if len(steps) != 1 else ''}")
    if timeline is not None and any(op.kernels for op in ops):
        kernels = _kept_kernels(kernels, timeline.device)
    else:
        kernels = kernels[:MAX_KERNELS]
    return Profile(status="completed", run=run, steps=steps, ops=(ops[:MAX_OPS] + kernels),
                   ops_steps=[s.index for s in steps], detail=detail, warnings=warnings, findings=findings,
                   seconds=seconds)


# ----------------------------------------------------------------------------- steps


def _outermost(events: Iterable[Event], names: frozenset[str]) -> list[Event]:
    return [e for e in events if e.name in names and not any(a.name in names for a in e.ancestors())]


def _within(event: Event, span: Event) -> bool:
    return span.start <= event.start <= span.end


def _steps(timeline: Timeline, step_events: list[Event]) -> list[StepRecord]:
    syncs = _outermost(timeline.host, SYNC_OPS)
    first = timeline.start
    steps = []
    seen = set()
    for event in step_events:
        # ProfilerStep#N counts prof.step() calls from 0; profile steps count from 1.
        index = int(_STEP.match(event.name).group(1)) + 1
        if index in seen:
            continue
        seen.add(index)
        steps.append(StepRecord(
            index=index, seconds=event.dur / 1e6, phase="measured", data_wait_seconds=None, batches=None,
            host_syncs=sum(1 for s in syncs if _within(s, event)), gc_seconds=None, gc_collections=None,
            start_seconds=(event.start - first) / 1e6))
    steps.sort(key=lambda s: s.index)
    return steps


# ------------------------------------------------------------------------------ ops


def launching_op(event: Event) -> Event | None:
    """The operator that launched a device event, where a flow links the two: the
    innermost namespaced operator (``aten::addmm``, ``npu::...``) holding the launch on
    its thread. Innermost, not outermost, because operator rows carry self time: the
    host-only run's ``aten::addmm`` is where the matrix product's time sits, not
    ``aten::linear`` around it."""
    node = event.launched_by
    while node is not None:
        if "::" in node.name and _is_host_op(node) and not _is_range(node):
            return node
        node = node.parent
    return None


def _launched(device: list[Event]) -> dict[str, dict[str, list]]:
    """Per operator name, per kernel name: [launches, device microseconds]."""
    out: dict[str, dict[str, list]] = defaultdict(dict)
    for event in device:
        op = launching_op(event)
        if op is not None:
            row = out[op.name].setdefault(_kernel_name(event), [0, 0.0])
            row[0] += 1
            row[1] += event.dur
    return out


def _op_table(events: list[Event], device: list[Event] | None = None) -> list[OpStat]:
    launched = _launched(device or [])
    rows: dict[str, dict] = {}
    shapes: dict[str, Counter] = defaultdict(Counter)
    shape_time: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for event in events:
        if not _is_host_op(event):
            continue
        row = rows.setdefault(event.name, {"calls": 0, "self": 0.0, "total": 0.0, "range": _is_range(event)})
        row["calls"] += 1
        row["self"] += event.self_us
        row["total"] += event.dur
        dims = event.input_dims()
        if dims is not None:
            key = tuple(tuple(d) if d is not None else None for d in dims)
            shapes[event.name][key] += 1
            shape_time[event.name][key] += event.self_us
    table = []
    for name, row in rows.items():
        groups = sorted(shapes[name].items(), key=lambda kv: (-shape_time[name][kv[0]], -kv[1]))[:MAX_SHAPE_GROUPS]
        kernels = sorted((OpKernel(name=k, calls=n, device_seconds=us / 1e6)
                          for k, (n, us) in launched.get(name, {}).items()),
                         key=lambda k: (-k.device_seconds, k.name))
        device_seconds = sum(k.device_seconds for k in kernels) if launched else None
        table.append(OpStat(
            name=name, kind="range" if row["range"] else "op", calls=row["calls"],
            self_seconds=row["self"] / 1e6, total_seconds=row["total"] / 1e6,
            device_self_seconds=device_seconds if not row["range"] else None, kernels=kernels,
            input_shapes=[OpShapeGroup(input_shapes=[list(s) if s is not None else None for s in key], calls=n,
                                       self_seconds=shape_time[name][key] / 1e6) for key, n in groups]))
    # Operators that launched device work first (most device time), then by host time.
    table.sort(key=lambda o: (o.kind != "op", -(o.device_self_seconds or 0.0), -o.self_seconds, o.name))
    return table


def _kept_kernels(kernels: list[OpStat], device: list[Event]) -> list[OpStat]:
    """The kernel rows a profile keeps: the most device time, and also those with
    launches linked to no operator (so that they can still be listed apart)."""
    unlinked = {_kernel_name(e) for e in device if launching_op(e) is None}
    top = kernels[:MAX_KERNELS]
    kept = {k.name for k in top}
    return top + [k for k in kernels[MAX_KERNELS:] if k.name in unlinked and k.name not in kept][:MAX_KERNELS]


def _kernels_from_events(events: list[Event]) -> list[OpStat]:
    rows: dict[str, list] = {}
    for event in events:
        row = rows.setdefault(_kernel_name(event), [0, 0.0])
        row[0] += 1
        row[1] += event.dur
    table = [OpStat(name=name, kind="kernel", calls=n, self_seconds=0.0, total_seconds=0.0,
                    device_self_seconds=us / 1e6) for name, (n, us) in rows.items()]
    table.sort(key=lambda k: (-(k.device_self_seconds or 0.0), k.name))
    return table


def _kernels_from_rows(kernels: list[KernelRow]) -> list[OpStat]:
    rows: dict[str, list] = {}
    groups: dict[str, dict] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for k in kernels:
        row = rows.setdefault(k.name, [0, 0.0])
        row[0] += 1
        row[1] += k.dur_us
        if k.input_shapes is not None:
            group = groups[k.name][k.input_shapes]
            group[0] += 1
            group[1] += k.dur_us
    table = []
    for name, (n, us) in rows.items():
        top = sorted(groups[name].items(), key=lambda kv: -kv[1][1])[:MAX_SHAPE_GROUPS]
        table.append(OpStat(
            name=name, kind="kernel", calls=n, self_seconds=0.0, total_seconds=0.0, device_self_seconds=us / 1e6,
            input_shapes=[OpShapeGroup(input_shapes=[list(s) if s is not None else None for s in key], calls=c,
                                       self_seconds=t / 1e6) for key, (c, t) in top]))
    table.sort(key=lambda k: (-(k.device_self_seconds or 0.0), k.name))
    return table


# ------------------------------------------------------------------------- findings


def _counted(counter: Counter, limit: int = 6) -> str:
    return ", ".join(f"{name} x{n}" for name, n in counter.most_common(limit)) + (
        f" and {len(counter) - limit} more" if len(counter) > limit else "")


def _per_step(count: int, steps: int) -> str:
    return f" ({count / steps:.1f} per step over {steps} steps)" if steps > 1 else (
        " in the profiled step" if steps == 1 else "")


def _optimizer_ranges(timeline: Timeline) -> list[tuple[str, Event]]:
    found = []
    for event in timeline.host:
        match = _OPTIMIZER_STEP.match(event.name)
        if match:
            found.append((match.group(1), event))
    return found


def _sync_findings(timeline: Timeline, steps: int, ascend: bool) -> list[ProfileFinding]:
    syncs = _outermost(timeline.host, SYNC_OPS)
    runtime = Counter(_runtime_name(e.name) for e in timeline.host if _runtime_name(e.name) in RUNTIME_SYNCS)
    findings = []
    if syncs:
        names = Counter(e.name for e in syncs)
        ranges = _optimizer_ranges(timeline)
        inside = [e for e in syncs if any(_within(e, r) for _, r in ranges)]
        split = ""
        if inside:
            optimizer = ranges[0][0]
            split = (f"; {len(inside)} of them inside {optimizer}.step (the optimizer reading a value, such as its "
                     f"step counter, on the host for each parameter: a fused optimizer avoids them), "
                     f"{len(syncs) - len(inside)} elsewhere")
        findings.append(ProfileFinding(
            kind="host-sync", count=len(syncs), ops=[n for n, _ in names.most_common()],
            message=f"{len(syncs)} host syncs ({_counted(names)}){_per_step(len(syncs), steps)}{split}: each one "
                    f"blocks the host until the {'NPU' if ascend else 'device'} has finished all queued work",
            suggestion="keep values such as the loss on the device and read them back every N steps "
                       "(accumulate with .detach(), call .item() when logging)"))
    if runtime:
        findings.append(ProfileFinding(
            kind="host-sync", count=sum(runtime.values()), ops=[n for n, _ in runtime.most_common()],
            message=f"{sum(runtime.values())} runtime synchronisations ({_counted(runtime)}): the host waited "
                    f"for the device (inside the operators above, copies, or explicit synchronize calls)"))
    return findings


def _copy_findings(timeline: Timeline, steps: int, ascend: bool) -> list[ProfileFinding]:
    findings = []
    htod = [e for e in timeline.device if e.cat == "gpu_memcpy" and "HtoD" in e.name]
    if htod:
        total = sum(e.dur for e in htod)
        findings.append(ProfileFinding(
            kind="host-to-device-copy", count=len(htod), ops=sorted({e.name for e in htod}),
            message=f"{len(htod)} host-to-device copies on the device timeline ({duration(total / 1e6, 2)})"
                    f"{_per_step(len(htod), steps)}",
            suggestion="copy batches from pinned memory (DataLoader(pin_memory=True)) with .to(device, "
                       "non_blocking=True), and keep constant tensors on the device"))
    # Copy operators that called the runtime's memcpy outside a host read: with the
    # reads (item) left out, what remains moves data from the host to the device.
    copies = []
    for event in _outermost(timeline.host, COPY_OPS):
        if any(a.name in SYNC_OPS for a in event.ancestors()):
            continue
        if _has_runtime_copy(event):
            copies.append(event)
    if copies and not htod:
        names = Counter(e.name for e in copies)
        findings.append(ProfileFinding(
            kind="host-to-device-copy", count=len(copies), ops=[n for n, _ in names.most_common()],
            message=f"{len(copies)} tensor copies ({_counted(names)}) that called the runtime's synchronous memcpy "
                    f"outside a host read{_per_step(len(copies), steps)}: copies of host data to the "
                    f"{'NPU' if ascend else 'device'} (the trace does not record the direction; this is inferred)",
            suggestion="copy batches from pinned memory with .to(device, non_blocking=True) (DataLoader("
                       "pin_memory=True)), prefetch the next batch, and create constant tensors on the device"))
    return findings


def _has_runtime_copy(event: Event) -> bool:
    stack = list(event.children)
    while stack:
        child = stack.pop()
        if _runtime_name(child.name) in RUNTIME_COPIES:
            return True
        stack.extend(child.children)
    return False


def _optimizer_findings(timeline: Timeline, ascend: bool) -> list[ProfileFinding]:
    ranges = _optimizer_ranges(timeline)
    if not ranges:
        return []
    inside: Counter = Counter()
    fused = False
    for _, span in ranges:
        for event in timeline.host:
            if event.cat == "user_annotation" or not _within(event, span) or event is span:
                continue
            if "_foreach_" in event.name or "fused" in event.name.lower() or "apply_adam" in event.name.lower():
                fused = True
            if event.name in ELEMENTWISE and not any(a.name in ELEMENTWISE for a in event.ancestors()):
                inside[event.name] += 1
    per_param = (inside["aten::addcdiv_"] or inside["aten::lerp_"] or inside["aten::add_"]) / len(ranges)
    if fused or per_param < 2 or sum(inside.values()) < 8:
        return []
    name = Counter(n for n, _ in ranges).most_common(1)[0][0]
    npu, other = FUSED.get(name, (f"a fused {name} (torch_npu.optim)", f"torch.optim.{name}(..., foreach=True)"))
    total = sum(inside.values())
    suggestion = (f"use {npu} on Ascend, {other} on CUDA" if ascend else
                  f"use {other} (on Ascend: {npu})")
    return [ProfileFinding(
        kind="unfused-optimizer", count=total, ops=[n for n, _ in inside.most_common()],
        message=f"{name}.step ran op by op: {total / len(ranges):.0f} elementwise operators per step "
                f"({_counted(inside)} over {len(ranges)} step{'s' if len(ranges) != 1 else ''}), about "
                f"{per_param:.0f} per-parameter updates each launched separately",
        suggestion=suggestion + "; a fused optimizer updates all parameters in a few kernels (check that results "
                                "match: the fused kernels round differently)")]


def _dynamic_from_kernels(kernels: list[KernelRow]) -> list[ProfileFinding]:
    dynamic = [k for k in kernels if k.state == "dynamic"]
    if not dynamic:
        return []
    types = Counter(k.type for k in dynamic)
    recorded = sum(1 for k in kernels if k.state is not None)
    return [ProfileFinding(
        kind="dynamic-shape", count=len(dynamic), ops=[n for n, _ in types.most_common()],
        message=f"{len(dynamic)} of {recorded} kernels ran as dynamic-shape operators (OP State dynamic): "
                f"{_counted(types)}",
        suggestion="dynamic-shape operators are tiled (and may be compiled) at run time: if the input shapes are "
                   "in fact fixed, try torch_npu.npu.set_compile_mode(jit_compile=False) and compare step times "
                   "(torchaxe trial); if they vary, pad or bucket inputs to a few shapes")]


def _dynamic_from_steps(timeline: Timeline, step_events: list[Event]) -> list[ProfileFinding]:
    """An operator whose input shapes differ from one step to the next (needs
    ``record_shapes`` and at least two steps)."""
    if len(step_events) < 2:
        return []
    per_step: dict[str, list[Counter]] = defaultdict(lambda: [Counter() for _ in step_events])
    recorded = False
    for event in timeline.host:
        if not _is_host_op(event) or _is_range(event):
            continue
        dims = event.input_dims()
        if dims is None:
            continue
        recorded = True
        for i, span in enumerate(step_events):
            if _within(event, span):
                per_step[event.name][i][tuple(tuple(d) if d is not None else None for d in dims)] += 1
                break
    if not recorded:
        return []
    self_us: Counter = Counter()
    for event in timeline.host:
        if event.name in per_step:
            self_us[event.name] += event.self_us
    dynamic = {name: len({frozenset(c.items()) for c in counts}) for name, counts in per_step.items()
               if name not in VIEW_OPS and any(c != counts[0] for c in counts[1:])}
    if not dynamic:
        return []
    names = sorted(dynamic, key=lambda n: (-self_us[n], n))
    return [ProfileFinding(
        kind="dynamic-shape", count=len(dynamic), ops=names,
        message=f"{len(dynamic)} operators saw different input shapes from one step to the next, most host time "
                f"first: {', '.join(f'{n} ({dynamic[n]} shape sets in {len(step_events)} steps)' for n in names[:5])}",
        suggestion="varying shapes defeat compilation and tuning for fixed shapes: pad or bucket inputs to a few "
                   "shapes, or mark the dimension dynamic (torch.compile(dynamic=True), mark_dynamic)")]


def _compile_findings(timeline: Timeline) -> list[ProfileFinding]:
    compiles = [e for e in timeline.host if _runtime_name(e.name) == "opCompile"]
    if not compiles:
        return []
    total = sum(e.dur for e in compiles)
    return [ProfileFinding(
        kind="online-compile", count=len(compiles), ops=["opCompile"],
        message=f"{len(compiles)} operator compilations during the profiled run (AscendCL@opCompile, "
                f"{duration(total / 1e6, 2)} of host time)",
        suggestion="operators compiled at run time: with fixed shapes this is a one-off cost; if it recurs every "
                   "step, compare torch_npu.npu.set_compile_mode(jit_compile=False) (torchaxe trial)")]
