"""``torchaxe shapes``: are the model's shapes static or dynamic, and which compile
mode suits it."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import click

from torchaxe.backends import TARGET_CHOICES
from torchaxe.console import CONTEXT, progress_printer, write_output
from torchaxe.runtime.torchrun import in_ranks
from torchaxe.errors import TorchaxeError, first_line

EPILOG = """\b
Exit codes:
  0    the shapes were recorded (and, with --try, every candidate measured)
  1    with --try: at least one candidate failed (its error is in the report)
  2    torchaxe could not do it: bad option, script not found, the script raised or
       exited before its first step, no step was seen (try --step-marker), a trace
       without shapes
  3    the script raised after its first steps: the shapes of the steps before it are
       reported, with the exception
"""


@click.command("shapes", context_settings=CONTEXT, epilog=EPILOG)
@click.option("--steps", type=click.IntRange(min=3), default=20, show_default=True,
              help="Training steps to record; then the script is stopped. Shapes are compared from step to step.")
@click.option("--max-shapes", type=click.IntRange(1, 8), default=4, show_default=True,
              help="K: the most distinct shapes bucketing may leave; the boundaries are chosen for the least padding.")
@click.option("--target", type=click.Choice(TARGET_CHOICES, case_sensitive=False), default="auto", show_default=True,
              help="The device the pick and --try are for (recommendations are given for every target); the shapes "
                   "are recorded on whatever device this machine has.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop recording after this many seconds.")
@click.option("--step-marker", metavar="MODULE:FUNCTION",
              help="End a step whenever this function returns, for loops without a torch.optim optimizer.")
@click.option("--try", "try_", is_flag=True,
              help="Also measure the candidate settings (eager, torch.compile static and dynamic, with bucketing; "
                   "jit_compile on and off on npu) in subprocesses, interleaved.")
@click.option("--try-steps", type=click.IntRange(min=2), default=10, show_default=True,
              help="With --try: steady-state steps per run, after the warm-up steps.")
@click.option("--try-warmup", type=click.IntRange(min=1), default=3, show_default=True,
              help="With --try: first steps of each run counted as compile/warm-up cost, reported separately.")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="With --try: rounds; each runs every candidate once (A B C A B C).")
@click.option("--compile-backend", default="inductor", show_default=True, metavar="NAME",
              help="With --try: the torch.compile backend of the compile candidates (inductor, aot_eager, eager).")
@click.option("--from-trace", "from_trace", metavar="PATH",
              help="Run nothing: decide from a torch_npu.profiler output (kernel_details.csv: Input Shapes, OP State) "
                   "or a torch.profiler trace recorded with record_shapes=True.")
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", show_default=True,
              help="text for people; json ({\"verdict\": ..., \"recommendations\": [...], ...}, schema "
                   "torchaxe.shapes/1) for scripts.")
@click.option("--out", "-o", metavar="FILE", help="Write the report to FILE (atomically) instead of stdout.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def shapes(steps, max_shapes, target, timeout, step_marker, try_, try_steps, try_warmup, repeats, compile_backend,
           from_trace, fmt, out, command):
    """Find out whether the model's shapes are static or dynamic, and which compile mode fits.

    Runs the training script unmodified for --steps steps with every operator's and
    module's input shapes recorded, and reports how many saw one shape and how many
    several; for the varying ones, which dimensions vary, their distribution and the
    cause where it can be traced (the collate function padding each batch to its
    longest sample, only the last partial batch, boolean-mask indexing,
    nonzero/unique, sizes read with .item()). The verdict (static, dynamic or mixed)
    comes with a recommendation per target: jit_compile on or off on the NPU,
    torch.compile static or dynamic (mark_dynamic) on cuda and cpu, cudnn.benchmark,
    and bucket boundaries for K = 1..8 shapes with their padding cost
    (torchaxe.shapes.BucketingCollate). --try measures the candidates.

    The script's own output goes to stderr, the report to stdout.

    \b
    Examples:
      torchaxe shapes -- python train.py
      torchaxe shapes --try --max-shapes 4 -- python train.py --batch-size 64
      torchaxe shapes --format json --target npu -- python -m mypkg.train
      torchaxe shapes --from-trace run_ascend_pt/
    """
    from torchaxe.backends import resolve_target
    from torchaxe.shapes.report import build_report, render_text, to_json

    resolved = resolve_target(target)
    code = 0
    if from_trace is not None:
        if command:
            raise TorchaxeError("--from-trace reads a trace: give it no training command")
        if try_:
            raise TorchaxeError("--try measures a run: give the training command instead of --from-trace")
        from torchaxe.shapes.trace import trace_shapes

        found = trace_shapes(from_trace)
        report = build_report(command=None, target=resolved, verdict=found.verdict, analysis=found.analysis,
                              source=f"trace {found.path} ({found.source})", steps=found.steps,
                              warnings=found.warnings, extra={"trace": {"path": found.path, "kind": found.source,
                                                                       "kernels": found.kernels,
                                                                       "op_state": found.states}})
    else:
        if not command:
            raise TorchaxeError("nothing to run: give the training command, e.g. `torchaxe shapes -- python train.py` "
                                "(or --from-trace PATH)")
        in_ranks(command)
        report, code = _run(list(command), steps, max_shapes, resolved, timeout, step_marker, try_, try_steps,
                            try_warmup, repeats, compile_backend)
        if _other_rank():
            # Under torchrun every rank records its shapes; rank 0 reports them (the ranks
            # run the same model on batches of one shape: one report, not one per rank).
            sys.exit(code)
    text = to_json(report) if fmt == "json" else _text(report, render_text)
    write_output(text, out, "--out")
    sys.exit(code)


def job_batches(command, profile) -> int | None:
    """The batches the whole job draws from its training loader, when the command
    states its length in steps (``--max_iters 300``): the steps times the batches a
    measured step drew (the median). None when it does not say, or steps draw none."""
    from torchaxe.runtime.job_command import batches_per_step, job_steps_in

    stated = job_steps_in(command)
    per_step = batches_per_step(s.batches for s in profile.steps if s.phase == "measured")
    if stated is None or not per_step:
        return None
    return stated[0] * per_step


def _other_rank() -> bool:
    """Whether this process is a rank other than 0 of a torchrun job."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0
    except ValueError:
        return False


#: A script's own switch that pads every batch to one length (Hugging Face examples'
#: ``--pad_to_max_length``).
_PADDING_SWITCH = re.compile(r"^--?pad[-_]to[-_]max(imum)?[-_]len(gth)?$")


def own_padding_switch(command: Sequence[str], script: Any = None) -> str | None:
    """The padding switch the command's script defines (``parser.add_argument(
    "--pad_to_max_length", ...)``, or a ``pad_to_max_length`` field of an argument
    dataclass) and the command does not pass; None otherwise. ``script``: the
    command's ScriptCommand, when parsed already. The script is read, never run; a
    module (``-m``) or an unreadable file has none."""
    import ast

    from torchaxe.runtime.command import parse_command

    if any(_PADDING_SWITCH.match(token.split("=", 1)[0]) for token in command):
        return None
    try:
        script = script if script is not None else parse_command(command)
        if script.kind != "path":
            return None
        tree = ast.parse(Path(script.target).read_text(encoding="utf-8"))
    except (TorchaxeError, OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _PADDING_SWITCH.match(arg.value):
                    return arg.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and _PADDING_SWITCH.match("--" + node.target.id):
            return "--" + node.target.id
    return None


def _text(report, render) -> str:
    import io

    buffer = io.StringIO()
    render(report, buffer)
    return buffer.getvalue()


def _run(command, steps, max_shapes, target, timeout, step_marker, try_, try_steps, try_warmup, repeats, backend):
    from torchaxe.runtime.command import check_module, parse_command
    from torchaxe.runtime.job_command import compile_switch_in
    from torchaxe.shapes.analysis import analyse
    from torchaxe.shapes.observe import observe
    from torchaxe.shapes.report import build_report
    from torchaxe.shapes.verdict import decide

    script = parse_command(command)
    check_module(script)  # one-line errors before anything runs
    progress = progress_printer("shapes")
    if try_:
        from torchaxe.backends import detect_target

        here = detect_target()
        if here != target:
            raise TorchaxeError(f"--try measures on this machine, which has {here}, not {target}: "
                                f"use --target {here}, or run --try where the {target} is")
    progress(f"recording shapes over {steps} steps of {' '.join(command)}")
    with contextlib.redirect_stdout(sys.stderr):  # the script's prints are not the report
        # recorded on whatever device this machine has; the advice is for --target
        observation = observe(command, steps=steps, timeout=timeout, step_marker=step_marker, target="auto")
    analysis = analyse(observation)
    from torchaxe.shapes.stream_chunks import chunk_sites

    chunks = chunk_sites(script.target) if script.kind == "path" else []
    verdict = decide(analysis, max_shapes, job_batches(command, observation.profile), chunks)
    own = compile_switch_in(command)
    if own is not None:
        for rec in verdict.recommendations:
            if rec.kind == "compile" and "torch.compile(" in rec.setting:
                rec.reason += (f"; the script has its own switch for it ({own} in this command): set that instead "
                               "of editing the code")
    padding = own_padding_switch(command, script) if any(r.kind == "bucketing" for r in verdict.recommendations) else None
    if padding is not None:
        for rec in verdict.recommendations:
            if rec.kind == "bucketing":
                rec.reason += (f"; the script has its own switch for one shape: {padding} pads every batch to the "
                               "maximum length (more padding than buckets, no code to change)")
    # the harness's notes on step-time statistics do not concern shapes
    warnings = [w for w in observation.profile.warnings
                if not w.startswith(("step time varies", "only ", "no measured steps"))]
    if observation.compiled_by_script:
        name = observation.compiled_by_script
        warnings.append(f"the script compiles {name} itself (torch.compile); it ran eagerly while shapes were "
                        "recorded (the compiler does not trace under the operator recorder), so the steps here are "
                        "eager ones")
        for rec in verdict.recommendations:
            if rec.kind == "compile" and "torch.compile(" in rec.setting:
                rec.reason += f"; the script compiles {name} already: keep its call, with this setting"
    error = observation.profile.error
    if error is not None:
        # The steps before it were recorded; the run did not end as the script meant it to.
        where = f" at {error.location}" if error.location else ""
        warnings.insert(0, f"the script raised {error.type}{where} after {observation.steps} of the {steps} steps "
                           f"asked for: {first_line(error.message)}; the shapes are those of the steps before it")
    elif observation.steps < steps:
        warnings.append(f"the script ended after {observation.steps} steps of the {steps} asked for")
    extra = {}
    if "torch_npu" in sys.modules:  # the script ran on the NPU: which compile mode it ran under
        from torchaxe.backends import npu

        extra["npu_compile_mode"] = {"jit_compile_in_effect": npu.jit_compile_enabled()}
        if extra["npu_compile_mode"]["jit_compile_in_effect"] is not None:
            warnings.append(f"the run used jit_compile={extra['npu_compile_mode']['jit_compile_in_effect']} "
                            "(read back with torch_npu.npu.is_jit_compile_false)")
    trial = None
    code = 3 if error is not None else 0
    if try_:
        from torchaxe.shapes.measure import run_compile_trial

        progress(f"measuring the candidates for {target}: {repeats} round(s) of {try_warmup} + {try_steps} steps")
        result = run_compile_trial(command, verdict, target, steps=try_steps, warmup=try_warmup, repeats=repeats,
                                   timeout=timeout, backend=backend, progress=progress)
        trial = result.to_dict()
        if any(not r.ok for r in result.results):
            code = code or 1
    report = build_report(command=command, target=target, verdict=verdict, analysis=analysis,
                          steps=observation.steps, max_shapes=max_shapes, warnings=warnings, trial=trial,
                          extra=extra)
    return report, code
