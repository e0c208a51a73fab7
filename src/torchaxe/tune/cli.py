"""``torchaxe tune``: tune the fixed-shape subgraphs of a training script's model."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, TextIO

import click

from torchaxe.backends import TARGET_CHOICES
from torchaxe.console import CONTEXT
from torchaxe.runtime.other_load import OtherLoad, OtherLoadWatch
from torchaxe.runtime.torchrun import in_ranks
from torchaxe.errors import TorchaxeError
from torchaxe.tune.strategies import ALL as STRATEGIES
from torchaxe.units import duration

EPILOG = """\b
Exit codes:
  0    tuned (or nothing left to tune); the report says what won
  2    usage error, the script failed before its model ran, or an unusable knowledge base
"""


@click.command("tune", context_settings=CONTEXT, epilog=EPILOG)
@click.option("--budget", default=None, metavar="DURATION",
              help="Stop measuring after this long (90s, 10m, 1h); the next run resumes where it stopped.")
@click.option("--kb", "kb_path", default=None, metavar="PATH",
              help="Knowledge base file (default $TORCHAXE_HOME/kb.sqlite).")
@click.option("--depth", type=click.IntRange(min=1), default=1, show_default=True,
              help="Subgraphs are the modules at this depth of the model's call tree (1: what forward calls).")
@click.option("--whole-model/--no-whole-model", default=True, show_default=True,
              help="Also tune the model as one graph, and keep its winner or the subgraphs' winners, "
                   "whichever saves more per forward + backward.")
@click.option("--strategies", default=None, metavar="LIST",
              help=f"Comma-separated subset of: {', '.join(STRATEGIES)} (default: all that apply).")
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True,
              help="Training steps to watch (for the shapes) before tuning; then the script is stopped.")
@click.option("--repeats", type=click.IntRange(min=1), default=7, show_default=True,
              help="Interleaved timing rounds per subgraph.")
@click.option("--min-gain", type=click.FloatRange(0, 1, max_open=True), default=0.05, show_default=True,
              help="A strategy must beat eager by this fraction to be chosen.")
@click.option("--target", type=click.Choice(TARGET_CHOICES, case_sensitive=False), default="auto",
              show_default=True, help="Device backend (synchronisation, which strategies apply).")
@click.option("--compile-backend", default="inductor", show_default=True,
              help="torch.compile backend of the compiling strategies.")
@click.option("--retune", is_flag=True, help="Measure again what the knowledge base already has.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Limit on the watched part of the script.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema torchaxe.tune/1).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def tune(budget, kb_path, depth, whole_model, strategies, steps, repeats, min_gain, target, compile_backend, retune, timeout,
         as_json, command):
    """Auto-tune the model's fixed-shape subgraphs and keep the winners.

    Runs the unmodified script in this process until its model has run --steps
    training steps, cuts the model into subgraphs (the modules at --depth of its call
    tree; modules whose shapes change between calls are left alone), and measures on
    each distinct subgraph (identical blocks are tuned once) every strategy: eager,
    torch.compile, max-autotune, channels_last, the scanner's fused replacements, AOE on
    npu. Each candidate is checked against eager (outputs and gradients) and timed
    forward + backward, interleaved. Results go to the knowledge base; a later run
    measures only what is missing, and `torchaxe trial` / `torchaxe.tune.apply(model)`
    use the winners. Progress goes to stderr, the report to stdout.

    \b
    Examples:
      torchaxe tune -- python train.py
      torchaxe tune --budget 10m --kb team.sqlite -- python train.py --batch-size 32
    """
    from torchaxe.runtime.command import check_module, parse_command
    from torchaxe.tune.tuner import TuneOptions, parse_budget

    chosen = tuple(s.strip() for s in strategies.split(",") if s.strip()) if strategies else STRATEGIES
    options = TuneOptions(kb=kb_path, budget=parse_budget(budget) if budget else None, depth=depth,
                          whole_model=whole_model, strategies=chosen, repeats=repeats, min_gain=min_gain, target=target,
                          compile_backend=compile_backend, retune=retune)
    in_ranks(command)
    script = parse_command(command)
    check_module(script)
    if kb_path is not None:
        from torchaxe.kb import KnowledgeBase

        KnowledgeBase.open(kb_path).close()  # a bad file is reported before the script runs
    report = tune_script(script, options, steps=steps, timeout=timeout, err=sys.stderr, watch=OtherLoadWatch())
    if as_json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        render(report, sys.stdout, command=list(command), kb=kb_path)


def busy_tuning_note(load: OtherLoad | None) -> str | None:
    """A note for the report when other processes shared the cores while tuning: the
    timings then mislead (a Dropout measured at 31 ms fwd+bwd that takes 0.9 ms)."""
    if load is None or not load.busy:
        return None
    return (f"other processes kept {load.cores:.1f} of the {load.usable} usable cores busy while this tuned "
            f"(busiest: {load.describe()}): timings on shared cores are slower and noisier, by far more than the "
            "share taken, and a winner may be the machine's; tune again on an idle machine with --retune for "
            "winners to rely on")


def tune_script(script: Any, options: Any, *, steps: int, timeout: float | None, err: TextIO,
                watch: OtherLoadWatch | None = None):
    """Watch the script's first steps, capture its model, tune it."""
    from torchaxe.runtime.harness import DEFAULT_FIRST_STEP_TIMEOUT, Harness, HarnessOptions
    from torchaxe.runtime.dynamo import compiled_by_script, eager_stance
    from torchaxe.runtime.first_model import FirstModel
    from torchaxe.tune.capture import CallRecorder
    from torchaxe.tune.tuner import compiled_note, tune_subgraphs

    holder: dict[str, Any] = {}

    def on_model(model):
        inner = compiled_by_script(model)
        if inner is not None:
            # The script compiles the model itself: the watched steps run it eagerly
            # (the compiler would trace the recorder's hooks into the script's graph,
            # and recompile at each module), and its subgraphs are the wrapped module's.
            holder["compiled"] = type(inner).__name__
            holder["stance"] = eager_stance()
            model = inner
        holder["recorder"] = CallRecorder(model, options.depth, whole=options.whole_model).install()

    finder = FirstModel(on_model).install()
    err.write(f"torchaxe tune: watching {steps} step(s) of {script.display} for the model and its shapes\n")
    try:
        # The script's own prints are chatter: stdout is for the report.
        with contextlib.redirect_stdout(err):
            profile = Harness(HarnessOptions(steps=steps, warmup=0, timeout=timeout, target=options.target,
                                             first_step_timeout=DEFAULT_FIRST_STEP_TIMEOUT)).run(script)
    finally:
        finder.uninstall()
        if "recorder" in holder:
            holder["recorder"].remove()
        if holder.get("stance") is not None:
            holder["stance"].__exit__(None, None, None)
    recorder = holder.get("recorder")
    if recorder is None:
        detail = f" ({profile.detail})" if profile.status in ("error", "exited", "timeout") else ""
        raise TorchaxeError(f"the script never called a module with parameters, so there is no model to tune"
                            f"{detail}")
    if profile.status == "error":
        raise TorchaxeError(f"the script failed: {profile.detail}")
    _ensure_process_group()
    subgraphs = recorder.subgraphs()
    if watch is not None:
        watch.start()
    try:
        with _Progress(err) as progress:
            report = tune_subgraphs(subgraphs, options, progress=progress.update, log=lambda line: progress.log(line))
    finally:
        load = watch.stop() if watch is not None else None
    if "compiled" in holder:
        root = next((sg.name for sg in subgraphs if sg.depth == 0), holder["compiled"])
        report.notes.append(compiled_note(report, root, holder["compiled"]))
    busy = busy_tuning_note(load)
    if busy is not None:
        report.notes.append(busy)  # last: it qualifies every figure above
    return report


def _ensure_process_group() -> None:
    """Under torchrun, the harness closes the script's process group when the script
    stops; distributed tuning needs one, so a gloo group is opened from the same
    environment."""
    import os

    import torch

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and torch.distributed.is_available() and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")


class _Progress:
    """A rich bar on stderr when it is a terminal; plain lines otherwise."""

    def __init__(self, err: TextIO) -> None:
        self.err = err
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> "_Progress":
        if self.err.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("tuning {task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(file=self.err), transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=None)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, what: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=what, completed=done, total=total)
        else:
            self.err.write(f"torchaxe tune: [{done}/{total}] {what}\n")
            self.err.flush()

    def log(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            self.err.write(f"torchaxe tune: {line}\n")
            self.err.flush()


def render(report: Any, out: TextIO, command: list[str] | None = None, kb: str | None = None) -> None:
    """The report as text: one block per distinct subgraph; with the tuned
    ``command``, what to run next when a winner would be swapped in."""
    where = f" (rank {report.rank} of {report.world_size})" if report.world_size else ""
    out.write(f"Tuned subgraphs{where}; knowledge base {report.kb}\n")
    for s in report.subgraphs:
        names = ", ".join(s.names[:4]) + (f" (+{len(s.names) - 4})" if len(s.names) > 4 else "")
        speed = f", {s.speedup:.2f}x eager" if s.speedup else ""
        out.write(f"\n{s.module.rsplit('.', 1)[-1]}  [{names}]  {s.status}; winner: {s.winner or '-'}{speed}\n")
        eager, winner = duration(s.eager_median, 3, missing="-"), duration(s.winner_median, 3, missing="-")
        out.write(f"  signature {s.signature}; eager {eager}, winner {winner}\n")
        for r in s.records:
            if r.status == "ok":
                median = duration(r.median, 3, missing="-")
                out.write(f"  {r.strategy:<16} ok      {median} fwd+bwd (n={len(r.samples)}, "
                          f"error {r.errors.get('output_max_rel', 0):.1e} out / {r.errors.get('grad_max_rel', 0):.1e} grad"
                          + ("; as close to float64 as eager" if r.errors.get("float64_checked") else "") + ")\n")
            else:
                out.write(f"  {r.strategy:<16} {r.status:<7} {r.message}\n")
        for name, why in s.unavailable.items():
            out.write(f"  {name:<16} n/a     {why}\n")
        for note in s.notes:
            out.write(f"  note: {note}\n")
    for name, why in report.skipped:
        out.write(f"\nleft alone: {name}: {why}\n")
    for note in report.notes:
        out.write(f"\nnote: {note}\n")
    out.write(f"\n{report.measured} candidate(s) measured in {report.seconds:.1f} s; "
              f"{len(report.applied)} module(s) would use a tuned strategy")
    if report.budget_exhausted:
        out.write("; the budget ran out: run again to measure the rest")
    out.write("\n")
    if report.applied and command:
        table = "{}" if kb is None else "{kb = " + json.dumps(str(kb)) + "}"
        out.write(f"next: `torchaxe advise -- {' '.join(command)}` measures the winners on the whole run "
                  f"(knob:tune), beside the other changes; `tune = {table}` under [run] in torchaxe.toml swaps them "
                  "in under `torchaxe run`\n")
