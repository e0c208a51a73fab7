"""Device backends: everything that differs between cpu, cuda and npu.

Only the names and detection live here; the backend modules import torch (and, for
npu, torch_npu) lazily, inside their methods.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path
from typing import Mapping

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


def _visible(devices: str | None) -> bool:
    """Whether a ``*_VISIBLE_DEVICES`` value leaves any device visible (unset: all are)."""
    return devices is None or devices.strip() not in ("", "-1")


def _torch_gpu_build(spec) -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from its
    ``version.py`` (parsed, not run) without importing torch."""
    folder = next(iter(spec.submodule_search_locations or ()), None)
    try:
        tree = ast.parse((Path(folder) / "version.py").read_text(encoding="utf-8")) if folder else None
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body if tree is not None else ():
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip") \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return True
    return False


def detect_target_without_torch(root: str | os.PathLike[str] = "/", environ: Mapping[str, str] = os.environ) -> str:
    """What :func:`detect_target` finds, read from files instead of asking torch:
    npu when torch_npu is installed and an Ascend device node is there, cuda when
    torch is a CUDA or ROCm build and a GPU device node is there, else cpu. A scan
    uses it: importing torch (seconds) costs more than the scan itself."""
    base = Path(root)
    if importlib.util.find_spec("torch_npu") is not None and _visible(environ.get("ASCEND_RT_VISIBLE_DEVICES")) \
            and any((base / "dev").glob("davinci[0-9]*")):
        return "npu"
    spec = importlib.util.find_spec("torch")
    if spec is not None and _visible(environ.get("CUDA_VISIBLE_DEVICES")) and _torch_gpu_build(spec) \
            and (any((base / "dev").glob("nvidia[0-9]*")) or (base / "dev" / "kfd").exists()):
        return "cuda"
    return "cpu"


def resolve_target(name: str | None, *, import_torch: bool = True) -> str:
    """Turn a ``--target`` value into a concrete target name; ``auto`` is detected by
    asking torch, or (``import_torch=False``) from files."""
    if name is None or name == "auto":
        return detect_target() if import_torch else detect_target_without_torch()
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
