"""AX114: SwiGLU, silu(a) * b, computed from separate kernels on an Ascend NPU."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import fast_walk
from torchaxe.scan.rules._formula import FormulaRule, Proposal, innermost
from torchaxe.scan.rules.base import Invalid, Valid

#: Tables and factories that pick an activation by name at run time.
_BY_NAME_TABLES = ("ACT2FN", "ACT2CLS")
_BY_NAME_FACTORIES = ("get_activation", "get_act_fn", "get_act_layer")


class HandWrittenSwiglu(FormulaRule):
    """
    ## What it does
    On the `npu` target, flags a SwiGLU gate, `silu(a) * b`, computed from separate
    operators: `F.silu(gate) * up`, a hand-written `a * sigmoid(a) * b`, and the
    one-tensor forms that split a projection in two (`x.chunk(2, -1)`, `x.split(h, -1)`,
    `x[..., :h]` / `x[..., h:]`). The SiLU may be a module attribute
    (`self.act_fn(gate) * up`) when `__init__` sets it once, unconditionally, to
    `nn.SiLU()`, `F.silu` or `ACT2FN["silu"]`. Recognised by its values on random inputs.
    A gate whose activation the configuration chooses (`self.act_fn =
    ACT2FN[config.hidden_act]`, `get_activation(...)`: the gated MLP of Llama, Mistral,
    Qwen2 and their kin) is reported as advice: it is SwiGLU when the configuration says
    `silu`.

    ## Why is this bad?
    The gate runs a SiLU kernel and a multiplication (and a split) each reading and
    writing the full intermediate activation of the MLP, the largest tensor of a
    transformer block. `torch_npu.npu_swiglu(x, dim=-1)` computes `silu(A) * B` for the
    two halves A, B of `x` in one kernel. torch has no fused SwiGLU on cpu or cuda, so
    other targets report nothing (a hand-written SiLU inside is still reported by
    AX113).

    ## Example
    ```python
    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
    ```

    ## Use instead
    ```python
    def forward(self, x):
        return self.w2(torch_npu.npu_swiglu(self.w13(x), dim=-1))
    ```

    ## Fix safety
    Unsafe, and offered only when the split and the gate are one expression over one
    tensor: `npu_swiglu` computes the same formula, but it is unverified on Ascend
    hardware. With two separate projections (`F.silu(self.w1(x)) * self.w3(x)`) the
    finding is advice: merge the projections into one linear layer whose output
    `npu_swiglu` splits.
    """

    code = "AX114"
    name = "hand-written-swiglu"
    category = "swiglu"
    label = "SwiGLU gate (silu(a) * b)"
    message = "SwiGLU computed from separate kernels; torch_npu.npu_swiglu fuses it"
    fix_title = "use torch_npu.npu_swiglu(x, dim=-1)"
    fix_safety = Applicability.UNSAFE
    safety_by_target = {"npu": Applicability.UNSAFE}
    targets = ("npu",)
    requires_text = ("silu(", "sigmoid(", "torch.exp(", ".exp()", "SiLU(", ".silu", "ACT2FN", "get_activation(")
    references = ("https://www.hiascend.com/document (torch_npu.npu_swiglu)",)
    examples = (
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n\ndef swiglu(x):\n"
            "    return F.silu(x.chunk(2, dim=-1)[0]) * x.chunk(2, dim=-1)[1]\n",
            target="npu",
            fixed="import torch\nimport torch.nn.functional as F\nimport torch_npu\n\n\ndef swiglu(x):\n"
            "    return torch_npu.npu_swiglu(x, dim=-1)\n", lines=(6,),
        ),
        Invalid(
            "import torch.nn.functional as F\n\n\ndef swiglu(x):\n    a, b = x.chunk(2, dim=-1)\n"
            "    return F.silu(a) * b\n",
            target="npu", lines=(6,),
        ),
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n\nclass MLP(torch.nn.Module):\n"
            "    def forward(self, x):\n        return self.w2(F.silu(self.w1(x)) * self.w3(x))\n",
            target="npu", lines=(7,),
        ),
        Invalid(
            "import torch\n\n\ndef swiglu(x):\n    h = x.shape[-1] // 2\n    a, b = x[..., :h], x[..., h:]\n"
            "    return a * torch.sigmoid(a) * b\n",
            target="npu", lines=(7,),
        ),
        Valid("import torch.nn.functional as F\ndef swiglu(x):\n    a, b = x.chunk(2, dim=-1)\n    return F.silu(a) * b\n",
              target="cuda"),
        Valid("import torch.nn.functional as F\ndef geglu(x):\n    a, b = x.chunk(2, dim=-1)\n    return F.gelu(a) * b\n",
              target="npu"),
        Valid("import torch_npu\ndef swiglu(x):\n    return torch_npu.npu_swiglu(x, dim=-1)\n", target="npu"),
        Invalid(
            "import torch\nfrom transformers.activations import ACT2FN\n\n\nclass MLP(torch.nn.Module):\n"
            "    def __init__(self, config):\n        super().__init__()\n"
            "        self.act_fn = ACT2FN[config.hidden_act]\n\n"
            "    def forward(self, x):\n        return self.down(self.act_fn(self.gate(x)) * self.up(x))\n",
            target="npu", lines=(11,),
        ),
        Valid(
            "import torch\nfrom transformers.activations import ACT2FN\n\n\nclass MLP(torch.nn.Module):\n"
            "    def __init__(self, config):\n        super().__init__()\n"
            "        self.act_fn = ACT2FN[config.hidden_act]\n\n"
            "    def forward(self, x):\n        return self.down(self.act_fn(self.up(x)))\n",
            target="npu",
        ),
        # Mamba's own gate: y is the selective scan's result, a method of the class.
        Valid(
            "import torch\nimport torch.nn.functional as F\n\n\nclass MambaBlock(torch.nn.Module):\n"
            "    def forward(self, x):\n        xz = self.in_proj(x)\n        x, z = xz.chunk(2, dim=-1)\n"
            "        y = self.ssm(F.silu(x), z)\n        z = F.silu(z)\n        return self.out_proj(y * z)\n\n"
            "    def ssm(self, x, z):\n        return torch.cumsum(x, dim=1) * self.D\n",
            target="npu",
        ),
        # A gate on a recurrence's output (Mamba): one factor is no projection.
        Valid(
            "import torch\nfrom transformers.activations import ACT2FN\n\n\nclass Mixer(torch.nn.Module):\n"
            "    def __init__(self, config):\n        super().__init__()\n"
            "        self.act = ACT2FN[config.hidden_act]\n\n"
            "    def forward(self, x):\n        h, gate = self.in_proj(x).chunk(2, dim=1)\n"
            "        y = torch.cumsum(h, dim=-1) + h * self.D\n        return y * self.act(gate)\n",
            target="npu",
        ),
    )

    def check_module(self, ctx) -> Iterable[Finding]:
        from torchaxe.scan.formulas.analysis import formula_matches

        found = [self.report(ctx, match) for match in formula_matches(ctx)
                 if match.category == self.category and not _gates_a_method_result(ctx, match)]
        yield from found
        if any(t in ctx.source for t in _BY_NAME_TABLES + _BY_NAME_FACTORIES):
            covered = [(f.line, f.end_line) for f in found]
            for node, act in _config_gates(ctx.tree):
                if any(lo <= node.lineno <= hi for lo, hi in covered):
                    continue
                yield ctx.finding(
                    self, node,
                    f"gated MLP: self.{act}(...) * ... with the activation chosen by the configuration; when it is "
                    "'silu' (as in Llama, Mistral and Qwen2 configurations) this is a SwiGLU gate: fuse the two "
                    "projections into one linear layer and call torch_npu.npu_swiglu(its output, dim=-1), which "
                    f"computes silu(first half) * second half in one kernel; unverified on Ascend hardware",
                    replacement="torch_npu.npu_swiglu(x, dim=-1) (when the activation is silu)",
                    fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY,
                                title="merge the projections and use torch_npu.npu_swiglu"))

    def propose(self, ctx, match):
        a, b, z = match.inputs.get("a"), match.inputs.get("b"), match.inputs.get("z")
        if match.params.get("single_input") and z:
            return Proposal(
                f"torch_npu.npu_swiglu({z}, dim=-1)",
                f"torch_npu.npu_swiglu({z}, dim=-1) splits {z} and computes silu(first half) * second half in one "
                "kernel",
                "use torch_npu.npu_swiglu(x, dim=-1)",
                Applicability.UNSAFE,
                imports=("import torch_npu",),
            )
        return Proposal(
            f"torch_npu.npu_swiglu(torch.cat(({a}, {b}), -1), dim=-1)",
            f"when {a} and {b} are two projections of one input, fuse them into one linear layer and call "
            "torch_npu.npu_swiglu(its output, dim=-1), which computes silu(first half) * second half in one kernel "
            "(where one of them is not a projection, as in a gated recurrence, the fused call needs the torch.cat "
            "above and may not pay)",
            "merge the projections and use torch_npu.npu_swiglu",
            Applicability.DISPLAY_ONLY,
            edit=False,
        )


def _chosen_by_config(value: ast.expr) -> bool:
    """``ACT2FN[config.hidden_act]`` or ``get_activation(config.act)``: an activation
    looked up by a name that is not a constant."""
    if isinstance(value, ast.Subscript):
        table = value.value
        name = table.id if isinstance(table, ast.Name) else table.attr if isinstance(table, ast.Attribute) else None
        return name in _BY_NAME_TABLES and not isinstance(value.slice, ast.Constant)
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        return name in _BY_NAME_FACTORIES and bool(value.args) and not isinstance(value.args[0], ast.Constant)
    return False


def _config_gates(tree: ast.AST) -> Iterable[tuple[ast.BinOp, str]]:
    """In each class whose ``__init__`` sets ``self.<act>`` once to an activation the
    configuration chooses, the products ``self.<act>(a) * b`` (either order) of its
    methods, with ``b`` not itself the activation."""
    for cls in fast_walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        init = next((s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if init is None or not init.args.args:
            continue
        me = init.args.args[0].arg
        acts = set()
        for stmt in init.body:
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
                    and isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == me
                    and _chosen_by_config(stmt.value)):
                acts.add(stmt.targets[0].attr)
        if not acts:
            continue
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef) or method.name == "__init__" or not method.args.args:
                continue
            this = method.args.args[0].arg
            for node in fast_walk(method):
                if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                    continue
                sides = [_activation_call(side, this, acts) for side in (node.left, node.right)]
                other = node.right if sides[0] is not None else node.left
                # Both factors projections of the input (an MLP), not a gate on something
                # else (Mamba's scan output, RWKV's mix): npu_swiglu needs both halves
                # from one linear layer.
                gated = (node.left if sides[0] is not None else node.right).args[0] \
                    if sum(a is not None for a in sides) == 1 else None
                if gated is not None and not isinstance(other, ast.Constant) and _projected(other, this, method) \
                        and _projected(gated, this, method):
                    yield node, next(a for a in sides if a is not None)


def _gates_a_method_result(ctx, match) -> bool:
    """Whether one factor of a two-input gate is, by every assignment in its method, the
    result of another method of the class (Mamba's ``y = self.ssm(x, z)``; ``y * silu(z)``):
    a gate on a computed state, not two projections that one linear layer could make."""
    if match.params.get("single_input"):
        return False
    cls = innermost(ctx, match.line, (ast.ClassDef,))
    method = innermost(ctx, match.line, (ast.FunctionDef,))
    if cls is None or method is None or not method.args.args:
        return False
    methods = {s.name for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    me = method.args.args[0].arg
    for role in ("a", "b"):
        text = match.inputs.get(role) or ""
        if not text.isidentifier():
            continue
        values = [stmt.value for stmt in fast_walk(method) if isinstance(stmt, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id == text for target in stmt.targets for n in fast_walk(target))]
        if values and all(_method_call(v, me, methods) for v in values):
            return True
    return False


def _method_call(node: ast.expr, me: str, methods: set[str]) -> bool:
    """``self.<m>(...)`` with ``m`` a method the class defines (not a layer it holds)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == me and node.func.attr in methods)


def _projected(node: ast.expr, me: str, method: ast.FunctionDef, depth: int = 0) -> bool:
    """Whether ``node`` is the output of one of the module's layers (``self.up(x)``),
    directly or through a name every assignment of the method sets so, or a half of one
    (``a, b = self.proj(x).chunk(2, -1)``)."""
    if depth > 3:
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if isinstance(node.func.value, ast.Name) and node.func.value.id == me:
            return True  # self.up(x)
        if node.func.attr in ("chunk", "split", "contiguous", "transpose", "view", "reshape", "float", "to"):
            return _projected(node.func.value, me, method, depth + 1)
    if isinstance(node, ast.Subscript):
        return _projected(node.value, me, method, depth + 1)
    if isinstance(node, ast.Name):
        values = []
        for stmt in fast_walk(method):
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target = stmt.targets[0]
                names = [target] if isinstance(target, ast.Name) else list(target.elts) \
                    if isinstance(target, ast.Tuple) else []
                if any(isinstance(t, ast.Name) and t.id == node.id for t in names):
                    values.append(stmt.value)
            elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign, ast.For)) and isinstance(
                    getattr(stmt, "target", None), ast.Name) and stmt.target.id == node.id:
                return False
        return bool(values) and all(_projected(v, me, method, depth + 1) for v in values)
    return False


def _activation_call(node: ast.expr, me: str, acts: set[str]) -> str | None:
    if (isinstance(node, ast.Call) and len(node.args) == 1 and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == me and node.func.attr in acts):
        return node.func.attr
    return None
