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

    def is_initialized(self) -> bool:
        import torch

        return bool(torch.cuda.is_initialized())

    def reset_peak_memory(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated())

    def profiler_activities(self) -> tuple[str, ...]:
        return ("cpu", "cuda")

    def enable_sync_warnings(self):
        import torch

        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return lambda: torch.cuda.set_sync_debug_mode(previous)

    def device_name(self) -> str | None:
        import torch

        return str(torch.cuda.get_device_name(torch.cuda.current_device()))

    def device_module(self):
        import torch

        return torch.cuda

    def device_locations(self, root="/", environ=None, vendor_tool=None) -> list:
        # Read from the driver's /proc listing or sysfs, not torch: no CUDA context
        # is created in a launcher that only plans the binding.
        import os

        from torchaxe.backends.pci import nvidia_locations

        return nvidia_locations(root, os.environ if environ is None else environ)
