"""AX117: softmax computed by hand from exp and sum."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import FormulaRule, Proposal, exact, torch_name
from torchaxe.scan.rules.base import Invalid, Valid


class HandWrittenSoftmax(FormulaRule):
    """
    ## What it does
    Flags softmax written out: `exp(x - max) / sum(exp(x - max))`, with or without the
    max subtraction, `exp(x - logsumexp(x))`, over any dimension. Recognised by its
    values on random inputs (including large ones).

    ## Why is this bad?
    The written-out form makes four passes over the tensor (max, subtract and exp,
    sum, divide) and keeps the exponentials for the backward pass. `torch.softmax` is
    one fused kernel, and it is numerically safe where a form without the max
    subtraction overflows.

    ## Example
    ```python
    def softmax(x):
        e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        return e / e.sum(dim=-1, keepdim=True)
    ```

    ## Use instead
    ```python
    def softmax(x):
        return torch.softmax(x, dim=-1)
    ```

    ## Fix safety
    Safe: `torch.softmax` computes the same function (rounding differs in the last
    bits). A formula assembled from several statements gets an unsafe fix that also deletes
    those statements when nothing else reads what they compute and no input is
    reassigned in between; otherwise it is reported without a fix.
    """

    code = "AX117"
    name = "hand-written-softmax"
    category = "softmax"
    label = "softmax"
    message = "softmax computed by hand from exp and sum"
    fix_title = "use torch.softmax"
    fix_safety = Applicability.SAFE
    safety_by_target = {"cpu": Applicability.SAFE, "cuda": Applicability.SAFE, "npu": Applicability.SAFE}
    requires_text = ("torch.exp(", ".exp()")
    references = ("https://pytorch.org/docs/stable/generated/torch.nn.functional.softmax.html",)
    examples = (
        Invalid(
            "import torch\n\n\ndef softmax(x):\n    return torch.exp(x) / torch.exp(x).sum(dim=-1, keepdim=True)\n",
            fixed="import torch\n\n\ndef softmax(x):\n    return torch.softmax(x, dim=-1)\n", lines=(5,),
        ),
        Invalid(
            "import torch\n\n\ndef softmax(logits, dim):\n    e = torch.exp(logits - logits.amax(dim, keepdim=True))\n"
            "    return e / e.sum(dim, keepdim=True)\n",
            target="npu",
            fixed="import torch\n\n\ndef softmax(logits, dim):\n    return torch.softmax(logits, dim=dim)\n", lines=(6,),
        ),
        Invalid(
            "import torch\nsm = lambda z: (z - torch.logsumexp(z, 1, keepdim=True)).exp()\n",
            fixed="import torch\nsm = lambda z: torch.softmax(z, dim=1)\n", lines=(2,),
        ),
        Valid("import torch\ndef softmax(x):\n    return torch.softmax(x, dim=-1)\n"),
        Valid("import torch\ndef normalise(x):\n    return x / x.sum(dim=-1, keepdim=True)\n"),
        Valid("import torch\ndef masked(x, m):\n    e = torch.exp(x) * m\n    return e / e.sum(-1, keepdim=True)\n"),
    )

    def propose(self, ctx, match):
        name, imports = torch_name(ctx, match.node.lineno)
        dim = match.inputs.get("dim")
        # Without the dimension as written, only the last one is independent of the rank.
        known = dim is not None or match.params.get("dim") == -1
        dim = dim or str(match.params.get("dim", -1))
        replacement = f"{name}.softmax({match.inputs['x']}, dim={dim})"
        safe = exact(match)
        return Proposal(replacement, f"{replacement} computes it in one fused, overflow-safe kernel", "use torch.softmax",
                        Applicability.SAFE if safe else Applicability.UNSAFE, edit=known, imports=imports)
