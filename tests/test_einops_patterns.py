"""einops patterns evaluated with torch views, as the formula interpreter reads
``rearrange``/``repeat`` calls (einops itself is never imported)."""

from __future__ import annotations

import pytest
import torch

from torchaxe.scan.formulas.einops_patterns import PatternError, apply


def test_heads_are_split_and_merged_as_views_would():
    x = torch.randn(2, 3, 12)
    split = apply(x, "b n (h d) -> b h n d", h=4)
    assert torch.equal(split, x.view(2, 3, 4, 3).permute(0, 2, 1, 3))
    assert torch.equal(apply(split, "b h n d -> b n (h d)"), x)
    assert torch.equal(apply(x, "b n (h d) -> (b h) n d", h=4), x.view(2, 3, 4, 3).permute(0, 2, 1, 3).reshape(8, 3, 3))


def test_ellipsis_pairs_and_unit_axes():
    x = torch.randn(2, 3, 8)
    pairs = apply(x, "... (d j) -> ... d j", j=2)
    assert torch.equal(pairs, x.view(2, 3, 4, 2))
    assert torch.equal(apply(pairs, "... d j -> ... (d j)"), x)
    assert torch.equal(apply(x, "b ... d -> b (...) d"), x)
    mask = torch.rand(2, 5) > 0.5
    assert torch.equal(apply(mask, "b j -> b 1 1 j"), mask[:, None, None, :])
    assert apply(torch.randn(2, 3, 1, 5), "b n () d -> b n d").shape == (2, 3, 5)


def test_repeat_adds_axes_with_their_lengths():
    v = torch.randn(6)
    out = apply(v, "d -> b 1 d", repeat=True, b=3)
    assert out.shape == (3, 1, 6) and torch.equal(out[2, 0], v)
    w = torch.randn(2, 4)
    assert torch.equal(apply(w, "b d -> b (3 d)", repeat=True), w.repeat(1, 3))


@pytest.mark.parametrize("shape,pattern,lengths,repeat", [
    ((2, 3), "b n -> b", {}, False),               # rearrange drops an axis
    ((2, 3), "b n m -> b n m", {}, False),         # rank mismatch
    ((2, 6), "b (h d) -> b h d", {}, False),       # two unknown sizes in a group
    ((2, 6), "b (h d) -> b h d", {"h": 4}, False),  # does not divide
    ((2, 3), "b (n -> b n", {}, False),            # unbalanced
    ((2, 3), "b n -> b n x", {}, True),            # a new axis without a length
    ((2, 3), "b n", {}, False),                    # no arrow
    ((2, 3), "b n -> b n", {"n": True}, False),    # a length that is not a number
])
def test_patterns_that_do_not_apply_raise(shape, pattern, lengths, repeat):
    with pytest.raises(PatternError):
        apply(torch.randn(shape), pattern, repeat=repeat, **lengths)
