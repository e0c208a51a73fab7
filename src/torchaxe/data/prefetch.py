"""Device-side prefetch: copy the next batch to the device while the current step runs.

``DevicePrefetcher(loader, device)`` wraps any iterable of batches. On a device with a
queue (cuda, npu) it fetches batch *k+1* and issues its host-to-device copy on a side
stream *before* handing batch *k* to the training loop, so the copy runs on the device
while the step's kernels do. Correctness rests on three things:

* the source tensors are in pinned (page-locked) host memory, so ``non_blocking=True``
  copies are truly asynchronous (a pageable copy would block the host);
* before a batch is handed out, the consumer's stream waits for the side stream
  (``current_stream.wait_stream(side)``), so no kernel reads a half-copied tensor;
* every device tensor made on the side stream is marked as used by the consumer's
  stream (``tensor.record_stream(current)``), so the caching allocator does not hand
  its memory to the next copy while the step still reads it.

On the cpu it is a pass-through: iterating it iterates the loader. Batches may be
nested (dicts, tuples, named tuples, lists, dataclasses); values that are not tensors
are passed along unchanged. An exception raised by the loader surfaces at the
``next()`` that would have returned that batch, not one step early.

Streams are reached through the device backend (``backend.device_module()``:
``torch.cuda`` or, through ``torchaxe.backends.npu``, ``torch.npu``); the tensor work
(pin, copy, record) is behind :class:`StreamOps`, so its logic is tested on the cpu
with a recording stand-in. The cuda path has run on an H200 (tests/test_cuda.py); the
npu path follows the documented stream API and is unverified on hardware.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

__all__ = ["DevicePrefetcher", "StreamOps", "map_tensors"]


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def map_tensors(batch: Any, fn: Callable[[Any], Any], tensor_type: type | None = None) -> Any:
    """A copy of ``batch`` with ``fn`` applied to every tensor in it, the containers
    rebuilt with their own types (dict subclasses, named tuples, dataclasses)."""
    tensor_type = tensor_type or _tensor_type()

    def walk(value: Any) -> Any:
        if isinstance(value, tensor_type):
            return fn(value)
        if isinstance(value, (str, bytes, int, float, bool, type(None))):
            return value
        if isinstance(value, Mapping):
            items = {k: walk(v) for k, v in value.items()}
            if isinstance(value, dict):
                out = _copy.copy(value)  # keeps a defaultdict's factory, an OrderedDict's type
                out.update(items)
                return out
            try:
                return type(value)(items)
            except TypeError:
                return items
        if isinstance(value, tuple):
            items = [walk(v) for v in value]
            if hasattr(value, "_fields"):  # a named tuple
                return type(value)(*items)
            return tuple(items) if type(value) is tuple else type(value)(items)
        if isinstance(value, list):
            items = [walk(v) for v in value]
            return items if type(value) is list else type(value)(items)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = dataclasses.fields(value)
            out = dataclasses.replace(value, **{f.name: walk(getattr(value, f.name)) for f in fields if f.init})
            for f in fields:
                if not f.init and hasattr(value, f.name):
                    object.__setattr__(out, f.name, walk(getattr(value, f.name)))
            return out
        return value

    return walk(batch)


class StreamOps:
    """The stream and tensor operations the prefetcher needs, on one device.

    ``module`` is the device runtime's torch namespace (``torch.cuda``, ``torch.npu``),
    from the backend. Tests replace this class with a recording stand-in."""

    def __init__(self, module: Any, device: Any) -> None:
        self.module = module
        self.device = device

    def new_stream(self) -> Any:
        return self.module.Stream(device=self.device)

    def current_stream(self) -> Any:
        return self.module.current_stream(self.device)

    def use(self, stream: Any) -> Any:
        """A context manager that makes ``stream`` current."""
        return self.module.stream(stream)

    def wait(self, waiter: Any, stream: Any) -> None:
        waiter.wait_stream(stream)

    def needs_copy(self, tensor: Any) -> bool:
        return tensor.device.type == "cpu"

    def pin(self, tensor: Any) -> Any:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def copy(self, tensor: Any) -> Any:
        return tensor.to(self.device, non_blocking=True)

    def record(self, tensor: Any, stream: Any) -> None:
        tensor.record_stream(stream)


_END = object()


class _DeviceIterator:
    """One pass over the loader, one batch ahead, copies on a side stream."""

    def __init__(self, source: Iterator, ops: StreamOps, pin_memory: bool, tensor_type: type) -> None:
        self._source = source
        self._ops = ops
        self._pin = pin_memory
        self._tensor_type = tensor_type
        self._stream = ops.new_stream()
        #: None (nothing fetched), _END, ("batch", batch, copies) or ("error", exception).
        self._slot: Any = None

    def __iter__(self) -> "_DeviceIterator":
        return self

    def _move(self, tensor: Any, copies: list) -> Any:
        ops = self._ops
        if not ops.needs_copy(tensor):
            return tensor
        if self._pin:
            tensor = ops.pin(tensor)
        moved = ops.copy(tensor)
        copies.append(moved)
        return moved

    def _preload(self) -> None:
        try:
            batch = next(self._source)
        except StopIteration:
            self._slot = _END
            return
        except Exception as exc:  # the loader's error belongs to the next() that asks for this batch
            self._slot = ("error", exc)
            return
        copies: list = []
        try:
            with self._ops.use(self._stream):
                moved = map_tensors(batch, lambda t: self._move(t, copies), self._tensor_type)
        except Exception as exc:
            self._slot = ("error", exc)
            return
        self._slot = ("batch", moved, copies)

    def __next__(self) -> Any:
        if self._slot is None:
            self._preload()
        slot = self._slot
        if slot is _END:
            raise StopIteration
        if slot[0] == "error":
            self._slot = None  # the loader may go on after this batch, as a DataLoader does
            raise slot[1]
        _, batch, copies = slot
        ops = self._ops
        current = ops.current_stream()
        ops.wait(current, self._stream)
        for tensor in copies:
            ops.record(tensor, current)
        self._slot = None
        self._preload()  # the next batch's copy runs while this step computes
        return batch


class DevicePrefetcher:
    """Iterate ``loader`` with every batch already on ``device``, the next batch's
    host-to-device copy overlapping the current step (cuda, npu); a pass-through on
    the cpu.

    ``pin_memory`` pins host tensors that are not pinned yet (pass
    ``pin_memory=True`` to the DataLoader instead to pin in its background thread).
    ``backend`` and ``ops`` are injectable for tests.

    >>> for images, labels in DevicePrefetcher(loader, "cuda"):   # doctest: +SKIP
    ...     loss = criterion(model(images), labels)
    """

    def __init__(self, loader: Iterable, device: Any, *, pin_memory: bool = True, backend: Any = None,
                 ops: StreamOps | None = None) -> None:
        import torch

        from torchaxe.errors import TorchaxeError

        self.loader = loader
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise TorchaxeError(f"DevicePrefetcher: device {device!r}: {exc}") from None
        self.pin_memory = pin_memory
        self._tensor_type = torch.Tensor
        self._ops = ops
        if ops is None and self.device.type != "cpu":
            if self.device.type not in ("cuda", "npu"):
                raise TorchaxeError(f"DevicePrefetcher: device {self.device}: only cpu, cuda and npu are supported")
            if backend is None:
                from torchaxe.backends import get_backend

                backend = get_backend(self.device.type)
            if not backend.is_available():
                raise TorchaxeError(f"DevicePrefetcher: device {self.device}: no {backend.name} device is available here")
            module = backend.device_module()
            if module is None:
                raise TorchaxeError(f"DevicePrefetcher: the {backend.name} backend has no streams")
            self._ops = StreamOps(module, self.device)

    @property
    def passthrough(self) -> bool:
        """True on the cpu: batches are handed out as the loader makes them."""
        return self._ops is None

    def __iter__(self) -> Iterator:
        source = iter(self.loader)
        if self._ops is None:
            return source
        return _DeviceIterator(source, self._ops, self.pin_memory, self._tensor_type)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]
