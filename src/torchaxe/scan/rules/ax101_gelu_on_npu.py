"""AX101: GELU through torch on an Ascend NPU, where torch_npu.fast_gelu is faster."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules.base import Invalid, Rule, Valid

GELU_CALLS = ("torch.nn.functional.gelu", "torch._C._nn.gelu")
GELU_MODULES = ("torch.nn.GELU", "torch.nn.modules.activation.GELU")


class GeluOnNpu(Rule):
    """
    ## What it does
    On the `npu` target, flags `torch.nn.functional.gelu(x)` calls and `torch.nn.GELU()`
    modules: torch_npu has an affinity operator, `torch_npu.fast_gelu(self)`, that the
    NPU runs faster.

    ## Why is this bad?
    On Ascend, `F.gelu` dispatches to the generic GELU kernel; `fast_gelu` is the
    operator the hardware is tuned for (it is on Huawei's list of NPU affinity APIs).
    GELU runs once or more per transformer layer, forward and backward, every step.

    ## Example
    ```python
    y = F.gelu(x)
    ```

    ## Use instead
    ```python
    y = torch_npu.fast_gelu(x)
    ```

    ## Fix safety
    Unsafe: `fast_gelu` is a different approximation of GELU (neither the erf form nor
    the tanh form), so outputs change slightly; verify accuracy after the change. The
    `nn.GELU()` module form is reported but not rewritten (wrap `fast_gelu` in your
    own module), and so is the class handed over to be built elsewhere
    (`Mlp(act_layer=nn.GELU)`, a parameter default `act_layer=nn.GELU`, as timm
    writes it). The NPU path is unverified on Ascend hardware.
    """

    code = "AX101"
    name = "gelu-without-npu-fast-gelu"
    category = "affinity_api"
    message = "GELU through torch; torch_npu.fast_gelu is the NPU affinity operator"
    fix_title = "use torch_npu.fast_gelu"
    fix_safety = Applicability.UNSAFE
    targets = ("npu",)
    requires_text = ("gelu", "GELU")
    node_types = (ast.Call, ast.arguments)
    references = (
        "https://www.hiascend.com/document (torch_npu.fast_gelu)",
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.gelu.html",
    )
    examples = (
        Invalid(
            "import torch.nn.functional as F\ny = F.gelu(x)\n",
            target="npu",
            fixed="import torch.nn.functional as F\nimport torch_npu\ny = torch_npu.fast_gelu(x)\n", lines=(2,),
        ),
        Invalid(
            'from torch.nn.functional import gelu\ny = gelu(h, approximate="tanh")\n',
            target="npu",
            fixed='from torch.nn.functional import gelu\nimport torch_npu\ny = torch_npu.fast_gelu(h)\n', lines=(2,),
        ),
        Invalid("import torch.nn as nn\nact = nn.GELU()\n", target="npu", lines=(2,)),
        Invalid("import torch.nn as nn\nmlp = Mlp(64, act_layer=nn.GELU)\n", target="npu", lines=(2,), message="handed over as the activation class"),
        Invalid("import torch.nn as nn\n\n\nclass Mlp(nn.Module):\n    def __init__(self, d, act_layer=nn.GELU):\n"
                "        super().__init__()\n        self.act = act_layer()\n", target="npu", lines=(5,)),
        Valid("import torch.nn as nn\nmlp = Mlp(64, act_layer=nn.ReLU)\n", target="npu"),
        Valid("import torch.nn.functional as F\ny = F.gelu(x)\n", target="cuda"),
        Valid("import torch_npu\ny = torch_npu.fast_gelu(x)\n", target="npu"),
        Valid("import torch.nn.functional as F\ny = F.gelu(*args)\n", target="npu"),
        Valid("def gelu(x):\n    return x\ny = gelu(x)\n", target="npu"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        if isinstance(node, ast.arguments):
            handed = [*node.defaults, *(d for d in node.kw_defaults if d is not None)]
        else:
            handed = [*node.args, *(k.value for k in node.keywords)]
        for value in handed:
            # The class itself, to be built elsewhere: Mlp(act_layer=nn.GELU).
            if isinstance(value, (ast.Name, ast.Attribute)) and ctx.qualified_name(value) in GELU_MODULES:
                yield ctx.finding(
                    self,
                    value,
                    "nn.GELU handed over as the activation class runs the generic kernel on the NPU; hand over a "
                    "module whose forward calls torch_npu.fast_gelu instead (a different approximation: verify "
                    "accuracy; unverified on Ascend hardware)",
                    replacement="a module calling torch_npu.fast_gelu(x) in forward",
                    fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
                )
        if not isinstance(node, ast.Call):
            return
        name = ctx.call_name(node)
        if name in GELU_CALLS:
            if len(node.args) != 1 or isinstance(node.args[0], ast.Starred):
                return
            extra = [k for k in node.keywords if k.arg != "approximate"]
            if extra:
                return
            arg = ctx.text(node.args[0])
            yield ctx.finding(
                self,
                node,
                "F.gelu on the NPU runs the generic kernel; torch_npu.fast_gelu is the affinity operator "
                "(a different approximation: verify accuracy; unverified on Ascend hardware)",
                replacement=f"torch_npu.fast_gelu({arg})",
                fix=ctx.fix(self, [ctx.replace(node, f"torch_npu.fast_gelu({arg})")], imports=("import torch_npu",)),
            )
        elif name in GELU_MODULES:
            yield ctx.finding(
                self,
                node,
                "nn.GELU on the NPU runs the generic kernel; call torch_npu.fast_gelu in forward instead "
                "(a different approximation: verify accuracy; unverified on Ascend hardware)",
                replacement="torch_npu.fast_gelu(x) in the module's forward",
                fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
            )
