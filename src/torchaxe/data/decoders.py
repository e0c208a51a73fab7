"""Image decoders: PIL, OpenCV and torchvision.io, compared on the user's own files.

``decode_image(path_or_bytes)`` returns what ``np.asarray(Image.open(p).convert("RGB"))``
returns (an H x W x 3 uint8 RGB array; H x W for ``mode="L"``), decoded by the fastest
decoder installed whose pixels match PIL's. The choice is measured, not assumed: the
first image of each format a process decodes is decoded by every available decoder a
few times, and the fastest one that reproduces PIL's pixels exactly (or within
``tolerance`` levels) is kept for that format. ``TORCHAXE_DECODER=pil|opencv|torchvision``
or ``decoder=`` pins one.

``benchmark_decoders(files)`` times every available decoder on a sample of files (the
bytes read once, outside the timing, so storage speed does not enter), interleaved,
and compares every decoder's pixels with PIL's: exact, or the largest and mean
difference in levels. Files that no decoder can read are listed, not fatal.

OpenCV (``opencv-python-headless``) and torchvision are optional; PIL is the
baseline. EXIF orientation is ignored by every decoder, as ``Image.open`` does.
"""

from __future__ import annotations

import importlib.util
import io
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from torchaxe.errors import TorchaxeError
from torchaxe.units import duration

DECODERS = ("pil", "opencv", "torchvision")
MODES = ("RGB", "L")
LAYOUTS = ("HWC", "CHW")
OUTPUTS = ("numpy", "tensor", "pil")
#: File name endings treated as images when looking for the user's image files.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm")
#: Decodes per decoder when choosing one at the first image of a format.
CHOICE_REPEATS = 3


class ImageDecodeError(TorchaxeError):
    """An image that cannot be read or decoded, in one line naming it."""


def sniff_format(data: bytes) -> str:
    """The image format from its first bytes: jpeg, png, gif, bmp, webp, tiff, pnm or unknown."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if data[:1] == b"P" and data[1:2] in b"123456":
        return "pnm"
    return "unknown"


# ------------------------------------------------------------------ the decoders


def _pil(data: bytes, mode: str) -> Any:
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert(mode))


def _opencv(data: bytes, mode: str) -> Any:
    import cv2
    import numpy as np

    buffer = np.frombuffer(data, dtype=np.uint8)
    keep = cv2.IMREAD_IGNORE_ORIENTATION
    if mode == "L":
        image = cv2.imdecode(buffer, cv2.IMREAD_GRAYSCALE | keep)
    else:
        rgb = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.10 decodes straight to RGB
        image = cv2.imdecode(buffer, (rgb if rgb is not None else cv2.IMREAD_COLOR) | keep)
        if image is not None and rgb is None:
            image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    if image is None:
        raise ValueError("cv2.imdecode could not decode it")
    return image


def _torchvision(data: bytes, mode: str) -> Any:
    import torch
    from torchvision.io import ImageReadMode, decode_image

    tensor = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                          mode=ImageReadMode.GRAY if mode == "L" else ImageReadMode.RGB)
    array = tensor.permute(1, 2, 0).numpy()
    return array[:, :, 0] if mode == "L" else array


_FUNCTIONS: dict[str, Callable[[bytes, str], Any]] = {"pil": _pil, "opencv": _opencv, "torchvision": _torchvision}
_MODULES = {"pil": "PIL", "opencv": "cv2", "torchvision": "torchvision"}
_available: dict[str, bool] = {}
_lock = threading.Lock()


def decoder_available(name: str) -> bool:
    """Whether the decoder's package is installed and imports (torchvision from PyPI
    may not import beside another torch build: then it is not available)."""
    if name not in _available:
        ok = importlib.util.find_spec(_MODULES[name]) is not None
        if ok:
            try:
                if name == "torchvision":
                    import torchvision.io  # noqa: F401
                else:
                    importlib.import_module(_MODULES[name])
            except Exception:  # installed but broken (an ABI mismatch with torch)
                ok = False
        _available[name] = ok
    return _available[name]


def available_decoders() -> list[str]:
    return [name for name in DECODERS if decoder_available(name)]


def read_image_bytes(source: Any) -> tuple[bytes, str]:
    """The bytes of a path or of bytes-like data, and a name for messages."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), "<bytes>"
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        try:
            with open(name, "rb") as handle:
                return handle.read(), name
        except FileNotFoundError:
            raise ImageDecodeError(f"{name}: no such file") from None
        except IsADirectoryError:
            raise ImageDecodeError(f"{name}: is a folder, not an image") from None
        except OSError as exc:
            raise ImageDecodeError(f"{name}: cannot read: {exc.strerror or exc}") from None
    raise ImageDecodeError(f"decode_image: expected a path or bytes, got {type(source).__name__}")


def decode_with(name: str, data: bytes, mode: str = "RGB") -> Any:
    """Decode with one named decoder; raises ValueError (or the decoder's own
    exception) when it cannot."""
    return _FUNCTIONS[name](data, mode)


# ------------------------------------------------------------------ the choice


@dataclass(frozen=True)
class DecoderChoice:
    """Which decoder ``decode_image`` uses for one (format, mode), and why."""

    format: str
    mode: str
    decoder: str
    #: Seconds per decode of the image the choice was made on, by decoder.
    seconds: dict[str, float] = field(default_factory=dict)
    #: Largest difference from PIL's pixels, in levels, by decoder (None: it failed).
    max_difference: dict[str, int | None] = field(default_factory=dict)
    reason: str = ""


_choices: dict[tuple[str, str], DecoderChoice] = {}


def _max_difference(a: Any, b: Any) -> int | None:
    import numpy as np

    if getattr(a, "shape", None) != getattr(b, "shape", None):
        return None
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) if a.size else 0


def choose_decoder(data: bytes, mode: str = "RGB", tolerance: int = 0,
                   clock: Callable[[], float] = time.perf_counter) -> DecoderChoice:
    """Measure every available decoder on ``data`` and keep the fastest whose pixels
    are within ``tolerance`` levels of PIL's (PIL itself when it is the only one, or
    nothing else matches)."""
    fmt = sniff_format(data)
    names = available_decoders()
    seconds: dict[str, float] = {}
    differences: dict[str, int | None] = {}
    reference = None
    outputs: dict[str, Any] = {}
    for name in names:
        best = None
        try:
            for _ in range(CHOICE_REPEATS):
                start = clock()
                out = decode_with(name, data, mode)
                elapsed = clock() - start
                best = elapsed if best is None else min(best, elapsed)
        except Exception:
            differences[name] = None
            continue
        seconds[name] = best or 0.0
        outputs[name] = out
    reference = outputs.get("pil")
    for name, out in outputs.items():
        differences[name] = 0 if name == "pil" else (_max_difference(out, reference) if reference is not None else None)
    matching = [n for n in seconds if differences.get(n) is not None and differences[n] <= tolerance]
    if not matching:
        matching = [n for n in seconds]
    if not matching:
        return DecoderChoice(fmt, mode, "pil", seconds, differences, "no decoder could decode the first image")
    fastest = min(matching, key=lambda n: seconds[n])
    reason = (f"fastest of {', '.join(sorted(seconds))} on the first {fmt} image "
              f"({duration(seconds[fastest], 3)}), pixels within {tolerance} of PIL's")
    return DecoderChoice(fmt, mode, fastest, seconds, differences, reason)


def current_choice(fmt: str, mode: str = "RGB") -> DecoderChoice | None:
    """The decoder chosen so far in this process for a format, if any."""
    return _choices.get((fmt, mode))


def reset_choices() -> None:
    """Forget the choices (tests; after installing a decoder)."""
    with _lock:
        _choices.clear()
        _available.clear()


def decode_image(source: Any, *, mode: str = "RGB", layout: str = "HWC", output: str = "numpy",
                 decoder: str | None = None, tolerance: int = 0) -> Any:
    """Decode an image file (a path) or its bytes with the fastest available decoder.

    Returns what ``np.asarray(PIL.Image.open(source).convert(mode))`` returns: an
    ``H x W x 3`` uint8 RGB array (``H x W`` for ``mode="L"``); ``layout="CHW"`` puts
    channels first (``3 x H x W`` / ``1 x H x W``, torchvision's layout);
    ``output="tensor"`` gives a torch uint8 tensor, ``output="pil"`` a PIL image (for
    code that goes on with PIL transforms). A file that cannot be read or decoded
    raises :class:`ImageDecodeError` (a TorchaxeError), one line naming it.
    """
    if mode not in MODES:
        raise ImageDecodeError(f"decode_image: mode {mode!r}: expected one of {', '.join(MODES)}")
    if layout not in LAYOUTS:
        raise ImageDecodeError(f"decode_image: layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if output not in OUTPUTS:
        raise ImageDecodeError(f"decode_image: output {output!r}: expected one of {', '.join(OUTPUTS)}")
    data, name = read_image_bytes(source)
    if not data:
        raise ImageDecodeError(f"{name}: empty file, not an image")
    pinned = decoder or os.environ.get("TORCHAXE_DECODER") or None
    if pinned is not None:
        if pinned not in DECODERS:
            raise ImageDecodeError(f"decoder {pinned!r}: expected one of {', '.join(DECODERS)}")
        if not decoder_available(pinned):
            raise ImageDecodeError(f"decoder {pinned!r} is not installed here (available: {', '.join(available_decoders())})")
        order = [pinned]
    else:
        fmt = sniff_format(data)
        choice = _choices.get((fmt, mode))
        if choice is None:
            with _lock:
                choice = _choices.get((fmt, mode))
                if choice is None:
                    choice = choose_decoder(data, mode, tolerance)
                    _choices[(fmt, mode)] = choice
        order = [choice.decoder] + [n for n in ("pil",) if n != choice.decoder and decoder_available(n)]
    errors = []
    array = None
    for candidate in order:
        try:
            array = decode_with(candidate, data, mode)
            break
        except Exception as exc:  # the next decoder may read what this one cannot
            errors.append(f"{candidate}: {_one_line(exc)}")
    if array is None:
        raise ImageDecodeError(f"{name}: cannot decode as an image ({'; '.join(errors)})")
    return _shape_output(array, mode, layout, output)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _shape_output(array: Any, mode: str, layout: str, output: str) -> Any:
    import numpy as np

    if output == "pil":
        from PIL import Image

        return Image.fromarray(np.ascontiguousarray(array), mode=mode)
    if layout == "CHW":
        array = array[None, :, :] if array.ndim == 2 else array.transpose(2, 0, 1)
    if output == "tensor":
        import torch

        return torch.from_numpy(np.ascontiguousarray(array))
    return array


# ------------------------------------------------------------------ the benchmark


@dataclass
class DecoderResult:
    """One decoder over the sample: raw per-file times and agreement with PIL."""

    name: str
    #: Per file decoded, the median seconds over the repeats.
    seconds: list[float] = field(default_factory=list)
    failures: int = 0
    first_failure: str | None = None
    #: Files whose pixels equal PIL's exactly / were compared.
    equal_files: int = 0
    compared_files: int = 0
    max_difference: int | None = None
    mean_difference: float | None = None
    shape_mismatches: int = 0

    @property
    def median_seconds(self) -> float | None:
        from torchaxe.runtime.stats import Samples

        return Samples.of(self.seconds).median

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)

    def agreement(self) -> str:
        if self.name == "pil":
            return "reference"
        if not self.compared_files:
            return "not compared"
        if self.shape_mismatches:
            return f"different shapes on {self.shape_mismatches} of {self.compared_files} files"
        if self.equal_files == self.compared_files:
            return f"pixel-identical on all {self.compared_files} files"
        return (f"differs on {self.compared_files - self.equal_files} of {self.compared_files} files: "
                f"at most {self.max_difference} levels, mean {self.mean_difference:.3f}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "median_seconds": self.median_seconds, "total_seconds": self.total_seconds,
                "files": len(self.seconds), "failures": self.failures, "first_failure": self.first_failure,
                "equal_files": self.equal_files, "compared_files": self.compared_files,
                "max_difference": self.max_difference, "mean_difference": self.mean_difference,
                "shape_mismatches": self.shape_mismatches, "agreement": self.agreement(),
                "seconds": list(self.seconds)}


@dataclass
class DecoderReport:
    """Every available decoder on the same files: which is fastest, by how much."""

    files: list[str]
    mode: str
    repeats: int
    results: list[DecoderResult]
    #: Files no decoder could decode: ``(file, reason)``.
    undecodable: list[tuple[str, str]] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    formats: dict[str, int] = field(default_factory=dict)

    def result(self, name: str) -> DecoderResult | None:
        return next((r for r in self.results if r.name == name), None)

    @property
    def fastest(self) -> DecoderResult | None:
        """The fastest decoder over the files every decoder read, among those whose
        pixels match PIL's (any decoder when PIL failed everywhere)."""
        usable = [r for r in self.results if r.seconds and not r.shape_mismatches]
        if not usable:
            return None
        return min(usable, key=lambda r: r.total_seconds)

    def speedup(self, name: str) -> float | None:
        """PIL's total time over ``name``'s on the same files."""
        pil, other = self.result("pil"), self.result(name)
        if pil is None or other is None or not other.total_seconds or len(pil.seconds) != len(other.seconds):
            return None
        return pil.total_seconds / other.total_seconds

    def to_dict(self) -> dict[str, Any]:
        fastest = self.fastest
        return {"files": len(self.files), "mode": self.mode, "repeats": self.repeats, "formats": dict(self.formats),
                "fastest": fastest.name if fastest else None,
                "speedup_vs_pil": self.speedup(fastest.name) if fastest else None,
                "decoders": [r.to_dict() for r in self.results],
                "unavailable": list(self.unavailable),
                "undecodable": [{"file": f, "reason": r} for f, r in self.undecodable]}


def find_image_files(root: str | Path, limit: int = 10_000) -> list[Path]:
    """Image files under a folder (by suffix), sorted; a file is itself."""
    root = Path(root)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise TorchaxeError(f"--images {root}: no such file or folder")
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if n.lower().endswith(IMAGE_SUFFIXES):
                found.append(Path(folder) / n)
                if len(found) >= limit:
                    return found
    return found


def benchmark_decoders(files: Sequence[str | Path], *, mode: str = "RGB", repeats: int = 5,
                       decoders: Iterable[str] | None = None,
                       clock: Callable[[], float] = time.perf_counter,
                       progress: Callable[[int, int], None] | None = None) -> DecoderReport:
    """Time each available decoder on each file, interleaved (every decoder on a file,
    ``repeats`` rounds, before the next file), and compare pixels with PIL's."""
    import numpy as np

    from torchaxe.runtime.stats import Samples

    if repeats < 1:
        raise TorchaxeError(f"--decode-repeats {repeats}: must be at least 1")
    wanted = list(decoders) if decoders is not None else list(DECODERS)
    names = [n for n in wanted if decoder_available(n)]
    report = DecoderReport(files=[str(f) for f in files], mode=mode, repeats=repeats,
                           results=[DecoderResult(n) for n in names],
                           unavailable=[n for n in wanted if n not in names])
    by_name = {r.name: r for r in report.results}
    diffs: dict[str, list[float]] = {n: [] for n in names}
    for index, path in enumerate(files, 1):
        try:
            data, shown = read_image_bytes(path)
        except ImageDecodeError as exc:
            report.undecodable.append((str(path), exc.message))
            continue
        fmt = sniff_format(data)
        report.formats[fmt] = report.formats.get(fmt, 0) + 1
        times: dict[str, list[float]] = {n: [] for n in names}
        outputs: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for _ in range(repeats):
            for name in names:
                if name in failed:
                    continue
                start = clock()
                try:
                    out = decode_with(name, data, mode)
                except Exception as exc:
                    failed[name] = _one_line(exc)
                    continue
                times[name].append(clock() - start)
                outputs.setdefault(name, out)
        if len(failed) == len(names):
            report.undecodable.append((shown, "; ".join(f"{n}: {m}" for n, m in failed.items())))
            continue
        # A file some decoder cannot read counts against that decoder only; the
        # speedup compares decoders over the files all of them read.
        for name, message in failed.items():
            result = by_name[name]
            result.failures += 1
            result.first_failure = result.first_failure or f"{shown}: {message}"
        if failed:
            continue
        reference = outputs.get("pil")
        for name in names:
            result = by_name[name]
            result.seconds.append(Samples.of(times[name]).median or 0.0)
            if name == "pil" or reference is None:
                continue
            out = outputs[name]
            result.compared_files += 1
            if out.shape != reference.shape:
                result.shape_mismatches += 1
                continue
            delta = np.abs(out.astype(np.int16) - reference.astype(np.int16))
            peak = int(delta.max()) if delta.size else 0
            if peak == 0:
                result.equal_files += 1
            result.max_difference = max(result.max_difference or 0, peak)
            diffs[name].append(float(delta.mean()) if delta.size else 0.0)
        if progress is not None:
            progress(index, len(files))
    for name in names:
        if diffs[name]:
            by_name[name].mean_difference = sum(diffs[name]) / len(diffs[name])
    return report
