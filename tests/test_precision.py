"""Mixed precision as advise measures it: the autocast knob hands the model's outputs
back in float32 (the loss the script computes from them runs in float32), the loss
record reads a device's losses only after the run, bf16 is not offered on a CPU
without native bfloat16."""

from __future__ import annotations

from collections import namedtuple

import pytest

from torchaxe.backends.cpu import bfloat16_matrix_units, native_bfloat16
from torchaxe.precision.candidates import candidates, own_speedups
from torchaxe.runtime import bootstrap, knob_specs
from torchaxe.runtime.knobs import KnobSet, knob_set_from_dict

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional


class TinyLM(nn.Module):
    """Logits from an embedding and a linear layer; the loss is the script's."""

    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


def train_losses(autocast: str | None, steps: int = 4) -> tuple[list[torch.Tensor], dict]:
    """A loop that computes its loss outside the model's forward (log_softmax +
    NLLLoss, as word-level language models do), under the autocast knob or not."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.NLLLoss()
    tokens = torch.randint(0, 50, (steps, 16))
    targets = torch.randint(0, 50, (steps, 16))
    knobs = knob_set_from_dict({"name": "k", **({"autocast": {"dtype": autocast}} if autocast else {})}, "test")
    applied = bootstrap.AppliedKnobs(knobs)
    losses = []
    with knob_specs.AUTOCAST.patch(knobs.autocast, applied):
        for step in range(steps):
            logits = model(tokens[step])
            loss = criterion(F.log_softmax(logits, dim=-1), targets[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return losses, applied.record


def test_the_loss_computed_after_an_autocast_forward_is_float32_and_close_to_float32_training() -> None:
    reference, _ = train_losses(None)
    mixed, record = train_losses("bfloat16")
    assert record["autocast"]["dtype"] == "bfloat16" and record["autocast"]["outputs"] == "float32"
    assert all(loss.dtype == torch.float32 for loss in mixed)
    for a, b in zip(mixed, reference):
        assert abs(float(a) - float(b)) / float(b) < 0.01


def test_autocast_covers_each_model_a_gan_iteration_calls() -> None:
    # A generator and a discriminator, each called from the loop: both run their
    # forward in the lower precision, not only the one called first.
    generator, discriminator = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 1))
    seen = {}
    generator[0].register_forward_hook(lambda m, i, o: seen.update(G=o.dtype))
    discriminator[0].register_forward_hook(lambda m, i, o: seen.update(D=o.dtype))
    knobs = knob_set_from_dict({"name": "k", "autocast": {"dtype": "bfloat16"}}, "test")
    applied = bootstrap.AppliedKnobs(knobs)
    with knob_specs.AUTOCAST.patch(knobs.autocast, applied):
        for _ in range(2):
            fake = generator(torch.randn(2, 4))
            score = discriminator(fake)
            generator(torch.randn(2, 4))
    assert seen == {"G": torch.bfloat16, "D": torch.bfloat16}
    assert fake.dtype == score.dtype == torch.float32  # handed back in float32
    assert applied.record["autocast"]["modules"] == ["Sequential", "Sequential"]


def test_only_the_lower_precision_outputs_are_cast_and_containers_keep_their_type() -> None:
    Out = namedtuple("Out", "logits hidden")
    low = torch.ones(2, dtype=torch.bfloat16)
    index = torch.arange(2)
    cast = knob_specs.outputs_in_float32(
        (Out(low, [low, index]), {"aux": low, "n": 3}, torch.ones(2, dtype=torch.float64)), torch.bfloat16)
    named, mapping, wide = cast
    assert type(named) is Out and named.logits.dtype == torch.float32
    assert named.hidden[0].dtype == torch.float32 and named.hidden[1] is index
    assert mapping["aux"].dtype == torch.float32 and mapping["n"] == 3
    assert wide.dtype == torch.float64  # not what autocast made: left alone
    same = (index, "text")
    assert knob_specs.outputs_in_float32(same, torch.bfloat16) is same


def test_gradients_flow_back_through_the_cast_outputs() -> None:
    model = TinyLM()
    knobs = knob_set_from_dict({"name": "k", "autocast": {"dtype": "bfloat16"}}, "test")
    with knob_specs.AUTOCAST.patch(knobs.autocast, bootstrap.AppliedKnobs(knobs)):
        logits = model(torch.randint(0, 50, (8,)))
        F.cross_entropy(logits, torch.randint(0, 50, (8,))).backward()
    assert logits.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_the_loss_record_holds_every_scalar_backward_and_is_read_when_the_record_is_taken() -> None:
    knobs = KnobSet(name="x")
    applied = bootstrap.AppliedKnobs(knobs)
    w = torch.ones(3, requires_grad=True)
    original = torch.Tensor.backward
    with knob_specs.OBSERVE.patch(True, applied) as recorder:
        for scale in (1.0, 2.0):
            (w.sum() * scale).backward()
        (w * 2).backward(torch.ones(3))  # not a scalar: not a loss
        assert recorder.kept == [3.0, 6.0]
    assert torch.Tensor.backward is original
    assert applied.record["loss"] == [3.0, 6.0]


def test_each_loss_is_tagged_with_the_harness_phase_and_advise_compares_the_measured_ones(monkeypatch) -> None:
    from torchaxe.advise.measure import measured_losses
    from torchaxe.runtime import harness

    applied = bootstrap.AppliedKnobs(KnobSet(name="x"))
    w = torch.ones(3, requires_grad=True)
    with knob_specs.OBSERVE.patch(True, applied):
        for phase, scale in (("warmup", 9.0), ("warmup", 7.0), ("measured", 1.0), ("measured", 2.0)):
            monkeypatch.setattr(harness, "_PHASE", [phase])
            (w.sum() * scale).backward()
    record = applied.record
    assert record["loss_phases"] == ["warmup", "warmup", "measured", "measured"]
    # A first compiled step or an optimizer's first large updates are no accuracy cost.
    assert measured_losses(record) == [3.0, 6.0]
    # A run that did not tag its losses (or has none measured) keeps them all.
    assert measured_losses({"loss": [1.0, 2.0]}) == [1.0, 2.0]
    assert measured_losses({"loss": [1.0], "loss_phases": ["warmup"]}) == [1.0]


def test_losses_kept_as_tensors_are_read_in_their_order() -> None:
    recorder = knob_specs.LossRecorder(bootstrap.AppliedKnobs(KnobSet(name="x")))
    recorder.kept.extend([1.5, torch.tensor(2.5)])  # a host float and a tensor not yet read
    assert recorder.values() == [1.5, 2.5]


# ------------------------------------------------------------------ bf16 on a cpu


@pytest.mark.parametrize("text, expected", [
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n", True),
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_bf16\n", True),
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n", False),
    ("processor\t: 0\nFeatures\t: fp asimd bf16 sve\n", True),
    ("processor\t: 0\nFeatures\t: fp asimd crc32\n", False),
    ("", None),
])
def test_native_bfloat16_is_read_from_the_cpu_flags(tmp_path, text, expected) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert native_bfloat16(cpuinfo) is expected
    assert native_bfloat16(tmp_path / "missing") is None
    assert bfloat16_matrix_units(cpuinfo) is (None if expected is None else "amx_bf16" in text)
    assert bfloat16_matrix_units(tmp_path / "missing") is None


def test_bf16_is_not_offered_on_a_cpu_without_native_bfloat16() -> None:
    keys = {c.key for c in candidates({}, "cpu", {"cpu_bfloat16": False})}
    assert "knob:autocast-bf16" not in keys
    note, = own_speedups({"cpu_bfloat16": False}, "cpu")
    assert "no native bfloat16" in note and "avx512_bf16" in note
    # Native, or not known (no /proc/cpuinfo): offered, and measured like any change.
    for known in (True, None):
        assert "knob:autocast-bf16" in {c.key for c in candidates({}, "cpu", {"cpu_bfloat16": known})}
        assert own_speedups({"cpu_bfloat16": known}, "cpu") == []
    # With matrix units (AMX) it is measured early, as on a device.
    priority = {c.key: c.priority for c in candidates({}, "cpu", {"cpu_bfloat16": True})}
    amx = {c.key: c.priority for c in candidates({}, "cpu", {"cpu_bfloat16": True, "cpu_bfloat16_matrix_units": True})}
    assert amx["knob:autocast-bf16"] > priority["knob:autocast-bf16"]
    assert amx["knob:autocast-bf16"] == {c.key: c.priority for c in candidates({}, "cuda", {})}["knob:autocast-bf16"]
    # A GPU's bfloat16 does not depend on the host's flags.
    assert "knob:autocast-bf16" in {c.key for c in candidates({}, "cuda", {"cpu_bfloat16": False})}
    assert own_speedups({"cpu_bfloat16": False}, "cuda") == []


class Attention(nn.Module):
    """A projection and torch's fused attention, as GPT-style models write it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_dtypes(knob: dict) -> tuple[list[torch.dtype], torch.Tensor, dict]:
    """The dtypes torch's fused attention saw its query in, under the autocast knob
    ``knob``, and the model's output."""
    seen: list[torch.dtype] = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append(q.dtype)
        return real(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        knobs = knob_set_from_dict({"name": "k", "autocast": knob}, "test")
        applied = bootstrap.AppliedKnobs(knobs)
        model = Attention()
        with knob_specs.AUTOCAST.patch(knobs.autocast, applied):
            out = model(torch.randn(2, 8, 32))
            out.sum().backward()
            F.scaled_dot_product_attention(*(torch.randn(1, 1, 4, 8, dtype=torch.bfloat16) for _ in range(3)))
        restored = F.scaled_dot_product_attention is recording
    finally:
        F.scaled_dot_product_attention = real
    assert restored, "the knob left F.scaled_dot_product_attention patched"
    return seen, out, applied.record


def test_the_attention_option_keeps_fused_attention_in_float32_inside_autocast() -> None:
    seen, out, record = attention_dtypes({"dtype": "bfloat16"})
    assert seen == [torch.bfloat16, torch.bfloat16]  # autocast's own rule
    seen, out, record = attention_dtypes({"dtype": "bfloat16", "attention": "float32"})
    # Inside the model's autocast: float32; a call outside autocast is torch's own.
    assert seen == [torch.float32, torch.bfloat16]
    assert out.dtype == torch.float32  # the model's output, handed back in float32 as always
    assert record["autocast_attention"]["dtype"] == "float32"


def test_attention_in_float32_hands_back_the_querys_dtype_and_its_gradient_flows() -> None:
    knobs = knob_set_from_dict({"name": "k", "autocast": {"dtype": "bfloat16", "attention": "float32"}}, "test")
    patch = knob_specs.AttentionInFloat32(bootstrap.AppliedKnobs(knobs)).install()
    try:
        q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        mask = torch.zeros(6, 6, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            positional = F.scaled_dot_product_attention(q, k, v, mask)  # the mask passed by position
        assert torch.equal(positional, out)
        out.float().sum().backward()
    finally:
        patch.uninstall()
    assert out.dtype == torch.bfloat16 and q.grad is not None and q.grad.dtype == torch.bfloat16
    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert torch.allclose(out.float(), expected, atol=1e-2)


def test_a_bad_attention_option_is_one_clear_error() -> None:
    from torchaxe.errors import TorchaxeError

    with pytest.raises(TorchaxeError, match="autocast.attention"):
        knob_set_from_dict({"name": "k", "autocast": {"dtype": "bfloat16", "attention": "fp8"}}, "test")
    knobs = knob_set_from_dict({"name": "k", "autocast": {"dtype": "bfloat16", "attention": "float32"}}, "test")
    assert knobs.autocast.to_dict() == {"dtype": "bfloat16", "attention": "float32"}
    assert knob_set_from_dict({"name": "k", "autocast": {}}, "test").autocast.to_dict() == {"dtype": "bfloat16"}


def attention_profile(share: float) -> dict:
    """A profile's op table with ``share`` of its time in the cpu's fused attention."""
    return {"ops": [{"name": "aten::mm", "kind": "op", "self_seconds": 1.0 - share},
                    {"name": "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "kind": "op",
                     "self_seconds": share}]}


def test_bf16_with_float32_attention_is_offered_where_a_cpu_run_spent_time_in_fused_attention() -> None:
    amx = {"cpu_bfloat16": True, "cpu_bfloat16_matrix_units": True}
    offered = {c.key: c for c in candidates(attention_profile(0.2), "cpu", amx)}
    both = offered["knob:autocast-bf16-attention-fp32"]
    assert both.knobs == {"autocast": {"dtype": "bfloat16", "attention": "float32"}}
    assert both.group == offered["knob:autocast-bf16"].group == "precision"  # one of them is kept
    assert "20% of its operator time" in both.rec.detail
    # Not where attention took too little of the run, nor where bf16 is not tried, nor on a device.
    assert "knob:autocast-bf16-attention-fp32" not in {c.key for c in candidates(attention_profile(0.01), "cpu", amx)}
    assert "knob:autocast-bf16-attention-fp32" not in {c.key for c in candidates({}, "cpu", amx)}
    assert not any(c.key == "knob:autocast-bf16-attention-fp32"
                   for c in candidates(attention_profile(0.2), "cpu", {"cpu_bfloat16": False}))
    assert not any(c.key == "knob:autocast-bf16-attention-fp32"
                   for c in candidates(attention_profile(0.2), "cpu", {**amx, "autocast": {"dtype": "bfloat16"}}))
    assert not any(c.key == "knob:autocast-bf16-attention-fp32" for c in candidates(attention_profile(0.2), "cuda", {}))
