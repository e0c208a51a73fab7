"""AX203: an optimizer step written by hand, one parameter at a time."""

from __future__ import annotations

import ast
import re
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext, child_nodes, fast_walk
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: In-place tensor methods that write a new value into the parameter.
_UPDATE_METHODS = ("add_", "sub_", "copy_", "addcmul_", "addcdiv_")
#: Calls that pass a parameter iterable through unchanged (for our purpose).
_PASS_THROUGH = ("list", "tuple", "filter", "sorted", "reversed")
#: Step sizes that can be negated without parentheses.
_SIMPLE = re.compile(r"^(?:[A-Za-z_][\w.]*|[0-9][\w.]*)$")


class ManualParameterUpdateLoop(Rule):
    """
    ## What it does
    Flags a gradient-descent update written by hand inside a loop over a model's
    parameters: `p.data.add_(p.grad, alpha=-lr)`, `p.data.sub_(lr * p.grad)`,
    `p.data -= lr * p.grad`, `p -= lr * p.grad` (under `torch.no_grad()`),
    `p.data = p.data - lr * p.grad`, or with a buffer made from the gradient first
    (momentum: `buf.mul_(mu).add_(p.grad); p.add_(buf, alpha=-lr)`, weight decay:
    `d_p = p.grad + wd * p`), in `for p in model.parameters()`,
    `for name, p in model.named_parameters()`, `for p, buf in zip(model.parameters(),
    bufs)`, `for i, p in enumerate(model.parameters())`, a list built from them, an argument of a plain function
    (`def sgd_step(params, lr): for p in params: ...`), or what a hand-written optimizer
    class was handed (`self.params = [p for p in params ...]` in `__init__`, walked in
    `step`; a subclass of `torch.optim.Optimizer` is an optimizer's own implementation
    and left alone). An Adam step (a buffer of squared gradients, the update divided by
    its square root) is named as one, with `torch.optim.Adam` built from the class's own
    arguments as the replacement.

    ## Why is this bad?
    Each statement launches one or more small kernels per parameter (a multiply, then
    an add), from a Python loop; a model with hundreds of parameters pays hundreds of
    launches and interpreter round trips per step. A fused optimizer updates all
    parameters with one or a few kernels.

    ## Example
    ```python
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    ```

    ## Use instead
    ```python
    opt = torch.optim.SGD(model.parameters(), lr=lr, fused=True)  # cpu, cuda
    opt = torch_npu.optim.NpuFusedSGD(model.parameters(), lr=lr)  # npu
    ...
    opt.step()
    ```
    or, keeping the loop's own logic, `torch._foreach_add_(params, grads, alpha=-lr)`
    (an underscore API, but the one `torch.optim` itself uses).

    ## Fix safety
    Display-only: the replacement creates an optimizer object and changes where the
    step happens, which needs a person. Fused kernels round differently in the last
    bits, and `torch.optim.SGD` skips parameters whose `.grad` is `None` where the
    loop would fail. NPU replacements are unverified on Ascend hardware.
    """

    code = "AX203"
    name = "manual-parameter-update-loop"
    category = "optimizer_unfused"
    message = "parameters updated one at a time by a hand-written loop"
    fix_title = "use a fused optimizer (torch.optim.SGD(..., fused=True))"
    fix_safety = Applicability.DISPLAY_ONLY
    requires_text = (".grad",)
    # the loop walks .parameters() or .named_parameters(), or what a class was handed
    also_requires_text = ("parameters(", "self.")
    node_types = (ast.For,)
    references = (
        "https://pytorch.org/docs/stable/generated/torch.optim.SGD.html",
        "https://pytorch.org/docs/stable/optim.html#algorithms",
    )
    examples = (
        Invalid(
            "import torch\nwith torch.no_grad():\n    for p in model.parameters():\n        p -= lr * p.grad\n", lines=(4,)
        ),
        Invalid("import torch\nfor p in model.parameters():\n    p.data.add_(p.grad, alpha=-0.01)\n", target="cuda", lines=(3,)),
        Invalid(
            "import torch\nfor name, param in net.named_parameters():\n"
            "    if param.grad is not None:\n        param.data.sub_(args.lr * param.grad.data)\n",
            target="npu", lines=(4,),
        ),
        Invalid(
            "import torch\nparams = [p for p in model.parameters() if p.requires_grad]\n"
            "for p in params:\n    p.data = p.data - lr * p.grad\n    p.data.mul_(1 - wd)\n", lines=(4,)
        ),
        Invalid(
            "import torch\nfor p in list(model.parameters()):\n    p.data -= lr * p.grad\n"
            "for q in model.parameters():\n    q.sub_(q.grad, alpha=lr)\n", lines=(3, 5),
        ),
        Invalid(
            "import torch\ndef sgd_step(params, lr):\n    for p in params:\n        p.data.add_(p.grad, alpha=-lr)\n"
            "sgd_step(model.parameters(), 0.1)\n", lines=(4,)
        ),
        Invalid(
            "import torch\nbufs = [torch.zeros_like(p) for p in model.parameters()]\nwith torch.no_grad():\n"
            "    for p, buf in zip(model.parameters(), bufs):\n        buf.mul_(0.9).add_(p.grad)\n"
            "        p.add_(buf, alpha=-lr)\n", lines=(6,)
        ),
        Invalid(
            "import torch\nfor p in model.parameters():\n    d_p = p.grad + wd * p.data\n    p.data.add_(d_p, alpha=-lr)\n", lines=(4,)
        ),
        # Momentum with weight decay, as in torch.optim.SGD: both kept in the replacement.
        Invalid(
            "import torch\nparams = [p for p in model.parameters() if p.requires_grad]\nwith torch.no_grad():\n"
            "    for p, v in zip(params, velocity):\n"
            "        g = p.grad + args.weight_decay * p\n        v.mul_(args.momentum).add_(g)\n        p.sub_(lr * v)\n", lines=(7,)
        ),
        Invalid(
            "import torch\nfor i, p in enumerate(model.parameters()):\n    v[i] = 0.9 * v[i] + p.grad\n"
            "    p.data -= lr * v[i]\n", lines=(4,)
        ),
        Valid(
            "import torch\nclass MySGD(torch.optim.Optimizer):\n    def update(self, params, lr):\n"
            "        for p in params:\n            p.data.add_(p.grad, alpha=-lr)\n"
            "opt = MySGD(model.parameters())\n"
        ),
        Valid("import torch\nfor p in model.parameters():\n    p.requires_grad_(False)\n"),
        # Gradients accumulated into buffers, the parameters left alone.
        Valid("import torch\nfor i, p in enumerate(model.parameters()):\n    acc[i].add_(p.grad)\n"),
        Valid("import torch\nfor p in model.parameters():\n    p.grad.mul_(scale)\n"),
        Valid(
            "import torch\nfor ema_p, p in zip(ema.parameters(), model.parameters()):\n"
            "    ema_p.data.mul_(0.999).add_(p.data, alpha=0.001)\n"
        ),
        Valid(
            "import torch\nfor group in self.param_groups:\n    for p in group['params']:\n"
            "        p.data.add_(p.grad, alpha=-group['lr'])\n"
        ),
        Valid("import torch\nfor p in model.parameters():\n    p.data.clamp_(-0.01, 0.01)\n"),
        Valid("import torch\nfor p in model.parameters():\n    p.data.add_(p.grad, alpha=-lr)  # noqa: AX203\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.For)
        # Cheap test first: only a loop whose variable is updated from its .grad can
        # matter, and only then is it worth resolving what the loop iterates.
        target = node.target
        names = [e.id for e in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(e, ast.Name)]
        body = list(_same_scope(node.body))
        for name in names:
            # A momentum buffer made from the gradient steps the parameter just the same.
            derived = _grad_derived(body, name)
            updates = [stmt for stmt in body if _update_step(stmt, name, derived) is not None]
            if updates:
                break
        else:
            return
        param = _loop_parameter(node, ctx)
        if param != name:
            return
        for stmt in updates:
            if _adam_shaped(body, stmt):
                # Adam by hand: the square of the gradient averaged, the step divided by its root.
                made = _construction(node, ctx)
                arguments = made or f"{_parameter_source(ctx, node.iter)}, lr={_learning_rate(ctx, stmt, param, derived) or 'lr'}"
                yield ctx.finding(
                    self,
                    stmt,
                    _message(ctx, "", "", algorithm="Adam", arguments=arguments),
                    replacement=_replacement(ctx, "", "", algorithm="Adam", arguments=arguments),
                    fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
                )
                return
            lr = _learning_rate(ctx, stmt, param, derived) or "lr"
            params = _parameter_source(ctx, node.iter)
            extra = _momentum(body, derived) + _weight_decay(body, param, derived)
            yield ctx.finding(
                self,
                stmt,
                _message(ctx, lr, params, extra),
                replacement=_replacement(ctx, lr, params, extra),
                fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
            )
            return  # one finding per loop: the loop is the problem


def _message(ctx: FileContext, lr: str, params: str, momentum: str = "", algorithm: str = "SGD",
             arguments: str = "") -> str:
    target = ctx.target
    replacement = _replacement(ctx, lr, params, momentum, algorithm, arguments)
    if target == "npu":
        instead = (
            f"{replacement} fuses the update (parameters must be fp16/fp32 and keep their identity; unverified on "
            "Ascend hardware)"
        )
    else:
        instead = f"{replacement} updates every parameter in one fused kernel"
    waiting = "the step waits" if target == "cpu" else f"the {target} device waits"
    if algorithm == "Adam":
        keep = ("or torch._foreach_mul_/_foreach_addcmul_/_foreach_addcdiv_ keep the loop's logic in a few "
                "multi-tensor calls")
        what = "hand-written Adam step, one parameter at a time"
    else:
        negative = f"-{lr}" if _SIMPLE.match(lr) else f"-({lr})"
        keep = f"or torch._foreach_add_(params, grads, alpha={negative}) keeps the loop's logic in one multi-tensor call"
        what = "hand-written per-parameter update"
    return (
        f"{what}: each iteration launches its own small kernels from Python "
        f"(hundreds per step for a real model) and {waiting} on the launches; "
        f"{instead}, {keep}. Display-only: moving to an optimizer object needs a person"
    )


def _adam_shaped(body: list[ast.stmt], update: ast.stmt) -> bool:
    """Adam's step: a buffer of squared gradients (``v.mul_(b2).addcmul_(g, g, ...)``
    or ``v = b2 * v + (1 - b2) * g ** 2``) and an update divided by a square root."""
    squares = False
    for stmt in body:
        for sub in fast_walk(stmt):
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "addcmul_":
                squares = True
            elif isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Pow) and isinstance(sub.right, ast.Constant) \
                    and sub.right.value == 2:
                squares = True
            elif isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mult) \
                    and ast.unparse(sub.left) == ast.unparse(sub.right) and isinstance(sub.left, ast.Name):
                squares = True
    root = any(isinstance(sub, ast.Call) and (
        (isinstance(sub.func, ast.Attribute) and sub.func.attr in ("sqrt", "sqrt_", "rsqrt"))
        or (isinstance(sub.func, ast.Name) and sub.func.id == "sqrt")) for sub in fast_walk(update))
    divides = any(isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Div) for sub in fast_walk(update)) or any(
        isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "addcdiv_"
        for sub in fast_walk(update))
    if not root:
        # The root taken into a name first: ``denom = v_hat.sqrt() + eps``.
        roots = {ast.unparse(t) for stmt in body if isinstance(stmt, ast.Assign) for t in stmt.targets
                 if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                        and c.func.attr in ("sqrt", "sqrt_") for c in fast_walk(stmt.value))}
        root = any(isinstance(sub, ast.Name) and sub.id in roots for sub in fast_walk(update))
    return squares and root and divides


def _construction(loop: ast.For, ctx: FileContext) -> str | None:
    """The arguments the script builds its hand-written optimizer class with
    (``model.parameters(), lr=args.lr``), when it builds it once in this file and
    names only arguments ``torch.optim.Adam`` takes too."""
    walked = loop.iter.args if isinstance(loop.iter, ast.Call) else [loop.iter]
    cls = next((c for c in (_held_by_class(w, ctx) for w in walked) if c is not None), None)
    if cls is None:
        return None
    calls = [n for n in fast_walk(ctx.tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == cls.name]
    if len(calls) != 1:
        return None
    call = calls[0]
    if any(k.arg not in _ADAM_KEYWORDS for k in call.keywords) or len(call.args) > 1 \
            or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    return ", ".join(ctx.text(a) for a in [*call.args, *call.keywords])


#: The keyword arguments of torch.optim.Adam a hand-written class may share.
_ADAM_KEYWORDS = ("params", "lr", "betas", "eps", "weight_decay", "amsgrad")


def _momentum(body: list[ast.stmt], derived: frozenset[str]) -> str:
    """``, momentum=M`` when a gradient buffer is decayed in place (``buf.mul_(M)``)."""
    for stmt in body:
        for node in fast_walk(stmt):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "mul_"
                    and len(node.args) == 1 and not node.keywords and ast.unparse(node.func.value) in derived):
                return f", momentum={ast.unparse(node.args[0])}"
    return ""


def _weight_decay(body: list[ast.stmt], param: str, derived: frozenset[str] = frozenset()) -> str:
    """``, weight_decay=WD`` when the gradient (or a name made from it, ``derived``)
    is decayed toward the parameter before stepping, as torch.optim.SGD's
    ``weight_decay`` does (``p.grad + wd * p``, ``d_p.add(p.data, alpha=wd)``)."""

    def gradient(node: ast.AST) -> bool:
        return _is_grad(node, param) or (isinstance(node, ast.Name) and node.id in derived)

    for stmt in body:
        for node in fast_walk(stmt):
            decay = None
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                for grad, other in ((node.left, node.right), (node.right, node.left)):
                    if gradient(grad) and isinstance(other, ast.BinOp) and isinstance(other.op, ast.Mult):
                        if _is_param(other.right, param):
                            decay = other.left
                        elif _is_param(other.left, param):
                            decay = other.right
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("add", "add_") and gradient(node.func.value)
                  and len(node.args) == 1 and _is_param(node.args[0], param)):
                decay = next((k.value for k in node.keywords if k.arg == "alpha"), None)
            if decay is not None:
                return f", weight_decay={ast.unparse(decay)}"
    return ""


def _is_grad(node: ast.AST, param: str) -> bool:
    """``p.grad`` or ``p.grad.data``."""
    if isinstance(node, ast.Attribute) and node.attr == "data":
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr == "grad" and isinstance(node.value, ast.Name) \
        and node.value.id == param


def _replacement(ctx: FileContext, lr: str, params: str, momentum: str = "", algorithm: str = "SGD",
                 arguments: str = "") -> str:
    arguments = arguments or f"{params}, lr={lr}{momentum}"
    if ctx.target == "npu":
        return f"torch_npu.optim.NpuFused{algorithm}({arguments})"
    if algorithm in ctx.capabilities.get("fused_optimizers", ("SGD", "Adam")):
        return f"torch.optim.{algorithm}({arguments}, fused=True)"
    return f"torch.optim.{algorithm}({arguments}, foreach=True)"


def _function_argument(name: str, ctx: FileContext) -> bool:
    """Whether ``name`` is an argument of the plain function the node being visited
    is in (not a method: a class's own loop over what it holds is an optimizer's
    implementation, or something else entirely)."""
    for node in reversed(ctx.parents):
        if isinstance(node, ast.ClassDef):
            return False
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
            return name in names and not any(isinstance(p, ast.ClassDef) for p in ctx.parents)
    return False


def _loop_parameter(loop: ast.For, ctx: FileContext) -> str | None:
    """The loop variable bound to each parameter, when the loop walks parameters:
    a module's, or a function's argument whose every element is stepped by its own
    ``.grad`` (``def sgd_step(params, lr): for p in params: ...``)."""
    kind = iterable_kind(loop.iter, ctx)
    if kind is None and isinstance(loop.iter, ast.Name) and _function_argument(loop.iter.id, ctx):
        kind = "parameters"
    target = loop.target
    call = loop.iter
    if (kind is None and isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == "enumerate" and "enumerate" not in ctx.imports and call.args
            and isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name)
            and iterable_kind(call.args[0], ctx) == "parameters"):
        return target.elts[1].id
    if (kind is None and isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "zip"
            and "zip" not in ctx.imports and isinstance(target, ast.Tuple) and len(target.elts) == len(call.args)):
        # for p, buf in zip(model.parameters(), buffers): the element walking the parameters;
        # for i, p in enumerate(model.parameters()): the second.
        for element, iterable in zip(target.elts, call.args):
            if isinstance(element, ast.Name) and iterable_kind(iterable, ctx) == "parameters":
                return element.id
        return None
    if kind == "parameters" and isinstance(target, ast.Name):
        return target.id
    if (
        kind == "named_parameters"
        and isinstance(target, ast.Tuple)
        and len(target.elts) == 2
        and isinstance(target.elts[1], ast.Name)
    ):
        return target.elts[1].id
    return None


def iterable_kind(node: ast.AST, ctx: FileContext, depth: int = 0) -> str | None:
    """``"parameters"`` or ``"named_parameters"`` when ``node`` yields a module's
    parameters (directly, through list()/filter()/a comprehension, or through a name
    assigned once from one of those), else None."""
    if depth > 3:
        return None
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("parameters", "named_parameters"):
            return func.attr
        if isinstance(func, ast.Name) and func.id in _PASS_THROUGH and func.id not in ctx.imports:
            for arg in node.args:
                kind = iterable_kind(arg, ctx, depth + 1)
                if kind:
                    return kind
        return None
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)) and len(node.generators) == 1:
        gen = node.generators[0]
        if isinstance(node.elt, ast.Name) and isinstance(gen.target, ast.Name) and node.elt.id == gen.target.id:
            return iterable_kind(gen.iter, ctx, depth + 1)
        return None
    if isinstance(node, ast.Name):
        value = ctx.single_assignments().get(node.id)
        if value is not None:
            return iterable_kind(value, ctx, depth + 1)
    if depth == 0 and _held_by_class(node, ctx) is not None:
        return "parameters"
    return None


def _held_by_class(node: ast.AST, ctx: FileContext) -> ast.ClassDef | None:
    """The class, when ``node`` is ``self.X`` in a method of a class that is not an
    optimizer (no base named ``...Optimizer``: torch.optim's own loops are its
    implementation) and whose ``__init__`` sets ``self.X`` from an argument it was
    handed (``self.params = [p for p in params if p.requires_grad]``, ``list(params)``):
    a hand-written optimizer class."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
        return None
    cls = next((p for p in reversed(ctx.parents) if isinstance(p, ast.ClassDef)), None)
    if cls is None or any(ast.unparse(base).split(".")[-1].endswith("Optimizer") for base in cls.bases):
        return None
    init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return None
    arguments = {a.arg for a in [*init.args.posonlyargs, *init.args.args, *init.args.kwonlyargs]} - {"self"}
    for stmt in fast_walk(init):
        if not isinstance(stmt, ast.Assign):
            continue
        for target in stmt.targets:
            if ast.unparse(target) == ast.unparse(node) and _from_argument(stmt.value, arguments):
                return cls
    return None


def _from_argument(value: ast.AST, arguments: set[str]) -> bool:
    """``params``, ``list(params)`` or ``[p for p in params if ...]`` for an argument."""
    if isinstance(value, ast.Name):
        return value.id in arguments
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in _PASS_THROUGH:
        return any(_from_argument(a, arguments) for a in value.args)
    if isinstance(value, (ast.ListComp, ast.GeneratorExp)) and len(value.generators) == 1:
        gen = value.generators[0]
        return isinstance(value.elt, ast.Name) and isinstance(gen.target, ast.Name) \
            and value.elt.id == gen.target.id and _from_argument(gen.iter, arguments)
    return False


def _parameter_source(ctx: FileContext, node: ast.AST) -> str:
    """Text for the parameters to hand an optimizer, e.g. ``model.parameters()``."""
    for sub in fast_walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "parameters":
            return ctx.text(sub)
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "named_parameters":
            return f"{ctx.text(sub.func.value)}.parameters()"
    if isinstance(node, ast.Name):
        return node.id
    return "params"


def _same_scope(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements of a loop body, nested blocks included, nested functions not."""
    stack = list(reversed(body))
    while stack:
        stmt = stack.pop()
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield stmt
        children = [c for c in child_nodes(stmt) if isinstance(c, ast.stmt)]
        stack.extend(reversed(children))


def _is_param(node: ast.AST, param: str) -> bool:
    """``p`` or ``p.data``."""
    if isinstance(node, ast.Attribute) and node.attr == "data":
        node = node.value
    return isinstance(node, ast.Name) and node.id == param


def _reads_grad(node: ast.AST, param: str, derived: frozenset[str] = frozenset()) -> bool:
    """Whether ``node`` reads ``param.grad``, or a buffer made from it (``derived``)."""
    for sub in fast_walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "grad" and isinstance(sub.value, ast.Name) \
                and sub.value.id == param:
            return True
        if derived and isinstance(sub, (ast.Name, ast.Subscript, ast.Attribute)) and isinstance(
                getattr(sub, "ctx", None), ast.Load) and ast.unparse(sub) in derived:
            return True
    return False


def _receiver(call: ast.Call) -> ast.AST:
    """What a chain of in-place calls writes to: ``buf`` in ``buf.mul_(m).add_(g)``."""
    node: ast.AST = call
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value
    return node


def _grad_derived(body: list[ast.stmt], param: str) -> frozenset[str]:
    """What the loop body computes from ``param.grad`` before stepping with it: a name
    (``d_p = p.grad + wd * p``), a buffer written in place (``buf.mul_(mu).add_(p.grad)``)
    or an entry (``state[p] = mu * state[p] + p.grad``), as source text."""
    derived: set[str] = set()
    for stmt in body:
        frozen = frozenset(derived)
        if isinstance(stmt, (ast.Assign, ast.AugAssign)) and _reads_grad(stmt.value, param, frozen):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, (ast.Name, ast.Subscript, ast.Attribute)) and not _is_param(target, param):
                    derived.add(ast.unparse(target))
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call = stmt.value
            if isinstance(call.func, ast.Attribute) and call.func.attr.endswith("_"):
                base = _receiver(call)
                inner = [a for c in fast_walk(call) if isinstance(c, ast.Call) for a in [*c.args, *c.keywords]]
                if not _is_param(base, param) and any(_reads_grad(a, param, frozen) for a in inner) and isinstance(
                        base, (ast.Name, ast.Subscript, ast.Attribute)):
                    derived.add(ast.unparse(base))
    return frozenset(derived)


def _update_step(stmt: ast.stmt, param: str, derived: frozenset[str] = frozenset()) -> ast.AST | None:
    """The expression that steps ``param`` by its gradient, when ``stmt`` is one."""
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, (ast.Add, ast.Sub)):
        if _is_param(stmt.target, param) and _reads_grad(stmt.value, param, derived):
            return stmt.value
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        if isinstance(target, ast.Attribute) and target.attr == "data" and _is_param(target, param):
            if _reads_grad(stmt.value, param, derived):
                return stmt.value
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in _UPDATE_METHODS and _is_param(func.value, param):
            if any(_reads_grad(a, param, derived) for a in [*call.args, *call.keywords]):
                return call
    return None


def _learning_rate(ctx: FileContext, stmt: ast.stmt, param: str,
                   derived: frozenset[str] = frozenset()) -> str | None:
    """The step size, as source text, for the common spellings of the update."""
    def grad_factor(expr: ast.AST) -> ast.AST | None:
        # lr * p.grad, p.grad * lr
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
            if _reads_grad(expr.right, param, derived) and not _reads_grad(expr.left, param, derived):
                return expr.left
            if _reads_grad(expr.left, param, derived) and not _reads_grad(expr.right, param, derived):
                return expr.right
        return None

    def negated(expr: ast.AST) -> str | None:
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
            return ctx.text(expr.operand)
        return None

    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Sub):
        factor = grad_factor(stmt.value)
        return ctx.text(factor) if factor is not None else None
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
        method = call.func.attr if isinstance(call.func, ast.Attribute) else ""
        alpha = next((k.value for k in call.keywords if k.arg == "alpha"), None)
        if method == "add_" and alpha is not None:
            return negated(alpha)
        if method == "sub_" and alpha is not None:
            return ctx.text(alpha)
        if method == "sub_" and len(call.args) == 1:
            factor = grad_factor(call.args[0])
            return ctx.text(factor) if factor is not None else None
        if method == "add_" and len(call.args) == 1:
            factor = grad_factor(call.args[0])
            return negated(factor) if factor is not None else None
        if method == "add_" and len(call.args) == 2 and _reads_grad(call.args[1], param):
            return negated(call.args[0])  # the old add_(-lr, grad) spelling
    if isinstance(stmt, ast.Assign):
        value = stmt.value
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Sub) and _is_param(value.left, param):
            factor = grad_factor(value.right)
            return ctx.text(factor) if factor is not None else None
    return None
