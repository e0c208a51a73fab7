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

    def device_name(self) -> str | None:
        import platform

        try:
            with open("/proc/cpuinfo", encoding="utf-8") as lines:
                for line in lines:
                    if line.startswith("model name"):
                        return line.partition(":")[2].strip() or None
        except OSError:
            pass
        return platform.processor() or None
