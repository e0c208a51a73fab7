"""The autotuner: measure every strategy on every distinct subgraph, keep the results
in the knowledge base, swap the winners in.

``tune(model, example_inputs)``:

1. captures the model on ``example_inputs`` (``capture.py``): the modules at the
   chosen depth of its call tree are the subgraphs; dynamic ones are left alone;
2. gives each a structural signature (``signature.py``), so identical blocks are
   tuned once, and under ``torch.distributed`` shares the signatures out among the
   ranks;
3. for each signature, measures what the knowledge base does not have yet: every
   applicable strategy (``strategies.py``) on a copy of the module, checked against
   eager (outputs and gradients; with dropout off and the same random numbers when
   the subgraph draws any), timed forward + backward in training mode, interleaved
   (``measure.py``); a wrong or failing candidate is recorded as such;
4. stores the records, exchanges them between ranks, picks the winners (the fastest
   correct strategy, when it beats eager by ``min_gain``) and applies them to the
   model in place.

``apply(model)`` does steps 1, 2 and 4 only, from what the knowledge base holds. The
work is bounded by ``budget`` seconds; what is left is measured by the next run.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import os
import platform
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from torchaxe import __version__
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.stats import Samples
from torchaxe.tune import strategies as S
from torchaxe.runtime.dynamo import (compiled_by_script, fallback_reasons, frames_compiled, fresh_caches,
                                     graphs_compiled, script_as_main)
from torchaxe.tune.capture import CallRecorder, Subgraph, capture
from torchaxe.kb import KnowledgeBase, TunedRecord, choose
from torchaxe.tune.measure import (Example, RunResult, Timer, checked_run, compare, draws_random_numbers, float64_run,
                                   interleaved, run_once, tolerance)
from torchaxe.tune.signature import describe, signature_of, signature_parts
from torchaxe.units import duration

#: A progress callback: (what is being done, units done, units in all).
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class TuneOptions:
    kb: str | os.PathLike[str] | None = None
    #: Seconds of tuning at most (None: no limit). Checked between candidates.
    budget: float | None = None
    depth: int = 1
    #: Also tune the model as a whole (depth 0), and keep the whole model's winner or
    #: the subgraphs' winners, whichever saves more per forward + backward.
    whole_model: bool = True
    strategies: tuple[str, ...] = S.ALL
    repeats: int = 7
    #: A sample lasts at least this long (iterations are repeated to get there).
    min_sample_seconds: float = 0.005
    #: A strategy must beat eager by this fraction to be chosen.
    min_gain: float = 0.05
    target: str = "auto"
    compile_backend: str = "inductor"
    #: Measure again what the knowledge base already has.
    retune: bool = False
    #: Swap the winners into the model.
    apply: bool = True

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise TorchaxeError(f"--depth {self.depth}: must be at least 1")
        if self.repeats < 1:
            raise TorchaxeError(f"--repeats {self.repeats}: must be at least 1")
        if self.budget is not None and self.budget <= 0:
            raise TorchaxeError(f"--budget {self.budget}: must be a positive number of seconds")
        unknown = [s for s in self.strategies if s not in S.ALL]
        if unknown:
            raise TorchaxeError(f"unknown strategy {unknown[0]!r}: choose from {', '.join(S.ALL)}")
        if not 0 <= self.min_gain < 1:
            raise TorchaxeError(f"--min-gain {self.min_gain}: must be in [0, 1)")


@dataclass
class SubgraphResult:
    """One signature: the modules that share it, what was measured, what won."""

    signature: str
    module: str
    names: list[str]
    #: tuned (measured now), known (all in the knowledge base already), budget (left
    #: for the next run), remote (measured by another rank), failed (eager itself
    #: could not run on a copy; the notes say why).
    status: str
    records: list[TunedRecord] = field(default_factory=list)
    winner: str | None = None
    eager_median: float | None = None
    winner_median: float | None = None
    unavailable: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        if self.eager_median and self.winner_median:
            return self.eager_median / self.winner_median
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"signature": self.signature, "module": self.module, "names": self.names, "status": self.status,
                "winner": self.winner, "speedup": self.speedup, "eager_median": self.eager_median,
                "winner_median": self.winner_median, "unavailable": self.unavailable, "notes": self.notes,
                "measured": [{"strategy": r.strategy, "status": r.status, "median": r.median,
                              "samples": len(r.samples), "message": r.message, "errors": r.errors}
                             for r in self.records]}


@dataclass
class TuneReport:
    kb: str
    subgraphs: list[SubgraphResult] = field(default_factory=list)
    #: (module name, why it was left alone)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: (module name, strategy) swapped into the model.
    applied: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    #: Of ``seconds``, the time spent swapping the winners in (mostly torch.compile's
    #: own set-up, e.g. importing dynamo, the first time in a process).
    apply_seconds: float = 0.0
    budget_exhausted: bool = False
    rank: int | None = None
    world_size: int | None = None
    #: What the figures mean for this script (e.g. that it compiles the model itself).
    notes: list[str] = field(default_factory=list)

    @property
    def measured(self) -> int:
        """Candidates measured in this run (0 for a warm run)."""
        return sum(len(s.records) for s in self.subgraphs)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "torchaxe.tune/1", "kb": self.kb, "seconds": self.seconds,
                "apply_seconds": self.apply_seconds, "measured": self.measured,
                "budget_exhausted": self.budget_exhausted, "rank": self.rank, "world_size": self.world_size,
                "subgraphs": [s.to_dict() for s in self.subgraphs],
                "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
                "applied": [{"name": n, "strategy": s} for n, s in self.applied], "notes": self.notes}


# ------------------------------------------------------------------ helpers


def _resolve_target(target: str) -> str:
    from torchaxe.backends import resolve_target

    return resolve_target(target)


def environment(target: str, compile_backend: str) -> dict[str, Any]:
    """What a measurement depends on besides the subgraph itself."""
    device_name = platform.processor() or platform.machine()
    if target == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name()
    return {"torch": torch.__version__, "python": platform.python_version(), "torchaxe": __version__,
            "target": target, "device_name": device_name, "host": socket.gethostname(),
            "threads": torch.get_num_threads(), "compile_backend": compile_backend}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:300]


def _distributed() -> tuple[int, int] | None:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    world = torch.distributed.get_world_size()
    return (torch.distributed.get_rank(), world) if world > 1 else None


def _nothing_compiled(before: dict[str, int], after: dict[str, int], tried: int) -> str:
    """What to say of a compile that made no graph: dynamo's own reason for running
    the code eagerly when it gave one during the compile (its first line)."""
    new = [reason for reason, count in after.items() if count > before.get(reason, 0)]
    why = new[0].strip().splitlines()[0].strip() if new else None
    if why:
        return f"nothing compiled: dynamo ran it eagerly ({why}), so it runs as eager does"
    if not tried:
        return "nothing compiled: dynamo did not set out to compile it, so it runs as eager does"
    return ("nothing compiled: dynamo made no graph of it (code or an input it cannot trace, such as a sparse "
            "tensor), so it runs as eager does")


@contextlib.contextmanager
def _quiet_compiler() -> Iterator[None]:
    """A failing candidate is recorded with its one-line reason; torch.compile's own
    error logging (whole tracebacks on stderr) is held back meanwhile, and so is what
    it writes to stderr itself (max-autotune's table of timings for every product)."""
    loggers = [logging.getLogger(n) for n in ("torch._dynamo", "torch._guards", "torch._inductor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _Deadline:
    def __init__(self, budget: float | None, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.end = None if budget is None else clock() + budget
        self.hit = False

    def over(self) -> bool:
        if self.end is not None and self.clock() >= self.end:
            self.hit = True
        return self.hit


# ------------------------------------------------------------------ measuring one signature


def measure_signature(signature: str, parts: dict[str, Any], module: nn.Module, example: Example,
                      todo: Sequence[str], ctx: S.StrategyContext, env: dict[str, Any], *, repeats: int,
                      min_sample_seconds: float, timer: Timer, deadline: _Deadline,
                      progress: Callable[[str], None] = lambda s: None) -> list[TunedRecord]:
    """Records for ``eager`` and every strategy of ``todo`` on copies of ``module``."""
    with script_as_main(module):
        return _measure_signature(signature, parts, module, example, todo, ctx, env, repeats=repeats,
                                  min_sample_seconds=min_sample_seconds, timer=timer, deadline=deadline,
                                  progress=progress)


def _measure_signature(signature: str, parts: dict[str, Any], module: nn.Module, example: Example,
                       todo: Sequence[str], ctx: S.StrategyContext, env: dict[str, Any], *, repeats: int,
                       min_sample_seconds: float, timer: Timer, deadline: _Deadline,
                       progress: Callable[[str], None]) -> list[TunedRecord]:
    info = describe(parts)
    eager = copy.deepcopy(module)
    reference = run_once(eager, example)
    assert reference is not None
    # A subgraph that draws random numbers (dropout) is checked with them made
    # deterministic, and timed as it trains.
    stochastic = draws_random_numbers(eager, example, reference)
    if stochastic:
        reference = checked_run(eager, example, stochastic)
    reference_dtypes = {t.dtype for t in reference.outputs if t.is_floating_point()}
    tol = [tolerance(d) for d in reference_dtypes] or [tolerance(torch.float32)]
    base = {"rtol": max(t[0] for t in tol), "atol": max(t[1] for t in tol)}
    records: list[TunedRecord] = []
    candidates: list[tuple[str, nn.Module]] = [("eager", eager)]
    extra: dict[str, dict[str, Any]] = {"eager": {"compile_seconds": 0.0}}
    errors: dict[str, dict[str, Any]] = {"eager": {"output_max_abs": 0.0, "grad_max_abs": 0.0, "tolerance": base,
                                                   "random": stochastic}}
    warm = timer.time(eager, example)
    ctx.run_example = lambda m: run_once(m, example, keep=False)
    wide: list[RunResult | None] = []

    def truth() -> RunResult | None:
        """A float64 run of the module, made once, when a candidate first needs it."""
        if not wide:
            wide.append(float64_run(module, example, stochastic))
        return wide[0]

    for name in todo:
        if name == "eager":
            continue
        if deadline.over():
            break
        progress(name)
        candidate = copy.deepcopy(module)
        ctx.notes = []
        try:
            with _quiet_compiler():
                if name in S.COMPILING:
                    fresh_caches()  # no cache entries left by the candidates before it
                reasons = fallback_reasons()
                notes = S.apply(name, candidate, ctx)
                graphs, frames = graphs_compiled(), frames_compiled()
                start = timer.clock()
                run_once(candidate, example, keep=False)  # compiles, for the compiling strategies
                compile_seconds = timer.clock() - start
                # Frames dynamo set out to compile, and graphs it made of them (a frame
                # whose code it compiled before is reused: neither moves).
                tried, made = frames_compiled() - frames, graphs_compiled() - graphs
                result = checked_run(candidate, example, stochastic)
        except Exception as exc:  # noqa: BLE001 - any failure of a candidate is recorded, never raised
            records.append(TunedRecord(signature, name, "failed", env=env, describe=info, message=_one_line(exc)))
            continue
        if name in S.COMPILING and made == 0:
            # A sparse GCN's "compile ok, error 0, as fast as eager": nothing was compiled.
            records.append(TunedRecord(signature, name, "failed", env=env, describe=info,
                                       message=_nothing_compiled(reasons, fallback_reasons(), tried)))
            continue
        check = compare(reference, result, truth)
        figures = {**check.to_dict(), "tolerance": base, "random": stochastic}
        if not check.ok:
            message = check.message or "differs from eager"
            if stochastic:
                message += " (checked with dropout off and the same random numbers)"
            records.append(TunedRecord(signature, name, "wrong", errors=figures, env=env, describe=info,
                                       message=message))
            continue
        candidates.append((name, candidate))
        extra[name] = {"compile_seconds": compile_seconds, "notes": notes}
        errors[name] = figures
    ctx.run_example = None
    # A discarded warm-up round (caches, allocator, thread pools), then the samples.
    warm = min(interleaved(timer, candidates, example, 1)["eager"][0], warm)
    iterations = max(1, math.ceil(min_sample_seconds / max(warm, 1e-9)))
    samples = interleaved(timer, candidates, example, repeats, iterations, should_stop=deadline.over)
    for name, values in samples.items():
        s = Samples.of(values)
        stats = {"median": s.median, "p10": s.p10, "p90": s.p90, "iqr": s.iqr, "n": len(s),
                 "iterations": iterations, "noisy": s.is_noisy(), **extra[name]}
        records.append(TunedRecord(signature, name, "ok", samples=list(values), stats=stats, errors=errors[name],
                                   env=env, describe=info))
    return records


# ------------------------------------------------------------------ distributed


def exchange(payload: str) -> list[str]:
    """Every rank's text, in rank order (JSON over tensors: no pickle)."""
    dist = torch.distributed
    data = torch.tensor(list(payload.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [bytes(g[: int(s.item())].tolist()).decode() for g, s in zip(gathered, sizes)]


# ------------------------------------------------------------------ the tuner


def tune_subgraphs(subgraphs: Sequence[Subgraph], options: TuneOptions, *, timer: Timer | None = None,
                   progress: Progress | None = None, log: Callable[[str], None] | None = None) -> TuneReport:
    """Tune (what is not known yet) and apply the winners, for captured subgraphs."""
    import json

    from torchaxe.backends import get_backend

    started = time.perf_counter()
    target = _resolve_target(options.target)
    backend = get_backend(target)
    timer = timer or Timer(synchronize=backend.synchronize)
    deadline = _Deadline(options.budget, timer.clock)
    env = environment(target, options.compile_backend)
    say = log or (lambda s: None)
    identity = _distributed()

    with KnowledgeBase.open(options.kb) as kb:
        report = TuneReport(kb=str(kb.path), rank=identity[0] if identity else None,
                            world_size=identity[1] if identity else None)
        groups: dict[str, list[Subgraph]] = {}
        parts_of: dict[str, dict[str, Any]] = {}
        for sg in subgraphs:
            if sg.skipped or sg.spec is None:
                report.skipped.append((sg.name, sg.skipped or "never called"))
                continue
            parts = signature_parts(sg.module, sg.spec, sg.autocast)
            sig = signature_of(parts)
            groups.setdefault(sig, []).append(sg)
            parts_of[sig] = parts
        ordered = list(groups)
        mine = set(ordered if identity is None else sorted(ordered)[identity[0]::identity[1]])

        plans: dict[str, tuple[list[str], dict[str, str]]] = {}
        contexts: dict[str, S.StrategyContext] = {}
        for sig in ordered:
            first = groups[sig][0]
            ctx = S.StrategyContext(target=target, compile_backend=options.compile_backend)
            contexts[sig] = ctx
            unavailable = {}
            wanted = []
            for name in options.strategies:
                why = S.unavailable(name, first.module, ctx)
                if why:
                    unavailable[name] = why
                else:
                    wanted.append(name)
            done = set() if options.retune else kb.measured_strategies(sig)
            todo = [n for n in wanted if n not in done]
            plans[sig] = (todo, unavailable)

        total = sum(len([n for n in plans[s][0] if n != "eager"]) for s in ordered if s in mine)
        count = 0
        for sig in ordered:
            todo, unavailable = plans[sig]
            first = groups[sig][0]
            result = SubgraphResult(sig, parts_of[sig]["module"], [g.name for g in groups[sig]], "known",
                                    unavailable=unavailable)
            report.subgraphs.append(result)
            if sig not in mine:
                result.status = "remote"
                continue
            if not todo:
                continue
            if deadline.over():
                result.status = "budget"
                continue
            label = f"{first.name} ({result.module.rsplit('.', 1)[-1]}, x{len(groups[sig])})"
            say(f"tuning {label}: {', '.join(todo)}")

            def step(name: str, label: str = label) -> None:
                nonlocal count
                count += 1
                if progress is not None:
                    progress(f"{label} {name}", count, total)

            assert first.example is not None
            try:
                records = measure_signature(sig, parts_of[sig], first.module, first.example, todo, contexts[sig],
                                            env, repeats=options.repeats,
                                            min_sample_seconds=options.min_sample_seconds, timer=timer,
                                            deadline=deadline, progress=step)
            except Exception as exc:  # noqa: BLE001 - eager itself cannot run on a copy: leave it alone
                result.status = "failed"
                result.notes.append(f"eager forward + backward of a copy failed: {_one_line(exc)}")
                continue
            kb.add(records)
            result.records = records
            result.status = "tuned"
            measured = {r.strategy for r in records}
            if any(n not in measured for n in todo):
                result.status = "budget"

        if identity is not None:
            mine_records = [r.to_dict() for s in report.subgraphs for r in s.records]
            for text in exchange(json.dumps(mine_records)):
                kb.add([TunedRecord.from_dict(d, "record from another rank") for d in json.loads(text)])

        choices: dict[str, str | None] = {}
        for sig in ordered:
            winner = choose(kb.latest(sig).values(), options.min_gain)
            choices[sig] = winner.strategy if winner is not None else None
        if identity is not None:
            # Every rank applies rank 0's choices, whatever its own file says.
            choices = json.loads(exchange(json.dumps(choices))[0])

        for result in report.subgraphs:
            latest = kb.latest(result.signature)
            result.winner = choices.get(result.signature)
            eager = latest.get("eager")
            result.eager_median = eager.median if eager is not None and eager.status == "ok" else None
            if result.winner is not None and result.winner in latest:
                result.winner_median = latest[result.winner].median
        levels = {sig: groups[sig][0].depth for sig in ordered}
        held = _one_level(report.subgraphs, levels, {sig: len(groups[sig]) for sig in ordered})
        for result in report.subgraphs:
            if result.signature in held:
                result.notes.append(held[result.signature])
                continue
            if options.apply and result.winner not in (None, "eager"):
                for sg in groups[result.signature]:
                    try:
                        begun = time.perf_counter()
                        notes = S.apply(result.winner, sg.module, contexts[result.signature])
                        report.apply_seconds += time.perf_counter() - begun
                        result.notes.extend(n for n in notes if n not in result.notes)
                    except Exception as exc:  # noqa: BLE001
                        result.notes.append(f"could not apply {result.winner} to {sg.name}: {_one_line(exc)}")
                        continue
                    report.applied.append((sg.name, result.winner))
    report.budget_exhausted = deadline.hit
    report.seconds = time.perf_counter() - started
    return report


def _saving(result: SubgraphResult, copies: int) -> float:
    """Seconds per forward + backward the winner saves over eager, for every copy."""
    if result.winner in (None, "eager") or not result.eager_median or not result.winner_median:
        return 0.0
    return copies * (result.eager_median - result.winner_median)


def _one_level(results: Sequence[SubgraphResult], levels: dict[str, int], copies: dict[str, int]) -> dict[str, str]:
    """With the whole model tuned as well as its subgraphs, the winners of one level
    only: the whole model's, or the subgraphs' (together), whichever saves more time
    per forward + backward. Returns the signatures *not* applied, with why."""
    whole = [r for r in results if levels.get(r.signature) == 0]
    parts = [r for r in results if levels.get(r.signature, 0) > 0]
    if not whole or not parts:
        return {}
    root = whole[0]
    root_saving = _saving(root, 1)
    parts_saving = sum(_saving(r, copies.get(r.signature, 1)) for r in parts)
    if root_saving > parts_saving:
        why = (f"not applied: the whole model's winner ({root.winner}) saves {duration(root_saving, 2)} per "
               f"forward + backward, the subgraphs' winners together {duration(parts_saving, 2)}")
        return {r.signature: why for r in parts if r.winner not in (None, "eager")}
    if root.winner in (None, "eager"):
        return {}
    return {root.signature: f"not applied: the subgraphs' winners together save {duration(parts_saving, 2)} per "
                            f"forward + backward, the whole model's ({root.winner}) {duration(root_saving, 2)}"}


def compiled_note(report: TuneReport, root: str, cls: str) -> str:
    """What the figures mean for a script that compiles its model itself: its steps
    run the whole model's ``compile`` already, so that, not eager, is the baseline."""
    result = next((r for r in report.subgraphs if root in r.names), None)
    compiled = next((r.median for r in (result.records if result else []) if r.strategy == "compile"
                     and r.status == "ok" and r.median), None)
    head = (f"the script compiles {cls} itself (torch.compile): its steps run compiled already, so the "
            f"\"x eager\" figures overstate what tuning adds")
    if result is None or compiled is None or not result.winner_median:
        return head + "; measure against the script's own run with `torchaxe advise`"
    return (head + f"; the whole model compiled as the script does: {duration(compiled, 3)}, its winner "
            f"({result.winner}) {duration(result.winner_median, 3)}, {compiled / result.winner_median:.2f}x over it")


def tune(model: nn.Module, example_inputs: Any, options: TuneOptions | None = None, *, timer: Timer | None = None,
         progress: Progress | None = None, log: Callable[[str], None] | None = None, **overrides: Any) -> TuneReport:
    """Tune ``model`` on ``example_inputs`` (a tensor or a tuple of positional
    arguments, with the shapes of training) and swap the winners in; options as
    keywords (``budget=600, kb="team.sqlite"``) or a :class:`TuneOptions`."""
    options = _options(options, overrides)
    if not isinstance(model, nn.Module):
        raise TorchaxeError(f"tune: expected a torch.nn.Module, got {type(model).__name__}")
    recorder = capture(model, example_inputs, options.depth, whole=options.whole_model)
    return tune_subgraphs(recorder.subgraphs(), options, timer=timer, progress=progress, log=log)


def apply(model: nn.Module, example_inputs: Any = None, options: TuneOptions | None = None,
          **overrides: Any) -> TuneReport | "LazyApply":
    """Swap in the knowledge base's winners without tuning anything.

    With ``example_inputs`` the model is captured at once and a report is returned.
    Without, the winners are applied right after the model's first forward (its
    shapes are then known) and a :class:`LazyApply` is returned, whose ``report``
    is filled in then."""
    options = _options(options, overrides)
    options = TuneOptions(**{**options.__dict__, "strategies": (), "retune": False})
    if example_inputs is not None:
        recorder = capture(model, example_inputs, options.depth, whole=options.whole_model)
        return tune_subgraphs(recorder.subgraphs(), options)
    lazy = LazyApply(model, options)
    lazy.install()
    return lazy


class LazyApply:
    """Applies the winners after the model's first forward (see :func:`apply`)."""

    def __init__(self, model: nn.Module, options: TuneOptions,
                 on_report: Callable[[TuneReport], None] | None = None) -> None:
        self.model = model
        self.options = options
        self.on_report = on_report
        self.report: TuneReport | None = None
        self.recorder: CallRecorder | None = None
        self._handles: list[Any] = []
        self._stance: Any = None

    def install(self) -> None:
        from torchaxe.runtime.dynamo import eager_stance

        # A model the script compiled itself: its subgraphs are those of the module it
        # wraps, and the first forward runs eagerly, so that the compiler does not
        # trace the capture's hooks into the script's graph.
        inner = compiled_by_script(self.model)
        if inner is not None:
            self._stance = eager_stance()
        self.recorder = CallRecorder(inner if inner is not None else self.model, self.options.depth,
                                     keep_examples=False, whole=self.options.whole_model)
        self.recorder.install()
        self._handles.append(self.model.register_forward_hook(self._after_first, always_call=True))

    def _after_first(self, module: nn.Module, args: tuple, output: Any) -> None:
        recorder = self.recorder
        for h in self._handles:
            h.remove()
        self._handles.clear()
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)
        if recorder is None:
            return
        recorder.remove()
        self.recorder = None
        self.report = tune_subgraphs(recorder.subgraphs(), self.options)
        if self.on_report is not None:
            self.on_report(self.report)


def _options(options: TuneOptions | None, overrides: dict[str, Any]) -> TuneOptions:
    if options is None:
        try:
            return TuneOptions(**overrides)
        except TypeError as exc:
            raise TorchaxeError(f"tune: {exc}") from None
    if overrides:
        return TuneOptions(**{**options.__dict__, **overrides})
    return options


def parse_budget(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``1.5h`` -> seconds."""
    value = text.strip().lower()
    scale = 1.0
    for suffix, factor in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if value.endswith(suffix):
            value, scale = value[: -len(suffix)], factor
            break
    try:
        seconds = float(value) * scale
    except ValueError:
        raise TorchaxeError(f"--budget {text!r}: expected a duration such as 90s, 10m or 1h") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise TorchaxeError(f"--budget {text!r}: must be a positive duration")
    return seconds


__all__ = ["tune", "apply", "TuneOptions", "TuneReport", "SubgraphResult", "LazyApply", "parse_budget",
           "tune_subgraphs", "measure_signature", "environment", "exchange"]
