"""AX701: a model trained in float64."""

from __future__ import annotations

import ast
import re
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules.base import Invalid, Rule, Valid

_FLOAT64 = frozenset({"torch.float64", "torch.double"})
_DOUBLE_TENSOR = frozenset({"torch.DoubleTensor", "torch.cuda.DoubleTensor"})


class Float64Model(Rule):
    """
    ## What it does
    Flags where a script makes its model or all its tensors float64:
    `torch.set_default_dtype(torch.float64)`, `torch.set_default_tensor_type(torch.DoubleTensor)`,
    and `model.double()` / `model.to(torch.float64)` on a module (a `torch.nn` layer,
    a class of the file that subclasses `nn.Module`, or a name assigned once from
    either).

    ## Why is this bad?
    float64 arithmetic runs at a fraction of float32's speed: 1/2 on data-centre GPUs
    without tensor cores for it, 1/32 to 1/64 on others, and NPUs' matrix units have no
    float64 path at all; on a CPU it halves the numbers per vector instruction and
    doubles the memory traffic. Mixed precision cannot help: autocast lowers float32
    operations only and leaves float64 ones as they are. Training rarely needs float64
    (a physics residual or an ill-conditioned solve may); a LSTMCell sequence model ran
    1.44x faster in float32 with the same loss.

    ## Example
    ```python
    model = Sequence().double()
    ```

    ## Use instead
    ```python
    model = Sequence()          # float32, with float32 inputs
    ```

    ## Fix safety
    Display-only: the inputs, the buffers the code creates (`torch.zeros(..., dtype=torch.double)`)
    and any tolerance tuned for float64 must change with it, and some problems need
    float64's range or precision: measure the loss in float32 before keeping it.
    """

    code = "AX701"
    name = "float64-model"
    category = "float64_compute"
    message = "the model computes in float64"
    fix_title = "train in float32 (model and inputs)"
    fix_safety = Applicability.DISPLAY_ONLY
    requires_text = ("double", "float64", "DoubleTensor")
    #: What ``visit`` reports, as text: a default dtype or tensor type, ``.double()``,
    #: or ``.to()`` whose first argument or ``dtype=`` names float64.
    requires_pattern = re.compile(r"set_default_(?:dtype|tensor_type)|\.double\(\s*\)"
                                  r"|\.to\(\s*[\w.]*(?:float64|double)\b"
                                  r"|\.to\([^)]*dtype\s*=\s*[\w.]*(?:float64|double)\b")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/amp.html#ops-that-can-autocast-to-float32",
        "https://pytorch.org/docs/stable/generated/torch.set_default_dtype.html",
    )
    examples = (
        Invalid("import torch\nimport torch.nn as nn\nmodel = nn.LSTM(4, 8).double()\n", lines=(3,)),
        Invalid(
            "import torch\nimport torch.nn as nn\nclass Net(nn.Module):\n    pass\nnet = Net()\nnet.double()\n",
            target="cuda", lines=(6,),
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\nclass Net(nn.Module):\n    pass\nnet = Net().to(torch.float64)\n",
            target="npu", lines=(5,),
        ),
        Invalid("import torch\ntorch.set_default_dtype(torch.float64)\n", lines=(2,)),
        Invalid("import torch\ntorch.set_default_tensor_type(torch.DoubleTensor)\n", lines=(2,)),
        Invalid("import torch\nmodel = torch.nn.Linear(4, 2)\nmodel.to(dtype=torch.double)\n", lines=(3,)),
        # Tensors, not the model.
        Valid("import torch\nx = torch.randn(4).double()\ny = batch.to(torch.float64)\n"),
        Valid("import torch\nloss = criterion(out, target.double())\n"),
        # Back to float32, or a dtype chosen elsewhere.
        Valid("import torch\ntorch.set_default_dtype(torch.float32)\nmodel = torch.nn.Linear(4, 2).to(dtype)\n"),
        Valid("import torch\ntorch.set_default_dtype(torch.float64)  # noqa: AX701\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        name = ctx.call_name(node) or ""
        what = None
        if name == "torch.set_default_dtype" and node.args and ctx.qualified_name(node.args[0]) in _FLOAT64:
            what = "torch.set_default_dtype(torch.float64) makes every tensor and layer the script creates float64"
        elif name == "torch.set_default_tensor_type" and node.args and (
                ctx.qualified_name(node.args[0]) in _DOUBLE_TENSOR
                or (isinstance(node.args[0], ast.Constant) and node.args[0].value in _DOUBLE_TENSOR)):
            what = "a DoubleTensor default makes every tensor and layer the script creates float64"
        elif isinstance(node.func, ast.Attribute) and _makes_float64(node, ctx) and _is_module(node.func.value, ctx):
            what = f"`{ctx.text(node)}` makes the model's parameters float64"
        if what is None:
            return
        if ctx.target == "npu":
            cost = "the NPU's matrix units have no float64 path (unverified on Ascend hardware)"
        elif ctx.target == "cuda":
            cost = "a GPU runs float64 at 1/2 (data-centre) to 1/64 of float32's speed, without tensor cores"
        else:
            cost = "a CPU fits half as many float64 numbers in a vector instruction and moves twice the bytes"
        message = (f"{what}: {cost}, and autocast (mixed precision) leaves float64 operations as they are; in "
                   "float32, with float32 inputs, the model usually trains the same. Display-only: inputs, created "
                   "buffers and tolerances change with it; measure the loss")
        yield ctx.finding(self, node, message, fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))


def _makes_float64(call: ast.Call, ctx: FileContext) -> bool:
    """``x.double()``, ``x.to(torch.float64)``, ``x.to(dtype=torch.double)``."""
    func = call.func
    assert isinstance(func, ast.Attribute)
    if func.attr == "double":
        return not call.args and not call.keywords
    if func.attr == "to":
        dtype = next((k.value for k in call.keywords if k.arg == "dtype"), call.args[0] if call.args else None)
        return dtype is not None and ctx.qualified_name(dtype) in _FLOAT64
    return False


def _is_module(node: ast.AST, ctx: FileContext, depth: int = 0) -> bool:
    """Whether ``node`` is a module: built by a ``torch.nn`` constructor or a class of
    the file that subclasses ``nn.Module`` (directly, or through a name assigned once)."""
    if depth > 2:
        return False
    if isinstance(node, ast.Name):
        value = ctx.single_assignments().get(node.id)
        return value is not None and _is_module(value, ctx, depth + 1)
    if not isinstance(node, ast.Call):
        return False
    name = ctx.call_name(node) or ""
    if name.startswith("torch.nn.") and name.rsplit(".", 1)[-1][:1].isupper():
        return True
    if isinstance(node.func, ast.Name):
        classes = [c for c in ctx.nodes(ast.ClassDef) if c.name == node.func.id]
        return len(classes) == 1 and any(ast.unparse(b).split(".")[-1] == "Module" for b in classes[0].bases)
    if isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "float", "cuda", "cpu", "train"):
        return _is_module(node.func.value, ctx, depth + 1)
    return False
