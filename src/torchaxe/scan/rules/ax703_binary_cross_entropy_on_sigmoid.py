"""AX703: binary cross-entropy computed on a sigmoid's probabilities."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext, Need, walk_scope
from torchaxe.scan.rules._bindings import (
    MODULE_METHODS, VALUE_KEEPING_METHODS, assigned_values, method, parameter_arguments, reaching, self_bindings,
    unmoved,
)
from torchaxe.scan.rules._distributed import enclosing, function_of
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Binary cross-entropy on probabilities, as a function.
_BCE_FUNCTIONS = frozenset({"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy"})
_BCE_LOSS = "torch.nn.BCELoss"
#: A sigmoid, as a function of its first argument.
_SIGMOID_FUNCTIONS = frozenset({"torch.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit",
                                "torch.Tensor.sigmoid"})
_SIGMOID_MODULE = "torch.nn.Sigmoid"
_KEEPS_VALUES_FUNCTIONS = frozenset({"torch.squeeze", "torch.flatten", "torch.reshape", "torch.unsqueeze"})
#: Wrappers of a model whose call is the model's.
_MODEL_WRAPPERS = frozenset({"torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                             "torch.nn.parallel.DistributedDataParallel", "torch.compile"})
_DEPTH = 6
_DATA_PARALLEL = frozenset({"torch.nn.parallel.data_parallel", "torch.nn.parallel.data_parallel.data_parallel"})
#: What :func:`_model_class` calls a module that is not a class of the file.
_SIGMOID_SEQUENTIAL = "sigmoid-sequential"
_SIGMOID_LAYER = "sigmoid-layer"
#: What a file tells others (``FileContext.exports``): its models whose forward() ends
#: in a sigmoid (``D``, or ``D[0]`` for the first element of the tuple it returns).
SIGMOID_MODELS = "sigmoid-models"
#: What a file does with other files' models (``FileContext.uses``): binary
#: cross-entropy on their output.
BCE_ON_OUTPUT = "bce-on-output"
#: Where the needs of other files found while reading one loss call are gathered.
_NEEDS = "ax703.needs"


@dataclass(frozen=True)
class _Imported:
    """A model built from a class another module defines (one of ``refs``, each
    ``(module, level, name)`` as ``FileContext.imported_from`` gives it)."""

    refs: tuple[tuple[str, int, str], ...]


class BinaryCrossEntropyOnSigmoid(Rule):
    """
    ## What it does
    Flags binary cross-entropy (`F.binary_cross_entropy`, an `nn.BCELoss()` criterion)
    whose input is a sigmoid's output: `torch.sigmoid(x)` or `x.sigmoid()` passed
    directly, a name the same function assigned from one, a parameter that every call
    of its function in the file fills with one, or the output of a model of the file
    whose `forward` ends in a sigmoid (`nn.Sequential(..., nn.Sigmoid())`, `return
    torch.sigmoid(h)`), through `.view(-1)` and other reshapes.

    ## Why is this bad?
    The sigmoid and the loss are separate kernels forward and backward, where
    `binary_cross_entropy_with_logits` computes both in one, with the log-sum-exp
    form that stays exact for large logits (on probabilities the log is clamped at
    -100, so a saturated sigmoid's gradient is lost). On CUDA (and NPU), autocast
    refuses `binary_cross_entropy` outright ("unsafe to autocast"): a script with this
    loss cannot take mixed precision until it changes.

    ## Example
    ```python
    loss = F.binary_cross_entropy(torch.sigmoid(logits), target)
    ```

    ## Use instead
    ```python
    loss = F.binary_cross_entropy_with_logits(logits, target)
    ```

    ## Fix safety
    Unsafe: the loss and its gradient change by rounding (and where the sigmoid
    saturated, by more: the clamped log is gone). Rewritten only where the sigmoid is
    inside the call; where it is a model's last layer, the model must return logits
    and everything that reads its output as a probability (accuracy, logging) must
    apply the sigmoid itself: shown, not rewritten. NPU: unverified on Ascend hardware.
    """

    code = "AX703"
    name = "binary-cross-entropy-on-sigmoid"
    category = "bce_on_probabilities"
    message = "binary cross-entropy is computed on a sigmoid's output"
    fix_title = "use binary_cross_entropy_with_logits on the logits"
    fix_safety = Applicability.UNSAFE
    requires_text = ("binary_cross_entropy", "BCELoss")
    export_text = ("sigmoid", "Sigmoid", "expit")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/generated/torch.nn.BCEWithLogitsLoss.html",
        "https://pytorch.org/docs/stable/amp.html#ops-that-can-autocast-to-float32",
    )
    examples = (
        Invalid(
            "import torch\nimport torch.nn.functional as F\nloss = F.binary_cross_entropy(torch.sigmoid(z), y)\n",
            fixed="import torch\nimport torch.nn.functional as F\nloss = F.binary_cross_entropy_with_logits(z, y)\n", lines=(3,),
        ),
        Invalid(
            "import torch\nimport torch.nn.functional as F\n"
            "loss = F.binary_cross_entropy((a + b).sigmoid().view(-1), y, reduction='sum')\n",
            target="cuda",
            fixed="import torch\nimport torch.nn.functional as F\n"
                  "loss = F.binary_cross_entropy_with_logits((a + b).view(-1), y, reduction='sum')\n", lines=(3,),
        ),
        # Through a name, and an nn.BCELoss criterion: shown.
        Invalid(
            "import torch\nimport torch.nn as nn\ncriterion = nn.BCELoss()\n"
            "def step(model, x, y):\n    logits = model(x)\n    probs = torch.sigmoid(logits)\n"
            "    return criterion(probs, y)\n", lines=(7,)
        ),
        # DCGAN: the discriminator's Sequential ends in nn.Sigmoid().
        Invalid(
            "import torch\nimport torch.nn as nn\n"
            "class D(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.main = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())\n"
            "    def forward(self, x):\n        return self.main(x)\n"
            "netD = D().to('cpu')\ncriterion = nn.BCELoss()\n"
            "for x, label in data:\n    output = netD(x).view(-1)\n    err = criterion(output, label)\n",
            target="npu", lines=(13,), message="whose forward() ends in a sig",
        ),
        # A VAE's decoder ends in a sigmoid; the loss function takes its output.
        Invalid(
            "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
            "class VAE(nn.Module):\n    def decode(self, z):\n        return torch.sigmoid(self.fc(z))\n"
            "    def forward(self, x):\n        z = self.enc(x)\n        return self.decode(z), z\n"
            "def loss_function(recon_x, x):\n    return F.binary_cross_entropy(recon_x, x, reduction='sum')\n"
            "model = VAE()\nrecon, z = model(x)\nloss = loss_function(recon, x)\n", lines=(11,)
        ),
        # ConvE: the model keeps its criterion; the training loop in another file applies
        # it to forward()'s output.
        Invalid(
            "import torch\n"
            "class ConvE(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.fc = torch.nn.Linear(4, 8)\n        self.loss = torch.nn.BCELoss()\n"
            "    def forward(self, x):\n        pred = self.fc(x)\n        pred = torch.sigmoid(pred)\n"
            "        return pred\n", lines=(6,), message="is an nn.BCELoss of ConvE, whose forward() ends in a sig",
        ),
        # ... not when the file calls it (that call is judged by its input).
        Valid("import torch\n"
              "class M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        self.loss = torch.nn.BCELoss()\n"
              "    def forward(self, x, y):\n        return torch.sigmoid(x)\n"
              "    def step(self, p, y):\n        return self.loss(p.clamp(0, 1), y)\n"),
        Valid("import torch\nimport torch.nn.functional as F\nloss = F.binary_cross_entropy_with_logits(z, y)\n"),
        # Probabilities that are not a sigmoid's, or of unknown origin.
        Valid("import torch\nimport torch.nn.functional as F\n"
              "loss = F.binary_cross_entropy(torch.softmax(z, -1)[:, 1], y)\n"),
        Valid("import torch\nimport torch.nn as nn\ncriterion = nn.BCELoss()\nloss = criterion(model(x), y)\n"),
        Valid("import torch\nimport torch.nn.functional as F\n"
              "def bce(p, y):\n    return F.binary_cross_entropy(p, y)\nloss = bce(p_clamped, y)\n"),
        # The name is bound to a sigmoid on one path only.
        Valid("import torch\nimport torch.nn.functional as F\ndef f(z, y, raw):\n    p = torch.sigmoid(z)\n"
              "    if raw:\n        p = z.clamp(0, 1)\n    return F.binary_cross_entropy(p, y)\n"),
        # A sigmoid used as a gate, the loss on something else.
        Valid("import torch\nimport torch.nn as nn\ncriterion = nn.BCELoss()\ng = torch.sigmoid(gate)\n"
              "loss = criterion(out * 0 + target_p, y)\n"),
        Valid("import torch\nimport torch.nn.functional as F\n"
              "loss = F.binary_cross_entropy(torch.sigmoid(z), y)  # noqa: AX703\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        if ctx.call_name(node) == _BCE_LOSS:
            yield from self._held_by_model(node, ctx)
            return
        functional = (ctx.call_name(node) or "") in _BCE_FUNCTIONS
        if not functional and not _is_bce_criterion(node.func, ctx):
            return
        probs = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "input"), None)
        if probs is None:
            return
        scope = function_of(ctx.parents, ctx.tree)
        owner = enclosing(ctx.parents, (ast.ClassDef,))
        ctx.cache[_NEEDS] = []
        how = _sigmoid_source(probs, scope, ctx, 0, owner=owner if isinstance(owner, ast.ClassDef) else None)
        needs: list[tuple[str, int, str]] = ctx.cache.pop(_NEEDS)
        if how is None:
            return
        if ctx.target == "cuda":
            cost = "and CUDA autocast refuses binary_cross_entropy (\"unsafe to autocast\"): no mixed precision with it"
        elif ctx.target == "npu":
            cost = ("and autocast on the NPU refuses binary_cross_entropy as on CUDA (unverified on Ascend "
                    "hardware): no mixed precision with it")
        else:
            cost = "and on GPUs and NPUs autocast refuses binary_cross_entropy, blocking mixed precision"
        message = (f"binary cross-entropy on {how}: the sigmoid and the loss are separate kernels forward and "
                   "backward, and the log of a saturated probability is clamped at -100 (its gradient lost); "
                   "binary_cross_entropy_with_logits on the logits computes both in one, stably, "
                   f"{cost}")
        edits = _rewrite(node, probs, ctx) if functional else None
        if needs:
            # The model's class is another file's: the finding holds when that file,
            # scanned too, says its forward() ends in a sigmoid; this file's use of it
            # is told to that file's finding.
            finding = ctx.finding(self, node, message + ". Shown, not rewritten: the model must return logits",
                                  fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
            ctx.needs.append((tuple(Need("exports", SIGMOID_MODELS, name, module, level)
                                    for module, level, name in needs), finding))
            ctx.uses.setdefault(BCE_ON_OUTPUT, []).extend((m, lv, n.split("[")[0]) for m, lv, n in needs)
        elif edits is not None:
            yield ctx.finding(self, node, message, fix=ctx.fix(self, edits))
        else:
            yield ctx.finding(self, node, message + ". Shown, not rewritten: the logits must be passed instead",
                              fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))


    def export(self, ctx: FileContext) -> Iterable[Finding]:
        """The file's models whose forward() ends in a sigmoid, for the training code
        of other files; each is reported when another file's binary cross-entropy
        is computed on its output."""
        for cls in ctx.nodes(ast.ClassDef):
            forward = method(cls, "forward")
            if forward is None:
                continue
            names = _sigmoid_outputs(cls, ctx)
            if not names:
                continue
            ctx.exports.setdefault(SIGMOID_MODELS, []).extend(names)
            finding = ctx.finding(
                self, forward,
                f"{cls.name}.forward() ends in a sigmoid, and the training code of another file computes binary "
                "cross-entropy on its output: the sigmoid and the loss are separate kernels forward and backward "
                "and the log of a saturated probability is clamped at -100 (its gradient lost); return the logits "
                "and use binary_cross_entropy_with_logits there (the sigmoid applied where a probability is read). "
                "Shown, not rewritten",
                fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
            ctx.needs.append(((Need("used", BCE_ON_OUTPUT, cls.name),), finding))
        return ()

    def _held_by_model(self, node: ast.Call, ctx: FileContext) -> Iterable[Finding]:
        """``self.loss = nn.BCELoss()`` in the ``__init__`` of a model whose
        ``forward`` ends in a sigmoid, the criterion called nowhere in the file: the
        training code elsewhere applies it to the model's output (ConvE's and
        TuckER's ``model.loss(model.forward(e1, rel), targets)``)."""
        assign = ctx.parents[-1] if ctx.parents else None
        if not isinstance(assign, ast.Assign) or len(assign.targets) != 1 or assign.value is not node:
            return
        target = assign.targets[0]
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"):
            return
        init = enclosing(ctx.parents, (ast.FunctionDef, ast.AsyncFunctionDef))
        owner = enclosing(ctx.parents, (ast.ClassDef,))
        if not isinstance(init, ast.FunctionDef) or init.name != "__init__" or not isinstance(owner, ast.ClassDef) \
                or method(owner, "__init__") is not init:
            return
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == target.attr
               for n in ctx.nodes(ast.Call)):
            return  # called in the file: that call is judged by what it is given
        how = _method_returns_sigmoid(owner, "forward", ctx, 0, None)
        if how is None:
            return
        yield ctx.finding(
            self, node,
            f"`self.{target.attr}` is an nn.BCELoss of {owner.name}, whose forward() ends in a sigmoid: the "
            "training code applies it to the sigmoid's output, so the sigmoid and the loss are separate kernels "
            "forward and backward and the log of a saturated probability is clamped at -100 (its gradient lost); "
            "return the logits from forward(), keep nn.BCEWithLogitsLoss() here, and apply the sigmoid where a "
            "probability is read (prediction, metrics). Shown, not rewritten",
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))


def _is_bce_criterion(func: ast.AST, ctx: FileContext) -> bool:
    """``nn.BCELoss()(...)`` or a name or attribute every assignment in the file binds
    to ``nn.BCELoss(...)``."""
    if isinstance(func, ast.Call):
        return ctx.call_name(func) == _BCE_LOSS
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name is None:
        return False
    values = [unmoved(v, ctx) for v in assigned_values(ctx).get(name) or ()]
    return bool(values) and all(isinstance(v, ast.Call) and ctx.call_name(v) == _BCE_LOSS for v in values)


def _strip_values_kept(node: ast.AST, ctx: FileContext) -> ast.AST:
    """``p.view(-1).float()`` -> ``p``; ``p[:, 0]`` -> ``p``; ``torch.squeeze(p)`` -> ``p``."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in VALUE_KEEPING_METHODS:
            if ctx.qualified_name(node.func) is None:  # a method, not torch.view(...)
                node = node.func.value
                continue
        if isinstance(node, ast.Call) and (ctx.call_name(node) or "") in _KEEPS_VALUES_FUNCTIONS and node.args:
            node = node.args[0]
            continue
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Constant):
            node = node.value
            continue
        return node


def _sigmoid_call(node: ast.AST, ctx: FileContext) -> ast.AST | None:
    """The logits of ``torch.sigmoid(z)``, ``z.sigmoid()``, ``nn.Sigmoid()(z)``;
    else None."""
    if not isinstance(node, ast.Call):
        return None
    name = ctx.call_name(node) or ""
    if name in _SIGMOID_FUNCTIONS and node.args:
        return node.args[0]
    if isinstance(node.func, ast.Attribute) and node.func.attr == "sigmoid" and not node.args and \
            ctx.qualified_name(node.func) is None:
        return node.func.value
    if isinstance(node.func, ast.Call) and ctx.call_name(node.func) == _SIGMOID_MODULE and node.args:
        return node.args[0]
    return None


def _sigmoid_source(node: ast.AST, scope: ast.AST | None, ctx: FileContext, depth: int,
                    index: int | None = None, owner: ast.ClassDef | None = None) -> str | None:
    """How ``node`` (read in function ``scope``) holds a sigmoid's output: a short
    phrase for the message, or None when it is not known to. ``index``: the element
    taken from a tuple the expression gives; ``owner``: the class whose ``self`` the
    expression may read."""
    if depth > _DEPTH:
        return None
    node = _strip_values_kept(node, ctx)
    if index is not None and isinstance(node, ast.Tuple):
        if index >= len(node.elts):
            return None
        return _sigmoid_source(node.elts[index], scope, ctx, depth + 1, None, owner)
    if index is None and _sigmoid_call(node, ctx) is not None:
        return f"`{ctx.text(node)}`" if depth == 0 else "a sigmoid's output"
    if isinstance(node, ast.Name) and scope is not None:
        return _name_source(node.id, scope, ctx, depth, index, owner, node.lineno)
    if isinstance(node, ast.Call):
        return _call_source(node, scope, ctx, depth, index, owner)
    return None


def _name_source(name: str, scope: ast.AST, ctx: FileContext, depth: int, index: int | None,
                 owner: ast.ClassDef | None, line: int) -> str | None:
    """A local name read on ``line``: every assignment it may hold the value of there
    (:func:`reaching`) gives a sigmoid's output (an element of an unpacked tuple counts
    by its position); a parameter: every call of the function in the file passes one."""
    sources = reaching(name, scope, line, ctx)
    if sources is None or (index is not None and any(b.index is not None for b in sources)):
        return None  # bound another way, or an element of an element: not followed
    if sources:
        found = [_sigmoid_source(b.value, scope, ctx, depth + 1, b.index if b.index is not None else index, owner)
                 for b in sources]
        return found[-1] if all(found) else None
    return _parameter_source(name, scope, ctx, depth, index)


def _parameter_source(name: str, scope: ast.AST, ctx: FileContext, depth: int, index: int | None) -> str | None:
    """A parameter of a function: every call of it in the file passes a sigmoid's
    output there (positionally or by keyword)."""
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or index is not None:
        return None
    arguments = parameter_arguments(scope, name, ctx)
    if arguments is None:
        return None
    found = [_sigmoid_source(arg, caller, ctx, depth + 1) for arg, caller in arguments]
    if not all(found):
        return None
    return f"{found[0]}, passed to {scope.name}() as `{name}`"


def _call_source(call: ast.Call, scope: ast.AST | None, ctx: FileContext, depth: int, index: int | None,
                 owner: ast.ClassDef | None) -> str | None:
    """A call of a model of the file whose ``forward`` (or the method called) ends in
    a sigmoid, of an ``nn.Sequential`` whose last layer is ``nn.Sigmoid()``, or of
    an ``nn.Sigmoid()`` module kept in a name."""
    func = call.func
    if (ctx.call_name(call) or "") in _DATA_PARALLEL and call.args:
        func = call.args[0]  # nn.parallel.data_parallel(module, inputs, ...)
    elif isinstance(func, ast.Attribute):
        cls = _model_class(func.value, scope, ctx, owner, depth)
        if isinstance(cls, ast.ClassDef) and method(cls, func.attr) is not None:
            return _method_returns_sigmoid(cls, func.attr, ctx, depth, index)
        if isinstance(cls, _Imported) and func.attr == "forward":
            func = func.value  # ``model.forward(x)``: the model's call
    elif isinstance(func, ast.Name) and _module_function(func.id, ctx) is not None:
        function = _module_function(func.id, ctx)
        returns = [n.value for n in walk_scope(function) if isinstance(n, ast.Return)]
        if returns and all(r is not None and _sigmoid_source(r, function, ctx, depth + 1, index) for r in returns):
            return f"the output of {func.id}(), which ends in a sigmoid"
        return None
    kind = _model_class(func, scope, ctx, owner, depth)
    if isinstance(kind, ast.ClassDef):
        return _method_returns_sigmoid(kind, "forward", ctx, depth, index)
    if isinstance(kind, _Imported):
        needs = ctx.cache.get(_NEEDS)
        if needs is None:
            return None
        suffix = f"[{index}]" if index is not None else ""
        needs.extend((module, level, name + suffix) for module, level, name in kind.refs)
        names = " or ".join(name for _, _, name in kind.refs)
        return f"the output of {names} (another file's model), whose forward() ends in a sigmoid"
    if kind == _SIGMOID_SEQUENTIAL and index is None:
        return "the output of an nn.Sequential that ends in nn.Sigmoid()"
    if kind == _SIGMOID_LAYER and index is None:
        return "an nn.Sigmoid() layer's output"
    return None


def _model_class(node: ast.AST, scope: ast.AST | None, ctx: FileContext, owner: ast.ClassDef | None,
                 depth: int) -> ast.ClassDef | str | _Imported | None:
    """The class of the file ``node`` is an instance of (a name or ``self.x`` every
    assignment binds to it, through ``.to(device)``, DataParallel and the file's
    functions and methods that build it), the string :data:`_SIGMOID_SEQUENTIAL` for
    an ``nn.Sequential`` ending in ``nn.Sigmoid()``, :data:`_SIGMOID_LAYER` for an
    ``nn.Sigmoid()`` or ``torch.sigmoid`` itself, or None."""
    if depth > _DEPTH:
        return None
    if isinstance(node, ast.Name) and node.id == "self" and owner is not None:
        return owner
    if (ctx.qualified_name(node) or "") in _SIGMOID_FUNCTIONS:
        return _SIGMOID_LAYER  # ``self.act = torch.sigmoid``
    if isinstance(node, ast.Call):
        return _built_class(node, scope, ctx, owner, depth)
    values: list[ast.expr] | None = None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        values = self_bindings(owner, node.attr, ctx) if owner is not None else assigned_values(ctx).get(node.attr)
    elif isinstance(node, ast.Name):
        if owner is not None and _init_parameter(owner, node.id):
            return _constructor_argument(owner, node.id, ctx, depth)
        values = assigned_values(ctx).get(node.id)
    if not values:
        return None
    found = set()
    result: ast.ClassDef | str | _Imported | None = None
    imported: list[tuple[str, int, str]] = []
    for value in values:
        if _wraps_itself(value, node, ctx):
            continue  # ``D = D.to(device)``, ``model = nn.DataParallel(model)``: the others say what it is
        kind = _model_class(value, scope, ctx, owner, depth + 1)
        if kind is None:
            return None
        if isinstance(kind, _Imported):
            imported.extend(r for r in kind.refs if r not in imported)
        found.add(id(kind) if isinstance(kind, ast.ClassDef) else "imported" if isinstance(kind, _Imported) else kind)
        result = kind
    if found == {"imported"}:
        return _Imported(tuple(imported))  # ``net = U2NET(...)`` or ``U2NETP(...)``: both must end in one
    return result if len(found) == 1 else None


def _built_class(node: ast.Call, scope: ast.AST | None, ctx: FileContext, owner: ast.ClassDef | None,
                 depth: int) -> ast.ClassDef | str | None:
    """What a call builds: a class of the file, a sigmoid-ended ``nn.Sequential``, an
    ``nn.Sigmoid()``, or what the file's function or method called returns."""
    inner = unmoved(node, ctx)
    if inner is not node:  # ``D().to(device)``
        return _model_class(inner, scope, ctx, owner, depth + 1)
    name = ctx.call_name(node) or ""
    if name in _MODEL_WRAPPERS and node.args:
        return _model_class(node.args[0], scope, ctx, owner, depth + 1)
    if name == _SIGMOID_MODULE:
        return _SIGMOID_LAYER
    if name == "torch.nn.Sequential":
        return _SIGMOID_SEQUENTIAL if _ends_in_sigmoid(node, scope, ctx) else None
    function = None
    if isinstance(node.func, ast.Name):
        classes = [c for c in ctx.nodes(ast.ClassDef) if c.name == node.func.id]
        if len(classes) == 1:
            return classes[0]
        function = _module_function(node.func.id, ctx)
    elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and \
            node.func.value.id == "self" and owner is not None:
        function = method(owner, node.func.attr)
    if function is None and not name.startswith("torch"):
        origin = ctx.imported_from(node.func)
        if origin is not None and origin[2][:1].isupper():  # a class, by the naming convention
            return _Imported((origin,))
    if function is None:
        return None
    returns = [n.value for n in walk_scope(function) if isinstance(n, ast.Return)]
    if not returns or any(r is None for r in returns):
        return None
    kinds = [_model_class(r, function, ctx, owner, depth + 1) for r in returns]
    first = kinds[0]
    return first if first is not None and all(k is first or k == first for k in kinds) else None


def _ends_in_sigmoid(sequential: ast.Call, scope: ast.AST | None, ctx: FileContext) -> bool:
    """``nn.Sequential(..., nn.Sigmoid())``, or ``nn.Sequential(*layers)`` where the
    last statement of the function to fill ``layers`` ends it with ``nn.Sigmoid()``."""
    args = sequential.args
    if not args:
        return False
    last = args[-1]
    if not isinstance(last, ast.Starred):
        return isinstance(last, ast.Call) and ctx.call_name(last) == _SIGMOID_MODULE
    if len(args) != 1 or not isinstance(last.value, ast.Name) or scope is None:
        return False
    name = last.value.id
    added: list[tuple[int, ast.AST | None]] = []  # (line, the last layer that statement adds)
    for node in walk_scope(scope):
        if getattr(node, "lineno", sequential.lineno) >= sequential.lineno:
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Attribute) and isinstance(node.value.func.value, ast.Name) and \
                node.value.func.value.id == name and node.value.args:
            method, arg = node.value.func.attr, node.value.args[-1]
            if method == "append":
                added.append((node.lineno, arg))
            elif method == "extend":
                added.append((node.lineno, arg.elts[-1] if isinstance(arg, (ast.List, ast.Tuple)) and arg.elts
                              else None))
            else:
                added.append((node.lineno, None))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                value = node.value
                added.append((node.lineno, value.elts[-1] if isinstance(value, (ast.List, ast.Tuple)) and value.elts
                              else None))
    if not added:
        return False
    layer = max(added, key=lambda item: item[0])[1]
    return isinstance(layer, ast.Call) and ctx.call_name(layer) == _SIGMOID_MODULE


def _wraps_itself(value: ast.AST, node: ast.AST, ctx: FileContext) -> bool:
    """``value`` is ``node`` moved or wrapped: ``D.to(device)``, ``DataParallel(D)``."""
    while isinstance(value, ast.Call):
        if isinstance(value.func, ast.Attribute) and value.func.attr in MODULE_METHODS and \
                ctx.qualified_name(value.func) is None:
            value = value.func.value
        elif (ctx.call_name(value) or "") in _MODEL_WRAPPERS and value.args:
            value = value.args[0]
        else:
            return False
    return ast.dump(value) == ast.dump(node)


def _module_function(name: str, ctx: FileContext) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    found = [f for f in ctx.tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == name]
    return found[0] if len(found) == 1 else None


def _init_parameter(cls: ast.ClassDef, name: str) -> bool:
    """``name`` is a parameter of ``cls.__init__`` other than ``self``."""
    init = method(cls, "__init__")
    if init is None:
        return False
    args = init.args
    return name in [a.arg for a in (*args.posonlyargs, *args.args)][1:] + [a.arg for a in args.kwonlyargs]


def _constructor_argument(cls: ast.ClassDef, param: str, ctx: FileContext, depth: int) -> str | None:
    """:data:`_SIGMOID_LAYER` when every construction of ``cls`` in the file passes a
    sigmoid (``torch.sigmoid``, ``nn.Sigmoid()``, a name bound to one) as ``param``."""
    init = method(cls, "__init__")
    arguments = parameter_arguments(init, param, ctx) if init is not None else None
    if not arguments or any(_model_class(arg, None, ctx, None, depth + 1) != _SIGMOID_LAYER for arg, _ in arguments):
        return None
    return _SIGMOID_LAYER


def _sigmoid_outputs(cls: ast.ClassDef, ctx: FileContext) -> list[str]:
    """``[cls.name]`` when every return of its forward() is a sigmoid's output, else
    ``cls.name[i]`` for each element ``i`` of the tuples it returns that is (U-2-Net's
    seven side outputs)."""
    if _method_returns_sigmoid(cls, "forward", ctx, 0, None):
        return [cls.name]
    forward = method(cls, "forward")
    returns = [n.value for n in walk_scope(forward) if isinstance(n, ast.Return)] if forward is not None else []
    sizes = {len(r.elts) for r in returns if isinstance(r, ast.Tuple)}
    if len(sizes) != 1 or not all(isinstance(r, ast.Tuple) for r in returns if r is not None):
        return []
    return [f"{cls.name}[{i}]" for i in range(sizes.pop()) if _method_returns_sigmoid(cls, "forward", ctx, 0, i)]


def _method_returns_sigmoid(cls: ast.ClassDef, name: str, ctx: FileContext, depth: int,
                            index: int | None) -> str | None:
    """Every ``return`` of the method ``name`` of ``cls`` gives a sigmoid's output (the element
    ``index`` of the tuple it returns, when one is taken)."""
    function = method(cls, name)
    if function is None:
        return None
    returns = [n for n in walk_scope(function) if isinstance(n, ast.Return)]
    if not returns or any(r.value is None for r in returns):
        return None
    for ret in returns:
        if _sigmoid_source(ret.value, function, ctx, depth + 1, index, cls) is None:
            return None
    return f"the output of {cls.name}, whose {name}() ends in a sigmoid"


def _rewrite(call: ast.Call, probs: ast.AST, ctx: FileContext) -> list | None:
    """``F.binary_cross_entropy(torch.sigmoid(z)..., y)`` ->
    ``F.binary_cross_entropy_with_logits(z..., y)``; None unless the sigmoid is
    written inside the call."""
    inner = _strip_values_kept(probs, ctx)
    logits = _sigmoid_call(inner, ctx)
    if logits is None:
        return None
    func_text = ctx.text(call.func)
    if not func_text.endswith("binary_cross_entropy"):
        return None
    text = ctx.text(logits)
    if inner is not probs and not isinstance(logits, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
        text = f"({text})"
    return [ctx.replace(call.func, func_text + "_with_logits"), ctx.replace(inner, text)]
