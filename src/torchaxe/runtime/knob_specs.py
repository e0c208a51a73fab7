"""The knobs that belong to no single axis: environment variables, CPU affinity,
torch settings, the npu compile mode, mixed precision, ``torch.compile`` of the model,
the loss record and source overlays. Each is one :class:`~torchaxe.runtime.knobs.KnobSpec`
registered in ``runtime/knobs.py``; the axes keep theirs in their own packages
(``data/knob.py``, ``shapes/knob.py``, ``tune/knob.py``, ``bind/knob.py``).

Parsing imports nothing heavy; torch is imported only when a patch is applied.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.compile_module import compile_in_place
from torchaxe.runtime.dynamo import refresh_tensor_attributes
from torchaxe.runtime.instance_forward import set_forward
from torchaxe.runtime.first_model import FirstModel
from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed, kind

MATMUL_PRECISIONS = ("highest", "high", "medium")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
AUTOCAST_DTYPES = ("bfloat16", "float16")
#: Where ``F.scaled_dot_product_attention`` runs under the autocast knob: in autocast's
#: lower precision (its own rule), or in float32.
AUTOCAST_ATTENTION = ("autocast", "float32")


# ------------------------------------------------------------------ env


def apply_environment(env: dict[str, str | None], applied: AppliedKnobs, environ: Any = os.environ) -> None:
    for var, value in env.items():
        if value is None:
            environ.pop(var, None)
        else:
            environ[var] = value
    if env:
        applied.note("env", dict(env))


class EnvKnob(Knob):
    """``env``: variables to set, or to unset (``null``), before torch is imported."""

    key = "env"
    before_torch = True
    example = {"OMP_NUM_THREADS": "2", "UNSET_ME": None}

    def default(self) -> dict[str, str | None]:
        return {}

    def parse(self, raw: Any, check: KnobCheck) -> dict[str, str | None]:
        if not isinstance(raw, dict):
            check.fail("env", f"expected an object of variable names to strings, got {kind(raw)}")
        env: dict[str, str | None] = {}
        for var, value in raw.items():
            if not var or "=" in var or "\0" in var:
                check.fail(f"env.{var}", "not a valid environment variable name")
            if value is not None and not isinstance(value, str):
                check.fail(f"env.{var}", f"expected a string (or null to unset it), got {kind(value)}")
            env[var] = value
        return env

    def to_json(self, value: dict[str, str | None]) -> dict[str, str | None]:
        return dict(value)

    def patch(self, value: dict[str, str | None], applied: AppliedKnobs):
        apply_environment(value, applied)
        return nullcontext()


# ------------------------------------------------------------------ cpu_affinity


def apply_affinity(cpus: tuple[int, ...], applied: AppliedKnobs) -> None:
    if not hasattr(os, "sched_setaffinity"):
        raise TorchaxeError("cpu_affinity: this platform has no os.sched_setaffinity")
    try:
        os.sched_setaffinity(0, set(cpus))
    except (OSError, ValueError) as exc:
        raise TorchaxeError(f"cpu_affinity {list(cpus)}: cannot pin to these CPUs: {exc}") from None
    applied.note("cpu_affinity", sorted(os.sched_getaffinity(0)))


class CpuAffinityKnob(Knob):
    """``cpu_affinity``: the CPUs the run may use, set before torch sizes its thread pools."""

    key = "cpu_affinity"
    before_torch = True
    example = [0]

    def parse(self, raw: Any, check: KnobCheck) -> tuple[int, ...] | None:
        if raw is None:
            return None
        if not isinstance(raw, list) or not raw:
            check.fail("cpu_affinity", f"expected a non-empty list of CPU numbers, got {kind(raw)}")
        for i, cpu in enumerate(raw):
            check.int(cpu, f"cpu_affinity[{i}]", 0)
        return tuple(sorted(set(raw)))

    def to_json(self, value: tuple[int, ...] | None) -> list[int] | None:
        return None if value is None else list(value)

    def patch(self, value: tuple[int, ...] | None, applied: AppliedKnobs):
        if value is not None:
            apply_affinity(value, applied)
        return nullcontext()


# ------------------------------------------------------------------ npu


@dataclass(frozen=True)
class NpuKnobs:
    jit_compile: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def apply_npu(npu_knobs: NpuKnobs, applied: AppliedKnobs) -> None:
    """The operator compile mode, through the npu backend (which imports ``torch_npu``)."""
    if npu_knobs.jit_compile is None:
        return
    from torchaxe.backends import npu

    try:
        npu.set_compile_mode(npu_knobs.jit_compile)
    except ModuleNotFoundError:
        raise TorchaxeError("npu.jit_compile: torch_npu is not installed here") from None
    applied.note("npu", {"jit_compile": npu_knobs.jit_compile})


class NpuKnob(Knob):
    """``npu``: ``torch_npu.npu.set_compile_mode(jit_compile=...)`` (unverified on hardware)."""

    key = "npu"
    example = {"jit_compile": False}

    def default(self) -> NpuKnobs:
        return NpuKnobs()

    def parse(self, raw: Any, check: KnobCheck) -> NpuKnobs:
        n = check.obj(raw, "npu", ("jit_compile",))
        return NpuKnobs(jit_compile=check.bool(n.get("jit_compile"), "npu.jit_compile"))

    def patch(self, value: NpuKnobs, applied: AppliedKnobs):
        apply_npu(value, applied)
        return nullcontext()


# ------------------------------------------------------------------ torch


@dataclass(frozen=True)
class TorchKnobs:
    cudnn_benchmark: bool | None = None
    matmul_precision: str | None = None
    num_threads: int | None = None
    interop_threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def apply_torch(t: TorchKnobs, applied: AppliedKnobs) -> None:
    import torch

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


class TorchKnob(Knob):
    """``torch``: cudnn.benchmark, float32 matmul precision and the thread counts."""

    key = "torch"
    example = {"num_threads": 2, "matmul_precision": "high"}

    def default(self) -> TorchKnobs:
        return TorchKnobs()

    def parse(self, raw: Any, check: KnobCheck) -> TorchKnobs:
        t = check.obj(raw, "torch", ("cudnn_benchmark", "matmul_precision", "num_threads", "interop_threads"))
        return TorchKnobs(
            cudnn_benchmark=check.bool(t.get("cudnn_benchmark"), "torch.cudnn_benchmark"),
            matmul_precision=check.choice(t.get("matmul_precision"), "torch.matmul_precision", MATMUL_PRECISIONS),
            num_threads=check.int(t.get("num_threads"), "torch.num_threads", 1),
            interop_threads=check.int(t.get("interop_threads"), "torch.interop_threads", 1),
        )

    def patch(self, value: TorchKnobs, applied: AppliedKnobs):
        apply_torch(value, applied)
        return nullcontext()


# ------------------------------------------------------------------ observe


class LossRecorder:
    """Records the value of every scalar tensor ``backward()`` is called on (the
    loss), by patching ``torch.Tensor.backward``. A loss on a device is copied on the
    device (no wait for it) and all of them are read back once, when the run's record
    is taken after its last step, so recording adds no host-device sync to the steps
    it measures. At most ``LIMIT`` values."""

    LIMIT = 10_000

    def __init__(self, applied: AppliedKnobs) -> None:
        #: Floats (host losses) or detached device copies, in the order of the calls.
        self.kept: list[Any] = []
        #: The harness phase each was recorded in ("warmup", "ops", "measured", or
        #: None before the first step boundary): advise compares the measured steps'.
        self.phases: list[str | None] = []
        self._original = None
        applied.note_later("loss", self.values)
        applied.note_later("loss_phases", self.recorded_phases)

    def install(self) -> None:
        import torch

        from torchaxe.runtime.harness import current_phase

        original = torch.Tensor.backward
        self._original = original
        kept, phases = self.kept, self.phases

        def loss_recording_backward(tensor, *args, **kwargs):
            # Named for the harness: an error raised through it (in the backward pass)
            # is not blamed on a change under trial (harness.OBSERVING_FRAMES).
            if tensor.numel() == 1 and len(kept) < self.LIMIT:
                value = tensor.detach().reshape(())
                kept.append(float(value) if value.device.type == "cpu" else value.clone())
                phases.append(current_phase())
            return original(tensor, *args, **kwargs)

        torch.Tensor.backward = loss_recording_backward

    def uninstall(self) -> None:
        if self._original is not None:
            import torch

            torch.Tensor.backward = self._original
            self._original = None
            refresh_tensor_attributes()

    def recorded_phases(self) -> list[str | None]:
        return list(self.phases)

    def values(self) -> list[float]:
        """Every loss recorded so far, as floats (one read of the device for all of
        them); what is on a device that can no longer be read is left out."""
        if all(isinstance(v, float) for v in self.kept):
            return list(self.kept)
        import torch

        out: list[float] = []
        try:
            on_device = [v for v in self.kept if not isinstance(v, float)]
            if len({v.device for v in on_device}) == 1:
                read = iter(torch.stack([v.float() for v in on_device]).cpu().tolist())
                return [v if isinstance(v, float) else next(read) for v in self.kept]
            for v in self.kept:
                out.append(v if isinstance(v, float) else float(v))
        except (RuntimeError, NotImplementedError):  # the device failed with the run: what was read is kept
            pass
        return out


class ObserveKnob(Knob):
    """``observe``: ``{"loss": true}`` records the training loss of every step (the
    scalar ``backward()`` is called on): how ``advise`` compares a change's loss with
    the original's."""

    key = "observe"
    example = {"loss": True}
    attribute = "observe_loss"

    def default(self) -> bool:
        return False

    def parse(self, raw: Any, check: KnobCheck) -> bool:
        observe = check.obj(raw, "observe", ("loss",))
        return bool(check.bool(observe.get("loss"), "observe.loss"))

    def to_json(self, value: bool) -> dict[str, bool] | None:
        return {"loss": True} if value else None

    def patch(self, value: bool, applied: AppliedKnobs):
        return installed(LossRecorder(applied)) if value else nullcontext()


# ------------------------------------------------------------------ seed


class SeedShift:
    """Adds ``offset`` to every seed the run gives ``torch.manual_seed`` (transformers'
    ``set_seed`` and Lightning's ``seed_everything`` call it), and to torch's initial
    seed for a script that never seeds: the same code under other random numbers."""

    def __init__(self, offset: int, applied: AppliedKnobs) -> None:
        self.offset = offset
        self.applied = applied
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        import torch
        import torch.random

        offset = self.offset

        def shifted(original):
            def manual_seed(seed):
                return original(int(seed) + offset)
            return manual_seed

        # Each name keeps its own function (torch.compile wraps ``torch.manual_seed``
        # once it is imported, and then the two differ).
        for owner in (torch, torch.random):
            self._saved.append((owner, "manual_seed", owner.manual_seed))
            owner.manual_seed = shifted(owner.manual_seed)
        self._saved[-1][2](torch.initial_seed() + offset)
        self.applied.note("seed", {"offset": offset})

    def uninstall(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


class SeedKnob(Knob):
    """``seed``: ``{"offset": N}`` shifts every torch seed of the run by N. advise's
    A/A arm runs the original so: the loss noise it reports is then what other random
    numbers (dropout masks, initial weights, data order) change, which a change that
    draws its random numbers differently (a compiled dropout) is judged against."""

    key = "seed"
    example = {"offset": 1}

    def parse(self, raw: Any, check: KnobCheck) -> int | None:
        if raw is None:
            return None
        c = check.obj(raw, "seed", ("offset",))
        return check.int(c.get("offset"), "seed.offset", 0)

    def to_json(self, value: int | None) -> dict[str, int] | None:
        return None if value is None else {"offset": value}

    def patch(self, value: int | None, applied: AppliedKnobs):
        return installed(SeedShift(value, applied)) if value else nullcontext()


# ------------------------------------------------------------------ autocast


@dataclass(frozen=True)
class AutocastKnobs:
    """Mixed precision: the model's forward runs under ``torch.autocast`` with this
    dtype; ``attention`` says where its fused attention runs (``AUTOCAST_ATTENTION``)."""

    dtype: str
    attention: str = "autocast"

    def to_dict(self) -> dict[str, Any]:
        out = {"dtype": self.dtype}
        if self.attention != "autocast":
            out["attention"] = self.attention
        return out


class AttentionInFloat32:
    """``F.scaled_dot_product_attention`` in float32 inside an autocast region.

    Autocast runs fused attention in its lower precision. On a CPU torch's fused
    attention kernel has bfloat16 paths that are slower than its float32 one for short
    sequences (a GPT of 64 tokens and 32-wide heads: forward and backward 4.6 times
    slower on an AMX Xeon, while its matmuls ran twice as fast), so a model can lose
    under bf16 autocast what its matmuls gain. While installed, a call made with
    autocast enabled on the query's device runs with autocast off, its inputs cast to
    float32, and hands back its output in the query's own dtype, as autocast would;
    outside autocast the call is torch's own. Its backward follows the forward's dtype
    (the casts are recorded by autograd)."""

    def __init__(self, applied: AppliedKnobs) -> None:
        self.applied = applied
        self.original: Any = None

    def install(self) -> "AttentionInFloat32":
        import functools

        import torch
        import torch.nn.functional as F

        original = self.original = F.scaled_dot_product_attention

        @functools.wraps(original)
        def attention(query, key, value, *args, **kwargs):
            device_type = query.device.type
            if not torch.is_autocast_enabled(device_type) or not query.is_floating_point():
                return original(query, key, value, *args, **kwargs)
            with torch.autocast(device_type=device_type, enabled=False):
                out = original(query.float(), key.float(), value.float(), *(_float_mask(a) for a in args),
                               **{k: _float_mask(v) for k, v in kwargs.items()})
            return out.to(query.dtype)

        F.scaled_dot_product_attention = attention
        self.applied.note("autocast_attention", {"function": "torch.nn.functional.scaled_dot_product_attention",
                                                 "dtype": "float32"})
        return self

    def uninstall(self) -> None:
        import torch.nn.functional as F

        if self.original is not None:
            F.scaled_dot_product_attention = self.original
            self.original = None


def _float_mask(value: Any) -> Any:
    """An additive attention mask in a lower floating-point precision, cast to float32
    (SDPA wants a float mask in the query's dtype); anything else as it is."""
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def outputs_in_float32(value: Any, low: Any) -> Any:
    """``value`` (a model's output: a tensor, or tuples, lists and dicts of them) with
    every floating-point tensor of dtype ``low`` cast to float32. Tuples and lists
    are rebuilt (a named tuple as its own type); a dict is updated in place, so that
    an output class built on one (a ``ModelOutput``) keeps its type and attributes."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype == low else value
    if isinstance(value, tuple):
        items = [outputs_in_float32(v, low) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [outputs_in_float32(v, low) for v in value]
    if isinstance(value, dict):
        for key, item in list(value.items()):
            cast = outputs_in_float32(item, low)
            if cast is not item:
                value[key] = cast
        return value
    return value


def _model_names(models: list[Any], module: Any) -> dict[str, Any]:
    """A model-wrapping knob's note: the first model's class (``module``) and every
    model's (``modules``), in the order the script first called them; a
    ``DistributedDataParallel`` wrapper by the module inside it, which is what the
    compile knob compiles (``compile_module.inner_of_wrapper``)."""
    from torchaxe.runtime.compile_module import inner_of_wrapper

    def name(m: Any) -> str:
        inner = inner_of_wrapper(m)
        own = type(inner).__qualname__
        return own if inner is m else f"{own} (inside {type(m).__qualname__})"

    names = [name(m) for m in models] or [name(module)]
    return {"module": names[0], "modules": names}


class ModelAutocast(FirstModel):
    """Runs the model's forward under ``torch.autocast`` (mixed precision) without
    touching the script: "the model" is found as :class:`ModelCompiler` finds it, and
    its ``forward`` is wrapped on the instance at its first call. The autocast device
    is the one its parameters live on.

    The script computes its loss from the model's outputs after the forward, outside
    the autocast region, where autocast's rule that losses and softmaxes run in
    float32 no longer holds: a ``log_softmax`` and ``nll_loss`` on bfloat16 logits
    would run in bfloat16. So the outputs autocast made in the lower precision leave
    the region cast to float32 (:func:`outputs_in_float32`), and what the script
    computes from them -- the loss -- runs in float32, as it would inside autocast.
    The matmuls and convolutions of the forward keep the lower precision."""

    def __init__(self, dtype: str, applied: AppliedKnobs) -> None:
        super().__init__(self.wrap, every_model=True)
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
                out = forward(*args, **kwargs)
            return outputs_in_float32(out, dtype)

        set_forward(module, autocast_forward)
        self.applied.note("autocast", {**_model_names(self.models, module), "device_type": device_type,
                                       "dtype": self.dtype, "outputs": "float32"})


class AutocastKnob(Knob):
    """``autocast``: ``{"dtype": "bfloat16"}`` runs the model's forward in mixed
    precision; its outputs are handed back in float32 (see :class:`ModelAutocast`).
    ``"attention": "float32"`` keeps ``F.scaled_dot_product_attention`` in float32
    inside it (:class:`AttentionInFloat32`)."""

    key = "autocast"
    example = {"dtype": "bfloat16"}

    def parse(self, raw: Any, check: KnobCheck) -> AutocastKnobs | None:
        if raw is None:
            return None
        a = check.obj(raw, "autocast", ("dtype", "attention"))
        dtype = check.choice(a.get("dtype", "bfloat16"), "autocast.dtype", AUTOCAST_DTYPES)
        attention = check.choice(a.get("attention", "autocast"), "autocast.attention", AUTOCAST_ATTENTION)
        return AutocastKnobs(dtype=dtype or "bfloat16", attention=attention or "autocast")

    def patch(self, value: AutocastKnobs | None, applied: AppliedKnobs):
        if value is None:
            return nullcontext()
        if value.attention == "autocast":
            return installed(ModelAutocast(value.dtype, applied))
        return _both(installed(AttentionInFloat32(applied)), installed(ModelAutocast(value.dtype, applied)))


@contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    """Two patches' contexts, entered in order and left in the reverse order."""
    with first, second:
        yield


# ------------------------------------------------------------------ compile


@dataclass(frozen=True)
class CompileKnobs:
    """``torch.compile`` of the model: each module with parameters that the script
    calls from outside any other module in its first iteration (see
    runtime/first_model.py)."""

    mode: str | None = None
    dynamic: bool | None = None
    backend: str = "inductor"
    fullgraph: bool = False

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None and self.mode != "default":
            out["mode"] = self.mode
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "dynamic": self.dynamic, "backend": self.backend, "fullgraph": self.fullgraph}


class ModelCompiler(FirstModel):
    """Compiles the model at its first forward, without touching the script.

    "The model" is found as runtime/first_model.py describes. It is compiled in place
    with ``module.compile(**kwargs)`` (``torch.compile`` of its ``forward``, same
    object, same ``state_dict`` keys, so the script's optimizer, checkpoints and
    ``.train()``/``.eval()`` calls all keep working). A script that trains several
    models in one iteration (a GAN's generator and discriminator) has each compiled.

    A model that is one of torch's own layers or containers (an ``nn.Sequential``
    built in the script) has its ``forward`` compiled instead (see
    runtime/compile_module.py): ``module.compile()`` would leave it eager without a
    word.
    """

    def __init__(self, kwargs: dict[str, Any], applied: AppliedKnobs) -> None:
        super().__init__(self.compile, every_model=True)
        self.kwargs = kwargs
        self.applied = applied
        self._how: list[str] = []

    def compile(self, module: Any) -> None:
        self._how.append(compile_in_place(module, **self.kwargs))
        self.applied.note("compile", {**_model_names(self.models, module), "kwargs": self.kwargs,
                                      "compiled": self._how[0], "how": list(self._how)})


class CompileKnob(Knob):
    """``compile``: ``torch.compile`` the model (``true`` for the defaults)."""

    key = "compile"
    example = {"mode": "default", "dynamic": False, "backend": "inductor", "fullgraph": False}

    def parse(self, raw: Any, check: KnobCheck) -> CompileKnobs | None:
        if raw is None:
            return None
        if raw is True:
            raw = {}
        m = check.obj(raw, "compile", ("mode", "dynamic", "backend", "fullgraph"))
        backend = m.get("backend", "inductor")
        if not isinstance(backend, str) or not backend:
            check.fail("compile.backend",
                       f"expected a backend name such as \"inductor\" or \"eager\", got {kind(backend)}")
        return CompileKnobs(
            mode=check.choice(m.get("mode"), "compile.mode", COMPILE_MODES),
            dynamic=check.bool(m.get("dynamic"), "compile.dynamic"),
            backend=backend,
            fullgraph=bool(check.bool(m.get("fullgraph"), "compile.fullgraph")),
        )

    def patch(self, value: CompileKnobs | None, applied: AppliedKnobs):
        return installed(ModelCompiler(value.kwargs(), applied)) if value is not None else nullcontext()


# ------------------------------------------------------------------ sources


class SourcesKnob(Knob):
    """``sources``: files read in place of the user's (original path -> replacement
    path): how a code fix is measured before it is applied (runtime/overlay.py)."""

    key = "sources"
    example = {"train.py": "fixed/train.py"}

    def default(self) -> dict[str, str]:
        return {}

    def parse(self, raw: Any, check: KnobCheck) -> dict[str, str]:
        if not isinstance(raw, dict):
            check.fail("sources", f"expected an object of original path to replacement path, got {kind(raw)}")
        sources: dict[str, str] = {}
        for original, replacement in raw.items():
            if not original or not isinstance(replacement, str) or not replacement:
                check.fail(f"sources.{original}", f"expected a replacement file path, got {kind(replacement)}")
            sources[original] = replacement
        return sources

    def to_json(self, value: dict[str, str]) -> dict[str, str]:
        return dict(value)

    def patch(self, value: dict[str, str], applied: AppliedKnobs):
        from torchaxe.runtime.overlay import check_overlay, source_overlay

        overlay = check_overlay(value)
        if not overlay:
            return nullcontext()
        applied.note("sources", dict(value))
        return source_overlay(overlay)


ENV = EnvKnob()
CPU_AFFINITY = CpuAffinityKnob()
NPU = NpuKnob()
TORCH = TorchKnob()
OBSERVE = ObserveKnob()
SEED = SeedKnob()
AUTOCAST = AutocastKnob()
COMPILE = CompileKnob()
SOURCES = SourcesKnob()
