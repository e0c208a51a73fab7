"""AX114: SwiGLU, silu(a) * b, computed from separate kernels on an Ascend NPU."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import FormulaRule, Proposal
from torchaxe.scan.rules.base import Invalid, Valid


class HandWrittenSwiglu(FormulaRule):
    """
    ## What it does
    On the `npu` target, flags a SwiGLU gate, `silu(a) * b`, computed from separate
    operators: `F.silu(gate) * up`, a hand-written `a * sigmoid(a) * b`, and the
    one-tensor forms that split a projection in two (`x.chunk(2, -1)`, `x.split(h, -1)`,
    `x[..., :h]` / `x[..., h:]`). The SiLU may be a module attribute
    (`self.act_fn(gate) * up`) when `__init__` sets it once, unconditionally, to
    `nn.SiLU()`, `F.silu` or `ACT2FN["silu"]`; an activation chosen at run time
    (`ACT2FN[config.hidden_act]`, `act_layer()`) is not assumed. Recognised by its values
    on random inputs.

    ## Why is this bad?
    The gate runs a SiLU kernel and a multiplication (and a split) each reading and
    writing the full intermediate activation of the MLP, the largest tensor of a
    transformer block. `torch_npu.npu_swiglu(x, dim=-1)` computes `silu(A) * B` for the
    two halves A, B of `x` in one kernel. torch has no fused SwiGLU on cpu or cuda, so
    other targets report nothing (a hand-written SiLU inside is still reported by
    AX113).

    ## Example
    ```python
    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
    ```

    ## Use instead
    ```python
    def forward(self, x):
        return self.w2(torch_npu.npu_swiglu(self.w13(x), dim=-1))
    ```

    ## Fix safety
    Unsafe, and offered only when the split and the gate are one expression over one
    tensor: `npu_swiglu` computes the same formula, but it is unverified on Ascend
    hardware. With two separate projections (`F.silu(self.w1(x)) * self.w3(x)`) the
    finding is advice: merge the projections into one linear layer whose output
    `npu_swiglu` splits.

    ## References
    - https://www.hiascend.com/document (torch_npu.npu_swiglu)
    """

    code = "AX114"
    name = "hand-written-swiglu"
    category = "swiglu"
    label = "SwiGLU gate (silu(a) * b)"
    message = "SwiGLU computed from separate kernels; torch_npu.npu_swiglu fuses it"
    fix_title = "use torch_npu.npu_swiglu(x, dim=-1)"
    fix_safety = Applicability.UNSAFE
    safety_by_target = {"npu": Applicability.UNSAFE}
    targets = ("npu",)
    requires_text = ("silu(", "sigmoid(", "torch.exp(", ".exp()", "SiLU(", ".silu", "ACT2FN", "get_activation(")
    references = ("https://www.hiascend.com/document (torch_npu.npu_swiglu)",)
    examples = (
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n\ndef swiglu(x):\n"
            "    return F.silu(x.chunk(2, dim=-1)[0]) * x.chunk(2, dim=-1)[1]\n",
            target="npu",
            fixed="import torch\nimport torch.nn.functional as F\nimport torch_npu\n\n\ndef swiglu(x):\n"
            "    return torch_npu.npu_swiglu(x, dim=-1)\n",
        ),
        Invalid(
            "import torch.nn.functional as F\n\n\ndef swiglu(x):\n    a, b = x.chunk(2, dim=-1)\n"
            "    return F.silu(a) * b\n",
            target="npu",
        ),
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n\nclass MLP(torch.nn.Module):\n"
            "    def forward(self, x):\n        return self.w2(F.silu(self.w1(x)) * self.w3(x))\n",
            target="npu",
        ),
        Invalid(
            "import torch\n\n\ndef swiglu(x):\n    h = x.shape[-1] // 2\n    a, b = x[..., :h], x[..., h:]\n"
            "    return a * torch.sigmoid(a) * b\n",
            target="npu",
        ),
        Valid("import torch.nn.functional as F\ndef swiglu(x):\n    a, b = x.chunk(2, dim=-1)\n    return F.silu(a) * b\n",
              target="cuda"),
        Valid("import torch.nn.functional as F\ndef geglu(x):\n    a, b = x.chunk(2, dim=-1)\n    return F.gelu(a) * b\n",
              target="npu"),
        Valid("import torch_npu\ndef swiglu(x):\n    return torch_npu.npu_swiglu(x, dim=-1)\n", target="npu"),
    )

    def propose(self, ctx, match):
        a, b, z = match.inputs.get("a"), match.inputs.get("b"), match.inputs.get("z")
        if match.params.get("single_input") and z:
            return Proposal(
                f"torch_npu.npu_swiglu({z}, dim=-1)",
                f"torch_npu.npu_swiglu({z}, dim=-1) splits {z} and computes silu(first half) * second half in one "
                "kernel",
                "use torch_npu.npu_swiglu(x, dim=-1)",
                Applicability.UNSAFE,
                imports=("import torch_npu",),
            )
        return Proposal(
            f"torch_npu.npu_swiglu(torch.cat(({a}, {b}), -1), dim=-1)",
            f"fuse the two projections that produce {a} and {b} into one linear layer and call "
            "torch_npu.npu_swiglu(its output, dim=-1), which computes silu(first half) * second half in one kernel",
            "merge the projections and use torch_npu.npu_swiglu",
            Applicability.DISPLAY_ONLY,
            edit=False,
        )
