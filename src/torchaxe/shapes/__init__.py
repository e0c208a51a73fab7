"""Static or dynamic shapes: record them, choose the compile mode, make them static.

``torchaxe shapes -- python train.py`` (``cli.py``) records every operator's and
module's input shapes over a few steps (``observe.py``, ``recorder.py``), traces the
varying dimensions to their cause (``analysis.py``), gives the verdict and the
setting per target (``verdict.py``), plans bucket boundaries (``buckets.py``) and,
with ``--try``, measures the candidates (``measure.py``).

The public API for training code is :class:`BucketingCollate` and
:func:`pad_to_bucket` (``bucketing.py``); they are imported on first use, so that
``import torchaxe.shapes`` does not import torch.
"""

from __future__ import annotations

from torchaxe.lazy import lazy_attributes

__all__ = ["BucketingCollate", "BucketingError", "pad_to_bucket"]


__getattr__ = lazy_attributes(__name__, dict.fromkeys(__all__, "torchaxe.shapes.bucketing"))
