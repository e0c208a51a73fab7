"""AX116: LayerNorm computed by hand (mean and variance written out)."""

from __future__ import annotations

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import (
    FormulaRule, Proposal, atom, eps_text, exact, functional, is_name, moved_last, over_named_dim,
)
from torchaxe.scan.rules.base import Invalid, Valid


class HandWrittenLayerNorm(FormulaRule):
    """
    ## What it does
    Flags code that normalises the last dimension by hand,
    `(x - mean) / sqrt(var + eps) * weight + bias`, with the mean and the biased
    variance written out (`x.mean(-1, keepdim=True)`, `((x - u) ** 2).mean(...)`,
    `x.var(-1, unbiased=False)`, `torch.var_mean`, `rsqrt`, or the unbiased `x.std(-1)`).
    Recognised by fitting its values on random inputs: eps, weight and bias are read
    from the computation; a norm without centring (RMSNorm) or over another dimension
    (BatchNorm) does not match.

    ## Why is this bad?
    The written-out form makes two or three passes to compute the statistics and more
    for the normalisation and the affine part, each a kernel over the activation,
    forward and backward. `F.layer_norm` is one fused kernel on every device (on NPU it
    maps to the LayerNorm operator).

    ## Example
    ```python
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias
    ```

    ## Use instead
    ```python
    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
    ```

    ## Fix safety
    Safe when the whole computation is one expression with eps inside the square root
    and no dtype casts: `F.layer_norm` computes the same formula. A form with eps added
    to the standard deviation (it differs for near-constant rows) or with the unbiased
    variance (the annotated Transformer's `x.std(-1)`: outputs differ by a factor
    `sqrt((n - 1) / n)`) is reported without a fix. The usual form, with `mean` and
    `var` locals, gets an unsafe fix that also deletes those statements when nothing
    else reads them.
    """

    code = "AX116"
    name = "hand-written-layer-norm"
    category = "layer_norm"
    label = "LayerNorm"
    message = "LayerNorm computed by hand instead of F.layer_norm"
    fix_title = "use F.layer_norm"
    fix_safety = Applicability.SAFE
    safety_by_target = {"cpu": Applicability.SAFE, "cuda": Applicability.SAFE, "npu": Applicability.SAFE}
    requires_text = ("sqrt", "std(", "** -0.5", "**-0.5", "** 0.5", "**0.5")
    references = ("https://pytorch.org/docs/stable/generated/torch.nn.functional.layer_norm.html",)
    examples = (
        Invalid(
            "import torch\n\n\nclass LayerNorm(torch.nn.Module):\n    def forward(self, x):\n"
            "        mean = x.mean(-1, keepdim=True)\n        var = ((x - mean) ** 2).mean(-1, keepdim=True)\n"
            "        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias\n",
            fixed="import torch\n\n\nclass LayerNorm(torch.nn.Module):\n    def forward(self, x):\n"
            "        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)\n", lines=(8,),
        ),
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n\ndef ln(x, eps=1e-5):\n"
            "    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps)\n",
            target="cuda",
            fixed="import torch\nimport torch.nn.functional as F\n\n\ndef ln(x, eps=1e-5):\n"
            "    return F.layer_norm(x, (x.shape[-1],), None, None, eps)\n", lines=(6,),
        ),
        Invalid(
            "import torch\n\n\ndef ln(x, g, b):\n    var, mean = torch.var_mean(x, -1, keepdim=True, unbiased=False)\n"
            "    return g * (x - mean) / (var + 1e-12).sqrt() + b\n",
            target="npu", lines=(6,),
            fixed="import torch\n\n\ndef ln(x, g, b):\n"
            "    return torch.nn.functional.layer_norm(x, (x.shape[-1],), g, b, 1e-12)\n",
        ),
        Invalid("import torch\ndef ln(x, eps):\n    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + eps)\n", lines=(3,)),
        Valid("import torch\ndef bn(x, eps):\n    return (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + eps)\n"),
        Valid("import torch\ndef centre(x):\n    return x - x.mean(-1, keepdim=True)\n"),
        Valid("import torch.nn.functional as F\ndef ln(x, w, b):\n    return F.layer_norm(x, (x.shape[-1],), w, b)\n"),
    )

    def propose(self, ctx, match):
        return moved_last(over_named_dim(self._propose(ctx, match), match), match, match.inputs["x"])

    def _propose(self, ctx, match):
        x, weight, bias, eps = match.inputs["x"], match.inputs.get("weight"), match.inputs.get("bias"), eps_text(match)
        fn, imports = functional(ctx, match.node.lineno)
        if match.params.get("scalar_weight"):
            # One number for every channel: applied to the output, not as F.layer_norm's weight and bias.
            size_of = x if is_name(x) else None
            shape = f"({atom(size_of)}.shape[-1],)" if size_of else "(x.shape[-1],)"
            replacement = f"{fn}.layer_norm({x}, {shape}, None, None, {eps})"
            if weight:
                replacement += f" * {atom(weight)}"
            if bias:
                replacement += f" + {atom(bias)}"
        else:
            size_of = x if is_name(x) else weight if is_name(weight) else bias if is_name(bias) else None
            shape = f"({atom(size_of)}.shape[-1],)" if size_of else "(x.shape[-1],)"
            replacement = f"{fn}.layer_norm({x}, {shape}, {weight or 'None'}, {bias or 'None'}, {eps})"
        note = f"{replacement} computes it in one fused kernel"
        placement = match.params.get("eps_placement", "inside")
        outside = placement != "inside" or match.params.get("dim", -1) != -1
        if match.params.get("dim", -1) != -1:
            written = match.params.get("dim_written", match.params["dim"])
            note += (f"; the hand-written form normalises dimension {written}, not the last one: "
                     + ("the replacement moves it last (movedim) and back" if isinstance(written, int) and
                        match.params.get("dim_written") is not None else
                        "move it last (permute to channels-last), normalise with F.layer_norm, and move it back"))
        casts = match.params.get("casts", False)
        if "unbiased" in placement:
            note += ("; the hand-written form divides by the unbiased standard deviation (n - 1), F.layer_norm by the "
                     "biased one (n): outputs differ by a factor sqrt((n - 1) / n), so retrain or rescale the weight")
        if "outside" in placement:
            note += "; the hand-written form adds eps to the standard deviation, F.layer_norm to the variance"
        if casts:
            note += " (the hand-written form normalises in another dtype and casts back)"
        safe = exact(match) and not casts
        return Proposal(replacement, note, "use F.layer_norm", Applicability.SAFE if safe else Applicability.UNSAFE,
                        edit=not outside and size_of is not None, imports=imports)
