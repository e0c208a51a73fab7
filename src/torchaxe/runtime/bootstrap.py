"""The trial bootstrap: apply one knob set inside a fresh process, then run the
user's unmodified script under the harness and write its Profile.

    python -m torchaxe.runtime.bootstrap KNOBS.json [--out PROFILE.json] [--steps N]
        [--warmup K] [--timeout S] [--target T] -- python train.py ARGS

Order, so that every knob takes effect where it must:

1. environment variables and CPU affinity, before torch is imported (``OMP_NUM_THREADS``
   and the affinity mask size torch's thread pools at import);
2. the npu compile mode, through ``torchaxe.backends.npu`` (imports ``torch_npu``);
3. torch settings: ``torch.backends.cudnn.benchmark``,
   ``torch.set_float32_matmul_precision``, ``torch.set_num_threads``,
   ``torch.set_num_interop_threads``;
4. patches that act while the script runs: ``DataLoader.__init__`` takes the
   dataloader overrides; ``nn.Module.__call__`` compiles the model (see
   :class:`ModelCompiler`);
5. the harness (``Harness(HarnessOptions(...)).run``) runs the script and stops it
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
import inspect
import os
import sys
import tempfile
from typing import Any, Sequence

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.first_model import FirstModel
from torchaxe.runtime.knobs import KnobSet, load_knob_set

#: Where the applied knobs are recorded in the profile: ``run.options[OPTIONS_KEY]``.
OPTIONS_KEY = "knobs"


class AppliedKnobs:
    """What the bootstrap actually did, for the profile (tests and users check it)."""

    def __init__(self, knobs: KnobSet) -> None:
        self.record: dict[str, Any] = {"name": knobs.name, "requested": knobs.to_dict()}

    def note(self, key: str, value: Any) -> None:
        self.record[key] = value


def apply_environment(knobs: KnobSet, applied: AppliedKnobs, environ: Any = os.environ) -> None:
    for var, value in knobs.env.items():
        if value is None:
            environ.pop(var, None)
        else:
            environ[var] = value
    if knobs.env:
        applied.note("env", dict(knobs.env))


def apply_affinity(knobs: KnobSet, applied: AppliedKnobs) -> None:
    if knobs.cpu_affinity is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise TorchaxeError("cpu_affinity: this platform has no os.sched_setaffinity")
    try:
        os.sched_setaffinity(0, set(knobs.cpu_affinity))
    except (OSError, ValueError) as exc:
        raise TorchaxeError(f"cpu_affinity {list(knobs.cpu_affinity)}: cannot pin to these CPUs: {exc}") from None
    applied.note("cpu_affinity", sorted(os.sched_getaffinity(0)))


def apply_npu(knobs: KnobSet, applied: AppliedKnobs) -> None:
    if knobs.npu.jit_compile is None:
        return
    from torchaxe.backends import npu

    try:
        npu.set_compile_mode(knobs.npu.jit_compile)
    except ModuleNotFoundError:
        raise TorchaxeError("npu.jit_compile: torch_npu is not installed here") from None
    applied.note("npu", {"jit_compile": knobs.npu.jit_compile})


def apply_torch(knobs: KnobSet, applied: AppliedKnobs) -> None:
    import torch

    t = knobs.torch
    done: dict[str, Any] = {}
    if t.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = t.cudnn_benchmark
        done["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    if t.matmul_precision is not None:
        torch.set_float32_matmul_precision(t.matmul_precision)
        done["matmul_precision"] = torch.get_float32_matmul_precision()
    if t.num_threads is not None:
        torch.set_num_threads(t.num_threads)
        done["num_threads"] = torch.get_num_threads()
    if t.interop_threads is not None:
        try:
            torch.set_num_interop_threads(t.interop_threads)
        except RuntimeError as exc:
            raise TorchaxeError(f"torch.interop_threads: {exc}") from None
        done["interop_threads"] = torch.get_num_interop_threads()
    if done:
        applied.note("torch", done)


class DataLoaderOverride:
    """Patches ``DataLoader.__init__`` so that every loader the script builds gets the
    knob's keywords, whether the script passed them by position, by name or not at all.
    ``prefetch_factor``, ``persistent_workers`` and ``multiprocessing_context`` need
    worker processes: on a loader that ends up with ``num_workers=0`` they are left out
    (torch refuses them there). The worker count of a loader over an
    ``IterableDataset`` is never changed: each worker iterates such a dataset whole
    unless it splits itself by ``get_worker_info()``, so another count could repeat or
    drop samples."""

    def __init__(self, overrides: dict[str, Any], applied: AppliedKnobs) -> None:
        self.overrides = overrides
        self.applied = applied
        self.loaders: list[dict[str, Any]] = []
        self._original = None

    def install(self) -> None:
        if not self.overrides:
            return
        from torch.utils.data import DataLoader

        original = DataLoader.__init__
        self._original = original
        signature = inspect.signature(original)
        override = self

        def __init__(loader, *args, **kwargs):
            try:
                bound = signature.bind(loader, *args, **kwargs)
            except TypeError:
                return original(loader, *args, **kwargs)  # let torch say what is wrong
            arguments = bound.arguments
            settings = dict(override.overrides)
            dataset = arguments.get("dataset")
            from torch.utils.data import IterableDataset

            if isinstance(dataset, IterableDataset) and "num_workers" in settings \
                    and settings["num_workers"] != arguments.get("num_workers", 0):
                # Each worker of an iterable dataset iterates it whole unless the
                # dataset splits itself by get_worker_info(): another worker count
                # could repeat or drop samples. Left as the script wrote it.
                settings.pop("num_workers")
            workers = settings.get("num_workers", arguments.get("num_workers", 0))
            if not workers:
                settings.pop("prefetch_factor", None)
                settings.pop("persistent_workers", None)
                settings.pop("multiprocessing_context", None)
            arguments.update(settings)
            final = {k: arguments.get(k, signature.parameters[k].default)
                     for k in ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                               "multiprocessing_context", "timeout")
                     if k in signature.parameters}
            context = final.get("multiprocessing_context")
            if context is not None and not isinstance(context, str):  # a context object: its method's name
                final["multiprocessing_context"] = getattr(context, "get_start_method", lambda: str(context))()
            override.loaders.append(final)
            override.applied.note("dataloader", {"overrides": override.overrides, "loaders": override.loaders})
            return original(*bound.args, **bound.kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        DataLoader.__init__ = __init__

    def uninstall(self) -> None:
        if self._original is not None:
            from torch.utils.data import DataLoader

            DataLoader.__init__ = self._original
            self._original = None


class ModelCompiler(FirstModel):
    """Compiles the model at its first forward, without touching the script.

    "The model" is found as runtime/first_model.py describes. It is compiled in place
    with ``module.compile(**kwargs)`` (``torch.compile`` of its ``forward``, same
    object, same ``state_dict`` keys, so the script's optimizer, checkpoints and
    ``.train()``/``.eval()`` calls all keep working). Only one model is compiled; a
    second top-level model (a GAN's discriminator) is not.
    """

    def __init__(self, kwargs: dict[str, Any], applied: AppliedKnobs) -> None:
        super().__init__(self.compile)
        self.kwargs = kwargs
        self.applied = applied

    def compile(self, module: Any) -> None:
        module.compile(**self.kwargs)
        self.applied.note("compile", {"module": type(module).__qualname__, "kwargs": self.kwargs})


class ModelAutocast(FirstModel):
    """Runs the model's forward under ``torch.autocast`` (mixed precision) without
    touching the script: "the model" is found as :class:`ModelCompiler` finds it, and
    its ``forward`` is wrapped on the instance at its first call. The autocast device
    is the one its parameters live on."""

    def __init__(self, dtype: str, applied: AppliedKnobs) -> None:
        super().__init__(self.wrap)
        self.dtype = dtype
        self.applied = applied

    def wrap(self, module: Any) -> None:
        import functools

        import torch

        device_type = next(module.parameters()).device.type
        dtype = getattr(torch, self.dtype)
        forward = module.forward

        @functools.wraps(forward)
        def autocast_forward(*args, **kwargs):
            with torch.autocast(device_type=device_type, dtype=dtype):
                return forward(*args, **kwargs)

        module.forward = autocast_forward
        self.applied.note("autocast", {"module": type(module).__qualname__, "device_type": device_type,
                                       "dtype": self.dtype})


class LossRecorder:
    """Records the value of every scalar tensor ``backward()`` is called on (the
    loss), by patching ``torch.Tensor.backward``. Reading it synchronises the device
    once per step, so it is only installed when asked for (``observe.loss``)."""

    LIMIT = 10_000

    def __init__(self, applied: AppliedKnobs) -> None:
        self.values: list[float] = []
        self._original = None
        applied.note("loss", self.values)

    def install(self) -> None:
        import torch

        original = torch.Tensor.backward
        self._original = original
        values = self.values

        def backward(tensor, *args, **kwargs):
            if tensor.numel() == 1 and len(values) < self.LIMIT:
                values.append(float(tensor.detach().float().cpu()))
            return original(tensor, *args, **kwargs)

        torch.Tensor.backward = backward

    def uninstall(self) -> None:
        if self._original is not None:
            import torch

            torch.Tensor.backward = self._original
            self._original = None



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
    parser.add_argument("--target", default="auto")
    parser.add_argument("--ops", action="store_true")
    parser.add_argument("--shapes", action="store_true")
    parser.add_argument("--step-marker", default=None)
    parser.add_argument("--protect-writes", default=None, metavar="DIR",
                        help="keep copies of the files the run writes in DIR, for runtime/protect.py's restore")
    parser.add_argument("--quiet", action="store_true",
                        help="no closing status line (torchaxe run: the script's own output is all there is)")
    parser.add_argument("--context-out", default=None,
                        help="also write the run's imported files and settings here (runtime/run_context.py)")
    return parser.parse_args(argv[:cut]), argv[cut + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    """Apply the knobs, run the script under the harness, write the profile."""
    try:
        args, command_argv = _parse(sys.argv[1:] if argv is None else argv)
        knobs = load_knob_set(args.knobs)
        applied = AppliedKnobs(knobs)
        apply_environment(knobs, applied)
        apply_affinity(knobs, applied)
        binding = None
        if knobs.bind is not None:  # before torch is imported, like cpu_affinity
            from torchaxe.bind.knob import BoundRun

            binding = BoundRun(knobs.bind, applied.note)

        from torchaxe.runtime.command import parse_command
        from torchaxe.runtime.harness import Harness, HarnessOptions, exit_code_for

        script = parse_command(command_argv)
        if args.protect_writes:
            from torchaxe.runtime.protect import WriteGuard, guard_roots

            WriteGuard(args.protect_writes, guard_roots(script.folder)).install().watch_torch_save()
        options = HarnessOptions(steps=args.steps, warmup=args.warmup, timeout=args.timeout, target=args.target,
                                 ops=args.ops, shapes=args.shapes, step_marker=args.step_marker)
        out = args.out or tempfile.mkstemp(prefix="torchaxe-trial-", suffix=".json")[1]
        apply_npu(knobs, applied)
        apply_torch(knobs, applied)
        loaders = DataLoaderOverride(knobs.dataloader.overrides(), applied)
        compiler = ModelCompiler(knobs.compile.kwargs(), applied) if knobs.compile is not None else None
        autocast = ModelAutocast(knobs.autocast.dtype, applied) if knobs.autocast is not None else None
        losses = LossRecorder(applied) if knobs.observe_loss else None
        bucketing = None
        if knobs.bucketing is not None:
            from torchaxe.shapes.knob import CollateBucketing

            bucketing = CollateBucketing(knobs.bucketing, applied.note)
        from torchaxe.runtime.overlay import check_overlay, source_overlay

        overlay = check_overlay(knobs.sources)
        tuned = None
        if knobs.tune is not None:
            from torchaxe.tune.knob import TunedModel

            tuned = TunedModel(knobs.tune, applied.note)
    except TorchaxeError as exc:
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

    probe = None
    if args.context_out:
        from torchaxe.runtime.run_context import ModelProbe

        probe = ModelProbe().install()
    loaders.install()
    if binding is not None:
        binding.install()
    if losses is not None:
        losses.install()
    if bucketing is not None:
        bucketing.install()
    if autocast is not None:
        autocast.install()
    if compiler is not None:
        compiler.install()
    if tuned is not None:
        tuned.install()
    if overlay:
        applied.note("sources", dict(knobs.sources))
    try:
        with source_overlay(overlay):
            profile = Harness(options, abandon=abandon).run(script)
    finally:
        if probe is not None:
            probe.uninstall()
        if tuned is not None:
            tuned.uninstall()
        if compiler is not None:
            compiler.uninstall()
        if autocast is not None:
            autocast.uninstall()
        if losses is not None:
            losses.uninstall()
        if bucketing is not None:
            bucketing.uninstall()
        if binding is not None:
            binding.uninstall()
        loaders.uninstall()
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
