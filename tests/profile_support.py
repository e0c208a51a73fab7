"""Helpers for the `torchaxe profile` tests: write a small training script, run it
in-process under the harness, find the line a comment marks."""

from __future__ import annotations

import textwrap
from pathlib import Path

from torchaxe.runtime.command import parse_command
from torchaxe.runtime.harness import Harness, HarnessOptions
from torchaxe.runtime.profile import Profile

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

#: The examples at sizes that take a few milliseconds a step.
TINY_GPT = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16", "--batch-size", "4",
            "--num-samples", "64", "--log-every", "100"]
TINY_SEQ = ["--num-samples", "100", "--hidden", "16", "--embed-dim", "8", "--batch-size", "16", "--log-every", "100"]

#: A model, an optimizer and a loop of `STEPS` steps; scripts add to it.
PRELUDE = """\
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.ones(2, 4)
def step():
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
"""


def write_script(folder: Path, source: str, name: str = "train.py") -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def run_script(folder: Path, source: str, *args: str, name: str = "train.py", clock=None, **options) -> Profile:
    """Write ``source`` to ``folder/name`` and profile ``python folder/name ARGS`` in-process."""
    path = write_script(folder, source, name)
    return run_command(["python", str(path), *args], clock=clock, **options)


def run_command(argv: list[str], clock=None, **options) -> Profile:
    options.setdefault("target", "cpu")
    kwargs = {"clock": clock} if clock is not None else {}
    return Harness(HarnessOptions(**options), **kwargs).run(parse_command(argv))


def line_of(path: Path, marker: str) -> int:
    """The 1-based line of ``path`` that holds ``# marker``."""
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if f"# {marker}" in text:
            return number
    raise AssertionError(f"no line marked {marker!r} in {path}")
