"""The precision settings worth measuring on a target: TF32 matmuls on cuda, and
mixed precision (bfloat16 everywhere, float16 on a device) unless the script already
runs under autocast, or the target is a CPU that has no bfloat16 instructions. Each
changes the numerics, so advise compares each one's training loss with the
original's before it may be chosen (docs/advise.md, Accuracy)."""

from __future__ import annotations

from typing import Any

from torchaxe.runtime.candidate import Accuracy, Candidate, knob_candidate

#: On a CPU without them bfloat16 runs emulated: on an AVX2 machine, small models'
#: steps ran 7 to 19 times slower under bf16 autocast than in float32.
NO_BFLOAT16 = ("bfloat16 autocast was not tried: this CPU has no native bfloat16 instructions (no avx512_bf16 "
               "or amx_bf16 flag in /proc/cpuinfo), so bfloat16 matmuls run emulated, many times slower than "
               "float32; `torchaxe trial` with {\"autocast\": {\"dtype\": \"bfloat16\"}} measures it all the same")


def _numerics(detail: str) -> Accuracy:
    return Accuracy(kind="unknown", detail=detail + "; its training loss is compared with the original's")


def candidates(profile: dict[str, Any], target: str, settings: dict[str, Any]) -> list[Candidate]:
    """TF32 and autocast candidates for ``target``, given the settings the run showed."""
    out: list[Candidate] = []
    own_autocast = bool(settings.get("autocast"))
    # On a GPU or NPU lower precision is the largest change a budget can try (tensor
    # cores), ahead of code fixes the profile found no time in; on a cpu it often is
    # not, but for one with bfloat16 matrix units (AMX).
    device = target in ("cuda", "npu") or (target == "cpu" and bool(settings.get("cpu_bfloat16_matrix_units")))
    precision = "lower precision in matmuls and convolutions, the outputs and the loss in float32"
    if target == "cuda" and settings.get("matmul_precision", "highest") == "highest":
        out.append(knob_candidate(
            "knob:tf32", "precision", "torch.set_float32_matmul_precision('high'): float32 matmuls on TF32 tensor cores",
            {"torch": {"matmul_precision": "high"}}, priority=1.4,
            accuracy=_numerics("float32 matmul inputs rounded to a 10-bit mantissa"),
            detail="Ampere and newer GPUs run float32 matmuls on tensor cores when TF32 is allowed; "
                   "PyTorch leaves it off for matmuls by default"))
    slow_bf16 = target == "cpu" and settings.get("cpu_bfloat16") is False
    if target in ("cpu", "cuda", "npu") and not own_autocast and not slow_bf16:
        out.append(knob_candidate(
            "knob:autocast-bf16", "precision", "mixed precision: the model's forward under torch.autocast(bfloat16)",
            {"autocast": {"dtype": "bfloat16"}}, group="precision", accuracy=_numerics(precision),
            priority=1.5 if device else 1.0,
            detail="matmuls and convolutions in bfloat16 (fp32 range, 8-bit mantissa)"))
    if target in ("cuda", "npu") and not own_autocast:
        out.append(knob_candidate(
            "knob:autocast-fp16", "precision", "mixed precision: the model's forward under torch.autocast(float16)",
            {"autocast": {"dtype": "float16"}}, group="precision", accuracy=_numerics(precision), priority=1.3,
            detail="float16 needs a GradScaler for training: its loss is compared with the original's"))
    return out


def own_speedups(settings: dict[str, Any], target: str) -> list[str]:
    """Why no mixed-precision candidate is offered, when it is not: the run showed the
    script using autocast itself, or the CPU has no bfloat16 instructions."""
    if settings.get("autocast"):
        return [f"the script runs its model under autocast ({settings['autocast']}) itself: mixed precision was "
                f"not tried again"]
    if target == "cpu" and settings.get("cpu_bfloat16") is False:
        return [NO_BFLOAT16]
    return []
