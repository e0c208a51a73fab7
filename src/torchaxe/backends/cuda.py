"""The CUDA backend."""

from __future__ import annotations

from torchaxe.backends.base import Backend


class CudaBackend(Backend):
    name = "cuda"
    optimizer_device = "cuda"

    def is_available(self) -> bool:
        import torch

        return bool(torch.cuda.is_available())

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()
