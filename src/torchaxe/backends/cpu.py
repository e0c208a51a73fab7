"""The CPU backend: no device queue, so synchronisation is a no-op."""

from __future__ import annotations

from pathlib import Path

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


#: CPU flags (``/proc/cpuinfo``) of instructions that compute in bfloat16: x86's
#: AVX512-BF16 and AMX-BF16, Arm's BF16 extension.
BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); None where they cannot
    be read (no ``/proc/cpuinfo``)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags) or None


def native_bfloat16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes in bfloat16 natively (True), or only by converting
    to float32 and back, many times slower than float32 itself (False); None where
    its flags cannot be read (no ``/proc/cpuinfo``)."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else bool(flags & BFLOAT16_FLAGS)


def bfloat16_matrix_units(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has matrix units for bfloat16 (x86's AMX tiles, ``amx_bf16``),
    which multiply bfloat16 matrices several times faster than its float32 vector
    units; None where its flags cannot be read."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else "amx_bf16" in flags
