"""Device backends: everything that differs between cpu, cuda and npu.

Only the names and detection live here; the backend modules import torch (and, for
npu, torch_npu) lazily, inside their methods.
"""

from __future__ import annotations

import importlib.util

from torchaxe.errors import TorchaxeError

TARGETS = ("cpu", "cuda", "npu")
TARGET_CHOICES = ("auto", *TARGETS)


def detect_target() -> str:
    """The best target this machine has: npu if torch_npu is installed and sees a
    device, else cuda if available, else cpu."""
    if importlib.util.find_spec("torch_npu") is not None:
        from torchaxe.backends.npu import NpuBackend

        if NpuBackend().is_available():
            return "npu"
    if importlib.util.find_spec("torch") is not None:
        from torchaxe.backends.cuda import CudaBackend

        if CudaBackend().is_available():
            return "cuda"
    return "cpu"


def resolve_target(name: str | None) -> str:
    """Turn a ``--target`` value into a concrete target name."""
    if name is None or name == "auto":
        return detect_target()
    name = name.lower()
    if name not in TARGETS:
        raise TorchaxeError(f"unknown target {name!r}: choose one of {', '.join(TARGET_CHOICES)}")
    return name


def get_backend(name: str | None):
    """The backend object for a target name (``auto`` detects)."""
    target = resolve_target(name)
    if target == "npu":
        from torchaxe.backends.npu import NpuBackend

        return NpuBackend()
    if target == "cuda":
        from torchaxe.backends.cuda import CudaBackend

        return CudaBackend()
    from torchaxe.backends.cpu import CpuBackend

    return CpuBackend()
