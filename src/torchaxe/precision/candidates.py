"""The precision settings worth measuring on a target: TF32 matmuls on cuda, and
mixed precision (bfloat16 everywhere, float16 on a device) unless the script already
runs under autocast, or the target is a CPU that has no bfloat16 instructions; on a
CPU whose run spent time in fused attention, bfloat16 with that attention in float32
as well. Each
changes the numerics, so advise compares each one's training loss with the
original's before it may be chosen (docs/advise.md, Accuracy)."""

from __future__ import annotations

from typing import Any

from torchaxe.runtime.candidate import Accuracy, Candidate, knob_candidate
from torchaxe.runtime.opstats import op_share

#: torch's fused attention kernel on a CPU, forward and backward (profile op names).
CPU_ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
#: Below this share of the operator time, where attention runs cannot change a step
#: measurably.
MIN_ATTENTION_SHARE = 0.03

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
    if float64_model(settings):
        return out  # autocast lowers float32 operations only: nothing to measure
    if target in ("cpu", "cuda", "npu") and not own_autocast and not slow_bf16:
        out.append(knob_candidate(
            "knob:autocast-bf16", "precision", "mixed precision: the model's forward under torch.autocast(bfloat16)",
            {"autocast": {"dtype": "bfloat16"}}, group="precision", accuracy=_numerics(precision),
            priority=1.5 if device else 1.0,
            detail="matmuls and convolutions in bfloat16 (fp32 range, 8-bit mantissa)"))
        out += _attention_in_float32(profile, target, 1.45 if device else 0.95)
    if target in ("cuda", "npu") and not own_autocast:
        out.append(knob_candidate(
            "knob:autocast-fp16", "precision", "mixed precision: the model's forward under torch.autocast(float16)",
            {"autocast": {"dtype": "float16"}}, group="precision", accuracy=_numerics(precision), priority=1.3,
            detail="float16 needs a GradScaler for training: its loss is compared with the original's"))
    return out


#: Said when the model's parameters are all float64 (``settings["model_dtypes"]``).
FLOAT64_MODEL = ("the model's parameters are float64: mixed precision was not tried, as autocast lowers float32 "
                 "operations only and leaves float64 ones as they are; the model and its inputs in float32 "
                 "(`model.float()`, float32 tensors) are the change to make first (AX701 shows where the script "
                 "asks for float64), and float64 runs at a fraction of float32's speed on GPUs and NPUs")


def float64_model(settings: dict[str, Any]) -> bool:
    """Whether the run's model holds float64 parameters and no others."""
    return settings.get("model_dtypes") == ["float64"]


def _attention_in_float32(profile: dict[str, Any], target: str, priority: float) -> list[Candidate]:
    """On a CPU, bf16 autocast with ``F.scaled_dot_product_attention`` kept in float32,
    when the run spent a visible share of its operator time in torch's fused CPU
    attention: its bfloat16 paths are slower than its float32 one for short sequences
    and faster for long ones, so both are measured (one group: the faster is kept)."""
    if target != "cpu":
        return []
    share = op_share(profile, *CPU_ATTENTION)
    if share < MIN_ATTENTION_SHARE:
        return []
    return [knob_candidate(
        "knob:autocast-bf16-attention-fp32", "precision",
        "mixed precision: the model's forward under torch.autocast(bfloat16), its fused attention in float32",
        {"autocast": {"dtype": "bfloat16", "attention": "float32"}}, group="precision", priority=priority,
        accuracy=_numerics("lower precision in matmuls and convolutions, attention, the outputs and the loss in "
                           "float32"),
        detail=f"the run spent {share:.0%} of its operator time in torch's fused attention on the cpu, whose "
               "bfloat16 kernels run slower than its float32 one on short sequences")]


def own_speedups(settings: dict[str, Any], target: str) -> list[str]:
    """Why no mixed-precision candidate is offered, when it is not: the run showed the
    script using autocast itself, a float64 model, or the CPU has no bfloat16
    instructions."""
    if float64_model(settings):
        return [FLOAT64_MODEL]
    if settings.get("autocast"):
        return [f"the script runs its model under autocast ({settings['autocast']}) itself: mixed precision was "
                f"not tried again"]
    if target == "cpu" and settings.get("cpu_bfloat16") is False:
        return [NO_BFLOAT16]
    return []
