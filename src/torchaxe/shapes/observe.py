"""Run the user's script for a few steps and record every shape: the harness
(module and batch shapes, step boundaries, how the run ended) with the shape
recorders of ``recorder.py`` around it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.harness import DEFAULT_FIRST_STEP_TIMEOUT
from torchaxe.runtime.profile import Profile
from torchaxe.shapes.recorder import DataDependentSite, LoaderInfo, OpTally


class NoStepsError(TorchaxeError):
    """The run ended without a single training step."""


@dataclass
class Observation:
    """Everything one recorded run saw: the profile (steps, module shapes) and the
    operator, data-dependent and loader records."""

    profile: Profile
    ops: list[OpTally] = field(default_factory=list)
    sites: list[DataDependentSite] = field(default_factory=list)
    loaders: list[LoaderInfo] = field(default_factory=list)
    #: Steps the operator records cover in full (an unfinished last one left out).
    complete_steps: int = 0
    #: The class of the model the script compiled itself (``torch.compile(model)``),
    #: which ran eagerly here: the operator recorder is a dispatch mode, under which
    #: the compiler does not trace.
    compiled_by_script: str | None = None

    @property
    def steps(self) -> int:
        return len(self.profile.steps)


def observe(command: list[str], steps: int = 20, timeout: float | None = None, step_marker: str | None = None,
            target: str = "auto", first_step_timeout: float | None = DEFAULT_FIRST_STEP_TIMEOUT) -> Observation:
    """Run ``command`` (``python train.py ARGS``) in this process for ``steps`` steps
    with every shape recorded. Raises :class:`NoStepsError` (with the
    ``--step-marker`` hint) when no step was seen, and TorchaxeError when the
    script fails before its first step. A script that shows no step
    ``first_step_timeout`` seconds after training started is stopped there."""
    from torchaxe.runtime.command import parse_command
    from torchaxe.runtime.dynamo import compiled_by_script
    from torchaxe.runtime.first_model import FirstModel
    from torchaxe.runtime.harness import HarnessOptions
    from torchaxe.runtime.probes import CodeMap
    from torchaxe.shapes.recorder import LoaderProbe, make_op_recorder

    script = parse_command(command)
    options = HarnessOptions(steps=steps, warmup=0, shapes=True, timeout=timeout, step_marker=step_marker,
                             target=target, first_step_timeout=first_step_timeout)
    codes = CodeMap()
    recorder = make_op_recorder(codes)
    loaders = LoaderProbe(codes, recorder)
    compiled: list[str] = []

    def on_model(model: Any) -> None:
        inner = compiled_by_script(model)
        if inner is not None:
            compiled.append(type(inner).__name__)

    finder = FirstModel(on_model).install()
    loaders.install()
    try:
        recorder.watch_modules()
        recorder.__enter__()
        try:
            profile = _harness(options, recorder).run(script)
        finally:
            recorder.__exit__(None, None, None)
            recorder.unwatch_modules()
    finally:
        loaders.uninstall()
        finder.uninstall()
    if not profile.steps:
        if profile.error is not None:
            where = f" at {profile.error.location}" if profile.error.location else ""
            raise TorchaxeError(f"the script raised {profile.error.type}{where} before its first step: "
                                f"{profile.error.message}")
        if profile.status == "timeout":
            raise TorchaxeError(f"--timeout {timeout:g} s ran out before the first step")
        if profile.status == "exited" and profile.exit_code:
            raise TorchaxeError(f"the script called sys.exit({profile.exit_code}) before its first step")
        hint = profile.warnings[0] if profile.warnings else "no step was seen"
        if profile.status == "stopped":  # the first-step timeout
            hint = f"{profile.detail}; {hint}"
        if "--step-marker" not in hint:
            hint += "; if one call of a function of yours is one training step, pass --step-marker MODULE:FUNCTION"
        raise NoStepsError(f"{hint} (shapes are recorded per training step)")
    # Training's operators; an inference-only script has only the others.
    ops = recorder.training_ops() or list(recorder.eval_ops.values())
    return Observation(profile=profile, ops=ops, sites=list(recorder.sites.values()),
                       loaders=[info for info in loaders.loaders.values() if info.batches],
                       complete_steps=recorder.complete_steps, compiled_by_script=compiled[0] if compiled else None)


def _harness(options, recorder):
    """The harness, sharing its step boundaries with the recorder where it can
    (a harness without extra probes leaves the recorder its own clock: optimizer
    steps, else batches)."""
    import inspect

    from torchaxe.runtime.harness import Harness
    from torchaxe.shapes.recorder import SharedStepClock

    if "probes" in inspect.signature(Harness).parameters:
        return Harness(options, probes=[lambda steps: SharedStepClock(steps, recorder)])
    return Harness(options)
