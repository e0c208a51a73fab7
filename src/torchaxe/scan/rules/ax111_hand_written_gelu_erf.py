"""AX111: exact (erf) GELU computed by hand, recognised by its values."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import FormulaRule, Proposal, exact, functional
from torchaxe.scan.rules.ax110_hand_written_gelu_tanh import FAST_GELU_NOTE
from torchaxe.scan.rules.base import Invalid, Valid


class HandWrittenGeluErf(FormulaRule):
    """
    ## What it does
    Flags code that computes the exact GELU, `x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))`,
    with elementary tensor operations (`torch.erf`, `torch.erfc`,
    `torch.special.ndtr`, in any arrangement), recognised by its values on random
    inputs rather than by its name.

    ## Why is this bad?
    The written-out form runs five or six elementwise kernels forward and as many
    backward, each reading and writing the whole tensor; `F.gelu(x)` is one fused
    kernel that computes the same function.

    ## Example
    ```python
    def gelu(x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    ```

    ## Use instead
    ```python
    def gelu(x):
        return F.gelu(x)                 # cpu, cuda
        return torch_npu.fast_gelu(x)    # npu: a different approximation
    ```

    ## Fix safety
    Safe on cpu and cuda: `F.gelu(x)` is the same function. On npu the fix to
    `torch_npu.fast_gelu` is unsafe: fast_gelu computes `x * sigmoid(1.702 * x)`, an
    approximation that differs from the exact GELU by up to 0.02; unverified on Ascend
    hardware. A formula assembled from several statements gets an unsafe fix that also deletes
    those statements when nothing else reads what they compute and no input is
    reassigned in between; otherwise it is reported without a fix.
    """

    code = "AX111"
    name = "hand-written-gelu-erf"
    category = "gelu_erf"
    label = "exact (erf) GELU"
    message = "exact GELU computed by hand instead of F.gelu"
    fix_title = "use F.gelu(x)"
    fix_safety = Applicability.SAFE
    safety_by_target = {"cpu": Applicability.SAFE, "cuda": Applicability.SAFE, "npu": Applicability.UNSAFE}
    requires_text = ("erf(", "erfc(", "ndtr(")
    references = (
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.gelu.html",
        "https://www.hiascend.com/document (torch_npu.fast_gelu)",
    )
    examples = (
        Invalid(
            "import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef gelu(x):\n"
            "    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))\n",
            fixed="import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef gelu(x):\n"
            "    return F.gelu(x)\n", lines=(7,),
        ),
        Invalid(
            "import torch\nfrom torch.nn import functional as fn\n\n\nclass GELU(torch.nn.Module):\n"
            "    def forward(self, hidden):\n        return hidden * torch.special.ndtr(hidden)\n",
            target="cuda",
            fixed="import torch\nfrom torch.nn import functional as fn\n\n\nclass GELU(torch.nn.Module):\n"
            "    def forward(self, hidden):\n        return fn.gelu(hidden)\n", lines=(7,),
        ),
        Invalid(
            "import torch\ndef gelu(x):\n    return 0.5 * x * torch.erfc(-x * 0.7071067811865476)\n",
            target="npu",
            fixed="import torch\nimport torch_npu\ndef gelu(x):\n    return torch_npu.fast_gelu(x)\n", lines=(3,),
        ),
        Valid("import torch.nn.functional as F\ndef gelu(x):\n    return F.gelu(x)\n"),
        Valid("import math, torch\ndef wrong(x):\n    return 0.5 * x * (1.0 + torch.erf(x / 2.0))\n"),
        Valid("import math, torch\ndef cdf(x):\n    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))\n"),
    )

    def propose(self, ctx, match):
        x = match.inputs["x"]
        fn, imports = functional(ctx, match.node.lineno)
        keep = f"{fn}.gelu({x})"
        if ctx.target == "npu":
            return Proposal(f"torch_npu.fast_gelu({x})", FAST_GELU_NOTE.format(x=x, keep=keep),
                            "use torch_npu.fast_gelu (a different approximation)", Applicability.UNSAFE,
                            imports=("import torch_npu",))
        safe = exact(match)
        note = f"{keep} computes it in one fused kernel, forward and backward"
        if not safe:
            note += f" (the hand-written constants differ from the exact ones: max relative difference {match.max_rel:.1e})"
        return Proposal(keep, note, "use F.gelu(x)", Applicability.SAFE if safe else Applicability.UNSAFE,
                        imports=imports)
