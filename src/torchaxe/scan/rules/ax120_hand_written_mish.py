"""AX120: Mish, x * tanh(softplus(x)), computed by hand."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import FormulaRule, fused_activation
from torchaxe.scan.rules.base import Invalid, Valid


class HandWrittenMish(FormulaRule):
    """
    ## What it does
    Flags code that computes Mish, `x * tanh(softplus(x))`, with elementary tensor
    operations: `x * torch.tanh(F.softplus(x))`, `x.mul(F.softplus(x).tanh())`,
    `x * torch.tanh(torch.log1p(torch.exp(x)))`, recognised by its values on random
    inputs (YOLO-style detectors and CSPNet backbones use it). Only the same input may
    go in both places.

    ## Why is this bad?
    The written-out form runs three elementwise kernels forward (softplus, tanh, the
    product) and more backward, keeping two intermediate tensors alive for the
    backward pass; `F.mish` is one kernel each way. On a 2-core CPU, forward and
    backward together measured 1.2-1.6x faster with `F.mish` on convolution-sized
    activations and slower on small ones (64 x 1024): `advise` measures it on the
    user's run before choosing it.

    ## Example
    ```python
    class Mish(nn.Module):
        def forward(self, x):
            return x * torch.tanh(F.softplus(x))
    ```

    ## Use instead
    ```python
    class Mish(nn.Module):
        def forward(self, x):
            return F.mish(x)
    ```

    ## Fix safety
    Safe: `F.mish` computes the same function (rounding differs in the last bits). On
    npu, torch_npu documents `torch_npu.npu_mish` as deprecated in favour of
    `F.mish`, which runs the NPU's own Mish kernel. A formula inside a custom
    `torch.autograd.Function`'s `forward` keeps that Function's hand-written backward.
    A formula assembled from several statements gets an unsafe fix that also deletes
    those statements when nothing else reads what they compute and no input is
    reassigned in between; otherwise it is reported without a fix.
    """

    code = "AX120"
    name = "hand-written-mish"
    category = "mish"
    label = "Mish (x * tanh(softplus(x)))"
    message = "Mish computed by hand instead of F.mish"
    fix_title = "use F.mish(x)"
    fix_safety = Applicability.SAFE
    safety_by_target = {"cpu": Applicability.SAFE, "cuda": Applicability.SAFE, "npu": Applicability.SAFE}
    inplace_argument = True
    requires_text = ("tanh(",)
    references = ("https://pytorch.org/docs/stable/generated/torch.nn.functional.mish.html",
                  "https://www.hiascend.com/document/detail/zh/Pytorch/60RC3/apiref/apilist/ptaoplist_000421.html")
    examples = (
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n\nclass Mish(torch.nn.Module):\n"
            "    def forward(self, x):\n        return x * torch.tanh(F.softplus(x))\n",
            fixed="import torch\nimport torch.nn.functional as F\n\n\nclass Mish(torch.nn.Module):\n"
            "    def forward(self, x):\n        return F.mish(x)\n", lines=(7,),
        ),
        Invalid(
            "import torch\n\n\ndef mish(h):\n    return h * torch.tanh(torch.log1p(torch.exp(h)))\n",
            target="cuda",
            fixed="import torch\n\n\ndef mish(h):\n    return torch.nn.functional.mish(h)\n", lines=(5,),
        ),
        Invalid(
            "import torch\nfrom torch.nn import functional as F\n\n\ndef mish(x):\n"
            "    return x.mul(F.softplus(x).tanh())\n",
            target="npu",
            fixed="import torch\nfrom torch.nn import functional as F\n\n\ndef mish(x):\n    return F.mish(x)\n", lines=(6,),
        ),
        Valid("import torch\nimport torch.nn.functional as F\ndef gate(x, y):\n    return x * torch.tanh(F.softplus(y))\n"),
        Valid("import torch\ndef tanh_gate(x):\n    return x * torch.tanh(x)\n"),
        Valid("import torch.nn.functional as F\ndef mish(x):\n    return F.mish(x)\n"),
    )

    def propose(self, ctx, match):
        return fused_activation(ctx, match, "mish")
