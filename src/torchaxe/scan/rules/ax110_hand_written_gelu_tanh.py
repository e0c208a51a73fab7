"""AX110: the tanh approximation of GELU computed by hand, recognised by its values."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import FormulaRule, Proposal, exact, functional
from torchaxe.scan.rules.base import Invalid, Valid

FAST_GELU_NOTE = (
    "torch_npu.fast_gelu({x}) is the NPU affinity operator, but it computes x*sigmoid(1.702*x) (its documented "
    "formula), a different, sigmoid-based approximation that differs from GELU by up to 0.02: verify accuracy, "
    "or keep these numerics with {keep}"
)


class HandWrittenGeluTanh(FormulaRule):
    """
    ## What it does
    Flags code that computes the tanh approximation of GELU,
    `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`, with elementary tensor
    operations: in any spelling (`math.sqrt(2 / math.pi)` or `0.7978845608`,
    `torch.pow(x, 3)`, `x ** 3` or `x * x * x`, spread over local variables, in a
    function, a method, `forward` or a lambda). The expression is recognised by
    evaluating it on random inputs and comparing with the reference, not by its name.

    ## Why is this bad?
    Written out, the activation runs as about ten elementwise kernels, each reading and
    writing the whole activation tensor, forward and backward, and keeps their
    intermediates for the backward pass. `F.gelu(x, approximate="tanh")` is one fused
    kernel (about 5x faster on a CPU for a 4096x4096 tensor).

    ## Example
    ```python
    def gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))
    ```

    ## Use instead
    ```python
    def gelu(x):
        return F.gelu(x, approximate="tanh")      # cpu, cuda
        return torch_npu.fast_gelu(x)             # npu: a different approximation
    ```

    ## Fix safety
    On cpu and cuda the fix is safe: `F.gelu(x, approximate="tanh")` computes the same
    formula (when the hand-written constants are exact to float32 precision; truncated
    constants make it unsafe, and the message gives the difference). On npu the fix to
    `torch_npu.fast_gelu` is unsafe: fast_gelu computes `x * sigmoid(1.702 * x)`, a
    different sigmoid-based approximation of GELU, so outputs change by up to 0.02; it
    is unverified on Ascend hardware. A formula assembled from several statements gets an unsafe fix that also deletes
    those statements when nothing else reads what they compute and no input is
    reassigned in between; otherwise it is reported without a fix.
    """

    code = "AX110"
    name = "hand-written-gelu-tanh"
    category = "gelu_tanh"
    label = "tanh-approximation GELU"
    message = "tanh-approximation GELU computed by hand instead of F.gelu(approximate='tanh')"
    fix_title = 'use F.gelu(x, approximate="tanh")'
    fix_safety = Applicability.SAFE
    safety_by_target = {"cpu": Applicability.SAFE, "cuda": Applicability.SAFE, "npu": Applicability.UNSAFE}
    requires_text = ("tanh(", "sigmoid(", "torch.exp(", ".exp()")
    references = (
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.gelu.html",
        "https://www.hiascend.com/document (torch_npu.fast_gelu)",
    )
    examples = (
        Invalid(
            "import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef gelu(x):\n"
            "    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))\n",
            fixed="import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef gelu(x):\n"
            '    return F.gelu(x, approximate="tanh")\n', lines=(7,),
        ),
        Invalid(
            "import torch\n\n\nclass NewGELU(torch.nn.Module):\n    def forward(self, h):\n"
            "        inner = 0.7978845608 * (h + 0.044715 * h * h * h)\n"
            "        return 0.5 * h * (1.0 + torch.tanh(inner))\n",
            target="cuda",
            fixed="import torch\n\n\nclass NewGELU(torch.nn.Module):\n    def forward(self, h):\n"
            "        return torch.nn.functional.gelu(h, approximate=\"tanh\")\n", lines=(7,),
        ),
        Invalid(
            "import torch\nact = lambda t: t * 0.5 * (1 + torch.tanh(0.79788456 * (t + 0.044715 * t ** 3)))\n",
            fixed='import torch\nact = lambda t: torch.nn.functional.gelu(t, approximate="tanh")\n', lines=(2,),
        ),
        Invalid(
            "import math, torch\ndef gelu(x):\n"
            "    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))\n",
            target="npu",
            fixed="import math, torch\nimport torch_npu\ndef gelu(x):\n    return torch_npu.fast_gelu(x)\n", lines=(3,),
        ),
        Valid("import torch.nn.functional as F\ndef gelu(x):\n    return F.gelu(x, approximate='tanh')\n"),
        Valid(
            "import math, torch\ndef not_gelu(x):\n"
            "    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.44715 * x ** 3)))\n"
        ),
        Valid("import math, torch\ndef erf_gelu(x):\n    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))\n"),
        Valid("import torch\ndef f(x, y):\n    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (y + 0.044715 * y ** 3)))\n"),
    )

    def propose(self, ctx, match):
        x = match.inputs["x"]
        fn, imports = functional(ctx, match.node.lineno)
        keep = f'{fn}.gelu({x}, approximate="tanh")'
        if ctx.target == "npu":
            return Proposal(
                f"torch_npu.fast_gelu({x})",
                FAST_GELU_NOTE.format(x=x, keep=keep),
                "use torch_npu.fast_gelu (a different approximation)",
                Applicability.UNSAFE,
                imports=("import torch_npu",),
            )
        safe = exact(match)
        note = f"{keep} computes it in one fused kernel, forward and backward"
        if not safe:
            note += f" (the hand-written constants differ from the exact ones: max relative difference {match.max_rel:.1e})"
        return Proposal(keep, note, 'use F.gelu(x, approximate="tanh")',
                        Applicability.SAFE if safe else Applicability.UNSAFE, imports=imports)
