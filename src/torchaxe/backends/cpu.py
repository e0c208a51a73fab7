"""The CPU backend: no device queue, so synchronisation is a no-op."""

from __future__ import annotations

from torchaxe.backends.base import Backend


class CpuBackend(Backend):
    name = "cpu"
    optimizer_device = "cpu"

    def is_available(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None
