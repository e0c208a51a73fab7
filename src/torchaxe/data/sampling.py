"""Time a loader's dataset in-process, split into stages: read, decode, transform, collate.

After the run, ``sample_loader(record)`` fetches a few samples of the loader's own
dataset (``dataset[i]`` for a map-style dataset, at seeded random indices; ``next()``
for an iterable one) in a helper thread, and times each one with its stages:

* **decode**: time inside the decoders' entry points, wrapped while sampling (PIL's
  ``Image.open`` and ``ImageFile.load``, ``cv2.imread``/``imdecode``, the
  ``torchvision.io`` decoders, ``torchaxe.data.decode_image``; only modules the
  dataset has already imported), outermost call only;
* **read**: the time to read the bytes of every file the sample opened, measured by
  reading them again right after the sample (``open`` is wrapped to see which files;
  the page cache is as the sample left it). Files opened inside a decoder
  (``Image.open(path)`` reads as it decodes) have their read time taken off decode;
* **transform**: the rest of the sample's time (crops, flips, conversion to tensors,
  normalisation);
* **collate**: the loader's ``collate_fn`` on a batch of the fetched samples, scaled
  to the batch size.

The wrappers cost a microsecond or two per decoder call, nothing per Python call. The
image files the samples opened are kept for the decoder benchmark.

Bad input is reported, never fatal: a sample that raises is recorded (type, message,
the user's line) and the others go on (up to :data:`MAX_ERRORS`); a sample that does
not return within ``timeout`` seconds ends the sampling with a message, its thread
left behind as a daemon.
"""

from __future__ import annotations

import builtins
import importlib
import io
import os
import queue
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from torchaxe.data.decoders import IMAGE_SUFFIXES

STAGES = ("read", "decode", "transform", "collate")
#: Sampling stops after this many samples raised.
MAX_ERRORS = 5
#: Repeats of the collate timing.
COLLATE_REPEATS = 3

#: Decoder entry points wrapped while sampling: (module, owner path, attribute).
DECODE_ENTRY_POINTS = (
    ("PIL.Image", "", "open"),
    ("PIL.ImageFile", "ImageFile", "load"),
    ("cv2", "", "imread"),
    ("cv2", "", "imdecode"),
    ("torchvision.io", "", "decode_image"),
    ("torchvision.io", "", "decode_jpeg"),
    ("torchvision.io", "", "decode_png"),
    ("torchvision.io", "", "read_image"),
    ("torchaxe.data.decoders", "", "decode_with"),
)
READ_CHUNK = 1 << 20


class StageTimer:
    """Wraps the decoders and ``open`` while sampling, timing the sampling thread's
    calls only; ``install``/``uninstall`` restore everything."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.thread: int | None = None
        self.decode = 0.0
        #: (path, opened inside a decoder) for files the current sample opened.
        self.opened: list[tuple[str, bool]] = []
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self.original_open = builtins.open

    def reset(self) -> None:
        self.decode = 0.0
        self.opened = []

    def install(self) -> None:
        if "PIL.Image" in sys.modules and "PIL.ImageFile" not in sys.modules:
            # PIL decodes lazily, in ImageFile.load (at .convert(), .load(), ...), and
            # imports that module with its first image plugin: in a script whose images
            # were opened in worker processes only, not yet in this one.
            try:
                importlib.import_module("PIL.ImageFile")
            except ImportError:
                pass
        for module_name, owner_path, attribute in DECODE_ENTRY_POINTS:
            module = sys.modules.get(module_name)
            if module is None:
                continue
            owner: Any = module
            for part in filter(None, owner_path.split(".")):
                owner = getattr(owner, part, None)
            original = getattr(owner, attribute, None) if owner is not None else None
            if original is None or not callable(original):
                continue
            self._saved.append((owner, attribute, owner.__dict__.get(attribute, original)
                                if isinstance(owner, type) else original))
            setattr(owner, attribute, self._wrap_decode(original))
        self._saved.append((builtins, "open", builtins.open))
        self._saved.append((io, "open", io.open))
        builtins.open = io.open = self._wrap_open(self.original_open)

    def uninstall(self) -> None:
        while self._saved:
            owner, attribute, original = self._saved.pop()
            setattr(owner, attribute, original)

    def _wrap_decode(self, original: Callable) -> Callable:
        timer = self

        def decode(*args, **kwargs):
            if timer._depth or threading.get_ident() != timer.thread:
                return original(*args, **kwargs)
            timer._depth = 1
            start = timer.clock()
            try:
                return original(*args, **kwargs)
            finally:
                timer.decode += timer.clock() - start
                timer._depth = 0

        decode.__wrapped__ = original  # type: ignore[attr-defined]
        return decode

    def _wrap_open(self, original: Callable) -> Callable:
        timer = self

        def recording_open(file, *args, **kwargs):
            if threading.get_ident() == timer.thread and isinstance(file, (str, os.PathLike)):
                name = os.fspath(file)
                if isinstance(name, str):
                    timer.opened.append((name, bool(timer._depth)))
            return original(file, *args, **kwargs)

        return recording_open

    def read_seconds(self) -> tuple[float, float]:
        """Seconds to read the files the sample opened again: all of them, and those
        opened inside a decoder."""
        total = inside = 0.0
        for name, in_decode in dict.fromkeys(self.opened):
            start = self.clock()
            try:
                with self.original_open(name, "rb") as handle:
                    while handle.read(READ_CHUNK):
                        pass
            except OSError:
                continue
            elapsed = self.clock() - start
            total += elapsed
            if in_decode:
                inside += elapsed
        return total, inside


@dataclass
class SampleError:
    """A sample that raised."""

    index: int | None
    type: str
    message: str
    location: str | None = None

    def text(self) -> str:
        where = f" at {self.location}" if self.location else ""
        which = f"dataset[{self.index}]" if self.index is not None else "next(iter(dataset))"
        return f"{which} raised {self.type}{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "type": self.type, "message": self.message, "location": self.location}


@dataclass
class StageReport:
    """What sampling one loader's dataset measured (seconds; raw samples kept)."""

    dataset_type: str
    batch_size: int
    attempted: int = 0
    sample_seconds: list[float] = field(default_factory=list)
    read_seconds: list[float] = field(default_factory=list)
    decode_seconds: list[float] = field(default_factory=list)
    #: Collate of one batch of ``batch_size`` samples (scaled when fewer were fetched).
    collate_seconds: list[float] = field(default_factory=list)
    errors: list[SampleError] = field(default_factory=list)
    collate_error: str | None = None
    hung: str | None = None
    image_files: list[str] = field(default_factory=list)

    def _median(self, values: list[float]) -> float | None:
        from torchaxe.runtime.stats import Samples

        return Samples.of(values).median

    @property
    def per_sample_seconds(self) -> float | None:
        return self._median(self.sample_seconds)

    def stage_seconds(self) -> dict[str, float | None]:
        """Median seconds per sample of each stage (collate: per sample of a batch)."""
        total = self.per_sample_seconds
        read = self._median(self.read_seconds)
        decode = self._median(self.decode_seconds)
        transform = None
        if total is not None:
            transform = max(0.0, total - (read or 0.0) - (decode or 0.0))
        collate = self._median(self.collate_seconds)
        return {"read": read, "decode": decode, "transform": transform,
                "collate": collate / self.batch_size if collate is not None else None}

    @property
    def per_batch_seconds(self) -> float | None:
        """Loading one batch in one process: batch_size samples and their collate."""
        total = self.per_sample_seconds
        if total is None:
            return None
        return total * self.batch_size + (self._median(self.collate_seconds) or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"dataset_type": self.dataset_type, "batch_size": self.batch_size, "attempted": self.attempted,
                "samples": len(self.sample_seconds), "per_sample_seconds": self.per_sample_seconds,
                "per_batch_seconds": self.per_batch_seconds, "stages": self.stage_seconds(),
                "errors": [e.to_dict() for e in self.errors], "collate_error": self.collate_error,
                "hung": self.hung, "image_files": len(self.image_files),
                "raw": {"sample_seconds": list(self.sample_seconds), "read_seconds": list(self.read_seconds),
                        "decode_seconds": list(self.decode_seconds),
                        "collate_seconds": list(self.collate_seconds)}}


def _error_of(exc: BaseException, index: int | None, codes: Any) -> SampleError:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if codes is None or codes.kind(f.filename) == "user"]
    where = user[-1] if user else (frames[-1] if frames else None)
    location = f"{codes.show(where.filename) if codes else where.filename}:{where.lineno}" if where else None
    lines = str(exc).strip().splitlines()
    return SampleError(index, type(exc).__qualname__, lines[0] if lines else "", location)


def sample_loader(record: Any, samples: int = 32, *, timeout: float = 30.0, seed: int = 0,
                  clock: Callable[[], float] = time.perf_counter, codes: Any = None) -> StageReport:
    """Sample ``record.dataset`` (a LoaderRecord, or anything with ``dataset``,
    ``collate_fn``, ``batch_size``) and time its stages."""
    dataset = record.dataset
    batch_size = int(record.batch_size or 1)
    report = StageReport(type(dataset).__qualname__, batch_size)
    if dataset is None or samples < 1:
        return report
    if codes is None:
        from torchaxe.runtime.probes import CodeMap

        codes = CodeMap()
    map_style = getattr(record, "map_style", True) and hasattr(dataset, "__getitem__")
    indices: list[int | None]
    if map_style:
        try:
            length = len(dataset)
        except Exception:
            length = None
        if not length:
            return report
        indices = random.Random(seed).sample(range(length), min(samples, length))
    else:
        indices = [None] * samples

    results: "queue.Queue[tuple]" = queue.Queue()
    stop = threading.Event()
    timer = StageTimer(clock)
    opened: dict[str, None] = {}

    def work() -> None:
        timer.thread = threading.get_ident()
        iterator = None
        kept: list[Any] = []
        errors = 0
        for index in indices:
            if stop.is_set():
                return
            timer.reset()
            try:
                if index is None:
                    if iterator is None:
                        iterator = iter(dataset)
                    fetch: Callable[[], Any] = lambda: next(iterator)  # noqa: E731
                else:
                    fetch = lambda i=index: dataset[i]  # noqa: E731
                start = clock()
                item = fetch()
                total = clock() - start
            except StopIteration:
                break
            except Exception as exc:
                results.put(("error", _error_of(exc, index, codes)))
                errors += 1
                if errors >= MAX_ERRORS:
                    break
                continue
            decode = timer.decode
            files = list(timer.opened)
            read, read_in_decode = timer.read_seconds()
            if len(kept) < batch_size:
                kept.append(item)
            results.put(("sample", total, read, max(0.0, decode - read_in_decode), files))
        if kept and record.collate_fn is not None:
            try:
                times = []
                for _ in range(COLLATE_REPEATS):
                    start = clock()
                    if getattr(record, "batch_size", None) is None:
                        for item in kept:
                            record.collate_fn(item)
                    else:
                        record.collate_fn(list(kept))
                    times.append((clock() - start) * batch_size / len(kept))
                results.put(("collate", times))
            except Exception as exc:
                results.put(("collate-error", _error_of(exc, None, codes).text().replace("next(iter(dataset))", "collate_fn")))
        results.put(("done",))

    timer.install()
    thread = threading.Thread(target=work, name="torchaxe-data-sampling", daemon=True)
    try:
        thread.start()
        while True:
            try:
                message = results.get(timeout=timeout)
            except queue.Empty:
                stop.set()
                done = len(report.sample_seconds) + len(report.errors)
                which = f"dataset[{indices[done]}]" if done < len(indices) and indices[done] is not None else "the next sample"
                report.hung = (f"{which} did not return within {timeout:g} s: sampling stopped "
                               f"(a hung __getitem__, a lock, or storage that does not answer)")
                break
            kind = message[0]
            if kind == "done":
                break
            if kind == "sample":
                _, total, read, decode, files = message
                report.attempted += 1
                report.sample_seconds.append(total)
                report.read_seconds.append(read)
                report.decode_seconds.append(decode)
                for name, _ in files:
                    if name.lower().endswith(IMAGE_SUFFIXES):
                        opened.setdefault(name, None)
            elif kind == "error":
                report.attempted += 1
                report.errors.append(message[1])
            elif kind == "collate":
                report.collate_seconds = list(message[1])
            elif kind == "collate-error":
                report.collate_error = message[1]
    finally:
        timer.uninstall()
    if report.hung is None:
        # Its last message is sent just before it returns: let it finish, so that no
        # thread is still inside torch when the process exits (an abort at shutdown).
        thread.join(timeout=5.0)
    report.image_files = list(opened)
    return report
