"""pad_to_bucket, BucketingCollate and the trials' bucketing knob."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

import torchaxe.shapes
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.knobs import KnobError, knob_set_from_dict
from torchaxe.shapes import BucketingCollate, pad_to_bucket
from torchaxe.shapes.knob import CollateBucketing


def test_public_names_and_lazy_import():
    assert torchaxe.shapes.BucketingCollate is BucketingCollate
    code = "import sys, torchaxe.shapes, torchaxe.shapes.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pad_to_bucket_pads_at_the_end_to_the_smallest_boundary():
    x = torch.ones(2, 5)
    y = pad_to_bucket(x, [4, 8, 16], dim=1, value=-1)
    assert y.shape == (2, 8)
    assert torch.equal(y[:, :5], x) and (y[:, 5:] == -1).all()
    assert pad_to_bucket(torch.ones(2, 8), [4, 8], dim=1).shape == (2, 8)
    image = torch.ones(3, 30, 50)
    assert pad_to_bucket(image, [[32, 64], [32, 64]], dim=[1, 2]).shape == (3, 32, 64)


def test_pad_to_bucket_refuses_oversize_unless_kept():
    with pytest.raises(TorchaxeError, match="size 20 along dim 1 is above the largest bucket 16"):
        pad_to_bucket(torch.ones(2, 20), [8, 16], dim=1)
    assert pad_to_bucket(torch.ones(2, 20), [8, 16], dim=1, oversize="keep").shape == (2, 20)
    with pytest.raises(TorchaxeError, match="positive integers"):
        pad_to_bucket(torch.ones(2), [0, 4])
    with pytest.raises(TorchaxeError, match="only 1 dimensions"):
        pad_to_bucket(torch.ones(2), [4], dim=3)


def test_collate_of_sequences_returns_padded_batch_and_mask():
    collate = BucketingCollate([4, 8], pad_value=0)
    samples = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8]), torch.tensor([9])]
    tokens, mask = collate(samples)
    assert tokens.shape == (3, 8)
    assert tokens[1, :5].tolist() == [4, 5, 6, 7, 8] and tokens[1, 5:].tolist() == [0, 0, 0]
    assert mask.dtype == torch.bool and mask.sum(1).tolist() == [3, 5, 1]
    assert mask[0].tolist() == [True] * 3 + [False] * 5


def test_collate_of_tuples_and_dicts():
    collate = BucketingCollate([6])
    tokens, labels, mask = collate([(torch.arange(2), 0), (torch.arange(4), 1)])
    assert tokens.shape == (2, 6) and labels.tolist() == [0, 1] and mask.sum().item() == 6
    out = BucketingCollate([6])([{"input_ids": torch.arange(3), "y": 1.0}, {"input_ids": torch.arange(5), "y": 2.0}])
    assert out["input_ids"].shape == (2, 6) and out["attention_mask"].sum().item() == 8
    assert out["y"].tolist() == [1.0, 2.0]
    with pytest.raises(TorchaxeError, match="fields="):
        BucketingCollate([6])([{"a": torch.arange(3)}])


def pad_collate(batch):
    sequences, labels = zip(*batch)
    return pad_sequence(list(sequences), batch_first=True), torch.tensor([len(s) for s in sequences]), torch.tensor(labels)


def test_wrapping_a_collate_function_keeps_its_structure():
    collate = BucketingCollate([8, 16], collate_fn=pad_collate)
    tokens, lengths, labels = collate([(torch.ones(3, dtype=torch.long), 0), (torch.ones(10, dtype=torch.long), 1)])
    assert tokens.shape == (2, 16) and lengths.tolist() == [3, 10] and labels.tolist() == [0, 1]
    assert tokens[:, 10:].eq(0).all()
    with_mask = BucketingCollate([8, 16], collate_fn=pad_collate, return_mask=True, pad_value=0)
    *_, mask = with_mask([(torch.ones(3, dtype=torch.long), 0)])
    assert mask.tolist() == [[True] * 3 + [False] * 5]


def hf_collate(batch):
    # A Hugging Face style collate: labels padded with the loss's ignore index, a
    # mask padded with 0, and a fixed-width target beside them.
    ids = [torch.tensor(s) for s in batch]
    return {"input_ids": pad_sequence(ids, batch_first=True, padding_value=0),
            "labels": pad_sequence(ids, batch_first=True, padding_value=-100),
            "attention_mask": pad_sequence([torch.ones(len(s), dtype=torch.long) for s in batch], batch_first=True),
            "onehot": torch.zeros(len(batch), 3)}


def test_a_wrapped_collate_is_padded_with_the_values_it_pads_with_itself():
    collate = BucketingCollate([8, 16], collate_fn=hf_collate)
    out = collate([[5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [9, 9]])
    assert collate.learned == {"input_ids": 0, "labels": -100, "attention_mask": 0}
    assert out["input_ids"].shape == out["labels"].shape == out["attention_mask"].shape == (3, 16)
    assert out["labels"][:, 10:].eq(-100).all() and out["attention_mask"][:, 10:].eq(0).all()
    assert out["onehot"].shape == (3, 3)  # not a sequence: left alone
    # The loss over the padded batch is the loss over the original one.
    original = hf_collate([[5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [9, 9]])
    logits = torch.randn(3, 16, 20, generator=torch.Generator().manual_seed(0))
    padded_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), out["labels"].flatten())
    loss = torch.nn.functional.cross_entropy(logits[:, :10].flatten(0, 1), original["labels"].flatten())
    torch.testing.assert_close(padded_loss, loss)


def test_a_wrapped_collate_passes_a_batch_on_unpadded_until_its_padding_is_known():
    collate = BucketingCollate([8, 16], collate_fn=hf_collate)
    same = collate([[5, 6, 7, 8], [1, 2, 3, 4]])  # equal lengths: nothing shows the padding
    assert same["labels"].shape == (2, 4) and collate.unpadded_batches == 1 and not collate.learned
    out = collate([[5, 6, 7, 8, 9], [1, 2]])
    assert out["labels"].shape == (2, 8) and out["labels"][1, 2:].eq(-100).all()


def test_learned_padding_is_not_fooled_by_rows_that_end_alike():
    from torchaxe.shapes.bucketing import learned_padding

    sep = 102
    # Truncated rows all end with [SEP]; one short row is padded with 0.
    rows = torch.tensor([[1, 4, 5, 6, sep], [1, 7, 8, 9, sep], [1, 3, 2, 8, sep], [1, 5, sep, 0, 0]])
    assert learned_padding(rows, 1) == 0
    assert learned_padding(torch.tensor([[1, 2, 3], [4, 5, 6]]), 1) is None  # no padding to see
    assert learned_padding(torch.ones(3, 5), 1) is None
    # Padded features: [batch, length, hidden].
    features = torch.randn(2, 4, 3)
    features[0, 2:] = 0.0
    assert learned_padding(features, 1) == 0.0


def test_pad_value_auto_needs_a_collate_function_to_learn_from():
    with pytest.raises(TorchaxeError, match="collate_fn"):
        BucketingCollate([8], pad_value="auto")
    with pytest.raises(TorchaxeError, match="pad_value"):
        BucketingCollate([8], collate_fn=hf_collate, pad_value="zero")


def test_loader_with_the_collate_yields_only_bucket_shapes():
    data = [(torch.ones(n, dtype=torch.long), n % 2) for n in range(1, 30)]
    loader = DataLoader(data, batch_size=4, shuffle=True, collate_fn=BucketingCollate([10, 20, 30], collate_fn=pad_collate))
    assert {tuple(batch[0].shape[1:]) for batch in loader} <= {(10,), (20,), (30,)}


def test_bucketing_knob_validation_in_one_line():
    knobs = knob_set_from_dict({"bucketing": {"boundaries": [32, 16], "dim": 1, "pad_value": 0}}, "b.json")
    assert knobs.bucketing.boundaries == (16, 32)
    assert knobs.to_dict()["bucketing"] == {"boundaries": [16, 32], "dim": 1, "pad_value": 0}
    two = knob_set_from_dict({"bucketing": {"boundaries": [[32], [32, 64]], "dim": [2, 3]}}, "b.json")
    assert two.to_dict()["bucketing"]["dim"] == [2, 3]
    for bad, message in [
        ({"bucketing": {"boundaries": []}}, "b.json: bucketing.boundaries: expected a non-empty list"),
        ({"bucketing": {"boundaries": [8], "pad": 1}}, "b.json: bucketing.pad: unknown key"),
        ({"bucketing": {"boundaries": [8], "dim": [1, 2]}}, "b.json: bucketing.boundaries: with dim [1, 2]"),
        ({"bucketing": {"boundaries": [8], "pad_value": "x"}}, "b.json: bucketing.pad_value: expected a number"),
    ]:
        with pytest.raises(KnobError) as info:
            knob_set_from_dict(bad, "b.json")
        assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_collate_bucketing_patch_wraps_loaders_and_is_removed():
    notes = {}
    knobs = knob_set_from_dict({"bucketing": {"boundaries": [16], "dim": 1}}, "b.json").bucketing
    patch = CollateBucketing(knobs, notes.__setitem__)
    original = DataLoader.__init__
    patch.install()
    try:
        loader = DataLoader([(torch.ones(3, dtype=torch.long), 0), (torch.ones(5, dtype=torch.long), 1)],
                            batch_size=2, collate_fn=pad_collate)
        plain = DataLoader([torch.ones(3)], batch_size=None)  # no automatic batching: left alone
    finally:
        patch.uninstall()
    assert DataLoader.__init__ is original
    assert isinstance(loader.collate_fn, BucketingCollate) and next(iter(loader))[0].shape == (2, 16)
    assert not isinstance(plain.collate_fn, BucketingCollate)
    assert notes["bucketing"]["collate_fns"] == ["pad_collate"]


VARLEN = """\
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
data = [torch.ones(n, dtype=torch.long) for n in range(3, 15)]
def collate(batch):
    return pad_sequence(batch, batch_first=True)
loader = DataLoader(data, batch_size=3, collate_fn=collate)
model = torch.nn.Embedding(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for tokens in loader:
    print("shape", tuple(tokens.shape), flush=True)
    model(tokens).sum().backward()
    opt.step()
"""


@pytest.mark.slow
def test_bootstrap_applies_the_bucketing_knob(tmp_path):
    script = tmp_path / "varlen.py"
    script.write_text(VARLEN)
    knobs = tmp_path / "k.json"
    knobs.write_text(json.dumps({"name": "b", "bucketing": {"boundaries": [8, 16], "dim": 1}}))
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "torchaxe.runtime.bootstrap", str(knobs), "--out", str(out),
                           "--steps", "3", "--warmup", "0", "--target", "cpu", "--", "python", str(script)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    shapes = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("shape")]
    assert shapes[:3] == ["(3, 8)", "(3, 8)", "(3, 16)"]
    applied = json.loads(out.read_text())["run"]["options"]["knobs"]
    assert applied["bucketing"] == {"boundaries": [8, 16], "dim": 1, "pad_value": "auto", "collate_fns": ["collate"]}
