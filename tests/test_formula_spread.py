"""Fixing a hand-written formula that is spread over several statements: the fused
call replaces the last part and the statements that built it are deleted, only when
that keeps the program's meaning."""

from __future__ import annotations

import importlib.util
import re
import textwrap

import pytest
import torch

from torchaxe.findings import Applicability
from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.fix import fix_source
from torchaxe.scan.formulas.analysis import FormulaMatch

NANOGPT = '''\
import math
import torch
import torch.nn as nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # the scores
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:,:,:T,:T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        return y.transpose(1, 2).contiguous().view(B, T, C)
'''


def _fix(source: str, code: str, target: str = "cuda") -> tuple[str, list]:
    options = ScanOptions(target=target, select=(code,), capabilities=torch_capabilities(target))
    findings = [f for f in scan_source(source, "m.py", options).findings if f.code == code]
    return fix_source(source, "m.py", options, unsafe=True).fixed, findings


def _load(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _before_after(tmp_path, source: str, fixed: str, name: str):
    """The original and the fixed source, imported as two modules."""
    (tmp_path / f"{name}_before.py").write_text(source)
    (tmp_path / f"{name}_after.py").write_text(fixed)
    return _load(tmp_path / f"{name}_before.py", f"{name}_before"), _load(tmp_path / f"{name}_after.py", f"{name}_after")


def test_nanogpt_attention_becomes_one_sdpa_call_with_its_mask_and_dropout(tmp_path):
    fixed, [finding] = _fix(NANOGPT, "AX118")
    assert finding.fix.applicability is Applicability.UNSAFE
    assert "deletes lines 23-26, used only to build it" in finding.message
    body = fixed.split("def forward(self, x):")[1]
    assert not re.search(r"\batt\b", body)
    assert ("        # the scores\n        y = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(k.size(-1)), "
            "attn_mask=self.bias[:,:,:T,:T] != 0, dropout_p=(self.attn_dropout.p if self.training else 0.0))\n"
            "        return y.transpose") in fixed

    # The fixed module computes what the original did (eval: no dropout), forward and backward.
    before, after = _before_after(tmp_path, NANOGPT, fixed, "nanogpt")
    torch.manual_seed(0)
    a = before.CausalSelfAttention(32, 4, 16, 0.1).eval()
    b = after.CausalSelfAttention(32, 4, 16, 0.1).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 12, 32, requires_grad=True)
    ya, yb = a(x), b(x)
    assert torch.allclose(ya, yb, atol=1e-5)
    ga, = torch.autograd.grad(ya.square().sum(), x)
    gb, = torch.autograd.grad(yb.square().sum(), x)
    assert torch.allclose(ga, gb, atol=1e-5)
    # In training the same fraction of weights is dropped (other random draws).
    b.train()
    assert b(x).shape == ya.shape


@pytest.mark.parametrize("change,why", [
    # The weights are returned (output_attentions): they must still be computed.
    (("        return y.transpose(1, 2).contiguous().view(B, T, C)\n",
      "        return y.transpose(1, 2).contiguous().view(B, T, C), att\n"), "read elsewhere"),
    # A chain name read between the statements.
    (("        att = F.softmax(att, dim=-1)\n", "        att = F.softmax(att, dim=-1)\n        print(att.mean())\n"),
     "read elsewhere"),
    # An in-place write between the statements.
    (("        att = F.softmax(att, dim=-1)\n", "        att = F.softmax(att, dim=-1)\n        att[:, 0] = 0\n"),
     "written in place"),
    # q is bound again after the scores used it: the call would read the new q.
    (("        att = F.softmax(att, dim=-1)\n", "        att = F.softmax(att, dim=-1)\n        q = q * 2\n"),
     "input reassigned"),
    # The mask is applied only sometimes.
    (("        att = att.masked_fill(self.bias[:,:,:T,:T] == 0, float('-inf'))\n",
      "        if self.causal:\n            att = att.masked_fill(self.bias[:,:,:T,:T] == 0, float('-inf'))\n"),
     "conditional"),
    # Two statements share a line.
    (("        att = F.softmax(att, dim=-1)\n", "        att = F.softmax(att, dim=-1); n = 1\n"), "shared line"),
    # A dropout-named module that is not nn.Dropout (its rate is not .p).
    (("        self.attn_dropout = nn.Dropout(dropout)\n", "        self.attn_dropout = DropPath(dropout)\n"),
     "unknown dropout"),
])
def test_a_chain_that_cannot_be_deleted_soundly_stays_advice(change, why):
    old, new = change
    assert old in NANOGPT
    source = NANOGPT.replace(old, new)
    fixed, findings = _fix(source, "AX118")
    # (A write into the weights in place, att[:, 0] = 0, is read as weights changed
    # after the softmax, as a head mask is: advice, never an edit.)
    assert len(findings) == 1, why
    for finding in findings:
        assert not finding.fix.edits, why
        assert "no automatic fix" in finding.message
    assert fixed == source


@pytest.mark.parametrize("target", ["cuda", "npu"])
def test_weights_read_after_the_attention_are_named_in_the_advice(target):
    """A fused attention does not return its weights: where the code reads them after
    the attention (returns them), the advice says so, on every target."""
    source = NANOGPT.replace("        return y.transpose(1, 2).contiguous().view(B, T, C)\n",
                             "        out = y.transpose(1, 2).contiguous().view(B, T, C)\n        return out, att\n")
    _, [finding] = _fix(source, "AX118", target=target)
    line = source.splitlines().index("        return out, att") + 1
    assert f"reads the attention weights (att) after the attention (line {line})" in finding.message
    assert not finding.fix.edits
    # Read only on the way to the attention (between its statements): nothing to say.
    source = NANOGPT.replace("        att = F.softmax(att, dim=-1)\n",
                             "        att = F.softmax(att, dim=-1)\n        print(att.mean())\n")
    _, [finding] = _fix(source, "AX118", target=target)
    assert "reads the attention weights" not in finding.message


def test_functional_dropout_becomes_dropout_p():
    source = NANOGPT.replace("        att = self.attn_dropout(att)\n",
                             "        att = F.dropout(att, p=self.p, training=self.training)\n")
    fixed, [finding] = _fix(source, "AX118")
    assert "dropout_p=(self.p if self.training else 0.0))" in fixed


def test_a_prescaled_query_keeps_its_scaling_and_the_weights_go():
    source = textwrap.dedent('''\
        import torch


        class A(torch.nn.Module):
            def forward(self, q, k, v):
                q = q * self.scale
                attn = q @ k.transpose(-2, -1)
                attn = attn.softmax(dim=-1)
                return attn @ v
    ''')
    fixed, _ = _fix(source, "AX118")
    assert fixed.endswith("        q = q * self.scale\n"
                          "        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)\n")


def test_other_formulas_lose_their_locals_too():
    source = textwrap.dedent('''\
        import math
        import torch


        def gelu(x):
            cdf = 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))
            return x * cdf


        def gelu_logged(x):
            cdf = 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))
            print(cdf.mean())
            return x * cdf
    ''')
    fixed, findings = _fix(source, "AX110", target="cpu")
    assert [bool(f.fix.edits) for f in findings] == [True, False]
    assert "deletes line 6, used only to build it" in findings[0].message
    assert 'def gelu(x):\n    return torch.nn.functional.gelu(x, approximate="tanh")\n' in fixed
    assert "print(cdf.mean())" in fixed and fixed.count("cdf = ") == 1


def test_the_plan_is_kept_with_the_stored_match():
    import ast

    from torchaxe.scan.context import FileContext
    from torchaxe.scan.formulas.analysis import _analyse

    ctx = FileContext("m.py", NANOGPT, ast.parse(NANOGPT), "cuda")
    [match] = [m for m in _analyse(ctx) if m.category == "attention"]
    assert match.plan is not None and match.plan.delete == ((23, 23), (24, 24), (25, 25), (26, 26))
    again = FormulaMatch.from_data(match.to_data())
    assert again.plan == match.plan and again.plan.dropout_p == match.plan.dropout_p


def test_the_bundled_gpt_example_gets_an_attention_fix():
    from pathlib import Path

    source = (Path(__file__).resolve().parent.parent / "examples" / "gpt" / "train.py").read_text()
    fixed, [finding] = _fix(source, "AX118", target="cpu")
    assert finding.fix.edits and "mask = self.causal_mask[:length, :length]" in fixed
    assert "F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(self.head_dim), attn_mask=mask)" in fixed
    assert "scores" not in fixed and "weights = " not in fixed


ANNOTATED = '''\
import math
import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = scores.softmax(dim=-1)
        p_attn = self.dropout(p_attn)
        return torch.matmul(p_attn, value)
'''


def test_an_optional_mask_is_passed_only_when_given(tmp_path):
    fixed, [finding] = _fix(ANNOTATED, "AX118")
    assert finding.fix.edits
    assert ("    def forward(self, query, key, value, mask=None):\n        return torch.nn.functional."
            "scaled_dot_product_attention(query, key, value, attn_mask=None if mask is None else mask != 0, "
            "dropout_p=(self.dropout.p if self.training else 0.0))\n") in fixed
    before, after = _before_after(tmp_path, ANNOTATED, fixed, "annotated")
    a, b = before.Attention().eval(), after.Attention().eval()
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 10, 16) for _ in range(3))
    mask = (torch.rand(2, 1, 1, 10) > 0.3).long()
    mask[..., 0] = 1  # no row masked everywhere
    for m in (None, mask):
        assert torch.allclose(a(q, k, v, m), b(q, k, v, m), atol=1e-5)


def test_an_added_optional_mask_is_passed_as_it_is():
    source = ANNOTATED.replace("scores.masked_fill(mask == 0, -1e9)", "scores + mask")
    fixed, [finding] = _fix(source, "AX118")
    assert "attn_mask=mask, dropout_p=" in fixed


@pytest.mark.parametrize("old,new", [
    # Guarding something other than the mask: the formula itself is conditional.
    ("        if mask is not None:\n            scores = scores.masked_fill(mask == 0, -1e9)\n",
     "        if self.temperature is not None:\n            scores = scores / self.temperature\n"),
    # An else branch.
    ("            scores = scores.masked_fill(mask == 0, -1e9)\n",
     "            scores = scores.masked_fill(mask == 0, -1e9)\n        else:\n            scores = scores * 1.0\n"),
    # Another test than "is not None".
    ("        if mask is not None:\n", "        if self.causal:\n"),
])
def test_other_conditional_chains_stay_advice(old, new):
    assert old in ANNOTATED
    source = ANNOTATED.replace(old, new)
    fixed, [finding] = _fix(source, "AX118")
    assert not finding.fix.edits and "no automatic fix" in finding.message
    assert fixed == source


def test_scores_reshaped_on_the_way_stay_advice():
    # The mask broadcasts over (batch, heads, ...) only while the scores are viewed 4-D:
    # one SDPA call on the 3-D bmm operands would broadcast it differently.
    source = textwrap.dedent('''\
        import torch
        import torch.nn.functional as F


        class HeadsViewed(torch.nn.Module):
            def forward(self, q, k, v, pad):
                scores = torch.bmm(q, k.transpose(-1, -2)) * self.scale
                scores = scores.view(-1, self.n_heads, scores.size(-2), scores.size(-1))
                scores = scores.masked_fill(pad, torch.finfo(scores.dtype).min)
                probs = F.softmax(scores, dim=-1)
                return torch.bmm(probs.view(-1, probs.size(-2), probs.size(-1)), v)
    ''')
    fixed, [finding] = _fix(source, "AX118")
    assert not finding.fix.edits and fixed == source


SIMPLE = '''\
import math
import torch
import torch.nn.functional as F


def attend(q, k, v):
    att = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    att = att.softmax(dim=-1)
    return att @ v
'''


@pytest.mark.parametrize("old,new,why", [
    # A detach stops the gradient through the weights; SDPA would let it through.
    ("    att = att.softmax(dim=-1)\n", "    att = att.softmax(dim=-1).detach()\n", "detach"),
    # The key written in place between the scores and @ v: the call would read the new values.
    ("    att = att.softmax(dim=-1)\n", "    att = att.softmax(dim=-1)\n    k.mul_(0.5)\n", "in place"),
    # A mask added before the scale is scaled with the scores.
    ("    att = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))\n",
     "    att = (q @ k.transpose(-2, -1) + bias) / math.sqrt(q.size(-1))\n", "mask scaled"),
])
def test_what_sdpa_would_compute_differently_stays_advice(old, new, why):
    assert old in SIMPLE
    source = SIMPLE.replace(old, new).replace("def attend(q, k, v):", "def attend(q, k, v, bias=None):")
    fixed, findings = _fix(source, "AX118")
    assert findings and all(not f.fix.edits for f in findings), why
    assert fixed == source


def test_a_cache_written_between_the_statements_stays_advice():
    source = textwrap.dedent('''\
        import math
        import torch


        class Decoder(torch.nn.Module):
            def forward(self, q, k, v):
                scores = q @ self.k_cache.transpose(-2, -1) / math.sqrt(q.size(-1))
                self.k_cache = torch.cat([self.k_cache[:, :, 1:], k], dim=2)
                w = scores.softmax(dim=-1)
                return w @ v
    ''')
    fixed, [finding] = _fix(source, "AX118")
    assert not finding.fix.edits and fixed == source


def test_dropout_on_the_scores_or_a_module_that_may_be_identity_stays_advice():
    before_softmax = NANOGPT.replace(
        "        att = F.softmax(att, dim=-1)\n        att = self.attn_dropout(att)\n",
        "        att = self.attn_dropout(att)\n        att = F.softmax(att, dim=-1)\n")
    maybe_identity = NANOGPT.replace(
        "        self.attn_dropout = nn.Dropout(dropout)\n",
        "        self.attn_dropout = nn.Dropout(dropout) if dropout else nn.Identity()\n").replace(
        "        self.n_head = n_head\n",
        "        if not dropout:\n            self.attn_dropout = nn.Identity()\n        self.n_head = n_head\n")
    for source in (before_softmax, maybe_identity):
        fixed, [finding] = _fix(source, "AX118")
        assert not finding.fix.edits and fixed == source


def test_a_tensor_scale_goes_on_the_query(tmp_path):
    # SDPA's scale= takes a Python float: a learned temperature multiplies q instead,
    # and keeps its gradient.
    source = textwrap.dedent('''\
        import torch


        class Attn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.temperature = torch.nn.Parameter(torch.tensor([0.3]))

            def forward(self, q, k, v):
                attn = (q @ k.transpose(-2, -1)) * self.temperature
                attn = attn.softmax(dim=-1)
                return attn @ v
    ''')
    fixed, [finding] = _fix(source, "AX118")
    assert ("        return torch.nn.functional.scaled_dot_product_attention(q * self.temperature, k, v, scale=1.0)\n"
            in fixed)
    before, after = _before_after(tmp_path, source, fixed, "temperature")
    a, b = before.Attn(), after.Attn()
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    ya, yb = a(q, k, v), b(q, k, v)
    assert torch.allclose(ya, yb, atol=1e-5)
    ya.sum().backward()
    yb.sum().backward()
    assert torch.allclose(a.temperature.grad, b.temperature.grad, atol=1e-4)


def test_module_level_chains_are_not_deleted():
    # A module's names may be imported by other modules.
    source = ("import math\nimport torch\nq = k = v = torch.randn(2, 4, 4)\n"
              "att = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))\natt = att.softmax(dim=-1)\nout = att @ v\n")
    fixed, [finding] = _fix(source, "AX118")
    assert not finding.fix.edits and fixed == source


def test_blank_lines_inside_the_chain_go_with_it():
    # vit-pytorch's layout: the statements separated by blank lines.
    source = textwrap.dedent('''\
        import torch
        import torch.nn as nn


        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.attend = nn.Softmax(dim=-1)
                self.dropout = nn.Dropout(0.1)

            def forward(self, q, k, v):
                h = q.shape[1]

                dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale

                attn = self.attend(dots)
                attn = self.dropout(attn)

                out = torch.matmul(attn, v)
                return out
    ''')
    fixed, [finding] = _fix(source, "AX118")
    assert fixed.endswith(
        "        h = q.shape[1]\n\n"
        "        out = torch.nn.functional.scaled_dot_product_attention(q * self.scale, k, v, scale=1.0, "
        "dropout_p=(self.dropout.p if self.training else 0.0))\n        return out\n")


@pytest.mark.parametrize("init, expected", [
    # vit-pytorch: a number from a parameter with a number default.
    ("def __init__(self, dim, heads=8, dim_head=64):\n        super().__init__()\n"
     "        self.scale = dim_head ** -0.5", "scaled_dot_product_attention(q, k, v, scale=self.scale)"),
    # timm: through an attribute set from annotated parameters.
    ("def __init__(self, dim: int, num_heads: int = 8):\n        super().__init__()\n"
     "        self.head_dim = dim // num_heads\n        self.scale = self.head_dim ** -0.5",
     "scaled_dot_product_attention(q, k, v, scale=self.scale)"),
    # A learned scale: a tensor, folded into the query.
    ("def __init__(self, dim):\n        super().__init__()\n        self.scale = nn.Parameter(torch.ones(1))",
     "scaled_dot_product_attention(q * self.scale, k, v, scale=1.0)"),
    # Parameters of unknown type: may be tensors, folded.
    ("def __init__(self, dim, heads):\n        super().__init__()\n        self.scale = (dim // heads) ** -0.5",
     "scaled_dot_product_attention(q * self.scale, k, v, scale=1.0)"),
    # Set again outside __init__: folded.
    ("def __init__(self, dim_head=64):\n        super().__init__()\n        self.scale = dim_head ** -0.5\n\n"
     "    def rescale(self, t):\n        self.scale = t", "scaled_dot_product_attention(q * self.scale, k, v, scale=1.0)"),
])
def test_a_scale_the_class_sets_to_a_number_is_passed_as_scale(init, expected):
    source = ("import torch\nimport torch.nn as nn\n\n\nclass Attention(nn.Module):\n    " + init + "\n\n"
              "    def forward(self, q, k, v):\n"
              "        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale\n"
              "        attn = dots.softmax(dim=-1)\n"
              "        return torch.matmul(attn, v)\n")
    fixed, [finding] = _fix(source, "AX118")
    assert f"        return torch.nn.functional.{expected}\n" in fixed, fixed


def test_a_scale_a_subclass_or_another_method_sets_again_is_read_at_run_time(tmp_path):
    # Inlining the 0.25 the base class sets would be wrong for the subclass's 1.0 and
    # for set_temperature; the fixed code must compute what the hand-written one did.
    source = textwrap.dedent('''\
        import torch
        import torch.nn as nn


        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = 0.25

            def forward(self, q, k, v):
                attn = (q @ k.transpose(-2, -1)) * self.scale
                attn = attn.softmax(dim=-1)
                return attn @ v


        class Unscaled(Attention):
            def __init__(self):
                super().__init__()
                self.scale = 1.0


        class Tempered(Attention):
            def set_temperature(self, t):
                self.scale = 0.25 / t
    ''')
    fixed, [finding] = _fix(source, "AX118")
    assert "scale=0.25" not in fixed and "scaled_dot_product_attention(q * self.scale, k, v, scale=1.0)" in fixed
    (tmp_path / "before.py").write_text(source)
    (tmp_path / "after.py").write_text(fixed)
    before, after = _load(tmp_path / "before.py", "before_scale"), _load(tmp_path / "after.py", "after_scale")
    q, k, v = (torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for name in ("Attention", "Unscaled", "Tempered"):
        a, b = getattr(before, name)(), getattr(after, name)()
        if name == "Tempered":
            a.set_temperature(2.0)
            b.set_temperature(2.0)
        torch.testing.assert_close(b(q, k, v), a(q, k, v))


def test_a_key_value_cache_joined_under_a_branch_is_the_inputs_own():
    """k and v joined with a cache under nested ifs: read with the branches skipped the
    attention is found, and the branch is not called a part the replacement leaves out
    (the call reads k and v after it)."""
    source = textwrap.dedent('''\
        import math
        import torch


        def mha(q, k, v, past_key_value=None):
            if past_key_value is not None:
                if len(past_key_value) != 0:
                    k = torch.cat([past_key_value[0], k], dim=3)
                    v = torch.cat([past_key_value[1], v], dim=2)
                past_key_value = (k, v)
            attn_weight = q.matmul(k) * (1 / math.sqrt(q.size(-1)))
            attn_weight = torch.softmax(attn_weight, dim=-1)
            return attn_weight.matmul(v)
    ''')
    _, [finding] = _fix(source, "AX118")
    assert finding.line == 13
    assert "only on some runs" not in finding.message


def test_a_branch_the_formula_leaves_out_is_named_in_the_advice():
    # Read with the branch skipped, the attention is unmasked: the replacement alone
    # would drop causality, so the message says which branch to carry over.
    source = textwrap.dedent('''\
        import torch
        import torch.nn.functional as F


        class Attention(torch.nn.Module):
            def forward(self, q, k, v):
                T = q.size(-2)
                att = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5
                if self.causal:
                    m = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
                    att = att.masked_fill(~m, float("-inf"))
                att = F.softmax(att, dim=-1)
                return att @ v


        class Biased(torch.nn.Module):
            def forward(self, q, k, v, bias=None):
                attn = q @ k.transpose(-2, -1) * self.scale
                if bias is not None:
                    attn = attn + bias
                attn = attn.softmax(dim=-1)
                return attn @ v
    ''')
    fixed, findings = _fix(source, "AX118")
    causal = next(f for f in findings if "Attention.forward" in f.message)
    assert "the code also changes att, m under `if self.causal:` (line 9)" in causal.message
    assert not causal.fix.edits
    biased = next(f for f in findings if "Biased.forward" in f.message)
    assert "the code also changes" not in biased.message  # the guarded mask is in the formula
    # A mask written in place (``att.masked_fill_``) under the branch is named alike.
    in_place = source.replace('att = att.masked_fill(~m, float("-inf"))', 'att.masked_fill_(~m, float("-inf"))')
    _, findings = _fix(in_place, "AX118")
    causal = next(f for f in findings if "Attention.forward" in f.message)
    assert "the code also changes att, m under `if self.causal:` (line 9)" in causal.message


GLU_UNPACKED = '''\
import torch
from torch import nn
import torch.nn.functional as F


class Gate(nn.Module):
    def forward(self, x):
        out, gate = x.chunk(2, dim=1)
        return out * torch.sigmoid(gate)
'''


def test_halves_unpacked_into_two_names_go_with_the_formula(tmp_path):
    fixed, findings = _fix(GLU_UNPACKED, "AX123")
    assert len(findings) == 1 and "also deletes line 8" in findings[0].message
    assert "out, gate" not in fixed and "return F.glu(x, dim=1)" in fixed
    before, after = _before_after(tmp_path, GLU_UNPACKED, fixed, "glu_unpacked")
    x = torch.randn(3, 8)
    assert torch.equal(before.Gate()(x), after.Gate()(x))


def test_an_unpacking_whose_half_is_read_again_stays():
    source = GLU_UNPACKED.replace("        return out * torch.sigmoid(gate)\n",
                                  "        y = out * torch.sigmoid(gate)\n        return y + gate\n")
    fixed, findings = _fix(source, "AX123")
    assert len(findings) == 1 and "no automatic fix" in findings[0].message
    assert fixed == source


RMS_CAST_LAST = '''\
import torch
from torch import nn


class RMSNorm(nn.Module):
    def forward(self, x):
        t, dtype = x.float(), x.dtype
        t = t * torch.rsqrt(torch.mean(t**2, dim=-1, keepdim=True) + self.eps)
        return (t * self.scale).to(dtype)
'''


def test_a_norm_whose_weighted_result_is_cast_back_is_advice():
    """gpt-oss's RMSNorm casts after its weight: F.rms_norm(x) * self.scale would come
    out in the product's dtype, not x's, so the fix is left to the user."""
    fixed, findings = _fix(RMS_CAST_LAST, "AX115")
    assert len(findings) == 1 and "casts the weighted result back" in findings[0].message
    assert fixed == RMS_CAST_LAST
    llama = RMS_CAST_LAST.replace("(t * self.scale).to(dtype)", "t.to(dtype) * self.weight")
    fixed, findings = _fix(llama, "AX115")
    assert "rms_norm(x, (x.shape[-1],), self.weight, self.eps)" in fixed and "t, dtype" not in fixed
