"""Train a small CNN on JPEG images that the script generates itself.

This script is DELIBERATELY UNTUNED. It is a typical hand-rolled image-classification
loop, and it exists so that torchaxe (``make demo``, the tests) has a data-loading-bound
workload to find problems in. Do not "fix" it: the slow patterns are the point.

What is slow on purpose:

* every sample is decoded from JPEG with ``PIL.Image.open(path).convert("RGB")`` and
  augmented (random crop, horizontal flip) in Python in ``__getitem__``;
* the ``DataLoader`` has ``num_workers=2`` but no ``persistent_workers``, so the worker
  processes are started again at every epoch, and no ``pin_memory``;
* ``images.to(device)`` and ``labels.to(device)`` without ``non_blocking=True``;
* ``torch.optim.SGD`` without ``fused=True``;
* predictions are copied back to the host every step (``.cpu().numpy()``, ``.tolist()``)
  to count accuracy, and the loss tensor is ``print``-ed now and then; both wait for
  the device.

On the first run the script writes a small, deterministic data set of 64x64 JPEGs
(4 classes of drawn shapes) into ``--data-dir`` (default: ``data/`` next to this file).
Nothing is downloaded. Everything is seeded.

Run it::

    python examples/image_classifier/train.py
    python examples/image_classifier/train.py --steps 200 --images-per-class 500 --image-size 128
    python examples/image_classifier/train.py --data-dir /tmp/shapes --device cuda
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset

CLASSES = ("circle", "square", "triangle", "stripes")
DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"
# Approximate per-channel mean and standard deviation of the generated images.
MEAN = (0.35, 0.34, 0.34)
STD = (0.29, 0.27, 0.29)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to run (default: 20)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="where the generated JPEGs live; created on first use")
    parser.add_argument("--images-per-class", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64, help="side of the generated images, in pixels")
    parser.add_argument("--crop-size", type=int, default=56, help="side of the random training crop")
    parser.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--log-every", type=int, default=5, help="print loss and accuracy every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    args = parser.parse_args(argv)
    if args.crop_size > args.image_size:
        parser.error("--crop-size cannot be larger than --image-size")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU. ``npu`` imports torch_npu, which
    registers the Ascend device with torch; it is imported only when asked for."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda was asked for but CUDA is not available")
    if name == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device)
        except ImportError as exc:
            raise SystemExit(f"error: --device npu needs torch_npu ({exc})") from exc
    return torch.device(name)


# ------------------------------------------------------------------ data generation


def draw_sample(label: str, size: int, rng: random.Random) -> Image.Image:
    """One image of a class: a shape of random colour, size and place on a noisy background."""
    background = tuple(rng.randrange(0, 96) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    colour = tuple(rng.randrange(128, 256) for _ in range(3))
    extent = rng.randrange(size // 3, size * 3 // 4)
    left = rng.randrange(0, size - extent)
    top = rng.randrange(0, size - extent)
    box = (left, top, left + extent, top + extent)
    if label == "circle":
        draw.ellipse(box, fill=colour)
    elif label == "square":
        draw.rectangle(box, fill=colour)
    elif label == "triangle":
        draw.polygon([(left, top + extent), (left + extent // 2, top), (left + extent, top + extent)], fill=colour)
    else:  # stripes across the whole image
        period = rng.randrange(6, 12)
        for x in range(rng.randrange(0, period), size, period):
            draw.rectangle((x, 0, x + period // 2 - 1, size), fill=colour)
    # Pixel noise, so that the JPEGs are not trivially compressible.
    noise = np.frombuffer(rng.randbytes(size * size * 3), dtype=np.uint8).reshape(size, size, 3) // 16
    pixels = np.asarray(image, dtype=np.uint8)
    return Image.fromarray(np.clip(pixels.astype(np.int16) + noise - 8, 0, 255).astype(np.uint8))


def ensure_dataset(root: Path, images_per_class: int, size: int, seed: int) -> None:
    """Write ``root/<class>/<n>.jpg`` once. The images are drawn into a temporary folder
    next to ``root`` that is renamed into place, so an interrupted run leaves nothing
    half-written and two runs racing each other both end with a complete data set."""
    marker = root / "COMPLETE"
    if marker.exists():
        return
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"error: {root} exists but is not a complete generated data set; remove it or pick another --data-dir")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        rng = random.Random(seed)
        for label in CLASSES:
            (staging / label).mkdir()
            for index in range(images_per_class):
                draw_sample(label, size, rng).save(staging / label / f"{index:04d}.jpg", quality=90)
        (staging / "COMPLETE").write_text(f"{images_per_class} images per class, {size}x{size}, seed {seed}\n")
        if root.exists():
            root.rmdir()  # empty, checked above
        os.replace(staging, root)
    except OSError:
        if not marker.exists():
            raise
        return  # another run finished first: keep its copy
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"generated {images_per_class * len(CLASSES)} images in {root}")


# -------------------------------------------------------------------------- dataset


class ShapeImages(Dataset):
    """Reads the JPEGs back, decodes them with PIL and augments them by hand."""

    def __init__(self, root: Path, crop_size: int, train: bool = True):
        self.samples = [(path, label) for label, name in enumerate(CLASSES) for path in sorted((root / name).glob("*.jpg"))]
        if not self.samples:
            raise SystemExit(f"error: no images found under {root}")
        self.crop_size = crop_size
        self.train = train
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        image = Image.open(path).convert("RGB")
        width, height = image.size
        crop = self.crop_size
        if self.train:
            # Random crop and horizontal flip, drawn from torch's generator (seeded per worker).
            left = int(torch.randint(0, width - crop + 1, ()))
            top = int(torch.randint(0, height - crop + 1, ()))
            image = image.crop((left, top, left + crop, top + crop))
            if torch.rand(()) < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            left, top = (width - crop) // 2, (height - crop) // 2
            image = image.crop((left, top, left + crop, top + crop))
        pixels = torch.from_numpy(np.array(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (pixels - self.mean) / self.std, label


# ---------------------------------------------------------------------------- model


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, width: int = 16):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for out_channels in (width, 2 * width, 4 * width):
            layers += [
                nn.Conv2d(channels, out_channels, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(out_channels),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            channels = out_channels
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.classifier(x)


# ------------------------------------------------------------------------- training


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)

    ensure_dataset(args.data_dir, args.images_per_class, args.image_size, args.seed)
    dataset = ShapeImages(args.data_dir, args.crop_size, train=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers)

    model = SmallCNN(len(CLASSES), args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss()
    print(f"image_classifier: {len(dataset)} images, {len(CLASSES)} classes, batch {args.batch_size}, device {device}")

    model.train()
    step = 0
    correct = seen = 0
    start = time.perf_counter()
    while step < args.steps:
        for images, labels in loader:  # a new set of worker processes every epoch
            images = images.to(device)
            labels = labels.to(device)

            logits = model(images)
            loss = criterion(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1

            predictions = logits.argmax(dim=1).cpu().numpy()
            targets = labels.tolist()
            correct += int((predictions == np.array(targets)).sum())
            seen += len(targets)

            if step % args.log_every == 0 or step == args.steps:
                print(f"step {step}/{args.steps} loss {loss.item():.4f} accuracy {correct / seen:.3f}")
                correct = seen = 0
            if step % (4 * args.log_every) == 0:
                print(loss)
            if step == args.steps:
                break

    elapsed = time.perf_counter() - start
    print(f"done: {args.steps} steps, final loss {loss.item():.4f}, {1000 * elapsed / args.steps:.1f} ms/step")


if __name__ == "__main__":
    main()
