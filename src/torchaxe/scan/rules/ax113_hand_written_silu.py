"""AX113: SiLU (swish), x * sigmoid(x), computed by hand."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import FormulaRule, fused_activation
from torchaxe.scan.rules.base import Invalid, Valid


class HandWrittenSilu(FormulaRule):
    """
    ## What it does
    Flags code that computes SiLU (swish), `x * sigmoid(x)`, with elementary tensor
    operations: `x * torch.sigmoid(x)`, `x / (1 + torch.exp(-x))`,
    `0.5 * x * (1 + tanh(x / 2))`, recognised by its values on random inputs. Only the
    same input may go in both places: `x * sigmoid(y)` with `y` another tensor is a
    gate, not a SiLU.

    ## Why is this bad?
    The written-out form runs two or three elementwise kernels forward and more
    backward, and keeps the sigmoid's output alive for the backward pass; `F.silu` is
    one fused kernel on every device.

    ## Example
    ```python
    def swish(x):
        return x * torch.sigmoid(x)
    ```

    ## Use instead
    ```python
    def swish(x):
        return F.silu(x)
    ```

    ## Fix safety
    Safe: `F.silu` computes the same function (rounding differs in the last bits). On
    npu, `F.silu` runs the NPU's own SiLU kernel. A formula assembled from several statements gets an unsafe fix that also deletes
    those statements when nothing else reads what they compute and no input is
    reassigned in between; otherwise it is reported without a fix.
    """

    code = "AX113"
    name = "hand-written-silu"
    category = "silu"
    label = "SiLU (x * sigmoid(x))"
    message = "SiLU computed by hand instead of F.silu"
    fix_title = "use F.silu(x)"
    fix_safety = Applicability.SAFE
    safety_by_target = {"cpu": Applicability.SAFE, "cuda": Applicability.SAFE, "npu": Applicability.SAFE}
    inplace_argument = True
    requires_text = ("sigmoid(", "torch.exp(", ".exp()", "tanh(")
    references = ("https://pytorch.org/docs/stable/generated/torch.nn.functional.silu.html",)
    examples = (
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n\ndef swish(x):\n    return x * torch.sigmoid(x)\n",
            fixed="import torch\nimport torch.nn.functional as F\n\n\ndef swish(x):\n    return F.silu(x)\n", lines=(6,),
        ),
        Invalid(
            "import torch\n\n\nclass Swish(torch.nn.Module):\n    def forward(self, x):\n"
            "        return x / (1 + torch.exp(-x))\n",
            target="npu",
            fixed="import torch\n\n\nclass Swish(torch.nn.Module):\n    def forward(self, x):\n"
            "        return torch.nn.functional.silu(x)\n", lines=(6,),
        ),
        Invalid(
            "from torch import sigmoid\n\n\ndef swish(h):\n    return h * sigmoid(h)\n",
            target="cuda",
            fixed="from torch import sigmoid\nimport torch.nn.functional as F\n\n\ndef swish(h):\n    return F.silu(h)\n", lines=(5,),
        ),
        Invalid(
            "import torch\n\n\ndef swish(x, inplace=False):\n"
            "    return x.mul_(x.sigmoid()) if inplace else x.mul(x.sigmoid())\n",
            fixed="import torch\n\n\ndef swish(x, inplace=False):\n"
            "    return torch.nn.functional.silu(x, inplace=True) if inplace else x.mul(x.sigmoid())\n", lines=(5,),
        ),
        Valid("import torch\ndef gate(x, y):\n    return x * torch.sigmoid(y)\n"),
        Valid("import torch.nn.functional as F\ndef swish(x):\n    return F.silu(x)\n"),
        Valid("import torch\ndef glu(x):\n    a, b = x.chunk(2, -1)\n    return a * torch.sigmoid(b)\n"),
    )

    def propose(self, ctx, match):
        return fused_activation(ctx, match, "silu")
