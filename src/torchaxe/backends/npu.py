"""The Ascend NPU backend. The only module outside the rules' npu replacements that
imports ``torch_npu``; always lazily. Unverified on Ascend hardware."""

from __future__ import annotations

import importlib

from torchaxe.backends.base import Backend


def _torch_npu():
    return importlib.import_module("torch_npu")


class NpuBackend(Backend):
    name = "npu"
    optimizer_device = "npu"
    unverified_on_hardware = True

    def is_available(self) -> bool:
        try:
            _torch_npu()
            import torch

            return bool(torch.npu.is_available())
        except Exception:  # torch_npu missing, or installed without a driver
            return False

    def synchronize(self) -> None:
        _torch_npu()
        import torch

        torch.npu.synchronize()

    def is_initialized(self) -> bool:
        # torch_npu mirrors torch.cuda's API (torch.npu.is_initialized); a process
        # that never imported torch_npu cannot have used the device.
        import sys

        if "torch_npu" not in sys.modules:
            return False
        import torch

        check = getattr(torch.npu, "is_initialized", None)
        return bool(check()) if check is not None else True

    def reset_peak_memory(self) -> None:
        _torch_npu()
        import torch

        torch.npu.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int | None:
        _torch_npu()
        import torch

        return int(torch.npu.max_memory_allocated())

    # Device-side op times on the NPU come from torch_npu.profiler output, read by
    # trace import; torch.profiler here records the host side only.


def set_compile_mode(jit_compile: bool) -> None:
    """Turn the NPU's online operator compilation on or off for this process
    (``torch_npu.npu.set_compile_mode(jit_compile=...)``); the trials' ``npu`` knob.
    On for fixed shapes usually pays off, off for dynamic shapes. Unverified on
    Ascend hardware: tested against a stand-in ``torch_npu`` that records the call."""
    torch_npu = _torch_npu()
    torch_npu.npu.set_compile_mode(jit_compile=bool(jit_compile))
