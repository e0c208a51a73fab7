"""Static findings meet the profile: how often the code a finding points at runs per
step, on which shapes, and for how long.

The profile attributes every operator call to the innermost user function on the
Python stack (``file:first_line``). A finding lies inside some function; the
operators attributed to that function are the finding's runtime cost. When the
function is a method, the module class's input shapes (from the profile's shape
report) say on which shapes it ran.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Sequence

from torchaxe.errors import TorchaxeError
from torchaxe.findings import Finding
from torchaxe.units import duration

if TYPE_CHECKING:
    from torchaxe.advise.candidates import Candidate


@dataclass
class RuntimeEvidence:
    function: str
    calls_per_step: float = 0.0
    seconds_per_step: float = 0.0
    ops: dict[str, float] = field(default_factory=dict)
    shapes: list[list[int] | None] = field(default_factory=list)
    module_calls_per_step: float | None = None

    #: Share of all operator host time in the op-profiled steps (forward and backward).
    share: float | None = None

    def describe(self, step_seconds: float | None = None) -> str:
        if not self.ops:
            return f"{self.function}: no operator ran in it during the profiled steps"
        top = ", ".join(f"{name} x{count:g}" for name, count in
                        sorted(self.ops.items(), key=lambda kv: -kv[1])[:3])
        share = f" ({self.share:.1%} of all operator time)" if self.share is not None else ""
        shape = f" on {', '.join(str(s) for s in self.shapes[:2])}" if self.shapes else ""
        return (f"{self.function}: {self.calls_per_step:g} forward operator calls per step ({top}), "
                f"{duration(self.seconds_per_step, 2)} of operator host time per profiled step (operators "
                f"recorded: slower than a plain run){share}{shape}")


@lru_cache(maxsize=256)
def _functions(path: str, mtime: float) -> tuple[tuple[int, int, int, str, str | None], ...]:
    """(first line incl. decorators, def line, end line, name, class) of every function."""
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return ()
    out = []

    def visit(node: ast.AST, klass: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((first, child.lineno, child.end_lineno or child.lineno, child.name, klass))
                visit(child, klass)
            elif isinstance(child, ast.ClassDef):
                visit(child, child.name)
            else:
                visit(child, klass)

    visit(tree, None)
    return tuple(out)


def enclosing_function(path: str, line: int) -> tuple[int, int, str, str | None] | None:
    """The innermost function around ``line``: (first line, def line, name, class)."""
    real = os.path.realpath(path)
    try:
        mtime = os.stat(real).st_mtime
    except OSError:
        return None
    best = None
    for first, def_line, end, name, klass in _functions(real, mtime):
        if def_line <= line <= end and (best is None or def_line >= best[1]):
            best = (first, def_line, name, klass)
    return best


def optimizer_evidence(finding: Finding, profile: dict[str, Any]) -> str | None:
    """For optimizer findings: the time of the optimizer's own profiler ranges."""
    prefix = "Optimizer.zero_grad#" if finding.code == "AX202" else "Optimizer.step#"
    steps = max(len(profile.get("ops_steps") or []), 1)
    ranges = [op for op in profile.get("ops") or [] if op.get("kind") == "range" and op["name"].startswith(prefix)]
    if not ranges:
        return None
    seconds = sum(op.get("total_seconds") or 0.0 for op in ranges) / steps
    names = ", ".join(sorted({op["name"] for op in ranges}))
    return (f"{names}: {duration(seconds, 2)} host time per profiled step (operators recorded: slower than a "
            "plain run)")


def evidence_for(finding: Finding, profile: dict[str, Any], base: str = ".") -> RuntimeEvidence | None:
    """The runtime cost of the function around ``finding``, from a Profile's JSON form.
    Only for findings about a computation (AX1xx): for the others the function is
    usually the training loop itself, whose operators are everything."""
    if not finding.code.startswith("AX1"):
        return None
    path = os.path.realpath(os.path.join(base, finding.path))
    found = enclosing_function(path, finding.line)
    if found is None:
        return None
    first, def_line, name, klass = found
    wanted = {f"{path}:{first}", f"{path}:{def_line}"}
    steps = max(len(profile.get("ops_steps") or []), 1)
    ev = RuntimeEvidence(function=f"{klass}.{name}" if klass else name)
    for op in profile.get("ops") or []:
        calls = op.get("calls") or 0
        for source in op.get("sources") or []:
            location = source.get("location", "")
            file, _, line = location.rpartition(":")
            if f"{os.path.realpath(file)}:{line}" not in wanted:
                continue
            count = source.get("count") or 0
            ev.ops[op["name"]] = ev.ops.get(op["name"], 0) + count / steps
            ev.calls_per_step += count / steps
            if calls:
                ev.seconds_per_step += (op.get("self_seconds") or 0.0) * count / calls / steps
    total = sum(op.get("self_seconds") or 0.0 for op in profile.get("ops") or [] if op.get("kind", "op") == "op")
    if total > 0:
        ev.share = ev.seconds_per_step * steps / total
    if klass:
        for module in (profile.get("shapes") or {}).get("modules") or []:
            if module.get("type") == klass:
                ev.module_calls_per_step = (ev.module_calls_per_step or 0) + (module.get("calls") or 0)
                for sig in module.get("signatures") or []:
                    for shape in sig.get("shapes") or []:
                        if shape not in ev.shapes:
                            ev.shapes.append(shape)
    if not ev.shapes and ev.ops:
        for op in profile.get("ops") or []:
            if op["name"] in ev.ops and op.get("input_shapes"):
                first_shape = op["input_shapes"][0]["input_shapes"][0]
                if first_shape and first_shape not in ev.shapes:
                    ev.shapes.append(first_shape)
                break
    return ev


def micro_benchmarks(candidates: Sequence[Candidate], target: str, out_of_time: Callable[[], bool],
                     progress: Callable[[str], None]) -> None:
    """A formula fix's replacement against the hand-written form on the shapes the
    run used (``torchaxe verify``), in this process: seconds, not a whole run."""
    from torchaxe.scan.formulas.verify import formula_rules, verify

    formula_codes = {rule.code for rule in formula_rules()}
    for c in candidates:
        code = c.rec.rules[0] if c.rec.rules else ""
        if code not in formula_codes or not c.shapes or out_of_time():
            continue
        shape = tuple(max(d, 1) for d in c.shapes[0])
        progress(f"micro-benchmark of {code} on {list(shape)}")
        try:
            (result,) = verify((code,), device=target, shape=shape, repeats=3)
        except (TorchaxeError, RuntimeError, ValueError) as exc:
            c.rec.evidence.append(f"micro-benchmark on {list(shape)} not run: {exc}")
            continue
        if result.error or result.speedup is None:
            c.rec.evidence.append(f"micro-benchmark on {list(shape)}: {result.error or 'no fused form here'}")
            continue
        c.rec.evidence.append(
            f"micro-benchmark on {list(shape)} {result.dtype}, forward: hand-written "
            f"{duration(result.hand.median, 3)}, replacement {duration(result.fused.median, 3)} "
            f"({result.speedup:.1f}x); max error {result.max_abs:.1e}")
        if result.max_abs is not None and c.rec.accuracy.kind in ("max_error", "exact", "unknown"):
            c.rec.accuracy.kind = "max_error"
            c.rec.accuracy.max_error = max(c.rec.accuracy.max_error or 0.0, result.max_abs)
            c.rec.accuracy.detail = "largest difference from the hand-written form, on the run's shapes"
