"""The small interface every device backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Backend(ABC):
    """What torchaxe needs to know about, or do on, one kind of device."""

    #: The target name used by ``--target`` and stored with every result.
    name: str = ""
    #: The ``torch.optim`` device string used to ask whether fused kernels exist.
    optimizer_device: str = ""
    #: True where torchaxe's code for this backend has not been run on real hardware.
    unverified_on_hardware: bool = False

    @abstractmethod
    def is_available(self) -> bool:
        """Whether this machine has a usable device of this kind."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued device work to finish."""

    # The methods below have working defaults, so a backend only overrides what its
    # device has. The harness calls them at step boundaries only.

    def is_initialized(self) -> bool:
        """Whether this process has started using the device. Until it has, the
        harness neither synchronises nor reads device memory, since either would
        create a device context the script may never have wanted (on the wrong
        device, for a torchrun rank that has not called ``set_device`` yet)."""
        return True

    def reset_peak_memory(self) -> None:
        """Start a new peak of device memory (see :meth:`peak_memory_bytes`)."""
        return None

    def peak_memory_bytes(self) -> int | None:
        """Highest device memory allocated by tensors since the last reset, or
        ``None`` where the device has no such counter (the cpu)."""
        return None

    def profiler_activities(self) -> tuple[str, ...]:
        """The ``torch.profiler.ProfilerActivity`` names (lower case) to record."""
        return ("cpu",)

    def enable_sync_warnings(self):
        """Ask the device runtime to warn at every host-device synchronisation (a
        warning whose message contains ``synchroniz``), and return a function that
        undoes it; ``None`` where the runtime cannot do it."""
        return None

    def device_name(self) -> str | None:
        """The name of the device this process computes on, as its runtime reports
        it (the peak FLOP/s table in :mod:`torchaxe.backends.peaks` is keyed by it);
        ``None`` where it cannot be read. Only called once the device is in use."""
        return None

    def device_module(self):
        """The torch namespace of this device's runtime (``torch.cuda``,
        ``torch.npu``), for streams and events (``Stream``, ``current_stream``,
        ``stream``); ``None`` where there is no device queue (the cpu)."""
        return None

    def device_locations(self, root="/", environ=None, vendor_tool=None) -> list:
        """Each visible device's PCI address and NUMA node
        (:class:`torchaxe.backends.pci.DeviceLocation`), read below ``root`` without
        torch (core binding, ``torchaxe topo``). ``environ`` (default ``os.environ``)
        supplies the ``*_VISIBLE_DEVICES`` variable; ``vendor_tool`` returns a vendor
        tool's text where the backend reads one (npu-smi). None here: the cpu."""
        return []
