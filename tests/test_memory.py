"""The memory axis: the ``checkpoint`` knob finds the repeated blocks, keeps the
numbers of the original (dropout included) and saves activation memory."""

from __future__ import annotations

import pytest

from torchaxe.memory.knob import SPEC, CheckpointKnobs, blocks_of_classes, repeated_blocks
from torchaxe.runtime.flops import SavedActivations
from torchaxe.runtime.knobs import AppliedKnobs, KnobError, knob_set_from_dict


def _model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return x + self.drop(self.down(torch.relu(self.up(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(Block(32) for _ in range(3))
            self.head = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _step(model, seed: int = 1):
    import torch

    torch.manual_seed(seed)
    x = torch.randn(8, 16)
    saved = SavedActivations()
    saved.start()
    loss = model(x).pow(2).mean()
    activation_bytes = saved.stop()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return loss.detach(), grads, activation_bytes


def test_auto_finds_the_largest_run_of_same_class_blocks():
    model = _model()
    assert [path for path, _ in repeated_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [path for path, _ in blocks_of_classes(model, ("Block",))] == ["blocks.0", "blocks.1", "blocks.2"]
    import torch

    assert repeated_blocks(torch.nn.Linear(2, 2)) == []


def test_checkpointed_blocks_give_the_same_numbers_with_dropout_and_save_memory():
    model = _model()
    model.train()
    loss, grads, plain_bytes = _step(model)
    applied = AppliedKnobs(knob_set_from_dict({"checkpoint": {"blocks": "auto"}}, "test"))
    with SPEC.patch(CheckpointKnobs(), applied):
        again, again_grads, checkpointed_bytes = _step(model)
    assert applied.record["checkpoint"]["wrapped"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert applied.record["checkpoint"]["class"].endswith("Block")
    assert again.item() == loss.item()  # the dropout masks are replayed, not drawn anew
    for a, b in zip(grads, again_grads):
        assert (a - b).abs().max().item() <= 1e-6
    assert checkpointed_bytes < plain_bytes / 2


def test_evaluation_and_no_grad_calls_are_not_checkpointed():
    import torch

    model = _model()
    applied = AppliedKnobs(knob_set_from_dict({"checkpoint": {"blocks": ["Block"]}}, "test"))
    with SPEC.patch(CheckpointKnobs(blocks=("Block",)), applied):
        with torch.no_grad():
            model(torch.randn(2, 16))
        model.eval()
        with torch.utils.checkpoint.set_checkpoint_early_stop(True):
            out = model(torch.randn(2, 16))
    assert out.shape == (2, 4)


@pytest.mark.parametrize("value, message", [
    ({"blocks": []}, "checkpoint.blocks"),
    ({"blocks": "all"}, "checkpoint.blocks"),
    ({"blocks": ["not a name"]}, "checkpoint.blocks"),
    ({"layers": "auto"}, "checkpoint.layers"),
])
def test_bad_values_are_one_line_errors(value, message):
    with pytest.raises(KnobError, match=message):
        knob_set_from_dict({"checkpoint": value}, "knobs.json")
