"""The trial bootstrap: apply one knob set inside a fresh process, then run the
user's unmodified script under the harness and write its Profile.

    python -m torchaxe.runtime.bootstrap KNOBS.json [--out PROFILE.json] [--steps N]
        [--warmup K] [--timeout S] [--first-step-timeout S] [--target T] -- python train.py ARGS

Each knob is a plugin (``runtime/knobs.py``): its patch is entered into one
``ExitStack`` in the registry's order and undone in reverse when the run ends. Two
phases, so that every knob takes effect where it must:

1. before torch is imported: environment variables, CPU affinity and core binding
   (``OMP_NUM_THREADS`` and the affinity mask size torch's thread pools at import);
2. after the script's command is read: the npu compile mode (through
   ``torchaxe.backends.npu``), torch settings, then the patches that act while the
   script runs (``DataLoader.__init__`` for loader settings and bucketing,
   ``Tensor.backward`` for the loss record, ``nn.Module.__call__`` for autocast,
   compile and tuned subgraphs, the import system for source overlays);
3. the harness (``Harness(HarnessOptions(...)).run``) runs the script and stops it
   after warmup + steps. What was applied is recorded in the profile under
   ``run.options.knobs``.

Settings the script makes itself (its own ``torch.set_num_threads``, its own
``num_workers=``) are overridden only for the DataLoader keywords; torch settings the
script changes after start-up win over the knob. The user's files are never edited.
Exit code: the harness's (``exit_code_for``: 0 measured, 3 the script raised, 4
``sys.exit`` non-zero, 5 timeout, 6 no steps, 130 interrupted), or 2 when the knobs
cannot be applied (one line on stderr, starting ``torchaxe bootstrap: error:``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import ExitStack
from typing import Sequence

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.knobs import AppliedKnobs, KnobSet, installed, load_knob_set

#: Where the applied knobs are recorded in the profile: ``run.options[OPTIONS_KEY]``.
OPTIONS_KEY = "knobs"


def apply_knobs(stack: ExitStack, knobs: KnobSet, applied: AppliedKnobs, *, before_torch: bool) -> None:
    """Enter each knob's patch of one phase into ``stack`` (undone in reverse order when it closes)."""
    for spec, value in knobs.active(before_torch=before_torch):
        stack.enter_context(spec.patch(value, applied))


def _steps(text: str) -> int | None:
    if text.lower() == "all":
        return None
    return int(text)


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise TorchaxeError("usage: python -m torchaxe.runtime.bootstrap KNOBS.json [options] -- python train.py ARGS")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m torchaxe.runtime.bootstrap")
    parser.add_argument("knobs")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=_steps, default=10, help="measured steps, or `all` to run to the end")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--first-step-timeout", type=float, default=None,
                        help="stop when no step has ended this many seconds after training started")
    parser.add_argument("--target", default="auto")
    parser.add_argument("--ops", action="store_true")
    parser.add_argument("--shapes", action="store_true")
    parser.add_argument("--step-marker", default=None)
    parser.add_argument("--flops", action="store_true", help="count one step's FLOPs and measure the peak (MFU)")
    parser.add_argument("--protect-writes", default=None, metavar="DIR",
                        help="keep copies of the files the run writes in DIR, for runtime/protect.py's restore")
    parser.add_argument("--quiet", action="store_true",
                        help="no closing status line (torchaxe run: the script's own output is all there is)")
    parser.add_argument("--context-out", default=None,
                        help="also write the run's imported files and settings here (runtime/run_context.py)")
    return parser.parse_args(argv[:cut]), argv[cut + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    """Apply the knobs, run the script under the harness, write the profile."""
    stack = ExitStack()
    try:
        args, command_argv = _parse(sys.argv[1:] if argv is None else argv)
        knobs = load_knob_set(args.knobs)
        applied = AppliedKnobs(knobs)
        apply_knobs(stack, knobs, applied, before_torch=True)

        from torchaxe.runtime.command import parse_command
        from torchaxe.runtime.harness import Harness, HarnessOptions, exit_code_for

        script = parse_command(command_argv)
        if args.protect_writes:
            from torchaxe.runtime.protect import WriteGuard, guard_roots

            WriteGuard(args.protect_writes, guard_roots(script.folder)).install().watch_torch_save()
        options = HarnessOptions(steps=args.steps, warmup=args.warmup, timeout=args.timeout, target=args.target,
                                 ops=args.ops, shapes=args.shapes, step_marker=args.step_marker,
                                 first_step_timeout=args.first_step_timeout, flops=args.flops)
        out = args.out or tempfile.mkstemp(prefix="torchaxe-trial-", suffix=".json")[1]
        # Under torchrun every rank writes its own file: OUT.rankN.json (and its context).
        from torchaxe.runtime.harness import distributed_identity
        from torchaxe.runtime.profile import rank_path

        rank, _, world = distributed_identity()
        out = str(rank_path(out, rank, world))
        if args.context_out:
            args.context_out = str(rank_path(args.context_out, rank, world))
        if args.context_out:
            from torchaxe.runtime.run_context import ModelProbe, OptimizerProbe

            stack.enter_context(installed(ModelProbe()))
            stack.enter_context(installed(OptimizerProbe()))
        apply_knobs(stack, knobs, applied, before_torch=False)
    except TorchaxeError as exc:
        stack.close()
        sys.stderr.write(f"torchaxe bootstrap: error: {exc.message}\n")
        return 2

    from torchaxe.runtime.profile import save_profile

    def write_context() -> None:
        if args.context_out:
            from torchaxe.runtime import run_context

            try:
                run_context.write(args.context_out)
            except OSError as exc:
                sys.stderr.write(f"torchaxe bootstrap: cannot write {args.context_out}: {exc}\n")

    def abandon(measured) -> None:
        measured.run.options[OPTIONS_KEY] = applied.record
        save_profile(measured, out)
        write_context()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code_for(measured))

    with stack:
        profile = Harness(options, abandon=abandon).run(script)
    profile.run.options[OPTIONS_KEY] = applied.record
    save_profile(profile, out)
    write_context()
    code = exit_code_for(profile)
    if profile.error is not None and profile.error.traceback:
        sys.stderr.write(profile.error.traceback)
    if not args.quiet:
        sys.stderr.write(f"torchaxe bootstrap: {profile.status}: {profile.detail}; profile written to {out}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    if profile.status in ("stopped", "timeout", "interrupted"):
        # A stopped script can leave non-daemon threads (a prefetcher) that would
        # keep the process alive: leave without waiting for them.
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
