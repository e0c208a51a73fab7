"""AX119: rotary position embedding applied by hand on an Ascend NPU."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import FormulaRule, Proposal, atom
from torchaxe.scan.rules.base import Invalid, Valid


class HandWrittenRotary(FormulaRule):
    """
    ## What it does
    On the `npu` target, flags rotary position embedding applied by hand:
    `x * cos + rotate_half(x) * sin` (the Hugging Face form, with `rotate_half`
    inlined from the same file), the interleaved GPT-J form, the complex-multiply form
    (`view_as_complex(x.reshape(..., -1, 2)) * freqs_cis`) and the split-halves form,
    however the code spells them: applied to q and k through `map(lambda t: ..., (q, k))`
    or a comprehension, with pairs regrouped by einops' `rearrange`, or with the even and
    odd lanes written into a new tensor (`out = torch.empty_like(x); out[..., 0::2] =
    ...`). Recognised by its values: the expression must be linear in `x` with a
    per-element cos and sin and a half or interleaved rotation, which are solved for
    from a few evaluations, and both members of each pair must turn by one angle (a
    reflection, a shear, a boost or a symmetric mix of pairs does not count; a sign kept
    in the stored sine table counts in a function named like a rotary).

    ## Why is this bad?
    Each application runs five to eight kernels (slices, negation, concatenation, two
    products, a sum) on the query and key tensors of every layer, forward and backward.
    `torch_npu.npu_rotary_mul(x, r1, r2)` computes `x * r1 + rotate_half(x) * r2` in
    one kernel. torch has no fused rotary embedding on cpu or cuda, so other targets
    report nothing.

    ## Example
    ```python
    def apply_rotary_pos_emb(q, k, cos, sin):
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
    ```

    ## Use instead
    ```python
    def apply_rotary_pos_emb(q, k, cos, sin):
        return torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)
    ```

    ## Fix safety
    Unsafe, and offered only for the rotate-half form written in one expression with
    its cos and sin: `npu_rotary_mul` computes the same formula but needs 4-D inputs
    with cos/sin broadcastable as [1, S, 1, D], [1, 1, S, D] or [S, 1, 1, D] and has
    limits on D; unverified on Ascend hardware. The interleaved and complex forms need
    cos and sin rebuilt (repeat-interleaved real and imaginary parts; recent torch_npu
    versions take `rotary_mode="interleave"`), so they are advice.
    """

    code = "AX119"
    name = "hand-written-rotary-embedding"
    category = "rotary"
    label = "rotary position embedding"
    message = "rotary position embedding applied by hand; torch_npu.npu_rotary_mul fuses it"
    fix_title = "use torch_npu.npu_rotary_mul"
    fix_safety = Applicability.UNSAFE
    safety_by_target = {"npu": Applicability.UNSAFE}
    targets = ("npu",)
    requires_text = ("cat(", "stack(", "view_as_complex(", "concat(", "empty_like(", "zeros_like(", "flip(")
    references = ("https://www.hiascend.com/document (torch_npu.npu_rotary_mul)",)
    examples = (
        Invalid(
            "import torch\n\n\ndef rotate_half(x):\n    x1 = x[..., : x.shape[-1] // 2]\n"
            "    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x2, x1), dim=-1)\n\n\n"
            "def apply_rotary_pos_emb(q, k, cos, sin):\n"
            "    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)\n",
            target="npu",
            fixed="import torch\nimport torch_npu\n\n\ndef rotate_half(x):\n    x1 = x[..., : x.shape[-1] // 2]\n"
            "    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x2, x1), dim=-1)\n\n\n"
            "def apply_rotary_pos_emb(q, k, cos, sin):\n"
            "    return torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)\n", lines=(11, 11),
        ),
        Invalid(
            "import torch\n\n\ndef apply_rotary_emb(xq, freqs_cis):\n"
            "    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))\n"
            "    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)\n",
            target="npu", lines=(6,),
        ),
        Invalid(
            "import torch\n\n\ndef rope(x, cos, sin):\n    x1, x2 = x.chunk(2, dim=-1)\n"
            "    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)\n",
            target="npu", lines=(6,),
        ),
        Valid(
            "import torch\n\n\ndef rotate_half(x):\n    x1, x2 = x.chunk(2, dim=-1)\n    return torch.cat((-x2, x1), dim=-1)\n\n\n"
            "def apply(q, cos, sin):\n    return q * cos + rotate_half(q) * sin\n",
            target="cuda",
        ),
        Valid("import torch\ndef mix(x, a, b):\n    return x * a + torch.cat((x, x), -1)[..., : x.shape[-1]] * b\n", target="npu"),
        Valid("import torch_npu\ndef rope(q, cos, sin):\n    return torch_npu.npu_rotary_mul(q, cos, sin)\n", target="npu"),
    )

    def propose(self, ctx, match):
        x, cos, sin = match.inputs["x"], match.inputs.get("cos"), match.inputs.get("sin")
        if match.params.get("sign_folded"):
            replacement = 'torch_npu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")' if (
                match.params.get("mode") != "half") else "torch_npu.npu_rotary_mul(x, cos, sin)"
            return Proposal(replacement, f"{replacement} computes the rotation in one kernel, with cos and sin "
                            f"rebuilt as tables (here the rotation's sign is kept in {sin or 'the sine table'}, "
                            "and pairs are swapped without negation)",
                            "use torch_npu.npu_rotary_mul", Applicability.DISPLAY_ONLY, edit=False)
        if match.params.get("sin_negated") and sin:
            sin = f"-{sin}" if sin.isidentifier() else f"-({sin})"  # a rotation by -theta
        if match.params.get("half_tables") and cos and sin:
            # Tables as wide as one member of each pair: widened to the full width.
            if match.params.get("mode") == "half":
                cos, sin = (f"torch.cat(({t}, {t}), dim=-1)" for t in (cos, sin))
                mode = ""
            else:
                cos, sin = (f"{atom(t)}.repeat_interleave(2, dim=-1)" for t in (cos, sin))
                mode = ', rotary_mode="interleave"'
            replacement = f"torch_npu.npu_rotary_mul({x}, {cos}, {sin}{mode})"
            return Proposal(
                replacement,
                f"{replacement} computes the rotation in one kernel, with the code's half-width cos and sin tables "
                "widened to the full width (build them once, where the tables are made)"
                + ("; the code rotates by -theta: the sine enters negated" if match.params.get("sin_negated") else ""),
                "use torch_npu.npu_rotary_mul", Applicability.DISPLAY_ONLY, edit=False)
        if match.params.get("mode") == "half" and cos and sin:
            replacement = f"torch_npu.npu_rotary_mul({x}, {cos}, {sin})"
            return Proposal(
                replacement,
                f"{replacement} computes x * cos + rotate_half(x) * sin in one kernel (it needs 4-D x, e.g. "
                "[B, N, S, D], and cos/sin broadcastable as [1, 1, S, D] or [1, S, 1, D])",
                "use torch_npu.npu_rotary_mul", Applicability.UNSAFE, imports=("import torch_npu",),
            )
        if match.params.get("mode") == "half":
            replacement = f"torch_npu.npu_rotary_mul({x}, cos, sin)"
            note = (f"{replacement} computes x * cos + rotate_half(x) * sin in one kernel, with cos and sin the "
                    "full-width (duplicated halves) rotation tensors")
        else:
            replacement = f'torch_npu.npu_rotary_mul({x}, cos, sin, rotary_mode="interleave")'
            note = (f"{replacement} computes the interleaved rotation in one kernel (recent torch_npu versions), with "
                    "cos and sin repeat-interleaved to the full width (for the complex form, the real and imaginary "
                    "parts of freqs_cis)")
        return Proposal(replacement, note, "use torch_npu.npu_rotary_mul", Applicability.DISPLAY_ONLY, edit=False)
