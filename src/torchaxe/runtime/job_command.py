"""What a training command says of itself: the job's length in optimizer steps or
epochs (``--max_iters 300``, ``--epochs 2``) and the script's own switches
(``--compile``), read from its arguments without running it. advise and shapes both
read them."""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Iterator, Sequence

#: Options of a training script that give its whole length in optimizer steps.
#: A dotted prefix names a section of a configuration (``--trainer.max_iters=300``,
#: Hydra's ``trainer.max_steps=300`` without the dashes).
_PREFIX = r"^(?:--(?:[\w-]+\.)*|(?:[\w-]+\.)+)"
#: A bare ``--steps`` or ``--iters`` too, and ``--num_batches`` (benchmark-style loops).
#: Any case, camelCase too (``--maxIters``, ``--nEpochs`` of pytorch/examples' super_resolution).
_LENGTH_OPTIONS = re.compile(_PREFIX + r"(((max|num|total|train)([-_]?train(ing)?)?[-_]?)?(steps|iters|iterations)"
                             r"|(max|num|total)[-_]?batches)$", re.IGNORECASE)
#: Options that give it in epochs (``--epochs 2``, ``--num_train_epochs 3``, ``--max-epochs``).
_EPOCH_OPTIONS = re.compile(_PREFIX + r"((max|num|n|total|train)[-_]?)?(train[-_]?)?epochs$", re.IGNORECASE)


def _options(command: Sequence[str], names: re.Pattern) -> Iterator[tuple[str, str | None, bool]]:
    """Each option matching ``names``: its name, its value (``--name=V``, else the next
    word when it is no option; None when there is none) and whether ``=`` joined them."""
    args = list(command)
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if not names.match(name):
            continue
        if sep:
            yield name, value, True
        elif name.startswith("-"):
            following = args[i + 1] if i + 1 < len(args) else None
            yield name, following if following is not None and not following.startswith("-") else None, False


def _stated(command: Sequence[str], names: re.Pattern, read: Any) -> tuple[Any, str] | None:
    """The one value the options matching ``names`` give (``--name V`` or
    ``--name=V``), as ``read(V)`` makes it (None: not a value), with the words read;
    None when none does, or two differ. A bare word without ``=`` is no option
    (Hydra's are ``key=value``)."""
    found: dict[Any, str] = {}
    for name, value, _ in _options(command, names):
        number = read(value) if value is not None else None
        if number is not None:
            found[number] = f"{name} {value}"
    return next(iter(found.items())) if len(found) == 1 else None


def _positive_int(value: str) -> int | None:
    return int(value) if value.isdigit() and int(value) > 0 else None


def _epochs(value: str) -> float | None:
    try:
        epochs = float(value)
    except ValueError:
        return None
    return epochs if 0 < epochs < 1e6 else None


def job_steps_in(command: Sequence[str]) -> tuple[int, str] | None:
    """The job's length in steps when the command states it (``--max-steps 300``,
    ``--max_iters=5000``, ``--num-train-steps``-like names): (steps, the words
    read). None when it does not, or states it twice differently."""
    return _stated(command, _LENGTH_OPTIONS, _positive_int)


def job_epochs_in(command: Sequence[str]) -> tuple[float, str] | None:
    """The job's length in epochs when the command states it (``--epochs 2``,
    ``--num_train_epochs=3.0``): (epochs, the words read). None when it does not, or
    states it twice differently."""
    return _stated(command, _EPOCH_OPTIONS, _epochs)


def job_steps_of_epochs(epochs: float, epoch: dict[str, Any], batches_per_step: float) -> int:
    """Optimizer steps in ``epochs`` epochs of a loader's ``epoch`` (its batch size,
    samples, ``drop_last``), ``batches_per_step`` batches a step (accumulation)."""
    whole, rest = divmod(epoch["samples"], epoch["batch_size"])
    batches = whole + (1 if rest and not epoch.get("drop_last") else 0)
    return max(1, math.ceil(epochs * batches / max(batches_per_step, 1.0)))


def batches_per_step(counts: Iterable[int | None]) -> int | None:
    """The batches a measured step drew from DataLoaders, the median over the steps
    (``counts``, one per step; None where not recorded, left out); None when no step
    recorded it. 0: the steps draw none (the script took its data once)."""
    known = sorted(c for c in counts if c is not None)
    return known[len(known) // 2] if known else None


#: The script's own compile switch (nanoGPT's ``--compile``, ``--use_compile``, ...).
_COMPILE_SWITCHES = re.compile(r"^--?(use[-_])?(torch[-_])?compile$")


def compile_switch_in(command: Sequence[str]) -> str | None:
    """The script's own compile switch as the command gives it (``--compile=False``,
    ``--compile False``, a bare ``--compile``), or None."""
    for name, value, joined in _options(command, _COMPILE_SWITCHES):
        if joined:
            return f"{name}={value}"
        return f"{name} {value}" if value is not None else name
    return None
