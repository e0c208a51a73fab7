"""The autotuner: signatures, capture, checks, timing, strategies, tune/apply, budget, AOE.

Compiling strategies run with torch.compile's "eager" backend here: the same capture
and the same in-place application as inductor, without its code generation."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchaxe
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.compile_module import is_compiled_in_place
from torchaxe.tune import strategies as S
from torchaxe.tune.capture import capture
from torchaxe.kb import KnowledgeBase
from torchaxe.tune.measure import (Example, RunResult, Timer, compare, fp64_multiplier, draws_random_numbers, float64_run, interleaved,
                                   run_once, same_randomness)
from torchaxe.tune.replacements import plan_for, apply_plan
from torchaxe.tune.signature import signature_of, signature_parts
from torchaxe.tune.tuner import TuneOptions, apply, parse_budget, tune

ROOT = Path(__file__).resolve().parents[1]


def _load_gpt():
    spec = importlib.util.spec_from_file_location("gpt_train_for_tests", ROOT / "examples" / "gpt" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GPT = _load_gpt()


def small_gpt(layers: int = 2, activation: str = "tanh"):
    torch.manual_seed(0)
    return GPT.GPT(64, 32, layers, 4, 16, activation)


def tokens():
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


class FakeClock:
    """A clock that advances by a chosen amount per call: deterministic timings."""

    def __init__(self, step: float = 0.001) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def fast_options(tmp_path, **kw) -> dict:
    base = dict(kb=tmp_path / "kb.sqlite", compile_backend="eager", repeats=3, min_sample_seconds=0.0,
                strategies=("eager", "compile", "replace"), target="cpu", whole_model=False)
    base.update(kw)
    return base


# ------------------------------------------------------------------ signatures and capture


def test_identical_blocks_share_a_signature_and_differences_split_it():
    model = small_gpt(layers=3)
    rec = capture(model, tokens())
    subs = {s.name: s for s in rec.subgraphs()}
    assert [n for n in subs if n.startswith("blocks.")] == ["blocks.0", "blocks.1", "blocks.2"]
    sig = {n: signature_of(signature_parts(s.module, s.spec)) for n, s in subs.items()}
    assert sig["blocks.0"] == sig["blocks.1"] == sig["blocks.2"]
    assert sig["norm"] != sig["blocks.0"]
    # Another activation setting, another input shape or another dtype: another signature.
    erf = capture(small_gpt(activation="erf"), tokens()).subgraphs()
    assert signature_of(signature_parts(erf[2].module, erf[2].spec)) != sig["blocks.0"]
    longer = capture(small_gpt(), torch.randint(0, 64, (2, 12))).subgraphs()
    assert signature_of(signature_parts(longer[2].module, longer[2].spec)) != sig["blocks.0"]
    double = small_gpt().double()
    d = capture(double, tokens()).subgraphs()
    assert signature_of(signature_parts(d[2].module, d[2].spec)) != sig["blocks.0"]


def test_capture_keeps_requires_grad_and_depth():
    model = small_gpt()
    subs = {s.name: s for s in capture(model, tokens()).subgraphs()}
    assert subs["blocks.0"].example.args[0].requires_grad
    assert not subs["token_embedding"].example.args[0].requires_grad
    deeper = {s.name for s in capture(model, tokens(), depth=2).subgraphs()}
    assert {"blocks.0.attn", "blocks.0.mlp", "blocks.0.norm1"} <= deeper


class Varying(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.fixed = nn.Linear(8, 8)

    def forward(self, x):
        a = self.proj(x[:, :3])
        b = self.proj(x[:, :5])
        return self.fixed(torch.cat([a, b], 1))


def test_a_module_called_with_different_shapes_is_left_alone_with_the_reason(tmp_path):
    model = Varying()
    report = tune(model, torch.randn(2, 6, 8), **fast_options(tmp_path, strategies=("eager",)))
    skipped = dict(report.skipped)
    assert "dynamic" in skipped["proj"] and "torchaxe shapes" in skipped["proj"] and "[2,3,8]" in skipped["proj"]
    assert [s.names for s in report.subgraphs] == [["fixed"]]


class SharedDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.down(self.drop(self.up(x))))


def test_a_module_without_parameters_reused_at_two_places_is_not_sent_to_shapes():
    # Seen in a review: one Dropout after attention and after the MLP was "dynamic ...
    # see torchaxe shapes", in a model whose shapes are fixed.
    subs = {s.name: s for s in capture(SharedDropout(), torch.randn(2, 8)).subgraphs()}
    assert subs["drop"].skipped.startswith("no parameters, called with 2 input shapes (reused at several places")
    assert "torchaxe shapes" not in subs["drop"].skipped


class Critic(nn.Module):
    """A GAN's discriminator: called on data and on generated samples that need gradients."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(8, 1)

    def forward(self, x):
        return self.score(x)


class RealAndGenerated(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = Critic()

    def forward(self, x):
        return self.critic(x) + self.critic(x.detach().requires_grad_())


def test_calls_that_differ_only_in_requires_grad_have_fixed_shapes():
    subs = {s.name: s for s in capture(RealAndGenerated(), torch.randn(4, 8)).subgraphs()}
    assert subs["critic"].skipped is None and subs["critic"].example is not None


# ------------------------------------------------------------------ checks and timing


def test_compare_uses_the_dtype_tolerance():
    ref = RunResult([torch.ones(4)], {"w": torch.ones(3)})
    close = RunResult([torch.ones(4) * (1 + 1e-6)], {"w": torch.ones(3)})
    far = RunResult([torch.ones(4)], {"w": torch.ones(3) * 1.01})
    assert compare(ref, close).ok
    bad = compare(ref, far)
    assert not bad.ok and "w differs" in bad.message and bad.grad_max_abs == pytest.approx(0.01, rel=1e-3)
    half = RunResult([torch.ones(4, dtype=torch.bfloat16)], {})
    assert compare(half, RunResult([torch.ones(4, dtype=torch.bfloat16) * 1.0078125], {})).ok
    assert not compare(ref, RunResult([torch.ones(5)], {"w": torch.ones(3)})).ok
    assert not compare(ref, RunResult([torch.ones(4)], {})).ok


def test_relative_error_leaves_out_differences_within_the_absolute_tolerance():
    # A gradient of ~1e-7 everywhere (a ViT's): 1e-7 apart passes on float32's atol and
    # is no 100% relative error in the report.
    ref = RunResult([torch.ones(4)], {"tiny": torch.full((3,), 1e-7), "w": torch.ones(3)})
    got = RunResult([torch.ones(4)], {"tiny": torch.full((3,), 2e-7), "w": torch.ones(3) * (1 + 3e-5)})
    check = compare(ref, got)
    assert check.ok and check.grad_max_abs == pytest.approx(3e-5, rel=1e-2)
    assert check.grad_max_rel == pytest.approx(3e-5, rel=1e-2)


def test_a_result_beyond_the_tolerance_passes_when_as_close_to_float64_as_eager():
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(1000, generator=g, dtype=torch.float64)
    eager = RunResult([torch.ones(2)], {"bias": (exact + 1e-3 * torch.randn(1000, generator=g, dtype=torch.float64))
                                        .float()})
    rounded = RunResult([torch.ones(2)], {"bias": (exact + 1e-3 * torch.randn(1000, generator=g, dtype=torch.float64))
                                          .float()})
    truth = RunResult([torch.ones(2, dtype=torch.float64)], {"bias": exact})
    assert not compare(eager, rounded).ok  # 1e-3 apart, beyond float32's 1e-4
    check = compare(eager, rounded, lambda: truth)
    assert check.ok and check.float64_checked and check.to_dict()["float64_checked"]
    # Five times eager's error against float64: wrong, with both errors said.
    far = RunResult([torch.ones(2)], {"bias": (exact + 5e-3 * torch.randn(1000, generator=g, dtype=torch.float64))
                                      .float()})
    check = compare(eager, far, lambda: truth)
    assert not check.ok and "against float64, root-mean-square error" in check.message
    # No float64 run (a module that cannot run in float64): the tolerance decides.
    assert not compare(eager, rounded, lambda: None).ok


def test_a_small_tensor_may_be_three_times_as_far_from_float64_as_eager_a_large_one_twice():
    """A batch norm's weight gradient (64 elements): a compiled reduction 2.4 times as
    far from float64 as eager's passes, as in torch's own accuracy check; the same
    error ratio on a large tensor does not, nor five times on a small one."""
    g = torch.Generator().manual_seed(0)

    def case(n: int, times: float) -> bool:
        exact = torch.randn(n, generator=g, dtype=torch.float64)
        noise = torch.randn(n, generator=g, dtype=torch.float64)
        eager = RunResult([torch.ones(2)], {"weight": (exact + 1e-3 * noise).float()})
        other = torch.randn(n, generator=g, dtype=torch.float64)
        other = other / other.pow(2).mean().sqrt() * noise.pow(2).mean().sqrt()  # the same rms as eager's noise
        candidate = RunResult([torch.ones(2)], {"weight": (exact + times * 1e-3 * other).float()})
        truth = RunResult([torch.ones(2, dtype=torch.float64)], {"weight": exact})
        return compare(eager, candidate, lambda: truth).ok

    assert case(64, 2.4) and not case(64, 5.0)
    assert not case(4096, 2.4) and case(4096, 1.5)
    assert fp64_multiplier(torch.zeros(8, 8, 1, 1), torch.float32) == 3.0
    assert fp64_multiplier(torch.zeros(64, 64, 3, 3), torch.float32) == 2.0
    assert fp64_multiplier(torch.zeros(64, 64, 3, 3), torch.bfloat16) == 3.0


def test_a_bias_before_batch_norm_in_channels_last_is_not_called_wrong():
    """A convolution's bias before batch norm gets a gradient of rounding noise only
    (the norm removes the mean): channels-last sums it in another order, 1.7 times
    its size apart from eager's, and as close to a float64 run as eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
    x = torch.randn(32, 16, 32, 32) * 3 + 1
    example = Example((x,))
    reference = run_once(copy.deepcopy(model), example)
    last = copy.deepcopy(model).to(memory_format=torch.channels_last)
    candidate = run_once(last, Example((x.contiguous(memory_format=torch.channels_last),),
                                       grad_outputs=example.grad_outputs))
    assert not compare(reference, candidate).ok
    assert compare(reference, candidate, lambda: float64_run(model, example, False)).ok


def test_run_once_returns_outputs_and_gradients():
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    result = run_once(layer, Example((x,)))
    assert set(result.grads) == {"input[0]", "weight", "bias"}
    again = run_once(layer, Example((x,), grad_outputs=None))
    assert not torch.equal(result.grads["weight"], torch.zeros(2, 3))
    assert again.outputs[0].shape == (4, 2)


def test_interleaved_rotates_the_order_and_uses_the_injected_clock():
    order = []

    class Probe(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            order.append(self.name)
            return x * self.w

    cands = [(n, Probe(n)) for n in "abc"]
    samples = interleaved(Timer(clock=FakeClock(0.5)), cands, Example((torch.ones(2),)), repeats=3)
    assert order == list("abcbcacab")
    assert all(v == [0.5, 0.5, 0.5] for v in samples.values())


class Stochastic(nn.Module):
    """Dropout as modules and functions, RReLU and attention dropout, all in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.act = nn.RReLU()

    def forward(self, x):
        h = self.act(self.drop(self.fc(x)))
        h = F.dropout(h, 0.3, training=True)
        q = h.reshape(2, 1, -1, 8)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).reshape(h.shape)


def test_same_randomness_turns_every_stochastic_layer_off_for_the_check_only():
    torch.manual_seed(0)
    model = Stochastic()
    example = Example((torch.randn(2, 4, 8, requires_grad=True),))
    assert draws_random_numbers(model, example)
    with same_randomness():
        first, second = run_once(model, example, seed=0), run_once(model, example, seed=1)
    assert torch.equal(first.outputs[0], second.outputs[0])
    assert torch.equal(first.grads["fc.weight"], second.grads["fc.weight"])
    # What evaluation mode computes (RReLU's mean slope, no dropout anywhere).
    h = F.leaky_relu(model.fc(example.args[0]), (1 / 8 + 1 / 3) / 2)
    q = h.reshape(2, 1, -1, 8)
    assert torch.allclose(first.outputs[0], F.scaled_dot_product_attention(q, q, q).reshape(h.shape), atol=1e-6)
    # Outside the check the model trains as written.
    assert model.drop.training and draws_random_numbers(model, example)
    assert not draws_random_numbers(nn.Linear(8, 8), example)


class DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        h = self.drop(F.gelu(self.fc1(x)))
        return self.fc2(F.dropout(h, 0.1, training=True))


def _own_random_stream(module, args):
    """What a compiler does with its own random generator: the masks differ from eager's."""
    torch.rand(5)


@pytest.mark.parametrize("wrong", [False, True])
def test_dropout_does_not_make_a_correct_strategy_wrong(tmp_path, monkeypatch, wrong):
    real_apply = S.apply
    seen_random = []

    def own_stream(name, module, ctx):
        notes = real_apply(name, module, ctx)
        if name == "compile":
            module.register_forward_pre_hook(_own_random_stream)
            if wrong:
                module.register_forward_hook(lambda m, a, out: out * 1.01)
        return notes

    real_time = Timer.time

    def timed(self, module, example, iterations=1):
        seen_random.append((type(module).__name__, draws_random_numbers(module, example)))
        return real_time(self, module, example, iterations)

    monkeypatch.setattr(S, "apply", own_stream)
    monkeypatch.setattr(Timer, "time", timed)
    torch.manual_seed(0)
    model = nn.Sequential(DropoutBlock(), nn.Linear(16, 4))
    report = tune(model, torch.randn(8, 16), **fast_options(tmp_path, strategies=("eager", "compile")))
    block = next(s for s in report.subgraphs if s.module == "DropoutBlock")
    status = {r.strategy: r for r in block.records}
    assert status["eager"].errors["random"] is True
    linear = next(s for s in report.subgraphs if s.module == "Linear")
    assert {r.strategy: r.errors["random"] for r in linear.records} == {"eager": False, "compile": False}
    if wrong:
        assert status["compile"].status == "wrong"
        assert status["compile"].errors["output_max_rel"] == pytest.approx(0.01, rel=0.05)
        assert "dropout off" in status["compile"].message
    else:
        assert status["compile"].status == "ok"
        assert status["compile"].errors["output_max_abs"] < 1e-5
    # Timed as it trains: the block drew random numbers in every timed run.
    timed_block = [random for kind, random in seen_random if kind == "DropoutBlock"]
    assert len(timed_block) >= 1 + 3 and all(timed_block)


# ------------------------------------------------------------------ replacements


def test_the_scanner_replacements_swap_in_and_match_eager():
    block = GPT.Block(32, 4, 16, "tanh")
    plan = plan_for(block)
    assert sorted(s.category for s in plan.swaps) == ["gelu_tanh", "rms_norm"]
    assert plan.rewrites == ["attention in CausalSelfAttention.forward"]
    import copy

    swapped = copy.deepcopy(block)
    keys = list(swapped.state_dict())
    assert sorted(apply_plan(swapped, plan)) == ["gelu_tanh in gelu_tanh", "rms_norm in RMSNorm.forward"]
    assert list(swapped.state_dict()) == keys
    assert swapped.norm1.forward.__func__.__name__ == "forward"
    assert "gelu_tanh" in swapped.mlp.forward.__func__.__globals__["gelu_tanh"].__torchaxe_replaces__
    # The module's own globals are untouched; only the swapped method sees the fused op.
    assert not hasattr(GPT.gelu_tanh, "__torchaxe_replaces__")
    x = torch.randn(2, 16, 32)
    assert torch.allclose(block(x), swapped(x), atol=1e-5)


def test_a_hand_written_mish_is_swapped_for_f_mish(tmp_path):
    source = (
        "import torch\nimport torch.nn.functional as F\n\n\n"
        "class Mish(torch.nn.Module):\n    def forward(self, x):\n        return x * torch.tanh(F.softplus(x))\n\n\n"
        "class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(8, 8)\n        self.act = Mish()\n\n"
        "    def forward(self, x):\n        return self.act(self.fc(x))\n")
    path = tmp_path / "mish_net.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("mish_net_for_tests", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        net = module.Net()
        plan = plan_for(net)
        assert [s.category for s in plan.swaps] == ["mish"]
        x = torch.randn(4, 8)
        expected = net(x)
        assert apply_plan(net, plan) == ["mish in Mish.forward"]
        assert "mish" in net.act.forward.__func__.__torchaxe_replaces__
        assert torch.allclose(net(x), expected, atol=1e-6)
    finally:
        sys.modules.pop(spec.name, None)


def test_the_compile_strategies_compile_torchs_own_layers(counting_backend):
    # module.compile() leaves nn.Linear, nn.LayerNorm, nn.Sequential eager without a
    # word: a tuned head or norm measured 1.00x, the eager module timed twice.
    for name in ("compile", "max-autotune"):
        counting_backend.runs.clear()
        for module in (nn.Linear(4, 4), nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 4), nn.GELU())):
            S.apply(name, module, S.StrategyContext(compile_backend=counting_backend))
            module(torch.ones(2, 4)).sum().backward()
        assert len(counting_backend.runs) == 3, name


def test_unavailable_strategies_say_why():
    ctx = S.StrategyContext(target="cpu", compile_backend="eager")
    assert "convolution" in S.unavailable("channels-last", nn.Linear(2, 2), ctx)
    assert "Ascend" in S.unavailable("aoe", nn.Linear(2, 2), ctx)
    assert "no formula" in S.unavailable("replace", nn.Linear(2, 2), S.StrategyContext())
    assert S.unavailable("channels-last", nn.Conv2d(3, 4, 3), ctx) is None


# ------------------------------------------------------------------ tune, apply, warm runs


def test_tune_records_every_candidate_and_a_warm_run_tunes_nothing(tmp_path):
    options = fast_options(tmp_path)
    model = small_gpt()
    report = tune(model, tokens(), **options)
    by_module = {s.module: s for s in report.subgraphs}
    block = by_module["Block"]
    assert block.names == ["blocks.0", "blocks.1"] and block.status == "tuned"
    assert {r.strategy for r in block.records} == {"eager", "compile", "replace"}
    assert all(r.status == "ok" and len(r.samples) == 3 for r in block.records)
    assert by_module["Embedding"].unavailable["replace"].startswith("no formula")
    with KnowledgeBase.open(options["kb"]) as kb:
        stored = kb.tuned(block.signature)
        assert {r.strategy for r in stored} == {"eager", "compile", "replace"}
        assert stored[0].describe["module"] == "Block" and stored[0].env["torch"] == torch.__version__
    warm = tune(small_gpt(), tokens(), **options)
    assert warm.measured == 0
    assert {s.signature: s.winner for s in warm.subgraphs} == {s.signature: s.winner for s in report.subgraphs}
    assert warm.seconds < 5


class SparseGraphLayer(nn.Module):
    """A graph convolution over a sparse adjacency (pygcn): dynamo makes no graph of it."""

    def __init__(self, n: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        adjacency = torch.sparse_coo_tensor(torch.randint(0, n, (2, 256), generator=g), torch.ones(256), (n, n))
        self.register_buffer("adjacency", adjacency.coalesce())
        self.weight = nn.Parameter(torch.randn(8, 4, generator=g))

    def forward(self, x):
        return torch.spmm(self.adjacency, x @ self.weight)


def test_a_compile_that_makes_no_graph_is_not_reported_as_compiled(tmp_path):
    # A review's GCN: "compile ok, error 0.0e+00", as fast as eager, because dynamo ran
    # the sparse product eagerly and compiled nothing.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = SparseGraphLayer()
        report = tune(layer, torch.randn(64, 8), **fast_options(tmp_path, whole_model=True,
                                                                strategies=("eager", "compile")))
    records = {r.strategy: r for s in report.subgraphs for r in s.records if s.module == "SparseGraphLayer"}
    assert records["compile"].status == "failed" and records["compile"].message.startswith("nothing compiled")
    assert all(s.winner in (None, "eager") for s in report.subgraphs)


def test_wrong_and_failing_candidates_are_recorded_and_never_chosen(tmp_path, monkeypatch):
    real_apply = S.apply

    def sabotaged(name, module, ctx):
        notes = real_apply(name, module, ctx)
        if name == "compile":
            module.register_forward_hook(lambda m, a, out: out * 1.01)  # wrong by 1 %
        if name == "replace":
            raise RuntimeError("the fused kernel is missing\nsecond line")
        return notes

    monkeypatch.setattr(S, "apply", sabotaged)
    # The clock makes every later sample shorter, so "compile" would look fastest.
    clock = FakeClock()
    report = tune(small_gpt(), tokens(), timer=Timer(clock=clock), **fast_options(tmp_path))
    block = next(s for s in report.subgraphs if s.module == "Block")
    status = {r.strategy: r for r in block.records}
    assert status["compile"].status == "wrong" and "differs from eager" in status["compile"].message
    assert status["compile"].errors["output_max_rel"] == pytest.approx(0.01, rel=0.05)
    assert status["replace"].status == "failed"
    assert status["replace"].message == "RuntimeError: the fused kernel is missing"
    assert block.winner == "eager"
    with KnowledgeBase.open(tmp_path / "kb.sqlite") as kb:
        assert kb.winner(block.signature).strategy == "eager"


def test_the_fastest_correct_strategy_wins_and_apply_swaps_it_in(tmp_path, monkeypatch):
    real_time = Timer.time

    def timed(self, module, example, iterations=1):
        real_time(self, module, example, iterations)
        return 0.001 if is_compiled_in_place(module) else 0.004

    monkeypatch.setattr(Timer, "time", timed)
    options = fast_options(tmp_path, strategies=("eager", "compile"))
    model = small_gpt()
    report = tune(model, tokens(), **options)
    assert all(s.winner == "compile" for s in report.subgraphs)
    assert all(s.speedup == pytest.approx(4.0) for s in report.subgraphs)
    assert {n for n, _ in report.applied} == {"token_embedding", "position_embedding", "blocks.0", "blocks.1",
                                              "norm", "head"}
    assert model.blocks[0]._compiled_call_impl is not None
    # apply() on a fresh model: same choices, nothing measured.
    fresh = small_gpt()
    applied = apply(fresh, tokens(), kb=options["kb"], compile_backend="eager")
    assert applied.measured == 0 and len(applied.applied) == 6
    assert fresh.blocks[1]._compiled_call_impl is not None
    assert torch.allclose(fresh(tokens()), small_gpt()(tokens()), atol=1e-5)


def test_lazy_apply_waits_for_the_first_forward(tmp_path, monkeypatch):
    monkeypatch.setattr(Timer, "time", lambda self, m, e, i=1: 0.001 if is_compiled_in_place(m) else 0.004)
    options = fast_options(tmp_path, strategies=("eager", "compile"))
    tune(small_gpt(), tokens(), **options)
    model = small_gpt()
    lazy = apply(model, kb=options["kb"], compile_backend="eager")
    assert lazy.report is None and model.blocks[0]._compiled_call_impl is None
    model(tokens())
    assert lazy.report is not None and len(lazy.report.applied) == 6
    assert model.blocks[0]._compiled_call_impl is not None


def test_lazy_apply_to_a_model_the_script_compiled_swaps_into_the_module_it_wraps(tmp_path, monkeypatch):
    monkeypatch.setattr(Timer, "time", lambda self, m, e, i=1: 0.001 if is_compiled_in_place(m) else 0.004)
    options = fast_options(tmp_path, strategies=("eager", "compile"))
    tune(small_gpt(), tokens(), **options)
    model = small_gpt()
    compiled = torch.compile(model, backend="eager")
    lazy = apply(compiled, kb=options["kb"], compile_backend="eager")
    compiled(tokens())
    assert lazy.report is not None and len(lazy.report.applied) == 6
    assert model.blocks[0]._compiled_call_impl is not None
    # The script's compiled model still runs, and computes what the plain one does.
    assert torch.allclose(compiled(tokens()), small_gpt()(tokens()), atol=1e-5)


def test_the_budget_stops_tuning_and_the_next_run_resumes(tmp_path):
    # Each clock call is 1 s, the budget 30 s: the first subgraphs only.
    options = fast_options(tmp_path, budget=30.0)
    first = tune(small_gpt(), tokens(), timer=Timer(clock=FakeClock(1.0)), **options)
    assert first.budget_exhausted
    statuses = [s.status for s in first.subgraphs]
    assert "budget" in statuses and "tuned" in statuses
    second = tune(small_gpt(), tokens(), **fast_options(tmp_path))
    assert 0 < second.measured
    measured_again = {r.strategy for s in second.subgraphs for r in s.records}
    assert second.measured < first.measured + second.measured
    assert all(s.status in ("tuned", "known") for s in second.subgraphs)
    third = tune(small_gpt(), tokens(), **fast_options(tmp_path))
    assert third.measured == 0 and measured_again


def test_torchaxe_tune_is_callable_and_options_are_checked(tmp_path):
    assert callable(torchaxe.tune)
    report = torchaxe.tune(nn.Linear(4, 4), torch.randn(2, 4), **fast_options(tmp_path, strategies=("eager",)))
    assert report.subgraphs == [] and report.skipped == []  # the model itself is depth 0
    with pytest.raises(TorchaxeError, match="unknown strategy"):
        TuneOptions(strategies=("fastest",))
    with pytest.raises(TorchaxeError, match="budget"):
        parse_budget("soon")
    assert parse_budget("10m") == 600 and parse_budget("1.5h") == 5400 and parse_budget("90") == 90
    with pytest.raises(TorchaxeError, match="nn.Module"):
        tune("model", torch.randn(1))


def test_report_json_round_trips(tmp_path):
    report = tune(small_gpt(), tokens(), **fast_options(tmp_path, strategies=("eager",)))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema"] == "torchaxe.tune/1" and data["measured"] == len(data["subgraphs"])


# ------------------------------------------------------------------ AOE through a stand-in torch_npu


FAKE_NPU = Path(__file__).parent / "scripts" / "fake_npu"


def test_aoe_dumps_runs_the_tool_and_reports_its_knowledge_base(tmp_path, monkeypatch):
    """AOE against the stand-in torch_npu (tests/scripts/fake_npu) and a stand-in
    `aoe` executable on PATH, run as a real subprocess."""
    monkeypatch.syspath_prepend(str(FAKE_NPU))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    log = tmp_path / "npu.log"
    monkeypatch.setenv("FAKE_TORCH_NPU_LOG", str(log))
    monkeypatch.setenv("TUNE_BANK_PATH", str(tmp_path / "bank"))
    tools = tmp_path / "bin"
    tools.mkdir()
    aoe_tool = tools / "aoe"
    aoe_tool.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        f"open({str(tmp_path / 'aoe-args.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                        "sys.exit(int(os.environ.get('FAKE_AOE_EXIT', '0')))\n")
    aoe_tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")

    ctx = S.StrategyContext(target="npu", compile_backend="eager")
    assert S.unavailable("aoe", nn.Linear(2, 2), ctx) is None
    from torchaxe.tune.tuner import _Deadline, environment, measure_signature

    layer = nn.Linear(4, 4)
    example = Example((torch.randn(2, 4, requires_grad=True),))
    parts = signature_parts(layer, [[{"tensor": [[2, 4], "float32", True, "cpu", True, False]}], {}])
    records = measure_signature("ab" * 16, parts, layer, example, ["eager", "aoe"], ctx, environment("npu", "eager"),
                                repeats=2, min_sample_seconds=0.0, timer=Timer(), deadline=_Deadline(None, lambda: 0))
    aoe = next(r for r in records if r.strategy == "aoe")
    assert aoe.status == "ok", aoe.message
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    dump = next(c["dump_path"] for c in calls if c["call"] == "set_aoe")
    assert json.loads((tmp_path / "aoe-args.json").read_text()) == ["--job_type=2", f"--model_path={dump}"]
    notes = aoe.stats["notes"][0]
    assert str(tmp_path / "bank") in notes and "unverified" in notes

    monkeypatch.setenv("FAKE_AOE_EXIT", "3")
    records = measure_signature("cd" * 16, parts, layer, example, ["eager", "aoe"], ctx, environment("npu", "eager"),
                                repeats=1, min_sample_seconds=0.0, timer=Timer(), deadline=_Deadline(None, lambda: 0))
    failed = next(r for r in records if r.strategy == "aoe")
    assert failed.status == "failed" and "aoe exited with 3" in failed.message


def test_aoe_is_unavailable_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    ctx = S.StrategyContext(target="npu")
    assert "torch_npu is not installed" in S.unavailable("aoe", nn.Linear(2, 2), ctx)


def test_iteration_count_grows_for_short_subgraphs(tmp_path):
    report = tune(small_gpt(), tokens(), **fast_options(tmp_path, strategies=("eager",), min_sample_seconds=0.05))
    eager = report.subgraphs[0].records[0]
    assert eager.stats["iterations"] >= 1
    assert math.isclose(eager.stats["median"], sorted(eager.samples)[1])
    assert list(itertools.islice(eager.samples, 3))


# ------------------------------------------------------------------ attention -> SDPA in the captured graph


def test_recognised_attention_is_rewritten_to_sdpa_in_the_captured_graph():
    import copy

    import torch.nn.functional as F

    from torchaxe.tune.replacements import AttentionRewrite

    seen = []

    class Spy(AttentionRewrite):
        def __call__(self, gm, example_inputs):
            compiled = super().__call__(gm, example_inputs)
            seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
            return compiled

    attn = GPT.CausalSelfAttention(32, 4, 16)
    assert plan_for(attn).rewrites == ["attention in CausalSelfAttention.forward"]
    backend = Spy(None)
    fused = copy.deepcopy(attn)
    fused.compile(backend=backend)
    x = torch.randn(2, 16, 32)
    assert torch.allclose(fused(x), attn(x), atol=1e-6)
    assert backend.rewritten == 1
    assert F.scaled_dot_product_attention in seen[0] and torch.softmax not in seen[0]


class SharedScores(nn.Module):
    """Attention whose softmax weights are also returned: not rewritable."""

    def forward(self, q, k, v):
        w = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1)
        return w @ v, w


def test_an_attention_chain_used_elsewhere_is_left_alone():
    from torchaxe.tune.replacements import AttentionRewrite

    backend = AttentionRewrite(None)
    model = SharedScores()
    compiled = torch.compile(model, backend=backend)
    q = k = v = torch.randn(1, 2, 4, 8)
    out, w = compiled(q, k, v)
    assert backend.rewritten == 0 and torch.allclose(out, model(q, k, v)[0])


class Uncopyable(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def __deepcopy__(self, memo):
        raise TypeError("cannot copy a lock")

    def forward(self, x):
        return self.inner(x)


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.part = Uncopyable()
        self.other = nn.Linear(4, 4)

    def forward(self, x):
        return self.other(self.part(x))


def test_a_subgraph_that_cannot_be_copied_is_reported_not_fatal(tmp_path):
    report = tune(Holder(), torch.randn(2, 4), **fast_options(tmp_path, strategies=("eager",)))
    status = {s.names[0]: s for s in report.subgraphs}
    assert status["part"].status == "failed" and "cannot copy a lock" in status["part"].notes[0]
    assert status["other"].status == "tuned"


# ------------------------------------------------------------------ the whole model as one more level


def _level_timer(monkeypatch, root_compiled: float, part_compiled: float) -> None:
    """Eager forward + backward 4 ms for the model and for each subgraph; compiled as given."""
    def timed(self, module, example, iterations=1):
        compiled = is_compiled_in_place(module)
        if isinstance(module, GPT.GPT):
            return root_compiled if compiled else 0.004
        return part_compiled if compiled else 0.004

    monkeypatch.setattr(Timer, "time", timed)


def test_capture_with_the_whole_model_adds_it_first_at_depth_0():
    model = small_gpt()
    subs = capture(model, tokens(), whole=True).subgraphs()
    assert subs[0].module is model and subs[0].depth == 0 and subs[0].name == "GPT"
    assert subs[0].example is not None and subs[0].spec is not None
    assert [s.name for s in subs[1:]][:2] == ["token_embedding", "position_embedding"]
    assert [s.name for s in capture(model, tokens()).subgraphs()][0] == "token_embedding"


def test_the_whole_model_wins_when_it_saves_more_than_the_subgraphs_together(tmp_path, monkeypatch):
    # Whole: 4 -> 0.5 ms (3.5 ms saved); six subgraphs: 4 -> 3.5 ms each (3 ms together).
    _level_timer(monkeypatch, root_compiled=0.0005, part_compiled=0.0035)
    model = small_gpt()
    report = tune(model, tokens(), **fast_options(tmp_path, strategies=("eager", "compile"), min_gain=0.05,
                                                   whole_model=True))
    assert report.applied == [("GPT", "compile")]
    assert model._compiled_call_impl is not None and model.blocks[0]._compiled_call_impl is None
    block = next(s for s in report.subgraphs if s.module == "Block")
    assert block.winner == "compile" and any("whole model's winner (compile)" in n for n in block.notes)
    # apply() from the knowledge base makes the same choice.
    fresh = small_gpt()
    applied = apply(fresh, tokens(), kb=tmp_path / "kb.sqlite", compile_backend="eager")  # whole_model: default on
    assert applied.measured == 0 and applied.applied == [("GPT", "compile")]


def test_the_subgraphs_win_when_together_they_save_more(tmp_path, monkeypatch):
    # Whole: 4 -> 3 ms (1 ms saved); six subgraphs: 4 -> 3 ms each (6 ms together).
    _level_timer(monkeypatch, root_compiled=0.003, part_compiled=0.003)
    model = small_gpt()
    report = tune(model, tokens(), **fast_options(tmp_path, strategies=("eager", "compile"), whole_model=True))
    assert ("GPT", "compile") not in report.applied and len(report.applied) == 6
    root = next(s for s in report.subgraphs if s.module == "GPT")
    assert root.winner == "compile" and any("subgraphs' winners together" in n for n in root.notes)
    assert model._compiled_call_impl is None and model.blocks[0]._compiled_call_impl is not None


def test_whole_model_can_be_turned_off(tmp_path):
    report = tune(small_gpt(), tokens(), **fast_options(tmp_path, strategies=("eager",), whole_model=False))
    assert report.subgraphs and all(s.module != "GPT" for s in report.subgraphs)
    assert any(s.module == "GPT" for s in tune(small_gpt(), tokens(), **fast_options(
        tmp_path, strategies=("eager",), whole_model=True)).subgraphs)


class TwoConvStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stage = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 8, 1))

    def forward(self, x):
        return self.stage(self.stem(x))


def test_a_subgraph_captured_under_the_scripts_autocast_is_tuned_in_it(tmp_path):
    """A script training under bf16 autocast hands its second stage bf16 activations;
    replayed without autocast, its float32 convolution would refuse them."""
    from torchaxe.tune.tuner import tune_subgraphs

    torch.manual_seed(0)
    model = TwoConvStages()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rec = capture(model, torch.randn(2, 3, 8, 8))
    subs = {s.name: s for s in rec.subgraphs()}
    stage = subs["stage"]
    assert stage.autocast == (("cpu", "bfloat16"),) and stage.example.args[0].dtype == torch.bfloat16
    # The region is part of the signature: a float32 run of the same stage is another entry.
    plain = {s.name: s for s in capture(model, torch.randn(2, 3, 8, 8)).subgraphs()}["stage"]
    assert plain.autocast == ()
    assert signature_parts(stage.module, stage.spec, stage.autocast)["autocast"] == [["cpu", "bfloat16"]]
    assert "autocast" not in signature_parts(plain.module, plain.spec, plain.autocast)
    report = tune_subgraphs(list(subs.values()), TuneOptions(**fast_options(tmp_path, strategies=("eager", "compile"))))
    by_name = {name: s for s in report.subgraphs for name in s.names}
    assert by_name["stage"].status == "tuned"
    assert {r.strategy: r.status for r in by_name["stage"].records} == {"eager": "ok", "compile": "ok"}


class CheckpointedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.GELU()) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_a_model_with_activation_checkpointing_and_dropout_is_checked_not_failed(tmp_path):
    # Seen in a review: the whole model "failed" (CheckpointError: recomputed values have
    # different metadata), dropout being off in the forward and on in the recompute.
    import torch.utils.checkpoint  # noqa: F401

    from torchaxe.tune.measure import checked_run

    torch.manual_seed(0)
    model = CheckpointedBlocks()
    example = Example((torch.randn(4, 8, requires_grad=True),))
    first, second = checked_run(model, example, True), checked_run(model, example, True)
    assert torch.equal(first.outputs[0], second.outputs[0])
    assert all(m.training for m in model.modules())  # put back as the script had it
    report = tune(model, torch.randn(4, 8, requires_grad=True), **fast_options(
        tmp_path, strategies=("eager", "compile"), whole_model=True))
    whole = next(s for s in report.subgraphs if s.module == "CheckpointedBlocks")
    assert whole.status == "tuned" and {r.strategy: r.status for r in whole.records} == {"eager": "ok",
                                                                                       "compile": "ok"}


class Stem(nn.Module):
    """One block class in eleven widths: eleven subgraphs whose compiles share its code."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width + 1)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Stem(4 + i) for i in range(11))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_every_candidate_compiles_however_many_compiled_the_same_code_before(tmp_path):
    # A review's UNet: past dynamo's recompile limit (8 entries for ResnetBlock.forward,
    # one per earlier candidate) the later blocks' compiles ran eagerly and were timed
    # and stored as compiled ("compile ok, error 0.0e+00").
    report = tune(Tower(), torch.randn(2, 4), **fast_options(tmp_path, strategies=("eager", "compile", "max-autotune")))
    records = [r for s in report.subgraphs if s.module == "Stem" for r in s.records if r.strategy != "eager"]
    assert len(records) == 22
    assert all(r.status == "ok" for r in records), [(r.strategy, r.status, r.message) for r in records]


SCRIPT_AS_MAIN = '''\
import math
import torch
from torch import nn


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def scale(x):
    return x * math.log(2.0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return scale(gelu(self.fc(x)))
'''


def test_replace_then_compile_of_a_model_defined_by_a_script_run_as_main(tmp_path):
    # A review's DDPM script: its module-level helper reads `math`; once the script had
    # run as __main__, replace+compile failed with "module '__main__' has no attribute
    # 'math'" (dynamo looked the helper's globals up as torchaxe's own __main__).
    import runpy

    path = tmp_path / "train.py"
    path.write_text(SCRIPT_AS_MAIN)
    namespace = runpy.run_path(str(path), run_name="__main__")
    block = namespace["Block"]()
    assert type(block).__module__ == "__main__" and sys.modules["__main__"].__dict__ is not namespace
    report = tune(block, torch.randn(8, 16), **fast_options(tmp_path, whole_model=True,
                                                            strategies=("eager", "replace+compile")))
    records = {r.strategy: r for s in report.subgraphs for r in s.records}
    assert records["replace+compile"].status == "ok", records["replace+compile"].message
    assert sys.modules["__main__"].__dict__ is not namespace  # put back as it was
