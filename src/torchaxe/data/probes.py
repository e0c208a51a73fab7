"""Probes of the input pipeline, added to the profile harness by ``torchaxe data``.

* :class:`LoaderProbe` records every ``DataLoader`` the script builds (the line that
  built it, its final settings after any knob override, its dataset and collate
  function for sampling afterwards), how long starting its iterator took (worker
  start-up), the batches and the time waited per loader, and how busy its worker
  processes were: their CPU time (``/proc/PID/stat``) over their lifetime.
* :class:`CopyProbe` times host-to-device copies (``Tensor.to``/``.cuda``/``.npu``
  of a host tensor that land on a device) per step, and the DataLoader's pinning of
  each batch (``pin_memory`` in its background thread).

Both follow the harness's probe protocol (``install``/``uninstall``) and are handed
to ``Harness(probes=[...])`` through their ``attach(recorder)`` method, which gives
them the step recorder for per-step attribution. They cost a couple of clock reads
per batch and per copy.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

#: Clock ticks per second of /proc/PID/stat's CPU times.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux ``/proc``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    try:
        fields = text.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (IndexError, ValueError):
        return None


def _default_start_method() -> str:
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_context().get_start_method()


@dataclass
class LoaderRecord:
    """One DataLoader the script built, with what was measured of it."""

    index: int
    file: str | None
    line: int | None
    dataset_type: str
    map_style: bool
    dataset_length: int | None
    batch_size: int | None
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    start_method: str | None
    timeout: float
    #: Iterators started (epochs, unless persistent_workers) and how long each took.
    iterator_seconds: list[float] = field(default_factory=list)
    batches: int = 0
    wait_seconds: float = 0.0
    batches_measured: int = 0
    wait_measured_seconds: float = 0.0
    workers_started: int = 0
    worker_cpu_seconds: float = 0.0
    worker_alive_seconds: float = 0.0
    #: Where the dataset's class is defined: (file, first line, last line), for findings inside it.
    dataset_source: tuple[str, int, int] | None = None
    #: Its batches come sample by sample from in-memory tensors (a TensorDataset with the
    #: default collate): the dataloader knob's ``batched_fetch`` takes them at once.
    batched_fetch: bool = False
    #: For sampling afterwards; not part of the JSON form.
    dataset: Any = field(default=None, repr=False, compare=False)
    collate_fn: Any = field(default=None, repr=False, compare=False)

    @property
    def site(self) -> str | None:
        return f"{self.file}:{self.line}" if self.file and self.line else None

    @property
    def worker_utilisation(self) -> float | None:
        """CPU time of the workers over their lifetime (1.0 = every worker busy all the time)."""
        if not self.worker_alive_seconds:
            return None
        return min(1.0, self.worker_cpu_seconds / self.worker_alive_seconds)

    def settings(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                "persistent_workers": self.persistent_workers, "prefetch_factor": self.prefetch_factor,
                "multiprocessing_context": self.start_method if self.num_workers else None,
                "timeout": self.timeout}

    def settings_text(self) -> str:
        parts = [f"num_workers={self.num_workers}", f"pin_memory={self.pin_memory}"]
        if self.num_workers:
            parts += [f"persistent_workers={self.persistent_workers}", f"prefetch_factor={self.prefetch_factor}",
                      f"start method {self.start_method}"]
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "site": self.site, "file": self.file, "line": self.line,
            "dataset_type": self.dataset_type, "map_style": self.map_style, "dataset_length": self.dataset_length,
            "dataset_source": (f"{self.dataset_source[0]}:{self.dataset_source[1]}-{self.dataset_source[2]}"
                               if self.dataset_source else None),
            "batch_size": self.batch_size, "settings": self.settings(),
            "iterators": len(self.iterator_seconds), "iterator_seconds": list(self.iterator_seconds),
            "batches": self.batches, "wait_seconds": self.wait_seconds,
            "batches_measured": self.batches_measured, "wait_measured_seconds": self.wait_measured_seconds,
            "workers_started": self.workers_started, "worker_cpu_seconds": self.worker_cpu_seconds,
            "worker_alive_seconds": self.worker_alive_seconds, "worker_utilisation": self.worker_utilisation,
            "batched_fetch": self.batched_fetch,
        }


def _class_source(cls: type, codes: Any) -> tuple[str, int, int] | None:
    """The user's file and line range of a class (None for torch's own datasets)."""
    import inspect

    try:
        filename = inspect.getsourcefile(cls)
        lines, first = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return None
    if not filename or codes.kind(filename) != "user":
        return None
    return codes.show(filename), first, first + len(lines) - 1


def _in_measured_step(recorder: Any) -> bool:
    return bool(recorder.started) and recorder.options.phase(len(recorder.steps) + 1) == "measured"


class LoaderProbe:
    """Records DataLoaders, their iterators, batches, waits and worker CPU time."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, codes: Any = None,
                 cpu_seconds: Callable[[int], float | None] = process_cpu_seconds) -> None:
        self.clock = clock
        self.codes = codes
        self.cpu_seconds = cpu_seconds
        self.records: list[LoaderRecord] = []
        self.recorder: Any = None
        self._by_loader: "weakref.WeakKeyDictionary[Any, LoaderRecord]" = weakref.WeakKeyDictionary()
        self._by_iterator: "weakref.WeakKeyDictionary[Any, LoaderRecord]" = weakref.WeakKeyDictionary()
        #: pid -> [record, start time, cpu seconds at start]
        self._workers: dict[int, list] = {}
        self._saved: list[tuple[type, str, Any]] = []
        self._lock = threading.Lock()

    def attach(self, recorder: Any) -> "LoaderProbe":
        self.recorder = recorder
        return self

    # -- install

    def install(self) -> None:
        from torch.utils.data import dataloader

        if self.codes is None:
            from torchaxe.runtime.probes import CodeMap

            self.codes = CodeMap()
        self._patch(dataloader.DataLoader, "__init__", self._wrap_init)
        self._patch(dataloader.DataLoader, "_get_iterator", self._wrap_get_iterator)
        self._patch(dataloader.DataLoader, "__iter__", self._wrap_iter)
        self._patch(dataloader._BaseDataLoaderIter, "__next__", self._wrap_next)
        self._patch(dataloader._MultiProcessingDataLoaderIter, "_shutdown_workers", self._wrap_shutdown)

    def _patch(self, owner: type, name: str, make: Callable[[Any], Callable]) -> None:
        from torchaxe.runtime.probes import patch_method

        patch_method(self._saved, owner, name, make)

    def uninstall(self) -> None:
        for pid in list(self._workers):
            self._close_worker(pid)
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    # -- wrappers

    def _wrap_init(self, original: Callable) -> Callable:
        probe = self

        def __init__(loader, *args, **kwargs):
            original(loader, *args, **kwargs)
            try:
                probe._register(loader, sys._getframe(1))
            except Exception:  # never break the user's loader over bookkeeping
                pass

        return __init__

    def _register(self, loader: Any, frame: Any) -> None:
        if loader in self._by_loader:  # a subclass calling super().__init__
            return
        codes = self.codes
        dataset = loader.dataset
        builder = frame
        while builder is not None and codes.kind(builder.f_code.co_filename) in ("internal", "tensor"):
            builder = builder.f_back
        if builder is not None and codes.kind(builder.f_code.co_filename) == "library":
            # An installed package rebuilding a loader of the user's over its dataset
            # (accelerate's prepare(), a trainer adding a sampler): the same loader for
            # the report, with the settings and batch size the user wrote.
            earlier = next((r for r in reversed(self.records) if r.dataset is dataset), None)
            if earlier is not None:
                self._by_loader[loader] = earlier
                return
        frame = builder  # the frames passed over so far are torch's or torchaxe's, none the user's
        while frame is not None and codes.kind(frame.f_code.co_filename) != "user":
            frame = frame.f_back
        try:
            length = len(dataset)
        except Exception:
            length = None
        from torch.utils.data import IterableDataset

        from torchaxe.runtime.tensor_batches import batchable

        context = loader.multiprocessing_context
        start = (context.get_start_method() if context is not None else _default_start_method()) \
            if loader.num_workers else None
        record = LoaderRecord(
            index=len(self.records),
            file=codes.show(frame.f_code.co_filename) if frame is not None else None,
            line=frame.f_lineno if frame is not None else None,
            dataset_type=type(dataset).__qualname__, batched_fetch=batchable(loader),
            map_style=not isinstance(dataset, IterableDataset),
            dataset_length=length,
            batch_size=loader.batch_size,
            num_workers=int(loader.num_workers),
            pin_memory=bool(loader.pin_memory),
            persistent_workers=bool(loader.persistent_workers),
            prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
            start_method=start,
            timeout=float(loader.timeout or 0),
            dataset=dataset,
            collate_fn=loader.collate_fn,
            dataset_source=_class_source(type(dataset), codes),
        )
        self.records.append(record)
        self._by_loader[loader] = record

    def _wrap_get_iterator(self, original: Callable) -> Callable:
        probe = self

        def _get_iterator(loader):
            start = probe.clock()
            iterator = original(loader)
            elapsed = probe.clock() - start
            record = probe._by_loader.get(loader)
            if record is not None:
                record.iterator_seconds.append(elapsed)
                probe._by_iterator[iterator] = record
                probe._watch_workers(iterator, record)
            return iterator

        return _get_iterator

    def _wrap_iter(self, original: Callable) -> Callable:
        """``iter(loader)`` blocks while workers start (every epoch, unless persistent):
        that is the loader's data wait too."""
        probe = self

        def __iter__(loader):
            record = probe._by_loader.get(loader)
            if record is None:
                return original(loader)
            start = probe.clock()
            try:
                return original(loader)
            finally:
                elapsed = probe.clock() - start
                record.wait_seconds += elapsed
                if probe.recorder is not None and _in_measured_step(probe.recorder):
                    record.wait_measured_seconds += elapsed

        return __iter__

    def _watch_workers(self, iterator: Any, record: LoaderRecord) -> None:
        now = self.clock()
        for process in getattr(iterator, "_workers", ()) or ():
            pid = getattr(process, "pid", None)
            if pid is None:
                continue
            record.workers_started += 1
            cpu = self.cpu_seconds(pid)
            if cpu is not None:
                with self._lock:
                    self._workers[pid] = [record, now, cpu]

    def _close_worker(self, pid: int) -> None:
        with self._lock:
            entry = self._workers.pop(pid, None)
        if entry is None:
            return
        record, start, cpu0 = entry
        cpu1 = self.cpu_seconds(pid)
        if cpu1 is None:
            return
        record.worker_cpu_seconds += max(0.0, cpu1 - cpu0)
        record.worker_alive_seconds += max(0.0, self.clock() - start)

    def _wrap_shutdown(self, original: Callable) -> Callable:
        probe = self

        def _shutdown_workers(iterator):
            for process in getattr(iterator, "_workers", ()) or ():
                pid = getattr(process, "pid", None)
                if pid is not None:
                    probe._close_worker(pid)
            return original(iterator)

        return _shutdown_workers

    def _wrap_next(self, original: Callable) -> Callable:
        probe = self

        def __next__(iterator):
            record = probe._by_iterator.get(iterator)
            if record is None:
                return original(iterator)
            start = probe.clock()
            fetched = False
            try:
                batch = original(iterator)
                fetched = True
                return batch
            finally:
                # The end of an epoch (StopIteration, after shutting the workers down)
                # is waited for too.
                elapsed = probe.clock() - start
                record.wait_seconds += elapsed
                record.batches += fetched
                if probe.recorder is not None and _in_measured_step(probe.recorder):
                    record.batches_measured += fetched
                    record.wait_measured_seconds += elapsed

        return __next__


@dataclass
class CopyStep:
    """Host-to-device copies made during one step."""

    seconds: float = 0.0
    bytes: int = 0
    copies: int = 0
    blocking: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "bytes": self.bytes, "copies": self.copies, "blocking": self.blocking}


class CopyProbe:
    """Times host-to-device copies by step, and the DataLoader's batch pinning."""

    METHODS = ("to", "cuda", "npu")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.recorder: Any = None
        self.steps: dict[int, CopyStep] = {}
        self.pin_seconds = 0.0
        self.pinned_batches = 0
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def attach(self, recorder: Any) -> "CopyProbe":
        self.recorder = recorder
        return self

    def install(self) -> None:
        import torch
        import torch.utils.data._utils.pin_memory as pin_module

        from torchaxe.runtime.dynamo import compiling_check

        compiling = compiling_check()
        for name in self.METHODS:
            original = getattr(torch.Tensor, name, None)  # ``npu`` only with torch_npu
            if original is None:
                continue
            self._saved.append((torch.Tensor, name, original, name in torch.Tensor.__dict__))
            setattr(torch.Tensor, name, self._wrap_copy(original, compiling, name))
        original_pin = pin_module.pin_memory
        self._saved.append((pin_module, "pin_memory", original_pin, True))
        pin_module.pin_memory = self._wrap_pin(original_pin)

    def uninstall(self) -> None:
        from torchaxe.runtime.probes import restore_patches

        restore_patches(self._saved)  # an inherited method (torch._C.TensorBase) is uncovered again

    def _step_index(self) -> int:
        recorder = self.recorder
        return len(recorder.steps) + 1 if recorder is not None else 0

    def _wrap_copy(self, original: Callable, compiling: Callable[[], bool], name: str) -> Callable:
        probe, local, clock = self, self._local, self.clock

        def copy(tensor, *args, **kwargs):
            if getattr(local, "depth", 0) or not tensor.is_cpu or compiling():
                return original(tensor, *args, **kwargs)
            local.depth = 1
            start = clock()
            try:
                result = original(tensor, *args, **kwargs)
            finally:
                local.depth = 0
            if result is not tensor and getattr(result, "is_cpu", True) is False:
                elapsed = clock() - start
                entry = probe.steps.setdefault(probe._step_index(), CopyStep())
                entry.seconds += elapsed
                entry.bytes += tensor.numel() * tensor.element_size()
                entry.copies += 1
                if not kwargs.get("non_blocking", False):
                    entry.blocking += 1
            return result

        copy.__name__ = name
        copy.__qualname__ = f"Tensor.{name}"
        copy.__doc__ = original.__doc__
        copy.__wrapped__ = original
        return copy

    def _wrap_pin(self, original: Callable) -> Callable:
        probe = self

        def pin_memory(data, *args, **kwargs):
            start = probe.clock()
            result = original(data, *args, **kwargs)
            probe.pin_seconds += probe.clock() - start
            probe.pinned_batches += 1
            return result

        pin_memory.__wrapped__ = original
        return pin_memory
