"""The op-level breakdown: torch.profiler over a few steps, turned into OpStats.

The window is started and stopped by the harness at step boundaries. The profiler
runs with its Python tracer on (``with_stack``), which is what lets each operator be
traced back to the user's line through its parent events; those steps are slowed
down by it, so they are marked ``ops`` and left out of the step-time summary.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections import Counter, defaultdict
from typing import Any, Iterator

from torchaxe.runtime.probes import CodeMap
from torchaxe.runtime.profile import OpShapeGroup, OpSource, OpStat

#: Rows kept in the op table, and shape groups and sources per row.
MAX_OPS = 100
MAX_SHAPE_GROUPS = 10
MAX_SOURCES = 5

_PY_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<function>.*)$")


def op_share(profile: dict[str, Any], *names: str) -> float:
    """The share of a Profile's (JSON) operators' own host time spent in the operators
    ``names``; 0 where the profile has no op table."""
    ops = [op for op in profile.get("ops") or [] if op.get("kind", "op") == "op"]
    total = sum(op.get("self_seconds") or 0.0 for op in ops)
    if total <= 0:
        return 0.0
    return sum(op.get("self_seconds") or 0.0 for op in ops if op.get("name") in names) / total


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the C++ side's start/stop banner (kineto prints to file descriptor 2)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


#: Python function calls the op window's Python tracer may record in all. Each costs
#: about 1.5 KB while recording and 3 KB and 70 us when the events are read back (a
#: 2-core AMD EPYC): 900,000 calls took 4 GiB and a minute. A training step of a
#: model made with transformers makes 2,000-4,000; one that makes tens of thousands
#: (plotting, a per-time-step Python loop) is recorded over fewer steps, or without
#: the user's lines.
PYTHON_CALLS_BUDGET = 100_000
#: Operators (as dispatched below autograd, counted on the last warm-up step with the
#: FLOPs) the op window records over all its steps. torch.profiler keeps an event per
#: operator and autograd node, with its shapes, and reading them back builds a Python
#: object for each: about 12 KB per dispatched operator at the peak, measured on an
#: LSTMCell loop. A training step of a small transformer runs 1,000-5,000.
OPERATORS_BUDGET = 100_000
#: Past this many operators in one step, none are recorded: one step alone would take
#: gigabytes and minutes to record and read back (pytorch/examples'
#: time_sequence_prediction: an LBFGS step of 20 closures over 1,000 time steps runs
#: 517,000).
OPERATORS_LIMIT = 200_000


class PythonCallCounter:
    """Counts the Python function calls of the current thread between ``start`` and
    ``stop`` (``sys.setprofile``; not started when another profile function is set).
    Calls made while a torch dispatch mode handles an operator (the FLOP counter may
    run in the same step; the op window will not) are left out: inside its handler
    the mode is off torch's dispatch-mode stack."""

    def __init__(self) -> None:
        self.calls: int | None = None
        self._on = False
        #: The code objects called (the functions the step executed).
        self.codes: set[Any] = set()

    def start(self) -> None:
        import torch

        if sys.getprofile() is not None:
            return
        self.calls = 0
        depth = torch._C._len_torch_dispatch_stack
        modes = depth()
        codes = self.codes
        # The functions the step runs inside (a framework's training loop) were
        # called before it: they are on the stack now.
        frame: Any = sys._getframe(1)
        while frame is not None:
            codes.add(frame.f_code)
            frame = frame.f_back

        def count(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and depth() >= modes:
                self.calls += 1
                codes.add(frame.f_code)

        sys.setprofile(count)
        self._on = True

    def stop(self) -> None:
        if self._on:
            sys.setprofile(None)
            self._on = False
            from torchaxe.runtime import run_context

            run_context.EXECUTED["step_functions"] = run_context.function_ranges(self.codes)
            self.codes = set()


class OpWindow:
    """One torch.profiler recording between two step boundaries."""

    def __init__(self, activities: tuple[str, ...], record_shapes: bool) -> None:
        self.activities = activities
        self.record_shapes = record_shapes
        self._profiler: Any = None
        self._search_path: list[str] = []
        self.steps: list[int] = []
        #: Whether the Python tracer runs (the user's line of each operator).
        self.with_stack = True
        #: Why the window was cut down, for the profile's warnings.
        self.note: str | None = None
        #: The events read back once the window stopped (``settle``), or why they
        #: could not be.
        self._events: list[Any] | None = None
        self._failure: str | None = None

    def plan(self, python_calls: int | None, steps: int, operators: int | None = None) -> int:
        """The steps to record, given the Python calls and the operators a step makes
        (None: not counted): as many of ``steps`` as both budgets allow, at least one;
        without the tracer when one step is over its budget; none when one step runs
        more than ``OPERATORS_LIMIT`` operators."""
        if operators is not None and operators > OPERATORS_LIMIT:
            self.note = (f"no operators recorded: a step runs {operators:,} operators, too many to record "
                         "(gigabytes of memory and minutes); the other figures are measured as usual. "
                         "--step-marker on a smaller function of yours records less per step")
            return 0
        fit = steps
        why: list[str] = []
        if operators is not None and operators * steps > OPERATORS_BUDGET:
            fit = min(fit, max(1, OPERATORS_BUDGET // max(operators, 1)))
            why.append(f"{operators:,} operators")
        if python_calls is not None and python_calls > PYTHON_CALLS_BUDGET:
            self.with_stack = False
            if operators is None:
                fit = 1
            self.note = (f"operators recorded over {fit} step{'s' if fit != 1 else ''} without the lines of your "
                         f"code that called them: a step makes {python_calls:,} Python calls, too many to record "
                         "(memory and minutes)")
            return fit
        if python_calls is not None and python_calls * fit > PYTHON_CALLS_BUDGET:
            fit = max(1, PYTHON_CALLS_BUDGET // python_calls)
            why.append(f"{python_calls:,} Python calls")
        if fit != steps:
            self.note = (f"operators recorded over {fit} step{'s' if fit != 1 else ''}, not {steps}: a step makes "
                         f"{' and '.join(why)}, and recording them costs memory and time")
        return fit

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        from torchaxe.runtime import first_model

        if self.with_stack and first_model.patched():
            # The Python tracer and the model finder's patch of nn.Module.__call__ do not
            # mix (a segmentation fault on CPython 3.11): the operators without lines.
            self.with_stack = False
            self.note = ("operators recorded without the lines of your code that called them: the model was "
                         "still being looked for when the recording began")
        kinds = [getattr(ProfilerActivity, name.upper()) for name in self.activities
                 if hasattr(ProfilerActivity, name.upper())]
        self._profiler = profile(activities=kinds, record_shapes=self.record_shapes, with_stack=self.with_stack)
        with _quiet_stderr():
            self._profiler.start()

    @property
    def started(self) -> bool:
        return self._profiler is not None

    def stop(self) -> None:
        if self._profiler is None or self._search_path:
            return
        # The profiler names files relative to the working folder or to the sys.path
        # entry they were found under; keep both, as the script had them, to find
        # the files again.
        self._search_path = [os.getcwd()] + [p or os.getcwd() for p in sys.path]
        with _quiet_stderr():
            self._profiler.stop()

    def settle(self) -> None:
        """Stop the window and read its events back now, while the script still runs.

        Now and then torch.profiler cannot hand them over: one of them carries a name
        that is not valid UTF-8 (a frame record of the Python tracer), and the
        conversion to Python fails for all of them. Read at the end of the run, that
        happened in about one nanoGPT profile in six; read as soon as the window ends,
        in none of fourteen. ``table`` says why when it did."""
        if self._profiler is None or self._events is not None or self._failure is not None:
            return
        self.stop()
        try:
            self._events = list(self._profiler.events())
        except (UnicodeDecodeError, RuntimeError) as exc:
            self._failure = f"torch.profiler could not return its events ({type(exc).__name__}: {exc})"

    def table(self, codes: CodeMap) -> list[OpStat]:
        """The operators of the window, most host self time first.

        Raises :class:`OpTableError` when torch.profiler cannot hand its events over
        (``settle``). The caller keeps the rest of the profile."""
        if self._profiler is None:
            return []
        self.settle()
        if self._failure is not None:
            raise OpTableError(self._failure)
        events = [e for e in self._events or [] if not getattr(e, "is_python_function", False)]
        return build_table(events, codes, self._search_path, self.record_shapes)


#: How a profile's warnings begin when it has no op table (``OpTableError``'s reason
#: follows); advise reads it back.
NO_OP_TABLE = "no op table: "


class OpTableError(Exception):
    """The op window's events could not be read: the op table is left out."""


def _device_self_us(event: Any) -> float:
    value = getattr(event, "self_device_time_total", None)
    if value is None:
        value = getattr(event, "self_cuda_time_total", 0.0)
    return float(value or 0.0)


class _SourceFinder:
    """Maps an event to the user's line that led to it, through its parents."""

    def __init__(self, codes: CodeMap, search_path: list[str]) -> None:
        self.codes = codes
        self.search_path = search_path
        self._files: dict[str, str | None] = {}
        self._defs: dict[str, list[tuple[int, int, str]]] = {}

    def _resolve(self, shown: str) -> str | None:
        if shown in self._files:
            return self._files[shown]
        found = None
        candidates = [shown] if os.path.isabs(shown) else [os.path.join(d, shown) for d in self.search_path]
        for path in candidates:
            if os.path.isfile(path):
                found = path
                break
        self._files[shown] = found
        return found

    def _def_line(self, path: str, line: int, function: str) -> int:
        """The line where ``function`` starts, for a ``line`` inside it. The tracer
        gives the start line for functions entered while recording, but the running
        line for those already under way when it started; this makes them alike."""
        defs = self._defs.get(path)
        if defs is None:
            import ast

            defs = []
            try:
                tree = ast.parse(open(path, encoding="utf-8").read())
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                tree = None
            if tree is not None:
                for node in ast.walk(tree):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                        defs.append((start, node.end_lineno or node.lineno, node.name))
            self._defs[path] = defs
        inside = [(start, end) for start, end, name in defs if name == function and start <= line <= end]
        return max(inside)[0] if inside else line

    def source(self, event: Any) -> tuple[str, str] | None:
        parent = getattr(event, "cpu_parent", None)
        hops = 0
        while parent is not None and hops < 256:
            if getattr(parent, "is_python_function", False):
                match = _PY_FRAME.match(parent.name)
                if match:
                    path = self._resolve(match["file"])
                    if path is not None and self.codes.kind(path) == "user":
                        line = self._def_line(path, int(match["line"]), match["function"])
                        return f"{self.codes.show(path)}:{line}", match["function"]
            parent = parent.cpu_parent
            hops += 1
        return None


def build_table(events: list[Any], codes: CodeMap, search_path: list[str], with_shapes: bool) -> list[OpStat]:
    """Aggregate profiler events (``FunctionEvent``-like objects) by operator name."""
    finder = _SourceFinder(codes, search_path)
    rows: dict[str, dict[str, Any]] = {}
    shape_rows: dict[str, dict[tuple, list]] = defaultdict(dict)
    sources: dict[str, Counter] = defaultdict(Counter)
    for event in events:
        name = event.name
        row = rows.get(name)
        if row is None:
            row = rows[name] = {"calls": 0, "self": 0.0, "total": 0.0, "device": 0.0,
                                "range": bool(getattr(event, "is_user_annotation", False))}
        self_us = float(event.self_cpu_time_total)
        row["calls"] += 1
        row["self"] += self_us
        row["total"] += float(event.cpu_time_total)
        row["device"] += _device_self_us(event)
        if with_shapes:
            shapes = tuple(tuple(s) if isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s) else None
                           for s in (getattr(event, "input_shapes", None) or ()))
            group = shape_rows[name].setdefault(shapes, [0, 0.0])
            group[0] += 1
            group[1] += self_us
        if not row["range"]:
            where = finder.source(event)
            if where is not None:
                sources[name][where] += 1
    saw_device = any(r["device"] > 0 for r in rows.values())
    table = []
    for name, row in rows.items():
        groups = sorted(shape_rows.get(name, {}).items(), key=lambda kv: -kv[1][1])[:MAX_SHAPE_GROUPS]
        table.append(OpStat(
            name=name,
            kind="range" if row["range"] else "op",
            calls=row["calls"],
            self_seconds=row["self"] / 1e6,
            total_seconds=row["total"] / 1e6,
            device_self_seconds=row["device"] / 1e6 if saw_device else None,
            input_shapes=[OpShapeGroup(input_shapes=[list(s) if s is not None else None for s in shapes],
                                       calls=calls, self_seconds=us / 1e6)
                          for shapes, (calls, us) in groups],
            sources=[OpSource(location=loc, function=function, count=n)
                     for (loc, function), n in sources[name].most_common(MAX_SOURCES)],
        ))
    table.sort(key=lambda o: (-(o.device_self_seconds or 0.0), -o.self_seconds, o.name))
    return table[:MAX_OPS]
