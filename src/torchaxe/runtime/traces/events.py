"""Chrome-trace events, as torch.profiler and torch_npu.profiler write them.

Both formats are a JSON list of events (torch.profiler wraps it in an object under
``traceEvents``); a complete event (``ph: X``) has a start ``ts`` and a ``dur`` in
microseconds, which torch_npu writes as strings. This module reads the file, keeps
the complete events and the flow starts, sorts out which process is the host and
which the device, and nests host events to give each its parent and self time.

torch_npu links each device task to the host call that launched it with a flow
(category ``async_npu``): its start (``ph: s``) lies on the host thread at the start
of the launching call (``aclnnMm``, ``Enqueue``, ...), its end (``ph: f``, same
``id``) on the ``Ascend Hardware`` row at the start of the task. A device event so
linked gets that host call as ``launched_by``.
"""

from __future__ import annotations

import gzip
import json
import zlib
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchaxe.errors import TorchaxeError


class TraceFormatError(TorchaxeError):
    """A trace file or folder that cannot be read as a profiler trace."""


#: Processes of a torch_npu trace that are the device's own timeline.
ASCEND_DEVICE_PROCESSES = ("Ascend Hardware",)
#: Processes of a torch_npu trace that hold derived or unrelated rows, left out.
ASCEND_SKIPPED_PROCESSES = ("Overlap Analysis", "HCCL", "AI Core Freq", "Stars Chip Trans", "Acc PMU",
                            "NPU MEM", "APP MEM", "PTA MEM", "GE MEM", "SIO", "QoS", "LLC", "HBM", "DDR")
#: torch.profiler event categories that run on a GPU.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: Flow categories that link a host launch to the device task it launched.
LAUNCH_FLOWS = ("async_npu",)
#: How far (microseconds) a flow end may sit from its device task (times written as strings).
FLOW_SLACK_US = 0.05


@dataclass
class Event:
    """One complete event (``ph: X``); times in microseconds."""

    name: str
    cat: str
    pid: Any
    tid: Any
    start: float
    dur: float
    args: dict[str, Any]
    device: bool = False
    parent: "Event | None" = None
    children: list["Event"] = field(default_factory=list)
    #: Device events: the host call that launched this task, where a flow says so.
    launched_by: "Event | None" = None

    @property
    def end(self) -> float:
        return self.start + self.dur

    @property
    def self_us(self) -> float:
        return max(0.0, self.dur - sum(c.dur for c in self.children))

    def ancestors(self):
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def input_dims(self) -> list[list[int] | None] | None:
        """Input shapes as recorded with ``record_shapes`` (``Input Dims``), or None."""
        dims = self.args.get("Input Dims")
        if not isinstance(dims, list):
            return None
        return [list(d) if isinstance(d, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                       for x in d) else None for d in dims]


@dataclass
class Timeline:
    """The events of one trace file, host events nested per thread."""

    path: Path
    host: list[Event]
    device: list[Event]
    #: Flow starts by category (``HostToDevice``, ``ac2g``, ``async_npu``...): how many.
    flows: dict[str, int]
    #: Process names from the metadata events, by pid.
    processes: dict[Any, str]

    @property
    def is_ascend(self) -> bool:
        return any(name in ASCEND_DEVICE_PROCESSES or name == "CANN" for name in self.processes.values())

    @property
    def start(self) -> float:
        return min((e.start for e in self.host + self.device), default=0.0)


def read_json(path: Path) -> Any:
    """The JSON in ``path`` (gzip-compressed when it ends in ``.gz``), or a one-line error."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such file or folder") from None
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if path.name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceFormatError(f"{path}: not a gzip file ({exc})") from None
    if not raw.strip():
        raise TraceFormatError(f"{path}: empty file, not a profiler trace")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" at line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise TraceFormatError(f"{path}: not JSON ({getattr(exc, 'msg', exc)}{where})") from None


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None


def read_timeline(path: Path) -> Timeline:
    """Read a Chrome trace (torch.profiler's object or torch_npu's bare list)."""
    data = read_json(path)
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise TraceFormatError(f"{path}: not a profiler trace (no list of trace events)")
    processes: dict[Any, str] = {}
    for item in raw:
        if isinstance(item, dict) and item.get("ph") == "M" and item.get("name") == "process_name":
            name = (item.get("args") or {}).get("name")
            if isinstance(name, str):
                processes[item.get("pid")] = name
    host: list[Event] = []
    device: list[Event] = []
    flows: dict[str, int] = {}
    # Launch flows' ends by id: where each starts (thread, time) and ends (process, thread, time).
    flow_starts: dict[Any, tuple[Any, float]] = {}
    flow_ends: dict[Any, tuple[Any, Any, float]] = {}
    for item in raw:
        if not isinstance(item, dict):
            continue
        ph = item.get("ph")
        if ph in ("s", "f"):
            cat = str(item.get("cat") or item.get("name") or "")
            if ph == "s":
                flows[cat] = flows.get(cat, 0) + 1
            ts, key = _number(item.get("ts")), item.get("id")
            if cat in LAUNCH_FLOWS and ts is not None and isinstance(key, (str, int)):
                if ph == "s":
                    flow_starts[key] = (item.get("tid"), ts)
                else:
                    flow_ends[key] = (item.get("pid"), item.get("tid"), ts)
            continue
        if ph != "X":
            continue
        start, dur = _number(item.get("ts")), _number(item.get("dur"))
        name = item.get("name")
        if start is None or dur is None or dur < 0 or not isinstance(name, str):
            continue
        cat = str(item.get("cat") or "")
        process = processes.get(item.get("pid"), "")
        if process in ASCEND_SKIPPED_PROCESSES:
            continue
        on_device = cat in DEVICE_CATEGORIES or process in ASCEND_DEVICE_PROCESSES
        args = item.get("args") if isinstance(item.get("args"), dict) else {}
        event = Event(name=name, cat=cat, pid=item.get("pid"), tid=item.get("tid"), start=start, dur=dur,
                      args=args, device=on_device)
        (device if on_device else host).append(event)
    if not host and not device:
        raise TraceFormatError(f"{path}: a trace without a single complete event (ph X)")
    _nest(host)
    _link_launches(host, device, flow_starts, flow_ends)
    return Timeline(path=path, host=host, device=device, flows=flows, processes=processes)


def _nest(events: list[Event]) -> None:
    """Give each host event its enclosing event on the same thread. torch_npu writes
    its CANN runtime calls as another process with the Python thread's id, so threads
    are matched by id alone, which nests ``AscendCL@aclrtMemcpy`` inside ``aten::to``."""
    threads: dict[Any, list[Event]] = {}
    for event in events:
        threads.setdefault(event.tid, []).append(event)
    for thread in threads.values():
        thread.sort(key=lambda e: (e.start, -e.dur))
        stack: list[Event] = []
        for event in thread:
            # A child that overruns its parent by rounding (string times) still nests.
            while stack and not (stack[-1].start <= event.start and event.end <= stack[-1].end + 0.05):
                stack.pop()
            if stack:
                event.parent = stack[-1]
                stack[-1].children.append(event)
            stack.append(event)


def _link_launches(host: list[Event], device: list[Event], starts: dict[Any, tuple[Any, float]],
                   ends: dict[Any, tuple[Any, Any, float]]) -> None:
    """Give each device event the host call its launch flow starts in: the innermost
    host event on the flow's thread whose span holds the flow's start (threads matched
    by id, as in :func:`_nest`)."""
    if not starts or not ends:
        return
    threads: dict[Any, list[Event]] = {}
    for event in host:
        threads.setdefault(event.tid, []).append(event)
    for thread in threads.values():
        thread.sort(key=lambda e: (e.start, -e.dur))
    thread_starts = {tid: [e.start for e in thread] for tid, thread in threads.items()}
    streams: dict[tuple[Any, Any], list[Event]] = {}
    for event in device:
        streams.setdefault((event.pid, event.tid), []).append(event)
    for stream in streams.values():
        stream.sort(key=lambda e: (e.start, -e.dur))
    stream_starts = {key: [e.start for e in stream] for key, stream in streams.items()}
    for key, (pid, tid, ts) in ends.items():
        start = starts.get(key)
        if start is None or (pid, tid) not in streams:
            continue
        stream = streams[(pid, tid)]
        i = bisect_right(stream_starts[(pid, tid)], ts + FLOW_SLACK_US) - 1
        if i < 0 or not (abs(stream[i].start - ts) <= FLOW_SLACK_US or stream[i].start <= ts <= stream[i].end):
            continue
        launcher = _innermost(threads.get(start[0], []), thread_starts.get(start[0], []), start[1])
        if launcher is not None:
            stream[i].launched_by = launcher


def _innermost(thread: list[Event], starts: list[float], ts: float) -> Event | None:
    """The innermost event of a nested, start-sorted thread whose span holds ``ts``:
    the last one to start by ``ts``, or the nearest of its ancestors that holds it."""
    i = bisect_right(starts, ts) - 1
    node = thread[i] if i >= 0 else None
    while node is not None and not node.start <= ts <= node.end:
        node = node.parent
    return node
