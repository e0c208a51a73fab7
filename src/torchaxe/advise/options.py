"""What one ``torchaxe advise`` is asked to do: target, budget, rounds, steps."""

from __future__ import annotations

from dataclasses import dataclass

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
    #: Count one step's FLOPs in the profiled run (for MFU); off, no counter runs.
    flops: bool = True

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
