"""What one ``torchaxe advise`` is asked to do: target, budget, rounds, steps."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from torchaxe.advise.stats import LOSS_TOLERANCE
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.harness import DEFAULT_FIRST_STEP_TIMEOUT


@dataclass(frozen=True)
class AdviseOptions:
    target: str = "auto"
    budget: float = 600.0
    repeats: int = 2
    #: Measured steps per trial run; ``None``: chosen from the profiled step time.
    steps: int | None = None
    warmup: int = 10
    #: Record the training loss of every run; a change that may alter the numerics is
    #: chosen only when its loss is within ``loss_tolerance`` beyond the noise.
    check_accuracy: bool = True
    loss_tolerance: float = LOSS_TOLERANCE
    #: Also scan the installed packages the run imported.
    scan_installed: bool = True
    step_marker: str | None = None
    #: Per-run limit; default from the budget.
    timeout: float | None = None
    #: The profiled run stops when no step has ended this long after training started
    #: (None: it waits for the script's end, within the budget).
    first_step_timeout: float | None = DEFAULT_FIRST_STEP_TIMEOUT
    #: Candidates whose key starts with one of these are not tried (``--skip knob:compile``).
    skip: tuple[str, ...] = ()
    #: Bytes of peak memory (device, else host RSS) no chosen change may exceed; None: no limit.
    memory_limit: int | None = None
    #: The steps the real training job runs (``--job-steps``): a change whose one-time
    #: cost (compiling) its saving per step does not pay back within them is held back.
    job_steps: int | None = None
    #: Also try a larger micro-batch (it changes the optimisation: opt-in).
    allow_batch_change: bool = False
    #: On a cpu, the runs of a round side by side, taking turns (runtime/turns.py):
    #: their ratios predict what whole runs deliver (benchmarks/RESULTS.md).
    turns: bool = True

    def __post_init__(self) -> None:
        if self.budget <= 0:
            raise TorchaxeError(f"--budget {self.budget:g}: must be a positive duration")
        if self.repeats < 1:
            raise TorchaxeError(f"--repeats {self.repeats}: must be at least 1")
        if not 0.0 <= self.loss_tolerance < 1.0:
            raise TorchaxeError(f"--loss-tolerance {self.loss_tolerance:g}: must be a fraction of the loss, "
                                "from 0 up to 1 (0.02 is 2%)")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise TorchaxeError(f"--memory-limit {self.memory_limit}: must be a positive number of bytes")
        if self.job_steps is not None and self.job_steps < 1:
            raise TorchaxeError(f"--job-steps {self.job_steps}: must be at least 1")
        if self.steps is not None and self.steps < 1:
            raise TorchaxeError(f"--steps {self.steps}: must be at least 1")


#: Options of a training script that give its whole length in optimizer steps.
#: A dotted prefix names a section of a configuration (``--trainer.max_iters=300``,
#: Hydra's ``trainer.max_steps=300`` without the dashes).
_PREFIX = r"^(?:--(?:[\w-]+\.)*|(?:[\w-]+\.)+)"
_LENGTH_OPTIONS = re.compile(_PREFIX + r"(max|num|total|train)([-_]train(ing)?)?[-_](steps|iters|iterations)$")
#: Options that give it in epochs (``--epochs 2``, ``--num_train_epochs 3``, ``--max-epochs``).
_EPOCH_OPTIONS = re.compile(_PREFIX + r"((max|num|n|total|train)[-_]?)?(train[-_])?epochs$")


def _stated(command: Sequence[str], names: re.Pattern, read: Any) -> tuple[Any, str] | None:
    """The one value the options matching ``names`` give (``--name V`` or
    ``--name=V``), as ``read(V)`` makes it (None: not a value), with the words read;
    None when none does, or two differ."""
    found: dict[Any, str] = {}
    args = list(command)
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if not names.match(name):
            continue
        if not sep:
            if not name.startswith("--"):
                continue  # a bare word without "=" is no option (Hydra's are key=value)
            value = args[i + 1] if i + 1 < len(args) else ""
        number = read(value)
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
