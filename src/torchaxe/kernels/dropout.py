"""Dropout with its mask drawn from packed random bits, for CPU training.

torch's CPU dropout draws one Bernoulli sample per element from the generator, one
element after another (only an MKL build on an Intel CPU takes a vectorised path). On
other CPUs that draw is most of dropout's cost: 262,144 elements took 3-4 ms on a
2-core AMD EPYC, where a multiply takes 0.1 ms. Here the mask comes from 64-bit draws
of the same generator cut into four 16-bit lanes: a quarter of the generator calls,
the rest vectorised. An element is kept when its lane is at or above
``round(p * 65536)`` of 65536, so the rate dropped is ``p`` to within 2**-17, and the
kept elements are scaled by the inverse of the rate actually kept: the output's
expectation is the input, as with ``torch.nn.functional.dropout``.

The masks are not those torch would draw (another use of the random stream), so a
run's numbers differ from the original's as they would under another seed: advise
compares the training loss before choosing it. The seed still decides everything:
``torch.manual_seed`` and the generator's state (activation checkpointing replays it)
give the same masks again.

Only out-of-place dropout in training mode on a CPU floating-point tensor takes this
path, and not while torch.compile traces (the compiler fuses its own random draw).
Everything else goes to the original ``torch.nn.functional.dropout``.
"""

from __future__ import annotations

from typing import Any, Callable

#: The mask's resolution: 16-bit lanes of 64-bit draws.
LANES_PER_DRAW = 4
LANE_VALUES = 1 << 16


def keep_threshold(p: float) -> int:
    """The number of the 65,536 lane values that drop an element, for a dropout rate ``p``."""
    return round(p * LANE_VALUES)


def packed_mask(shape: Any, p: float, generator: Any = None) -> tuple[Any, float]:
    """(a boolean mask of ``shape``, True where an element is kept; the scale of the
    kept elements) for a dropout rate ``p``, from torch's random stream."""
    import torch

    n = 1
    for size in shape:
        n *= size
    draws = torch.empty((n + LANES_PER_DRAW - 1) // LANES_PER_DRAW, dtype=torch.int64)
    # From the int64 minimum with no upper bound: all 64 bits random (torch's documented
    # special case); random_() alone would leave the top bit 0.
    draws.random_(-(1 << 63), None, generator=generator)
    lanes = draws.view(torch.int16).reshape(-1)[:n].reshape(shape)
    dropped = keep_threshold(p)
    mask = lanes >= dropped - LANE_VALUES // 2
    return mask, LANE_VALUES / (LANE_VALUES - dropped)


def _function() -> Any:
    import torch

    class PackedDropout(torch.autograd.Function):
        """``x * mask * scale``; backward ``grad * mask * scale``. Keeps the boolean
        mask for backward (one byte an element, as torch's own dropout does)."""

        @staticmethod
        def forward(ctx: Any, x: Any, p: float) -> Any:
            mask, scale = packed_mask(x.shape, p)
            ctx.save_for_backward(mask)
            ctx.scale = scale
            return x.mul(mask).mul_(scale)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
            (mask,) = ctx.saved_tensors
            return grad.mul(mask).mul_(ctx.scale), None

    return PackedDropout


_PACKED: Any = None


def packed_dropout(x: Any, p: float) -> Any:
    """Dropout of ``x`` at rate ``p`` (0 < p < 1) with a packed-bits mask, differentiable."""
    global _PACKED
    if _PACKED is None:
        _PACKED = _function()
    return _PACKED.apply(x, p)


def takes_packed_path(x: Any, p: float, training: bool, inplace: bool) -> bool:
    """Whether a ``dropout(x, p, training, inplace)`` call is one this module computes."""
    import torch

    return (training and not inplace and isinstance(p, (int, float)) and 0.0 < p < 1.0
            and type(x) in (torch.Tensor, torch.nn.Parameter) and x.device.type == "cpu" and x.is_floating_point()
            and x.layout == torch.strided and not torch.compiler.is_compiling())


def dropout_with(original: Callable[..., Any], counter: list[int]) -> Callable[..., Any]:
    """A stand-in for ``torch.nn.functional.dropout`` (same signature) that sends the
    calls it can take to :func:`packed_dropout` (counted in ``counter[0]``) and the rest
    to ``original``."""
    import functools

    @functools.wraps(original)
    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if takes_packed_path(input, p, training, inplace):
            counter[0] += 1
            return packed_dropout(input, float(p))
        return original(input, p, training, inplace)

    return dropout
