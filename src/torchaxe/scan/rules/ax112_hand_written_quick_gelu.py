"""AX112: quick GELU, x * sigmoid(1.702 * x), computed by hand on an Ascend NPU."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import FormulaRule, Proposal
from torchaxe.scan.rules.base import Invalid, Valid


class HandWrittenQuickGelu(FormulaRule):
    """
    ## What it does
    On the `npu` target, flags code that computes the "quick GELU" of CLIP-style
    models, `x * sigmoid(1.702 * x)`, with elementary tensor operations (a sigmoid, or
    `x / (1 + exp(-1.702 * x))`), recognised by its values on random inputs.

    ## Why is this bad?
    The written-out form runs three elementwise kernels forward and more backward.
    `torch_npu.fast_gelu` is the NPU affinity operator for exactly this function: its
    documented formula, `x / (1 + exp(-1.702 |x|)) * exp(0.851 (x - |x|))`, equals
    `x * sigmoid(1.702 * x)`. torch has no fused kernel for it on cpu or cuda (only
    `torch.compile` fuses it), so other targets report nothing.

    ## Example
    ```python
    def quick_gelu(x):
        return x * torch.sigmoid(1.702 * x)
    ```

    ## Use instead
    ```python
    def quick_gelu(x):
        return torch_npu.fast_gelu(x)
    ```

    ## Fix safety
    Unsafe: the documented formula is the same function, so only rounding should
    differ, but the replacement is unverified on Ascend hardware. A formula assembled from several statements gets an unsafe fix that also deletes
    those statements when nothing else reads what they compute and no input is
    reassigned in between; otherwise it is reported without a fix.
    """

    code = "AX112"
    name = "hand-written-quick-gelu"
    category = "quick_gelu"
    label = "quick GELU (x * sigmoid(1.702 * x))"
    message = "quick GELU computed by hand; torch_npu.fast_gelu computes the same function"
    fix_title = "use torch_npu.fast_gelu"
    fix_safety = Applicability.UNSAFE
    safety_by_target = {"npu": Applicability.UNSAFE}
    targets = ("npu",)
    requires_text = ("sigmoid(", "torch.exp(", ".exp()", "tanh(")
    references = (
        "https://www.hiascend.com/document (torch_npu.fast_gelu, npu_fast_gelu: formula)",
    )
    examples = (
        Invalid(
            "import torch\n\n\nclass QuickGELU(torch.nn.Module):\n    def forward(self, x):\n"
            "        return x * torch.sigmoid(1.702 * x)\n",
            target="npu",
            fixed="import torch\nimport torch_npu\n\n\nclass QuickGELU(torch.nn.Module):\n    def forward(self, x):\n"
            "        return torch_npu.fast_gelu(x)\n", lines=(6,),
        ),
        Invalid("import torch\ndef act(x):\n    return x / (1.0 + torch.exp(-1.702 * x))\n", target="npu",
                fixed="import torch\nimport torch_npu\ndef act(x):\n    return torch_npu.fast_gelu(x)\n", lines=(3,)),
        Valid("import torch\ndef act(x):\n    return x * torch.sigmoid(1.702 * x)\n", target="cuda"),
        Valid("import torch\ndef act(x):\n    return x * torch.sigmoid(1.5 * x)\n", target="npu"),
        Valid("import torch\ndef act(x, y):\n    return x * torch.sigmoid(1.702 * y)\n", target="npu"),
    )

    def propose(self, ctx, match):
        x = match.inputs["x"]
        return Proposal(
            f"torch_npu.fast_gelu({x})",
            f"torch_npu.fast_gelu({x}) computes the same function in one fused kernel (its documented formula is "
            "x / (1 + exp(-1.702|x|)) * exp(0.851(x - |x|)) = x * sigmoid(1.702x))",
            "use torch_npu.fast_gelu",
            Applicability.UNSAFE,
            imports=("import torch_npu",),
        )
