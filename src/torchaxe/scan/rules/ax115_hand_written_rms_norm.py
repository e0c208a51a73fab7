"""AX115: RMSNorm computed by hand, recognised by its values."""

from __future__ import annotations

import ast
import re

from torchaxe.findings import Applicability
from torchaxe.scan.rules._formula import (
    FormulaRule, Proposal, atom, eps_text, exact, expression_at, functional, innermost, is_name, moved_last,
    over_named_dim, torch_version_at_least,
)
from torchaxe.scan.rules.base import Invalid, Valid


#: A weight named (``self.weight``, ``self.norm.g``, a parameter ``g``): F.rms_norm's
#: weight argument. An expression (``gamma + 1.`` of a conditioning input) may be of
#: another shape, (b, 1, d): a factor on the output instead.
_STORED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

#: The eps a fix writes where the hand-written form has none that shows (a norm by
#: F.normalize clamps at 1e-12): zero rows give zeros, and no other row changes.
ZERO_EPS_TEXT = "1e-24"


class HandWrittenRmsNorm(FormulaRule):
    """
    ## What it does
    Flags code that computes RMSNorm over the last dimension,
    `x * rsqrt(mean(x**2, -1) + eps) * weight`, with elementary tensor operations
    (`rsqrt` or `1 / sqrt`, `pow(2)`, `x * x` or `square`, `mean` or `sum / n`,
    `norm(...) / sqrt(n)`, an optional weight such as `self.weight` or
    `1 + self.weight`), including the LLaMA form that normalises in float32 and casts
    back. Recognised by fitting its values on random inputs: eps, weight and where eps
    sits are read from the computation, and a normalisation that is not RMS (L2
    normalisation, mean absolute value, LayerNorm) does not match. An L2 normalisation
    times a stored factor named like a scale or a size (`F.normalize(x, dim=-1) *
    self.scale * self.g` with `self.scale = dim ** 0.5`) is reported as advice: it is
    RMSNorm when that factor is the square root of the normalised size. Over another
    dimension (channels-first, `mean(x**2, dim=1)`) it is reported with the advice to
    move that dimension last.

    ## Why is this bad?
    The written-out norm launches five to eight kernels forward and more backward, each
    a pass over the activation tensor, on every layer of the model.
    `F.rms_norm` (torch >= 2.4) and `torch_npu.npu_rms_norm` compute it in one kernel.

    ## Example
    ```python
    class RMSNorm(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
    ```

    ## Use instead
    ```python
    return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)          # cpu, cuda
    return torch_npu.npu_rms_norm(x, self.weight, epsilon=self.eps)[0]   # npu
    ```

    ## Fix safety
    Safe on cpu and cuda when the hand-written form has eps inside the square root, no
    dtype casts and exact constants: `F.rms_norm` computes the same formula. With casts
    (normalising in float32) the fix is unsafe: the fused kernel keeps the input dtype.
    eps outside the square root is reported without a fix. On npu the fix is unsafe
    (`npu_rms_norm` needs a weight, returns a tuple whose first element is the output,
    and is unverified on Ascend hardware). A formula assembled from several statements gets an unsafe fix that also deletes
    those statements when nothing else reads what they compute and no input is
    reassigned in between; otherwise it is reported without a fix.
    """

    code = "AX115"
    name = "hand-written-rms-norm"
    category = "rms_norm"
    label = "RMSNorm"
    message = "RMSNorm computed by hand instead of a fused norm"
    fix_title = "use F.rms_norm"
    fix_safety = Applicability.SAFE
    safety_by_target = {"cpu": Applicability.SAFE, "cuda": Applicability.SAFE, "npu": Applicability.UNSAFE}
    requires_text = ("sqrt", ".norm(", "** -0.5", "**-0.5", "** 0.5", "**0.5", "normalize(")
    references = (
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.rms_norm.html",
        "https://www.hiascend.com/document (torch_npu.npu_rms_norm)",
    )
    examples = (
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n\nclass RMSNorm(torch.nn.Module):\n"
            "    def forward(self, x):\n"
            "        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight\n",
            fixed="import torch\nimport torch.nn.functional as F\n\n\nclass RMSNorm(torch.nn.Module):\n"
            "    def forward(self, x):\n        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)\n", lines=(7,),
        ),
        Invalid(
            "import torch\n\n\nclass RMSNorm(torch.nn.Module):\n    def forward(self, x):\n"
            "        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight\n",
            target="npu",
            fixed="import torch\nimport torch_npu\n\n\nclass RMSNorm(torch.nn.Module):\n    def forward(self, x):\n"
            "        return torch_npu.npu_rms_norm(x, self.weight, epsilon=self.eps)[0]\n", lines=(6,),
        ),
        Invalid(
            "import torch\n\n\nclass LlamaRMSNorm(torch.nn.Module):\n"
            "    def _norm(self, x):\n        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)\n\n"
            "    def forward(self, x):\n        output = self._norm(x.float()).type_as(x)\n"
            "        return output * self.weight\n",
            target="cuda",
            fixed="import torch\n\n\nclass LlamaRMSNorm(torch.nn.Module):\n"
            "    def _norm(self, x):\n        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, self.eps)\n\n"
            "    def forward(self, x):\n        output = self._norm(x.float()).type_as(x)\n"
            "        return output * self.weight\n", lines=(6,),
        ),
        Invalid(
            "import torch\ndef adaptive(x, cond_gamma, eps=1e-6):\n"
            "    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (cond_gamma + 1.0)\n",
            fixed="import torch\ndef adaptive(x, cond_gamma, eps=1e-6):\n"
            "    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * (cond_gamma + 1.0)\n", lines=(3,),
        ),
        Invalid(
            "import torch\ndef rms(h, g, eps=1e-6):\n"
            "    return h / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps) * g\n",
            fixed="import torch\ndef rms(h, g, eps=1e-6):\n"
            "    return torch.nn.functional.rms_norm(h, (h.shape[-1],), g, eps)\n", lines=(3,),
        ),
        Valid("import torch\ndef l2(x):\n    return x / x.norm(dim=-1, keepdim=True)\n"),
        Valid("import torch\ndef scale(x, eps):\n    return x / (x.abs().mean(-1, keepdim=True) + eps)\n"),
        Valid("import torch.nn.functional as F\ndef norm(x, w):\n    return F.rms_norm(x, (x.shape[-1],), w)\n"),
    )

    def propose(self, ctx, match):
        proposal = over_named_dim(self._propose(ctx, match), match)
        if ctx.target != "npu":
            proposal = moved_last(proposal, match, match.inputs["x"])
        factor = match.inputs.get("factor")
        dim = match.params.get("dim", -1)
        if not match.params.get("factor") and dim == -1:
            return proposal
        note = proposal.note
        if dim != -1:
            written = match.params.get("dim_written")
            note += (f"; the hand-written form normalises dimension {dim if written is None else written}, not the last "
                     "one: " + ("the replacement moves it last (movedim) and back" if written is not None
                                and ctx.target != "npu" else
                                "move it last (permute to channels-last), normalise, and move it back"))
        if match.params.get("factor"):
            # An L2 normalisation times a stored factor (self.scale = dim ** 0.5): RMSNorm
            # only when that factor is the square root of the normalised size.
            note += (f"; this assumes {factor or 'the constant factor'} is the square root of the normalised size "
                     "(the hand-written form is an L2 normalisation times that factor)")
        applicability = proposal.applicability
        if applicability is not Applicability.DISPLAY_ONLY:
            applicability = Applicability.UNSAFE
        return Proposal(proposal.replacement, note, proposal.title, applicability, edit=False,
                        imports=proposal.imports)

    def _propose(self, ctx, match):
        x, weight, eps = match.inputs["x"], match.inputs.get("weight"), eps_text(match)
        # No eps to fit (F.normalize's clamp at 1e-12 is too small to see): a zero row
        # would come out NaN from the fused kernel where F.normalize gives zeros.
        zero_eps = eps is not None and "eps" not in match.inputs and float(match.params.get("eps", 0.0)) == 0.0
        if zero_eps:
            eps = ZERO_EPS_TEXT
        casts = match.params.get("casts", False)
        placement = match.params.get("eps_placement")
        outside = placement in ("outside", "clamped")
        # Where the hand-written form puts eps; the fused kernels add it under the root.
        where = "clamps the root at eps" if placement == "clamped" else "adds eps outside the square root"
        if ctx.target == "npu":
            if weight is None:
                return Proposal(
                    f"torch_npu.npu_rms_norm({x}, torch.ones({atom(x)}.shape[-1]), epsilon={eps})[0]",
                    "torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0] computes it in one kernel (it needs a gamma "
                    "tensor: pass ones, or the norm's weight)",
                    "use torch_npu.npu_rms_norm", Applicability.DISPLAY_ONLY, edit=False,
                )
            replacement = f"torch_npu.npu_rms_norm({x}, {weight}, epsilon={eps})[0]"
            if not _STORED.match(weight):
                # Computed in the forward: a factor on the output, as for F.rms_norm below.
                replacement = (f"torch_npu.npu_rms_norm({x}, torch.ones({atom(x)}.shape[-1]), epsilon={eps})[0] * "
                               f"{atom(weight)}")
            note = f"{replacement} computes it in one kernel (the first output of npu_rms_norm is the normalised tensor)"
            if outside:
                note += f"; the hand-written form {where}, npu_rms_norm adds it inside"
            return Proposal(replacement, note, "use torch_npu.npu_rms_norm", Applicability.UNSAFE, edit=not outside,
                            imports=("import torch_npu",))
        fn, imports = functional(ctx, match.node.lineno)
        scalar = match.params.get("scalar_weight", False)
        size_of = x if is_name(x) else weight if is_name(weight) and not scalar else None
        shape = f"({atom(size_of)}.shape[-1],)" if size_of else "(x.shape[-1],)"
        factor = bool(weight and (scalar or not _STORED.match(weight)))
        if factor:
            # One number for every channel, or a weight computed in the forward (from a
            # condition: (b, 1, d), not F.rms_norm's (d,)): a factor on the output.
            replacement = f"{fn}.rms_norm({x}, {shape}, None, {eps}) * {atom(weight)}"
        else:
            replacement = f"{fn}.rms_norm({x}, {shape}, {weight or 'None'}, {eps})"
        available = torch_version_at_least(ctx, 2, 4)
        if available is False:
            return Proposal(replacement, "F.rms_norm (torch >= 2.4, also torch.nn.RMSNorm) computes it in one "
                            "kernel; upgrade torch to use it", "use F.rms_norm", Applicability.DISPLAY_ONLY, edit=False)
        note = (f"{replacement} computes it in one fused kernel on cuda (on cpu the gain depends on the torch build: "
                "`torchaxe verify AX115` measures it)" if ctx.target == "cpu" else
                f"{replacement} computes it in one fused kernel")
        safe = exact(match) and not casts
        cast_last = casts and factor and _ends_in_cast(ctx, match.node)
        if cast_last:
            # ``(t * self.scale).to(dtype)``: the result has the cast's dtype, the
            # replacement the product's (a float32 factor would promote it).
            note += (" (the hand-written form normalises in another dtype and casts the weighted result back: "
                     "cast the replacement's result the same way)")
        elif casts:
            note += " (the hand-written form normalises in another dtype and casts back; the fused kernel keeps the input dtype)"
        if outside:
            note += f"; the hand-written form {where}, F.rms_norm adds it inside (differs for tiny activations)"
        if zero_eps:
            note += f"; eps {ZERO_EPS_TEXT} where the hand-written form has none to see: a row of zeros stays zeros, not NaN"
        return Proposal(replacement, note, "use F.rms_norm", Applicability.SAFE if safe else Applicability.UNSAFE,
                        edit=not outside and not cast_last and size_of is not None, imports=imports)


#: Tensor methods that change a tensor's dtype.
_CASTS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16", "double"})


def _ends_in_cast(ctx, span) -> bool:
    """Whether the replaced expression's last operation is a dtype cast
    (``(t * self.scale).to(dtype)``)."""
    scope = innermost(ctx, span.lineno, (ast.FunctionDef, ast.AsyncFunctionDef)) or ctx.tree
    node = expression_at(scope, span)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CASTS
