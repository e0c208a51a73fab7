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
path; everything else goes to the original ``torch.nn.functional.dropout``. Inside a
model compiled with torch.compile, the draw is one operator the compiler calls as it
is (its own draw, an element-wise Philox, made compiled training slower than eager on
models with dropout) and the mask's arithmetic is fused by the compiler.
"""

from __future__ import annotations

from typing import Any, Callable

#: The mask's resolution: 16-bit lanes of 64-bit draws.
LANES_PER_DRAW = 4
LANE_VALUES = 1 << 16


def keep_threshold(p: float) -> int:
    """The number of the 65,536 lane values that drop an element, for a dropout rate ``p``."""
    return round(p * LANE_VALUES)


def packed_lanes(shape: Any, generator: Any = None) -> Any:
    """Random int16 lanes of ``shape`` (each of the 65,536 values equally likely),
    four to a 64-bit draw of torch's random stream."""
    import torch

    n = 1
    for size in shape:
        n *= size
    draws = torch.empty((n + LANES_PER_DRAW - 1) // LANES_PER_DRAW, dtype=torch.int64)
    # From the int64 minimum with no upper bound: all 64 bits random (torch's documented
    # special case); random_() alone would leave the top bit 0.
    draws.random_(-(1 << 63), None, generator=generator)
    return draws.view(torch.int16).reshape(-1)[:n].reshape(shape)


def packed_mask(shape: Any, p: float, generator: Any = None) -> tuple[Any, float]:
    """(a boolean mask of ``shape``, True where an element is kept; the scale of the
    kept elements) for a dropout rate ``p``, from torch's random stream."""
    dropped = keep_threshold(p)
    mask = packed_lanes(shape, generator) >= dropped - LANE_VALUES // 2
    return mask, LANE_VALUES / (LANE_VALUES - dropped)


#: The packed draw as one operator, for compiled graphs (see :func:`register_lanes_op`).
LANES_NAMESPACE, LANES_NAME = "torchaxe", "packed_lanes"
LANES_OP = f"{LANES_NAMESPACE}::{LANES_NAME}"
_LANES_OP: Any = None


def register_lanes_op() -> Any:
    """``torch.ops.torchaxe.packed_lanes(like)``: the lanes of ``like``'s shape, as an
    operator that torch.compile calls as it is (its own draw would be an element-wise
    Philox, slower on a CPU than torch's eager one) while it fuses the mask's arithmetic.
    Tagged ``nondeterministic_seeded``, so that a compiled backward keeps the forward's
    lanes instead of drawing them again. Registered once per process."""
    global _LANES_OP
    if _LANES_OP is None:
        import torch

        @torch.library.custom_op(LANES_OP, mutates_args=(), schema="(Tensor like) -> Tensor",
                                 tags=(torch.Tag.nondeterministic_seeded,))
        def lanes_op(like: Any) -> Any:
            return packed_lanes(like.shape).clone()

        @lanes_op.register_fake
        def _(like: Any) -> Any:
            return like.new_empty(like.shape, dtype=torch.int16)

        _LANES_OP = lanes_op
    return _LANES_OP


def traced_dropout(x: Any, p: float) -> Any:
    """Packed dropout written for torch.compile to trace: the draw through the
    registered operator, the mask and scale as plain tensor arithmetic (which the
    compiler fuses and differentiates)."""
    import torch

    dropped = keep_threshold(p)
    lanes = getattr(getattr(torch.ops, LANES_NAMESPACE), LANES_NAME)(x)
    return x * (lanes >= dropped - LANE_VALUES // 2) * (LANE_VALUES / (LANE_VALUES - dropped))


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

    # While compiling, x is the compiler's own tensor subclass (fake, functional).
    plain = torch.compiler.is_compiling() or type(x) in (torch.Tensor, torch.nn.Parameter)
    return (training and not inplace and isinstance(p, (int, float)) and 0.0 < p < 1.0
            and plain and x.device.type == "cpu" and x.is_floating_point() and x.layout == torch.strided)


def dropout_with(original: Callable[..., Any], counter: list[int]) -> Callable[..., Any]:
    """A stand-in for ``torch.nn.functional.dropout`` (same signature) that sends the
    calls it can take to :func:`packed_dropout` (counted in ``counter[0]``) and the rest
    to ``original``."""
    import functools

    import torch

    register_lanes_op()

    # torch.compile either traces into this function or, when its table of torch's own
    # functions was made after the swap, puts it in the graph as one call and traces it
    # with its own tensors; both take the traced path below. In a graph it is named by
    # its own module and name, not torch's (so not `functools.wraps`): the compiler's
    # caches key a graph by its code, and under torch's name a graph with the packed
    # draw would be the cached answer for the same model compiled without this swap,
    # in a later run that has no `torchaxe::packed_lanes` operator.
    @functools.wraps(original, assigned=("__doc__",))
    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if takes_packed_path(input, p, training, inplace):
            counter[0] += 1  # while compiling: once per traced call, not per run of the graph
            if torch.compiler.is_compiling():
                return traced_dropout(input, float(p))
            return packed_dropout(input, float(p))
        return original(input, p, training, inplace)

    return dropout
