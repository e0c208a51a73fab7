"""The data axis: the device must never wait for data.

* ``torchaxe data -- python train.py``: per-step data wait against compute, worker
  use, per-sample stage times, copy and pinning time, a verdict with its reasons, the
  scanner's AX4xx findings next to the measurements, and (``--tune``) a search over
  DataLoader settings with trials, stored in the knowledge base;
* :func:`decode_image`: the fastest installed image decoder whose pixels match PIL's;
* :class:`DevicePrefetcher`: the next batch's host-to-device copy overlapped with the
  current step.

Importing this package does not import torch; the names below load on first use.
"""

from __future__ import annotations

from torchaxe.lazy import lazy_attributes

__all__ = ["DevicePrefetcher", "ImageDecodeError", "benchmark_decoders", "decode_image"]

__getattr__ = lazy_attributes(__name__, {
    "DevicePrefetcher": "torchaxe.data.prefetch",
    "decode_image": "torchaxe.data.decoders",
    "benchmark_decoders": "torchaxe.data.decoders",
    "ImageDecodeError": "torchaxe.data.decoders",
})
