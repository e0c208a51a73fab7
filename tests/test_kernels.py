"""The ``kernels`` knob: dropout with a packed-bits mask keeps dropout's rate, scale,
gradient and seeding, takes only the calls it can compute, puts torch's function back,
and is proposed only where the run spent time drawing dropout masks."""

from __future__ import annotations

import pytest

from torchaxe.kernels.candidates import candidates
from torchaxe.kernels.dropout import packed_dropout, packed_mask
from torchaxe.kernels.knob import SPEC, KernelKnobs
from torchaxe.runtime.knobs import AppliedKnobs, KnobError, knob_set_from_dict

torch = pytest.importorskip("torch")
F = torch.nn.functional


def test_the_packed_mask_drops_at_the_rate_and_keeps_the_expectation():
    torch.manual_seed(0)
    x = torch.randn(1000, 1000, requires_grad=True)
    y = packed_dropout(x, 0.1)
    kept = y != 0
    assert kept.float().mean().item() == pytest.approx(0.9, abs=2e-3)
    # The kept elements are scaled by the inverse of the rate the 16-bit lanes keep.
    scale = 65536 / (65536 - round(0.1 * 65536))
    assert torch.allclose(y[kept], x[kept] * scale)
    assert y.mean().item() == pytest.approx(x.mean().item(), abs=3e-3)
    y.sum().backward()
    assert torch.equal(x.grad != 0, kept)
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], scale))


def test_every_lane_of_the_draws_is_uniform():
    # random_() without the int64 minimum would leave every fourth lane's top bit 0.
    torch.manual_seed(0)
    mask, _ = packed_mask((4096, 4), 0.5)
    assert mask.float().mean(0).tolist() == pytest.approx([0.5] * 4, abs=0.03)


def test_the_seed_decides_the_masks():
    torch.manual_seed(3)
    a, _ = packed_mask((33, 7), 0.3)
    b, _ = packed_mask((33, 7), 0.3)
    torch.manual_seed(3)
    assert torch.equal(packed_mask((33, 7), 0.3)[0], a)
    assert not torch.equal(a, b)


def test_the_gradient_is_the_masks():
    x = torch.randn(6, 5, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: (torch.manual_seed(1), packed_dropout(t, 0.3))[1], (x,))


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))


def test_the_knob_takes_training_dropout_and_puts_torchs_back():
    original = F.dropout
    applied = AppliedKnobs(knob_set_from_dict({"kernels": {"dropout": "packed"}}, "test"))
    net, x = _net(), torch.randn(16, 8)
    with SPEC.patch(KernelKnobs(dropout="packed"), applied):
        assert F.dropout is not original
        net(x).sum().backward()
        net.eval()
        evaluated = net(x)
        F.dropout(x.clone(), 0.2, training=True, inplace=True)   # in place: torch's own
        F.dropout(x, 0.0, training=True)                          # nothing to drop: torch's own
    assert F.dropout is original
    assert applied.record["kernels"] == {"dropout": "packed", "dropout_calls": 1}
    assert torch.equal(evaluated, net(x))


@pytest.mark.parametrize("backend", ["aot_eager", "aot_eager_decomp_partition"])
def test_inside_a_compiled_graph_the_draw_is_one_operator_and_backward_keeps_its_mask(backend):
    # The compiler traces the packed path (its own draw would be a slower Philox); the
    # draw is torchaxe::packed_lanes, which the partitioner does not draw again for the
    # backward: the gradient uses the forward's mask.
    applied = AppliedKnobs(knob_set_from_dict({"kernels": {"dropout": "packed"}}, "test"))
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 64)
    net = torch.nn.Sequential(linear, torch.nn.Dropout(0.3))
    x = torch.randn(32, 64, requires_grad=True)
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def seen(gm, inputs):  # the forward graph the compiler would compile
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    with SPEC.patch(KernelKnobs(dropout="packed"), applied):
        compiled = torch.compile(net, backend=backend, fullgraph=True)
        y = compiled(x)
        y.backward(torch.ones_like(y))
        traced = torch.compile(net, backend=aot_autograd(fw_compiler=seen), fullgraph=True)
        traced(torch.randn(4, 64))
    assert applied.record["kernels"]["dropout_calls"] > 0
    assert any("packed_lanes" in g for g in graphs)
    kept = y.detach() != 0
    assert 1 - kept.float().mean().item() == pytest.approx(0.3, abs=0.04)
    scale = 65536 / (65536 - round(0.3 * 65536))
    assert torch.allclose(y.detach(), linear(x).detach() * kept * scale, atol=1e-6)
    assert torch.allclose(x.grad, (kept.float() * scale) @ linear.weight, atol=1e-5)


def test_a_compiled_graph_with_the_swap_is_not_named_as_torchs_dropout():
    # The compiler's caches key a graph by its code; a graph that calls the stand-in
    # under torch's name would be loaded, later, by a run compiled without the swap,
    # which has no torchaxe::packed_lanes operator and crashes.
    codes = []

    def seen(gm, inputs):
        codes.append(gm.code)
        return gm.forward

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3))
    applied = AppliedKnobs(knob_set_from_dict({"kernels": {"dropout": "packed"}}, "test"))
    with SPEC.patch(KernelKnobs(dropout="packed"), applied):
        torch.compile(net, backend=seen)(torch.randn(2, 8))
    assert codes and "torchaxe" in codes[0]
    assert "torch.nn.functional.dropout(" not in codes[0] and "torch.dropout(" not in codes[0]


def test_torch_leaves_dropout_alone():
    original = F.dropout
    applied = AppliedKnobs(knob_set_from_dict({"kernels": {"dropout": "torch"}}, "test"))
    with SPEC.patch(KernelKnobs(dropout="torch"), applied):
        assert F.dropout is original


@pytest.mark.parametrize("value, message", [
    ({"dropout": "fast"}, "kernels.dropout"),
    ({"gelu": "packed"}, "kernels.gelu"),
    ("packed", "kernels: expected an object"),
])
def test_bad_values_are_one_line_errors(value, message):
    with pytest.raises(KnobError, match=message):
        knob_set_from_dict({"kernels": value}, "knobs.json")


def _profile(draw: float, rest: float) -> dict:
    return {"ops": [{"name": "aten::bernoulli_", "kind": "op", "self_seconds": draw},
                    {"name": "aten::mm", "kind": "op", "self_seconds": rest},
                    {"name": "Optimizer.step#AdamW.step", "kind": "range", "self_seconds": 50.0}]}


def test_packed_dropout_is_proposed_on_a_cpu_that_spends_time_drawing_masks():
    packed, compiled = candidates(_profile(0.2, 0.8), "cpu", {})
    assert packed.key == "knob:dropout-packed"
    assert packed.knobs == {"kernels": {"dropout": "packed"}}
    assert packed.rec.accuracy.changes_numerics
    assert "20%" in packed.rec.detail
    # Compile alone would draw the masks with inductor's slower draw: the pair is
    # measured too, in the same group, so that only the faster of the two is combined.
    assert compiled.key == "knob:compile-dropout-packed"
    assert compiled.knobs == {"compile": {"mode": "default"}, "kernels": {"dropout": "packed"}}
    assert compiled.group == packed.group
    assert compiled.rec.accuracy.changes_numerics
    assert compiled.priority > packed.priority


def test_compile_with_packed_dropout_follows_the_shapes_and_the_script():
    profile = {**_profile(0.2, 0.8), "shapes": {"static": False}}
    _, compiled = candidates(profile, "cpu", {})
    assert compiled.knobs["compile"] == {"mode": "default", "dynamic": True}
    # A script that compiles its model itself gets packed dropout alone: its own
    # torch.compile call already takes the packed draw into its graph.
    [packed] = candidates(_profile(0.2, 0.8), "cpu", {"compiled_graphs": 2})
    assert packed.key == "knob:dropout-packed"


@pytest.mark.parametrize("profile, target", [
    (_profile(0.01, 0.99), "cpu"),   # too little time in the draw
    (_profile(0.2, 0.8), "cuda"),
    ({}, "cpu"),
])
def test_packed_dropout_is_not_proposed_without_time_in_the_draw_on_a_cpu(profile, target):
    assert candidates(profile, target, {}) == []
