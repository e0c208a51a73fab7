"""Running a subgraph forward and backward: timing it, and checking it against eager.

One *run* feeds fresh copies of the captured inputs (with their ``requires_grad``
flags) through the module, then back-propagates a fixed random gradient into every
floating-point output. Its result is the outputs, the input gradients and the
parameter gradients; a candidate's result is compared with eager's tensor by tensor,
normwise: ``max|a - b| <= atol + rtol * max|b|``, with the tolerance of the
tensor's dtype (:data:`TOLERANCES`).

A subgraph that draws random numbers (dropout, RReLU, attention dropout, noise) gives
other outputs on every run, and a compiler draws them from its own stream: comparing
such runs says nothing about the compiler. When two eager runs with different seeds
differ (:func:`draws_random_numbers`), the check runs under :func:`same_randomness`:
dropout and the other stochastic layers, functional or modules, run as in evaluation
(for the check only), every run starts from the same seed, and inductor draws what
random numbers are left from eager's stream. Timing stays in training mode.

Timing uses the backend's ``synchronize`` around each sample and an injectable clock
(``time.perf_counter`` by default); samples of all candidates are taken interleaved,
round after round, in a rotating order, so slow drifts of the machine touch every
candidate alike.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: (rtol, atol) by dtype, normwise (see the module docstring).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-6),
    torch.float16: (2e-3, 1e-4),
    torch.bfloat16: (2e-2, 1e-3),
}
DEFAULT_TOLERANCE = (1e-4, 1e-6)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES.get(dtype, DEFAULT_TOLERANCE)


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for _, v in sorted(value.items(), key=lambda kv: str(kv[0])) for t in tensors_in(v)]
    return []


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, through lists, tuples and
    dicts; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def _fresh(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A detached copy of ``tensor`` (in ``dtype``, for a floating-point one) with its
    ``requires_grad`` kept."""
    if dtype is not None and tensor.is_floating_point():
        out = tensor.detach().to(dtype, copy=True)
    else:
        out = tensor.detach().clone()
    if tensor.requires_grad and (out.is_floating_point() or out.is_complex()):
        out.requires_grad_(True)
    return out


def clone_value(value: Any) -> Any:
    """A fresh copy of an input: tensors detached and cloned, ``requires_grad`` kept."""
    return map_tensors(value, _fresh)


@dataclass
class Example:
    """Captured inputs of a subgraph, and the gradients fed back into its outputs."""

    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    grad_outputs: list[torch.Tensor] | None = None
    seed: int = 0
    #: The autocast regions the script called the subgraph in, ``(device type, dtype)``
    #: pairs: its forward runs in them here too (the backward, as in training, outside).
    autocast: tuple[tuple[str, str], ...] = ()

    def fresh(self) -> tuple[tuple, dict[str, Any]]:
        return clone_value(self.args), clone_value(self.kwargs)


def in_autocast(regions: Sequence[tuple[str, str]]) -> Any:
    """A context that enters ``torch.autocast`` for each ``(device type, dtype)``."""
    stack = contextlib.ExitStack()
    for kind, dtype in regions:
        stack.enter_context(torch.autocast(kind, dtype=getattr(torch, dtype)))
    return stack


@dataclass
class RunResult:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor]


def run_once(module: nn.Module, example: Example, *, keep: bool = True, seed: int | None = None) -> RunResult | None:
    """One forward and backward, from the random seed ``seed`` (the example's by
    default); with ``keep`` the outputs and gradients are returned."""
    args, kwargs = example.fresh()
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(example.seed if seed is None else seed)
    with in_autocast(example.autocast):
        out = module(*args, **kwargs)
    outputs = tensors_in(out)
    differentiable = [t for t in outputs if t.requires_grad and t.is_floating_point()]
    if example.grad_outputs is None:
        generator = torch.Generator(device="cpu").manual_seed(1234 + example.seed)
        example.grad_outputs = [torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.device, t.dtype)
                                for t in differentiable]
    if differentiable:
        torch.autograd.backward(differentiable, example.grad_outputs[: len(differentiable)])
    if not keep:
        return None
    grads: dict[str, torch.Tensor] = {}
    for i, t in enumerate(tensors_in((args, kwargs))):
        if t.grad is not None:
            grads[f"input[{i}]"] = t.grad.detach()
    for name, p in module.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.detach().clone()
    return RunResult([t.detach() for t in outputs], grads)


def _stochastic_arguments() -> dict[Any, tuple[str, int, Any]]:
    """The functions whose randomness an argument turns off: function -> (parameter
    name, its position, the value that makes the call deterministic)."""
    import torch.nn.functional as F

    table: dict[Any, tuple[str, int, Any]] = {}
    for fn in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout):
        table[fn] = ("training", 2, False)
    for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout",
                 "dropout_", "alpha_dropout_", "feature_dropout_", "feature_alpha_dropout_"):
        fn = getattr(torch, name, None)
        if fn is not None:
            table[fn] = ("train", 2, False)
    table[F.rrelu] = ("training", 3, False)
    for name in ("rrelu", "rrelu_"):
        fn = getattr(torch, name, None)
        if fn is not None:
            table[fn] = ("training", 3, False)
    table[F.scaled_dot_product_attention] = ("dropout_p", 4, 0.0)
    table[F.multi_head_attention_forward] = ("training", 13, False)
    return table


class NoStochasticLayers(TorchFunctionMode):
    """Dropout (every variant, module or functional), RReLU and attention dropout run
    as in evaluation: the argument that makes them random is set to its
    deterministic value. Under torch.compile the mode is part of what a compiled
    graph is guarded on, so a graph traced under it is separate from the training one."""

    def __init__(self) -> None:
        super().__init__()
        self.table = _stochastic_arguments()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        entry = self.table.get(func)
        if entry is not None:
            name, position, value = entry
            if len(args) > position:
                args = (*args[:position], value, *args[position + 1:])
            else:
                kwargs[name] = value
        return func(*args, **kwargs)


@contextlib.contextmanager
def same_randomness() -> Any:
    """Runs made inside compare what the compiler computes, not which random numbers
    it drew: stochastic layers off (:class:`NoStochasticLayers`) and, where inductor is
    in use, its random operators drawn from eager's generator (``fallback_random``),
    so a run that starts from the same seed draws the same numbers compiled or not.
    A compiled module must have run once before (inductor loaded), as the tuner's
    first, compiling run does."""
    with contextlib.ExitStack() as stack:
        inductor = sys.modules.get("torch._inductor.config")
        if inductor is not None:
            stack.enter_context(inductor.patch(fallback_random=True))
        stack.enter_context(NoStochasticLayers())
        yield


def _same(a: RunResult, b: RunResult) -> bool:
    if len(a.outputs) != len(b.outputs) or set(a.grads) != set(b.grads):
        return False
    pairs = list(zip(a.outputs, b.outputs)) + [(a.grads[k], b.grads[k]) for k in a.grads]
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


def draws_random_numbers(module: nn.Module, example: Example, first: RunResult | None = None) -> bool:
    """Whether two runs from different seeds differ (``first``: the run from the
    example's seed, when it was made already)."""
    first = first if first is not None else run_once(module, example)
    second = run_once(module, example, seed=example.seed + 1)
    assert first is not None and second is not None
    return not _same(first, second)


def checked_run(module: nn.Module, example: Example, random: bool) -> RunResult:
    """The run a check compares: under :func:`same_randomness` when ``random``, its
    dropout modules in evaluation mode as well."""
    with contextlib.ExitStack() as stack:
        if random:
            stack.enter_context(same_randomness())
            stack.enter_context(_stochastic_modules_off(module))
        result = run_once(module, example)
    assert result is not None
    return result


@contextlib.contextmanager
def _stochastic_modules_off(module: nn.Module) -> Any:
    """The dropout and RReLU modules of ``module`` in evaluation mode, then back. The
    mode of :class:`NoStochasticLayers` covers them in the forward pass, but not where
    activation checkpointing recomputes a block in the backward pass (the recompute
    would draw a mask the forward did not, and checkpointing refuses the difference);
    a module's own flag holds in both."""
    kinds = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
             nn.RReLU)
    switched = [m for m in module.modules() if isinstance(m, kinds) and m.training]
    for m in switched:
        m.training = False
    try:
        yield
    finally:
        for m in switched:
            m.training = True


#: A candidate whose result fails the tolerance against eager still passes when its
#: error against a float64 run of the same module is at most this many times eager's
#: own error against it (plus the dtype's atol), root-mean-square: a reduction summed
#: in another order (batch norm's weight and bias gradients over N*H*W elements) moves
#: the last bits of a large sum as far as eager's own rounding does (torch._dynamo's
#: accuracy checker judges compiled code the same way, with these multipliers).
FP64_MULTIPLIER = 2.0
#: The multiplier for a small tensor (fewer than :data:`SMALL_TENSOR` elements: a
#: normalisation layer's weight, where a few elements' noise dominates the error), a
#: 1x1 convolution's kernel, and a half-precision result.
FP64_MULTIPLIER_NOISY = 3.0
SMALL_TENSOR = 1000


def fp64_multiplier(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """How many times eager's error against float64 a candidate's may reach."""
    if dtype in (torch.float16, torch.bfloat16) or reference.numel() < SMALL_TENSOR or \
            (reference.ndim == 4 and reference.shape[-1] == reference.shape[-2] == 1):
        return FP64_MULTIPLIER_NOISY
    return FP64_MULTIPLIER


def float64_run(module: nn.Module, example: Example, random: bool) -> RunResult | None:
    """The run of a float64 copy of ``module`` on the example's inputs and output
    gradients in float64: the reference both eager's and a candidate's rounding are
    measured against. None when the module cannot run in float64."""
    import copy

    if example.grad_outputs is None:
        return None
    try:
        wide = copy.deepcopy(module).to(torch.float64)

        def widen(t: torch.Tensor) -> torch.Tensor:
            return _fresh(t, torch.float64)

        wide_example = Example(args=map_tensors(example.args, widen), kwargs=map_tensors(example.kwargs, widen),
                               grad_outputs=map_tensors(list(example.grad_outputs), widen), seed=example.seed)
        return checked_run(wide, wide_example, random)
    except Exception:  # noqa: BLE001 - an operator without float64: no such reference
        return None


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(a) & torch.isfinite(b)
    return float(((a - b)[finite] ** 2).mean().sqrt()) if finite.any() else 0.0


@dataclass
class Comparison:
    ok: bool
    output_max_abs: float = 0.0
    output_max_rel: float = 0.0
    grad_max_abs: float = 0.0
    grad_max_rel: float = 0.0
    worst: str | None = None
    message: str | None = None
    #: A tensor beyond the tolerance against eager passed against a float64 run.
    float64_checked: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"output_max_abs": self.output_max_abs, "output_max_rel": self.output_max_rel,
                "grad_max_abs": self.grad_max_abs, "grad_max_rel": self.grad_max_rel, "worst": self.worst,
                "float64_checked": self.float64_checked}


def compare(reference: RunResult, candidate: RunResult,
            truth: Callable[[], RunResult | None] | None = None) -> Comparison:
    """Whether ``candidate`` matches ``reference`` within each dtype's tolerance, or,
    where it does not, comes as close to ``truth()`` (a float64 run, made when first
    needed) as :func:`fp64_multiplier` times the reference does."""
    result = Comparison(ok=True)
    if len(reference.outputs) != len(candidate.outputs):
        return Comparison(False, message=f"{len(candidate.outputs)} outputs instead of {len(reference.outputs)}")
    missing = sorted(set(reference.grads) ^ set(candidate.grads))
    if missing:
        return Comparison(False, message=f"gradient {missing[0]} present in only one of eager and the candidate")
    pairs = [(f"output[{i}]", a, b, "output") for i, (a, b) in enumerate(zip(reference.outputs, candidate.outputs))]
    pairs += [(name, reference.grads[name], candidate.grads[name], "grad") for name in sorted(reference.grads)]
    worst_ratio = -1.0
    for name, ref, got, kind in pairs:
        if ref.shape != got.shape:
            return Comparison(False, message=f"{name}: shape {list(got.shape)} instead of {list(ref.shape)}")
        if not (ref.is_floating_point() or ref.is_complex()):
            if not torch.equal(ref, got.to(ref.dtype)):
                return Comparison(False, message=f"{name}: integer values differ from eager", worst=name)
            continue
        a = ref.detach().to(torch.float64)
        b = got.detach().to(torch.float64).to(a.device)
        if a.numel() == 0:
            continue
        if not torch.isfinite(b).all() and torch.isfinite(a).all():
            return Comparison(False, message=f"{name}: not finite where eager is", worst=name)
        finite = torch.isfinite(a) & torch.isfinite(b)
        diff = float((a - b)[finite].abs().max()) if finite.any() else 0.0
        scale = float(a[finite].abs().max()) if finite.any() else 0.0
        rel = diff / scale if scale > 0 else diff
        rtol, atol = tolerance(got.dtype if got.dtype in TOLERANCES else ref.dtype)
        limit = atol + rtol * scale
        # A difference within the absolute tolerance is no relative error: a gradient of
        # ~1e-7 everywhere differing by 1e-7 would read as 100% (a ViT's).
        counted = rel if diff > atol else 0.0
        if kind == "output":
            result.output_max_abs = max(result.output_max_abs, diff)
            result.output_max_rel = max(result.output_max_rel, counted)
        else:
            result.grad_max_abs = max(result.grad_max_abs, diff)
            result.grad_max_rel = max(result.grad_max_rel, counted)
        ratio = diff / limit if limit > 0 else float("inf") if diff else 0.0
        if ratio > worst_ratio:
            worst_ratio, result.worst = ratio, name
        if diff > limit:
            exact = truth() if truth is not None else None
            wide = _pick(exact, name, kind)
            if wide is not None and wide.shape == a.shape:
                wide = wide.detach().to(torch.float64).to(a.device)
                eager_error, own_error = _rms(a, wide), _rms(b, wide)
                if own_error <= fp64_multiplier(a, got.dtype) * eager_error + atol:
                    result.float64_checked = True
                    continue
                far = (f"; against float64, root-mean-square error {own_error:.2e}, eager's {eager_error:.2e}")
            else:
                far = ""
            result.ok = False
            result.message = (f"{name} differs from eager by {diff:.2e} (relative {rel:.2e}; "
                              f"{str(got.dtype).replace('torch.', '')} tolerance {rtol:.0e}{far})")
            return result
    return result


def _pick(run: RunResult | None, name: str, kind: str) -> torch.Tensor | None:
    """The tensor called ``name`` (``output[i]`` or a gradient's name) of ``run``."""
    if run is None:
        return None
    if kind == "output":
        index = int(name[len("output["):-1])
        return run.outputs[index] if index < len(run.outputs) else None
    return run.grads.get(name)


@dataclass
class Timer:
    """Times one forward + backward: the backend's synchronize around an injectable clock."""

    synchronize: Callable[[], None] = lambda: None
    clock: Callable[[], float] = time.perf_counter

    def time(self, module: nn.Module, example: Example, iterations: int = 1) -> float:
        """Seconds per iteration over ``iterations`` runs."""
        self.synchronize()
        start = self.clock()
        for _ in range(iterations):
            run_once(module, example, keep=False)
        self.synchronize()
        return (self.clock() - start) / iterations


def interleaved(timer: Timer, candidates: Sequence[tuple[str, nn.Module]], example: Example, repeats: int,
                iterations: int = 1, should_stop: Callable[[], bool] = lambda: False) -> dict[str, list[float]]:
    """Samples per candidate name, taken round after round; round ``r`` starts at
    candidate ``r mod n`` so that no candidate always runs first."""
    samples: dict[str, list[float]] = {name: [] for name, _ in candidates}
    n = len(candidates)
    for r in range(repeats):
        if r and should_stop():
            break
        for i in range(n):
            name, module = candidates[(r + i) % n]
            samples[name].append(timer.time(module, example, iterations))
    return samples
