"""Verify, don't assume: each formula rule's hand-written form against its fused
replacement, on random inputs, on this machine.

For every selected rule the hand-written reference form (``references.FORMS``) and
the replacement the rule proposes for the device's target run on the same inputs; the
result is the max absolute and relative difference, whether it is within the dtype's
tolerance (torch.testing's defaults), and the speed of both, measured as interleaved
runs (hand, fused, fused, hand, ...) whose medians are compared. Raw samples are
kept. torch_npu is never imported: an NPU replacement is reported as not run, and
where its documented formula is known (``torch_npu.fast_gelu``) its difference is
computed from that formula and labelled as emulated.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from torchaxe.errors import TorchaxeError
from torchaxe.units import duration

#: torch.testing's default (rtol, atol) per dtype.
TOLERANCES = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
}
NOISY_SPREAD = 0.10
#: Each timed sample runs the function this long at least.
SAMPLE_SECONDS = 0.05


@dataclass
class Timing:
    """Raw per-call times (seconds) of interleaved samples."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.nan

    @property
    def spread(self) -> float:
        if len(self.samples) < 2 or not self.median:
            return 0.0
        return (max(self.samples) - min(self.samples)) / self.median


@dataclass
class VerifyResult:
    """One rule's hand-written form against its replacement on one device."""

    code: str
    category: str
    device: str
    dtype: str
    shape: tuple[int, ...]
    hand_text: str
    replacement: str | None
    #: The applicability the rule gives this fix on the device's target (None: no fix).
    fix_safety: str | None
    max_abs: float | None = None
    max_rel: float | None = None
    rtol: float = 0.0
    atol: float = 0.0
    within_tolerance: bool | None = None
    hand: Timing = field(default_factory=Timing)
    fused: Timing = field(default_factory=Timing)
    npu_replacement: str | None = None
    #: max_rel is max |fused - hand| / max |hand| (elementwise ratios blow up near 0).
    #: Difference of the NPU operator's documented formula from the hand-written form.
    npu_emulated_max_abs: float | None = None
    error: str | None = None

    @property
    def speedup(self) -> float | None:
        if not self.hand.samples or not self.fused.samples or not self.fused.median:
            return None
        return self.hand.median / self.fused.median

    @property
    def noisy(self) -> bool:
        return self.hand.spread > NOISY_SPREAD or self.fused.spread > NOISY_SPREAD

    @property
    def agrees(self) -> bool:
        """A fix called safe keeps the numerics within the dtype's tolerance."""
        return not (self.fix_safety == "safe" and self.within_tolerance is False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        data["hand"] = {"median_s": _finite(self.hand.median), "samples_s": self.hand.samples}
        data["fused"] = {"median_s": _finite(self.fused.median), "samples_s": self.fused.samples}
        data["speedup"] = self.speedup
        data["noisy"] = self.noisy
        data["agrees_with_fix_safety"] = self.agrees
        return data


def _finite(value: float) -> float | None:
    return None if value is None or math.isnan(value) else value


def formula_rules(codes: tuple[str, ...] = ()) -> list[type]:
    """The formula rules selected by code prefixes (all of them when empty)."""
    from torchaxe.scan.rules import select_rules
    from torchaxe.scan.rules._formula import FormulaRule

    chosen = select_rules(codes, what="torchaxe verify") if codes else select_rules(("AX1",))
    rules = [r for r in chosen if issubclass(r, FormulaRule)]
    if not rules:
        raise TorchaxeError(f"{', '.join(codes)}: no formula rule to verify (formula rules are AX110-AX120 and AX123)")
    return rules


def resolve_device(device: str) -> str:
    import torch

    if device == "npu":
        raise TorchaxeError(
            "verify runs on cpu or cuda: torchaxe never imports torch_npu, so NPU replacements are unverified on "
            "Ascend hardware (the npu line shows the documented formula's difference where it is known)"
        )
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TorchaxeError("--device cuda: torch sees no CUDA device here")
    return device


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        raise TorchaxeError(f"--shape {text!r}: give sizes separated by commas, e.g. 8,256,1024") from None
    if not shape or any(s <= 0 for s in shape):
        raise TorchaxeError(f"--shape {text!r}: sizes must be positive integers")
    return shape


def verify(
    codes: tuple[str, ...] = (),
    device: str = "auto",
    dtype: str = "float32",
    shape: tuple[int, ...] | None = None,
    repeats: int = 5,
    timer: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] | None = None,
) -> list[VerifyResult]:
    """Measure every selected formula rule's replacement against its hand-written form."""
    import torch

    from torchaxe.scan.formulas.references import FORMS

    if dtype not in TOLERANCES:
        raise TorchaxeError(f"--dtype {dtype!r}: choose one of {', '.join(TOLERANCES)}")
    rules = formula_rules(codes)
    device = resolve_device(device)
    torch_dtype = getattr(torch, dtype)
    results = []
    for rule in rules:
        form = FORMS[rule.category]
        size = shape or form.default_shape
        if len(size) < form.min_rank or size[-1] % 2 and rule.category in ("swiglu", "rotary"):
            raise TorchaxeError(f"--shape {','.join(map(str, size))}: {rule.code} ({rule.category}) needs at least "
                                f"{form.min_rank} dimensions and an even last one")
        safety = rule.safety_by_target.get(device)
        result = VerifyResult(
            code=rule.code, category=rule.category, device=device, dtype=dtype, shape=tuple(size),
            hand_text=form.hand_text, replacement=form.fused_text if form.fused and form.available() else None,
            fix_safety=safety.value if safety is not None else None, npu_replacement=form.npu_text,
        )
        result.rtol, result.atol = TOLERANCES[dtype]
        if progress:
            progress(f"{rule.code} {rule.category} {list(size)} {dtype} on {device}")
        try:
            _measure(result, form, torch_dtype, device, repeats, timer)
        except (RuntimeError, ValueError, TypeError) as exc:
            result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        results.append(result)
    return results


def _measure(result: VerifyResult, form: Any, torch_dtype: Any, device: str, repeats: int,
             timer: Callable[[], float]) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    inputs = form.make_inputs(result.shape, torch_dtype, device, g)
    with torch.no_grad():
        hand = form.hand(*inputs)
        if form.npu_documented is not None:
            emulated = form.npu_documented(*inputs)
            result.npu_emulated_max_abs = float((emulated.double() - hand.double()).abs().max())
        if result.replacement is None:
            result.hand = _time(lambda: form.hand(*inputs), None, repeats, timer, device)[0]
            return
        fused = form.fused(*inputs)
        diff = (fused.double() - hand.double()).abs()
        magnitude = hand.double().abs()
        result.max_abs = float(diff.max())
        # Relative to the output's scale: elementwise ratios blow up where it crosses 0.
        result.max_rel = result.max_abs / max(float(magnitude.max()), torch.finfo(torch.float64).tiny)
        result.within_tolerance = bool((diff <= result.atol + result.rtol * magnitude).all())
        result.hand, result.fused = _time(lambda: form.hand(*inputs), lambda: form.fused(*inputs), repeats, timer,
                                          device)


def _time(hand: Callable[[], Any], fused: Callable[[], Any] | None, repeats: int, timer: Callable[[], float],
          device: str) -> tuple[Timing, Timing]:
    """Interleaved timing: hand, fused, then fused, hand, ... so that drift on the
    machine hits both alike. Each sample covers enough calls to last SAMPLE_SECONDS."""
    sync = _synchronizer(device)
    calls = []
    for fn in (hand, fused):
        if fn is None:
            calls.append(0)
            continue
        fn()
        fn()  # warm up: allocator, kernel selection
        sync()
        start = timer()
        fn()
        sync()
        once = max(timer() - start, 1e-9)
        calls.append(max(1, min(10_000, int(SAMPLE_SECONDS / once))))
    timings = (Timing(), Timing())
    for r in range(repeats):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            fn = (hand, fused)[which]
            if fn is None:
                continue
            sync()
            start = timer()
            for _ in range(calls[which]):
                fn()
            sync()
            timings[which].samples.append((timer() - start) / calls[which])
    return timings


def _synchronizer(device: str) -> Callable[[], None]:
    if device == "cuda":
        from torchaxe.backends import get_backend

        return get_backend("cuda").synchronize
    return lambda: None


# ------------------------------------------------------------------ rendering
def render_text(results: list[VerifyResult], out: Any, header: str) -> None:
    w = out.write
    w(header + "\n")
    for r in results:
        w(f"\n{r.code} {r.category}  {list(r.shape)} {r.dtype} on {r.device}\n")
        w(f"  hand-written  {r.hand_text}   {duration(r.hand.median, 3, missing='-')}\n")
        if r.error:
            w(f"  error         {r.error}\n")
            continue
        if r.replacement is None:
            w(f"  replacement   none in torch on {r.device} (the rule reports this formula on npu only)\n")
        else:
            speed = f"   {r.speedup:.2f}x" + (" (noisy)" if r.noisy else "") if r.speedup else ""
            w(f"  replacement   {r.replacement}   {duration(r.fused.median, 3, missing='-')}{speed}\n")
            verdict = "within" if r.within_tolerance else "NOT within"
            w(f"  difference    max abs {r.max_abs:.2e}, max rel {r.max_rel:.2e} (of the largest output): {verdict} {r.dtype} tolerance "
              f"(rtol {r.rtol:g}, atol {r.atol:g})\n")
            if r.fix_safety is None:
                w(f"  fix on {r.device:<6} none: {r.code} reports this formula on npu only\n")
            else:
                agree = "agrees" if r.agrees else "DISAGREES: the rule calls this fix safe"
                w(f"  fix on {r.device:<6} {r.fix_safety} ({agree})\n")
        if r.npu_replacement:
            line = f"  npu           {r.npu_replacement}: not run (unverified on Ascend hardware)"
            if r.npu_emulated_max_abs is not None:
                line += f"; its documented formula differs by max abs {r.npu_emulated_max_abs:.2e} (emulated)"
            w(line + "\n")
