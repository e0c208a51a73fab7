"""``torchaxe shapes --from-trace``: the same verdict from a profile recorded elsewhere.

- torch_npu.profiler output with ``kernel_details.csv``: each row is one device task
  with its ``Step Id``, ``Input Shapes`` and, in newer versions, ``OP State``
  (``static``: the operator was compiled for its shape; ``dynamic``: it ran as a
  dynamic-shape kernel). With shapes over two steps or more, a kernel is dynamic when
  its shapes change from one step to the next (as in a live run). The OP State
  column says how the kernels ran: all ``dynamic`` while the shapes never change
  means online compilation (``jit_compile=True``) was off and may pay off.
- a torch.profiler Chrome trace recorded with ``record_shapes=True``: the trace
  import's own finding of operators whose shapes change between ``ProfilerStep``s.

A trace with no input shapes and no OP State is refused in one line that says how
to record one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.profile import Profile
from torchaxe.shapes.analysis import ShapeAnalysis, Subject, op_subject
from torchaxe.shapes.recorder import OpTally
from torchaxe.shapes.verdict import Recommendation, TARGETS, Verdict

RECORD_HINT = ("record it with torch_npu.profiler (or torch.profiler) and record_shapes=True, over at least two "
               "steps")


@dataclass
class TraceShapes:
    """What a trace says about shapes, with its verdict."""

    path: str
    source: str  # ascend-kernels, torch-trace, ascend-trace
    steps: int
    verdict: Verdict
    kernels: int = 0
    states: dict[str, int] = field(default_factory=dict)
    analysis: ShapeAnalysis | None = None
    warnings: list[str] = field(default_factory=list)


def _kernel_file(path: Path) -> Path | None:
    if path.is_file():
        return path if path.name.endswith(".csv") and "kernel" in path.name else None
    for where in (path / "ASCEND_PROFILER_OUTPUT", path):
        candidate = where / "kernel_details.csv"
        if candidate.is_file():
            return candidate
    return None


def trace_shapes(path: str | Path) -> TraceShapes:
    """Read a trace and decide static, dynamic or mixed; TorchaxeError when it cannot."""
    from torchaxe.runtime.traces import TraceFormatError, load_trace
    from torchaxe.runtime.traces.ascend import read_kernel_details

    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file or folder")
    kernels = _kernel_file(path)
    if kernels is not None:
        return _from_kernels(str(path), read_kernel_details(kernels))
    return _from_profile(str(path), load_trace(path))


def _state_recommendations(verdict: str) -> list[Recommendation]:
    if verdict == "static":
        return [Recommendation("npu", "compile-mode", "torch_npu.npu.set_compile_mode(jit_compile=True)",
                               "the operators' shapes do not change: compiled once each, static kernels are reused",
                               "jit-compile-on", True)]
    if verdict == "dynamic":
        return [Recommendation("npu", "compile-mode", "torch_npu.npu.set_compile_mode(jit_compile=False)",
                               "shapes change: online compilation would compile again for every new shape",
                               "jit-compile-off", True),
                Recommendation("npu", "bucketing", "torchaxe.shapes.BucketingCollate(...)",
                               "pad the batches to a few sizes so that the shapes become static "
                               "(run `torchaxe shapes -- python train.py` for the boundaries)", None, True)]
    return [Recommendation("npu", "measure", "torchaxe shapes --try --target npu -- python train.py",
                           "some kernels ran static and some dynamic: measure jit_compile=True against False",
                           None, True)]


def _from_kernels(path: str, rows: list) -> TraceShapes:
    with_shapes = [r for r in rows if r.input_shapes is not None]
    states = Counter(r.state for r in rows if r.state is not None)
    steps = sorted({r.step for r in rows if r.step is not None})
    warnings: list[str] = []
    reasons: list[str] = []
    shape_verdict = None
    analysis = None
    if with_shapes and len(steps) >= 2:
        tallies: dict[str, OpTally] = {}
        for r in with_shapes:
            if r.step is None:
                continue
            tally = tallies.setdefault(r.name, OpTally(r.name))
            tally.add(tuple(s if s is not None else () for s in r.input_shapes), r.step - steps[0] + 1)
        subjects = [op_subject(t, len(steps)) for t in tallies.values()]
        dynamic = [s for s in subjects if s.dynamic]
        analysis = ShapeAnalysis(steps=len(steps), subjects=subjects, causes=[], sites=[], loaders=[], batch_sources=[])
        if dynamic:
            shape_verdict = "dynamic"
            names = ", ".join(s.name for s in dynamic[:5])
            reasons.append(f"{len(dynamic)} of {len(subjects)} kernels changed input shapes between steps: {names}")
        else:
            shape_verdict = "static"
            reasons.append(f"all {len(subjects)} kernels kept their input shapes over {len(steps)} steps")
    elif with_shapes:
        warnings.append(f"input shapes for {len(steps)} step only: whether they change cannot be seen ({RECORD_HINT})")
    state_verdict = None
    if states:
        total = sum(states.values())
        if states.get("dynamic", 0) == total:
            state_verdict = "dynamic"
        elif states.get("static", 0) == total:
            state_verdict = "static"
        else:
            state_verdict = "mixed"
        reasons.append(f"OP State: {states.get('static', 0)} kernels static, {states.get('dynamic', 0)} dynamic "
                       f"(of {len(rows)})")
    if shape_verdict is None and state_verdict is None:
        what = ("no input shapes and no OP State column" if not with_shapes
                else f"input shapes for only {len(steps)} step and no OP State column")
        raise TorchaxeError(f"{path}: the trace has {what}: cannot tell static shapes from dynamic; {RECORD_HINT}")
    verdict = shape_verdict or state_verdict
    assert verdict is not None
    if shape_verdict == "static" and state_verdict in ("dynamic", "mixed"):
        reasons.append("the shapes did not change, yet kernels ran as dynamic-shape operators: online compilation "
                       "(jit_compile=True) may make them faster; measure it")
    if shape_verdict is None:
        reasons.append("verdict from the OP State column alone (how the kernels ran, with one step of shapes)")
    recommendations = _state_recommendations(verdict)
    if shape_verdict is None and verdict == "dynamic":
        recommendations = [
            Recommendation("npu", "compile-mode", "torch_npu.npu.set_compile_mode(jit_compile=False)",
                           "every kernel ran as a dynamic-shape operator: either the shapes change or the run already "
                           "used the binary kernels (jit_compile=False); one step of shapes cannot tell which",
                           "jit-compile-off", True),
            Recommendation("npu", "measure", "torchaxe shapes --try --target npu -- python train.py",
                           "records the shapes step by step and measures jit_compile=True against False", None, True)]
    result = Verdict(verdict=verdict, reasons=reasons, recommendations=recommendations,
                     picks={"npu": {"static": "jit-compile-on", "dynamic": "jit-compile-off"}.get(verdict)})
    return TraceShapes(path=path, source="ascend-kernels", steps=len(steps), verdict=result, kernels=len(rows),
                       states=dict(states), analysis=analysis, warnings=warnings)


def _from_profile(path: str, profile: Profile) -> TraceShapes:
    ops = [o for o in profile.ops if o.kind == "op"]
    if not any(o.input_shapes for o in ops):
        raise TorchaxeError(f"{path}: the trace has no input shapes: cannot tell static shapes from dynamic; "
                            f"{RECORD_HINT}")
    steps = len(profile.steps)
    dynamic = next((f for f in profile.findings if f.kind == "dynamic-shape"), None)
    reasons: list[str] = []
    warnings: list[str] = []
    if dynamic is not None:
        verdict = "dynamic"
        reasons.append(dynamic.message)
    elif steps >= 2:
        verdict = "static"
        reasons.append(f"no operator changed input shapes over {steps} steps")
    else:
        raise TorchaxeError(f"{path}: the trace holds {steps} step(s): whether shapes change cannot be seen; "
                            f"{RECORD_HINT}")
    recs = []
    picks: dict[str, str | None] = {}
    for target in TARGETS:
        if target == "npu":
            recs += _state_recommendations(verdict)
            picks["npu"] = "jit-compile-on" if verdict == "static" else "jit-compile-off"
        elif verdict == "static":
            recs.append(Recommendation(target, "compile", "model = torch.compile(model)",
                                       "fixed shapes: one graph, compiled once", "compile-static"))
            picks[target] = "compile-static"
        else:
            recs.append(Recommendation(target, "compile", "model = torch.compile(model, dynamic=True)",
                                       "shapes change between steps: symbolic sizes instead of recompiling",
                                       "compile-dynamic"))
            picks[target] = "compile-dynamic"
    subjects = [Subject(kind="op", name=o.name, calls=o.calls, distinct=len(o.input_shapes)) for o in ops]
    analysis = ShapeAnalysis(steps=steps, subjects=subjects, causes=[], sites=[], loaders=[], batch_sources=[])
    return TraceShapes(path=path, source=profile.run.source, steps=steps,
                       verdict=Verdict(verdict=verdict, reasons=reasons, recommendations=recs, picks=picks),
                       analysis=analysis, warnings=warnings)
