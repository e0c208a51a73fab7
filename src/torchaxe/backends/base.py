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
