"""One way to change the DataLoaders a script builds without editing it: a patch of
``DataLoader.__init__`` that hands each loader's arguments, bound to torch's own
signature (whether the script passed them by position, by name or not at all), to an
``edit`` function before torch's ``__init__`` runs. The loader knobs (workers,
bucketing, worker core binding) are each one such edit. torch is imported at
``install``."""

from __future__ import annotations

import inspect
from typing import Any, Callable

#: ``edit(arguments, parameters)``: change ``arguments`` (name -> value, as bound) in
#: place; ``parameters`` is torch's signature's, for the defaults of the rest.
LoaderEdit = Callable[[dict[str, Any], "inspect.Signature"], None]


class LoaderPatch:
    """Installs ``edit`` on ``DataLoader.__init__`` until :meth:`uninstall`. A call
    that does not bind to torch's signature is passed through untouched, so that torch
    says what is wrong with it."""

    def __init__(self, edit: LoaderEdit) -> None:
        self.edit = edit
        self._original: Any = None

    def install(self) -> "LoaderPatch":
        from torch.utils.data import DataLoader

        original = DataLoader.__init__
        self._original = original
        signature = inspect.signature(original)
        edit = self.edit

        def __init__(loader, *args, **kwargs):
            try:
                bound = signature.bind(loader, *args, **kwargs)
            except TypeError:
                return original(loader, *args, **kwargs)
            edit(bound.arguments, signature)
            return original(*bound.args, **bound.kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        DataLoader.__init__ = __init__
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            from torch.utils.data import DataLoader

            DataLoader.__init__ = self._original
            self._original = None
