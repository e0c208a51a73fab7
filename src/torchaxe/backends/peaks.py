"""Published peak FLOP/s of accelerators, per dtype, with where each figure comes from.

Model FLOPs utilisation (MFU) divides the FLOP/s a run achieves by the device's peak
for the dtype its matrix products run in. The figures are the vendors' dense figures
(no 2:4 sparsity), in FLOP/s. A device or dtype not in the table has no table peak:
the profile says so, and the peak measured on the device by a short matmul probe
(:mod:`torchaxe.runtime.flops`) stands beside it either way.

Dtype keys: ``fp32`` (plain float32 matrix products), ``tf32`` (float32 inputs with
TF32 tensor cores allowed: ``torch.backends.cuda.matmul.allow_tf32`` or
``torch.set_float32_matmul_precision("high")``), ``bf16``, ``fp16``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TERA = 1e12

NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet (dense figures)"
NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet (dense: half the sparsity figures)"
NVIDIA_H200 = "NVIDIA H200 Tensor Core GPU datasheet (dense: half the sparsity figures)"
NVIDIA_L40S = "NVIDIA L40S datasheet (dense: half the sparsity figures)"
NVIDIA_V100 = "NVIDIA V100 Tensor Core GPU datasheet"
NVIDIA_A10 = "NVIDIA A10 Tensor Core GPU datasheet (dense figures)"
NVIDIA_L4 = "NVIDIA L4 Tensor Core GPU datasheet (dense: half the sparsity figures)"
ASCEND_910 = "Huawei, Ascend 910 announcement and Hot Chips 31 (2019): 256 TFLOPS FP16"
ASCEND_910B2 = "widely cited figure for the Ascend 910B2 (Huawei publishes no per-variant datasheet)"


@dataclass(frozen=True)
class PeakEntry:
    """One device family: a pattern its reported name matches, and its peaks."""

    #: Regular expression searched in the device name (case-insensitive).
    pattern: str
    #: Peak FLOP/s per dtype key.
    peaks: dict[str, float]
    source: str


#: Most specific first: the first entry whose pattern matches the name is used.
PEAKS: tuple[PeakEntry, ...] = (
    PeakEntry(r"H200.*NVL", {"fp32": 60 * TERA, "tf32": 417.5 * TERA, "bf16": 835.5 * TERA,
                             "fp16": 835.5 * TERA}, NVIDIA_H200),
    PeakEntry(r"H200", {"fp32": 67 * TERA, "tf32": 494.5 * TERA, "bf16": 989.5 * TERA, "fp16": 989.5 * TERA},
              NVIDIA_H200),
    PeakEntry(r"H100.*PCIe", {"fp32": 51 * TERA, "tf32": 378 * TERA, "bf16": 756 * TERA, "fp16": 756 * TERA},
              NVIDIA_H100),
    PeakEntry(r"H100.*NVL", {"fp32": 60 * TERA, "tf32": 417.5 * TERA, "bf16": 835.5 * TERA,
                             "fp16": 835.5 * TERA}, NVIDIA_H100),
    PeakEntry(r"H100", {"fp32": 67 * TERA, "tf32": 494.5 * TERA, "bf16": 989.5 * TERA, "fp16": 989.5 * TERA},
              NVIDIA_H100),
    PeakEntry(r"A100", {"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
              NVIDIA_A100),
    PeakEntry(r"L40S", {"fp32": 91.6 * TERA, "tf32": 183 * TERA, "bf16": 362.05 * TERA, "fp16": 362.05 * TERA},
              NVIDIA_L40S),
    PeakEntry(r"\bL4\b", {"fp32": 30.3 * TERA, "tf32": 60 * TERA, "bf16": 121 * TERA, "fp16": 121 * TERA},
              NVIDIA_L4),
    PeakEntry(r"\bA10\b", {"fp32": 31.2 * TERA, "tf32": 62.5 * TERA, "bf16": 125 * TERA, "fp16": 125 * TERA},
              NVIDIA_A10),
    PeakEntry(r"V100.*PCIe", {"fp32": 14 * TERA, "fp16": 112 * TERA}, NVIDIA_V100),
    PeakEntry(r"V100", {"fp32": 15.7 * TERA, "fp16": 125 * TERA}, NVIDIA_V100),
    PeakEntry(r"Ascend\s*910\s*B2", {"bf16": 376 * TERA, "fp16": 376 * TERA}, ASCEND_910B2),
    PeakEntry(r"Ascend\s*910\s*(A|Pro\s*A|Premium\s*A)?$", {"fp16": 256 * TERA}, ASCEND_910),
)


@dataclass(frozen=True)
class TablePeak:
    flops_per_second: float
    source: str
    dtype: str


def dtype_key(dtype_name: str | None, tf32: bool = False) -> str | None:
    """The table's key for a torch dtype name (``float32``, ``torch.bfloat16``...)."""
    if not dtype_name:
        return None
    name = dtype_name.removeprefix("torch.")
    if name in ("float32", "float"):
        return "tf32" if tf32 else "fp32"
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(name)


def table_peak(device_name: str | None, dtype_name: str | None, tf32: bool = False) -> TablePeak | None:
    """The published peak of ``device_name`` for the dtype, or None when the table has
    no figure for that device or dtype (a CPU, an unlisted accelerator)."""
    key = dtype_key(dtype_name, tf32)
    if not device_name or key is None:
        return None
    for entry in PEAKS:
        if re.search(entry.pattern, device_name.strip(), re.IGNORECASE):
            value = entry.peaks.get(key)
            return TablePeak(value, entry.source, key) if value is not None else None
    return None
