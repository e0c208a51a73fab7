"""The precision settings worth measuring on a target: TF32 matmuls on cuda, and
mixed precision (bfloat16 everywhere, float16 on a device) unless the script already
runs under autocast. Each can change the numerics, so each says how to measure that."""

from __future__ import annotations

from typing import Any

from torchaxe.runtime.candidate import Accuracy, Candidate, knob_candidate


def candidates(profile: dict[str, Any], target: str, settings: dict[str, Any]) -> list[Candidate]:
    """TF32 and autocast candidates for ``target``, given the settings the run showed."""
    out: list[Candidate] = []
    own_autocast = bool(settings.get("autocast"))
    # On a GPU or NPU lower precision is the largest change a budget can try (tensor
    # cores), ahead of code fixes the profile found no time in; on a cpu it often is not.
    device = target in ("cuda", "npu")
    precision = Accuracy(kind="unknown", detail="lower precision in matmuls and convolutions; "
                         "use --check-accuracy to measure the loss")
    if target == "cuda" and settings.get("matmul_precision", "highest") == "highest":
        out.append(knob_candidate(
            "knob:tf32", "precision", "torch.set_float32_matmul_precision('high'): float32 matmuls on TF32 tensor cores",
            {"torch": {"matmul_precision": "high"}}, priority=1.4,
            accuracy=Accuracy(kind="unknown", detail="float32 matmul inputs rounded to a 10-bit mantissa; "
                              "use --check-accuracy to measure the loss"),
            detail="Ampere and newer GPUs run float32 matmuls on tensor cores when TF32 is allowed; "
                   "PyTorch leaves it off for matmuls by default"))
    if target in ("cpu", "cuda", "npu") and not own_autocast:
        out.append(knob_candidate(
            "knob:autocast-bf16", "precision", "mixed precision: the model's forward under torch.autocast(bfloat16)",
            {"autocast": {"dtype": "bfloat16"}}, group="precision", accuracy=precision,
            priority=1.5 if device else 1.0,
            detail="matmuls and convolutions in bfloat16 (fp32 range, 8-bit mantissa)"))
    if target in ("cuda", "npu") and not own_autocast:
        out.append(knob_candidate(
            "knob:autocast-fp16", "precision", "mixed precision: the model's forward under torch.autocast(float16)",
            {"autocast": {"dtype": "float16"}}, group="precision", accuracy=precision, priority=1.3,
            detail="float16 needs a GradScaler for training; measure the loss with --check-accuracy"))
    return out


def own_speedups(settings: dict[str, Any]) -> list[str]:
    """A note when the run showed the script using autocast itself, which is why no
    mixed-precision candidate is offered."""
    if not settings.get("autocast"):
        return []
    return [f"the script runs its model under autocast ({settings['autocast']}) itself: mixed precision was not "
            f"tried again"]
