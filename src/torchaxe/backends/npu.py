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
