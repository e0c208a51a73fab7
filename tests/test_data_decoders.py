"""Image decoders: decode_image's layouts and pixel equality with PIL, bad files, and the
benchmark on a folder of real JPEGs and PNGs."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from torchaxe.data import decoders
from torchaxe.data.decoders import (
    ImageDecodeError, available_decoders, benchmark_decoders, decode_image, find_image_files, sniff_format,
)
from torchaxe.errors import TorchaxeError

HAS_CV2 = decoders.decoder_available("opencv")


def _picture(size=(48, 40), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    base[:, : size[0] // 2] = (200, 30, 60)
    noise = rng.integers(0, 40, size=base.shape, dtype=np.uint8)
    return Image.fromarray(base + noise)


def _bytes(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.delenv("TORCHAXE_DECODER", raising=False)
    decoders.reset_choices()
    yield
    decoders.reset_choices()


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "imgs"
    (folder / "sub").mkdir(parents=True)
    for i in range(4):
        _picture(seed=i).save(folder / f"{i}.jpg", quality=90)
    rgba = Image.new("RGBA", (20, 10), (10, 20, 30, 128))
    rgba.save(folder / "sub" / "alpha.png")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    (folder / "notes.txt").write_text("not an image")
    return folder


def test_sniff_format():
    assert sniff_format(_bytes(_picture(), "JPEG")) == "jpeg"
    assert sniff_format(_bytes(_picture(), "PNG")) == "png"
    assert sniff_format(b"hello") == "unknown"


def test_decode_image_matches_pil_pixels_for_path_and_bytes(images):
    path = images / "0.jpg"
    reference = np.asarray(Image.open(path).convert("RGB"))
    for source in (path, str(path), path.read_bytes()):
        out = decode_image(source)
        assert out.shape == reference.shape and out.dtype == np.uint8
        assert np.array_equal(out, reference)
    choice = decoders.current_choice("jpeg", "RGB")
    assert choice is not None and choice.decoder in available_decoders()
    assert choice.max_difference[choice.decoder] == 0  # the chosen one reproduces PIL's pixels
    assert set(choice.seconds) == set(available_decoders())


def test_layouts_outputs_and_modes(images):
    path = images / "1.jpg"
    reference = np.asarray(Image.open(path).convert("RGB"))
    chw = decode_image(path, layout="CHW")
    assert chw.shape == (3, *reference.shape[:2]) and np.array_equal(chw.transpose(1, 2, 0), reference)
    tensor = decode_image(path, output="tensor", layout="CHW")
    import torch

    assert tensor.dtype == torch.uint8 and tuple(tensor.shape) == chw.shape
    assert np.array_equal(tensor.numpy(), chw)
    pil = decode_image(path, output="pil")
    assert isinstance(pil, Image.Image) and pil.mode == "RGB" and np.array_equal(np.asarray(pil), reference)
    gray = decode_image(path, mode="L")
    assert np.array_equal(gray, np.asarray(Image.open(path).convert("L")))
    assert decode_image(path, mode="L", layout="CHW").shape == (1, *gray.shape)


def test_png_with_alpha_becomes_rgb_like_pil(images):
    path = images / "sub" / "alpha.png"
    assert np.array_equal(decode_image(path), np.asarray(Image.open(path).convert("RGB")))


@pytest.mark.parametrize("name", ["pil", "opencv"])
def test_pinned_decoder(images, name, monkeypatch):
    if not decoders.decoder_available(name):
        pytest.skip(f"{name} not installed")
    path = images / "2.jpg"
    reference = np.asarray(Image.open(path).convert("RGB"))
    assert np.array_equal(decode_image(path, decoder=name), reference)
    monkeypatch.setenv("TORCHAXE_DECODER", name)
    assert np.array_equal(decode_image(path), reference)


def test_bad_input_is_one_line_naming_the_file(images, tmp_path):
    with pytest.raises(ImageDecodeError, match=r"broken\.jpg: cannot decode as an image") as info:
        decode_image(images / "broken.jpg")
    assert "\n" not in str(info.value) and isinstance(info.value, TorchaxeError)
    with pytest.raises(ImageDecodeError, match="no such file"):
        decode_image(tmp_path / "missing.jpg")
    with pytest.raises(ImageDecodeError, match="is a folder"):
        decode_image(images)
    (tmp_path / "empty.jpg").write_bytes(b"")
    with pytest.raises(ImageDecodeError, match="empty file"):
        decode_image(tmp_path / "empty.jpg")
    with pytest.raises(ImageDecodeError, match="expected a path or bytes"):
        decode_image(12)
    with pytest.raises(ImageDecodeError, match="mode 'CMYK'"):
        decode_image(images / "0.jpg", mode="CMYK")
    with pytest.raises(ImageDecodeError, match="decoder 'magic'"):
        decode_image(images / "0.jpg", decoder="magic")
    # and a good image still decodes afterwards
    assert decode_image(images / "0.jpg").shape == (40, 48, 3)


def test_a_decoder_that_is_not_installed_is_refused(images, monkeypatch):
    monkeypatch.setitem(decoders._available, "torchvision", False)
    with pytest.raises(ImageDecodeError, match="not installed here"):
        decode_image(images / "0.jpg", decoder="torchvision")


def test_find_image_files(images):
    found = find_image_files(images)
    assert [p.name for p in found] == ["0.jpg", "1.jpg", "2.jpg", "3.jpg", "broken.jpg", "alpha.png"]
    assert find_image_files(images / "0.jpg") == [images / "0.jpg"]
    with pytest.raises(TorchaxeError, match="no such file or folder"):
        find_image_files(images / "nope")


def test_benchmark_times_every_decoder_and_lists_undecodable_files(images):
    files = find_image_files(images)
    ticks = iter(range(10**6))
    report = benchmark_decoders(files, repeats=2, clock=lambda: next(ticks) * 1e-3)
    names = [r.name for r in report.results]
    assert names[0] == "pil" and set(names) == set(available_decoders())
    assert [f for f, _ in report.undecodable] == [str(images / "broken.jpg")]
    assert report.formats == {"jpeg": 5, "png": 1}
    pil = report.result("pil")
    assert len(pil.seconds) == 5 and report.speedup("pil") == pytest.approx(1.0)
    assert report.fastest is not None
    data = report.to_dict()
    assert data["files"] == 6 and data["undecodable"][0]["file"].endswith("broken.jpg")
    if HAS_CV2:
        cv = report.result("opencv")
        assert cv.compared_files == 5 and cv.equal_files == 5 and cv.agreement().startswith("pixel-identical")


def test_benchmark_reports_pixel_differences():
    original = decoders._FUNCTIONS["opencv"]
    decoders._FUNCTIONS["opencv"] = lambda data, mode: np.clip(decoders._pil(data, mode).astype(np.int16) + 2, 0, 255).astype(np.uint8)
    decoders._available["opencv"] = True
    try:
        report = benchmark_decoders([_bytes(_picture(), "JPEG")], repeats=1, decoders=["pil", "opencv"])
    finally:
        decoders._FUNCTIONS["opencv"] = original
    cv = report.result("opencv")
    assert cv.max_difference == 2 and cv.equal_files == 0
    assert cv.agreement().startswith("differs on 1 of 1 files: at most 2 levels")


def test_choice_prefers_a_decoder_that_matches_pil(monkeypatch):
    """A faster decoder whose pixels differ from PIL's is not chosen at tolerance 0."""
    monkeypatch.setitem(decoders._available, "opencv", True)
    monkeypatch.setitem(decoders._available, "torchvision", False)
    monkeypatch.setitem(decoders._FUNCTIONS, "opencv", lambda data, mode: decoders._pil(data, mode) // 2)
    choice = decoders.choose_decoder(_bytes(_picture(), "JPEG"))
    assert choice.decoder == "pil" and choice.max_difference["opencv"] > 0
    loose = decoders.choose_decoder(_bytes(_picture(), "JPEG"), tolerance=255)
    assert loose.decoder in ("pil", "opencv")


def test_benchmark_rejects_bad_repeats():
    with pytest.raises(TorchaxeError, match="at least 1"):
        benchmark_decoders([], repeats=0)
