"""A model changed by a knob (autocast, compile of a torch layer, activation
checkpointing) can still be saved whole and deep-copied, as scripts do for their best
checkpoint (``torch.save(model, path)``) or an EMA copy, and the copy or the loaded
model is the model the script wrote, running its own parameters."""

from __future__ import annotations

import copy
import io

import pytest

from torchaxe.memory.knob import SPEC as CHECKPOINT, CheckpointKnobs
from torchaxe.runtime import knob_specs
from torchaxe.runtime.compile_module import FORWARD, compile_in_place
from torchaxe.runtime.knobs import AppliedKnobs, KnobSet, knob_set_from_dict

torch = pytest.importorskip("torch")
nn = torch.nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _doubled(x):
    return 2 * x


def _autocast_model():
    torch.manual_seed(0)
    plain = Net()
    model = copy.deepcopy(plain)
    knobs = knob_set_from_dict({"name": "k", "autocast": {"dtype": "bfloat16"}}, "test")
    with knob_specs.AUTOCAST.patch(knobs.autocast, AppliedKnobs(knobs)):
        model(torch.randn(2, 8))  # the first call wraps the model
    return model, plain


def _checkpointed_model():
    torch.manual_seed(0)
    plain = Net()
    model = copy.deepcopy(plain)
    with CHECKPOINT.patch(CheckpointKnobs(blocks=("Block",)), AppliedKnobs(KnobSet(name="x"))):
        model(torch.randn(2, 8))
    return model, plain


def _compiled_layer():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(plain)
    assert compile_in_place(model, backend="eager") == FORWARD
    return model, plain


CHANGED = {"autocast": _autocast_model, "checkpoint": _checkpointed_model, "compile": _compiled_layer}


@pytest.mark.parametrize("knob", sorted(CHANGED))
def test_a_model_changed_by_a_knob_saves_whole_and_loads_as_the_script_wrote_it(knob: str) -> None:
    model, plain = CHANGED[knob]()
    changed = [m for m in model.modules() if "forward" in vars(m)]
    assert changed
    loaded = _saved_and_loaded(model)
    assert not any("forward" in vars(m) or "__getstate__" in vars(m) for m in loaded.modules())
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), plain(x))  # eager, full precision, its own parameters
    assert all("forward" in vars(m) for m in changed)  # the running model keeps its knob


@pytest.mark.parametrize("knob", sorted(CHANGED))
def test_a_deep_copy_of_a_changed_model_runs_its_own_parameters(knob: str) -> None:
    model, plain = CHANGED[knob]()
    x = torch.randn(4, 8)
    with torch.no_grad():
        before = model(x)
        twin = copy.deepcopy(model)
        for p in list(twin.parameters()) + list(plain.parameters()):
            p.add_(1.0)
        assert torch.equal(model(x), before)
        assert torch.equal(twin(x), plain(x))


def test_the_scripts_own_instance_forward_is_what_a_copy_and_a_saved_model_keep() -> None:
    from torchaxe.runtime.instance_forward import set_forward

    model = nn.Linear(2, 2)
    model.forward = _doubled  # the script set one itself
    set_forward(model, lambda x: x * 0)
    x = torch.ones(1, 2)
    assert torch.equal(model(x), 0 * x)
    assert torch.equal(copy.deepcopy(model)(x), 2 * x)
    assert torch.equal(_saved_and_loaded(model)(x), 2 * x)


def test_a_librarys_once_only_logging_in_forward_does_not_split_the_compiled_graph(monkeypatch) -> None:
    # transformers adds Logger.warning_once and calls it from GPT-2's forward (its
    # loss-type notice): compiled, that call broke the forward into two graphs.
    import logging

    from torch._dynamo import config
    from torch._dynamo.utils import counters

    if not isinstance(getattr(config, "ignore_logging_functions", None), set):
        pytest.skip("this torch has no torch._dynamo.config.ignore_logging_functions")
    said = []

    def warning_once(self, message):
        said.append(message)

    monkeypatch.setattr(logging.Logger, "warning_once", warning_once, raising=False)
    # The set itself is torch's setting: emptied for the test and refilled after it
    # (torch's config module forgets an attribute that is set and set back).
    ignored = config.ignore_logging_functions
    saved = set(ignored)
    ignored.clear()
    logger = logging.getLogger("torchaxe-test-library")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x).relu()
            logger.warning_once("loss_type=None is not recognised")
            return self.b(x)

    torch._dynamo.reset()
    counters.clear()
    try:
        model = Block()
        compile_in_place(model, backend="eager")
        model(torch.randn(2, 4))
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        assert warning_once in config.ignore_logging_functions
    finally:
        ignored.clear()
        ignored.update(saved)
        torch._dynamo.reset()
