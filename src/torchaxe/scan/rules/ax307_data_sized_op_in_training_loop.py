"""AX307: an operation whose result's size depends on tensor values (boolean-mask
indexing, nonzero, masked_select, one-argument where, unique) on every training step."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import BOUNDARY_TYPES, FileContext
from torchaxe.scan.rules import _tensors as T
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Tensor methods and torch functions whose result is a boolean tensor of their
#: input's shape.
MASK_OPS = frozenset(
    "eq ne gt ge lt le greater greater_equal less less_equal not_equal isnan isinf isfinite isneginf isposinf "
    "isin logical_not logical_and logical_or logical_xor".split()
)
#: Methods that keep a mask a mask (moves, views, copies).
MASK_KEEPING = frozenset(
    "to cuda npu contiguous detach clone view reshape flatten squeeze unsqueeze expand expand_as t transpose "
    "permute repeat".split()
)
#: Factories that make a mask when given ``dtype=torch.bool``.
BOOL_FACTORIES = frozenset("ones zeros full empty eye ones_like zeros_like full_like empty_like tril triu".split())
#: torch functions and tensor methods whose result's size the data decides.
SIZED_BY_DATA = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"})
#: torch.nn.functional's losses whose names do not say so.
_FUNCTIONAL_LOSSES = frozenset({"cross_entropy", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div"})
_COMPARISONS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
#: How deep names are followed to their values.
_DEPTH = 4


class DataSizedOpInTrainingLoop(Rule):
    """
    ## What it does
    Flags, inside a training loop (a loop whose own body calls `backward()` or an
    optimizer's `step()`, or the body of a step function, or a helper every step calls
    unconditionally, such as a loss method called from the loop), the operations whose
    result's size depends on a tensor's values: indexing with a boolean mask
    (`logits[labels != -100]`, `sim[~mask]`, `x[m.bool()]`, `x[torch.isfinite(x)]`),
    `nonzero()`, `argwhere()`, `masked_select()`, `torch.where(cond)` with one argument
    and `unique()`. A mask is recognised from how it is made (a comparison of a tensor,
    `~`, `&` and `|` of masks, `.bool()`, `isnan`-like tests, a factory with
    `dtype=torch.bool`), also through a name assigned in the same function; an index
    tensor of positions (`x[idx]`) is not a mask and is not reported. A module's
    `forward` that computes a loss (a class named for one, or a forward returning a
    value named `loss`, an `F.*` loss or `self.criterion(...)`) runs on every
    training step wherever the loop is, so it is read too, its arguments taken as
    tensors (not its branches under `if not self.training:`).

    ## Why is this bad?
    The result's size is the number of `True` elements, which only the device knows:
    before it can allocate the result, the host copies that count back, so it waits
    until every kernel queued so far has run, on every step, and cannot queue the next
    kernels meanwhile. Under `torch.compile` the same operation breaks the graph. A mask
    that keeps its shape costs neither.

    Not reported on the `cpu` target (no device queue to drain), on tensors moved to
    the host first (`x.cpu()[mask]`), on numpy arrays, in evaluation loops, on a few
    steps only (inside an `if step % N == 0:` branch), or for stores (`x[mask] = 0`
    with a number is a `masked_fill`, no count needed; `x[mask] -= 1` reads `x[mask]`
    first and is reported).

    ## Example
    ```python
    for x, labels in loader:
        logits = model(x)
        keep = labels != -100
        loss = F.cross_entropy(logits[keep], labels[keep])
        loss.backward()
        opt.step()
    ```

    ## Use instead
    ```python
    for x, labels in loader:
        logits = model(x)
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
        loss.backward()
        opt.step()
    ```
    More generally keep the shape and weight by the mask: `(loss * mask).sum() /
    mask.sum().clamp(min=1)`, `torch.where(mask, x, 0)`, `x.masked_fill(~mask, 0)`. A
    mask that is the same on every step (SimCLR's `~torch.eye(n, dtype=torch.bool)`)
    can become index tensors built once before the loop (`idx = mask.nonzero(as_tuple=
    True)`; `x[idx]` inside), and an `N x (N-1)` selection a `view` of a gather.

    ## Fix safety
    Display-only: the fixed-shape form changes what later code sees (padding rows, a
    weighted mean), so the rewrite is the user's to make.
    """

    code = "AX307"
    name = "data-sized-op-in-training-loop"
    category = "host_sync_in_loop"
    message = "an operation whose result's size depends on tensor values runs on every training step"
    fix_title = "keep the shape fixed (a mask weight, torch.where, ignore_index) or build the indices once"
    fix_safety = Applicability.DISPLAY_ONLY
    targets = ("cuda", "npu")
    requires_text = ("backward", "step(", "def forward")
    node_types = (ast.Subscript, ast.Call)
    references = (
        "https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution",
        "https://pytorch.org/docs/stable/generated/torch.nonzero.html",
        "https://pytorch.org/docs/stable/generated/torch.masked_select.html",
    )
    examples = (
        Invalid(
            "import torch\nimport torch.nn.functional as F\n"
            "for x, labels in loader:\n"
            "    x, labels = x.to(device), labels.to(device)\n"
            "    logits = model(x)\n"
            "    keep = labels != -100\n"
            "    loss = F.cross_entropy(logits[keep], labels[keep])\n"
            "    loss.backward()\n"
            "    opt.step()\n",
            target="cuda", lines=(7, 7),
        ),
        # SimCLR's loss, a method the training loop calls on every step.
        Invalid(
            "import torch\n\n\nclass SimCLR:\n"
            "    def info_nce_loss(self, features):\n"
            "        labels = torch.cat([torch.arange(self.n) for i in range(2)], dim=0)\n"
            "        labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float().to(self.device)\n"
            "        sim = torch.matmul(features, features.T)\n"
            "        mask = torch.eye(labels.shape[0], dtype=torch.bool).to(self.device)\n"
            "        labels = labels[~mask].view(labels.shape[0], -1)\n"
            "        sim = sim[~mask].view(sim.shape[0], -1)\n"
            "        positives = sim[labels.bool()].view(labels.shape[0], -1)\n"
            "        return positives, labels\n\n"
            "    def train(self, loader):\n"
            "        for images in loader:\n"
            "            features = self.model(images)\n"
            "            logits, labels = self.info_nce_loss(features)\n"
            "            loss = self.criterion(logits, labels)\n"
            "            self.optimizer.zero_grad()\n"
            "            loss.backward()\n"
            "            self.optimizer.step()\n",
            target="cuda", lines=(10, 11, 12),
        ),
        Invalid(
            "import torch\n"
            "def train_step(batch):\n"
            "    out = model(batch)\n"
            "    idx = torch.nonzero(out.sum(-1) > 0)\n"
            "    sel = out.masked_select(out > 0)\n"
            "    rows = torch.where(out.isnan())\n"
            "    loss = out[idx].sum() + sel.sum() + out.unique().sum()\n"
            "    low, high = out.floor().long(), out.ceil().long()\n"
            "    low[(high > 0) * (low == high)] -= 1\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "for batch in loader:\n"
            "    train_step(batch)\n",
            target="npu", lines=(4, 5, 6, 7, 9),
        ),
        # A loss module (annotated-transformer's label smoothing), and a model that
        # returns its training loss; no loop in the file.
        Invalid(
            "import torch\nfrom torch import nn\n\n\nclass LabelSmoothing(nn.Module):\n"
            "    def forward(self, x, target):\n"
            "        dist = x.data.clone()\n"
            "        pad = torch.nonzero(target.data == self.padding_idx)\n"
            "        dist.index_fill_(0, pad.squeeze(), 0.0)\n"
            "        return self.criterion(x, dist)\n\n\n"
            "class Contrastive(nn.Module):\n"
            "    def forward(self, q, k):\n"
            "        sim = torch.mm(q, k.t())\n"
            "        mask = ~torch.eye(q.shape[0], dtype=torch.bool, device=q.device)\n"
            "        neg = sim.masked_select(mask).view(q.shape[0], -1)\n"
            "        loss = -torch.log(sim.diag() / neg.sum(-1)).mean()\n"
            "        return q, loss\n",
            target="cuda", lines=(8, 17),
        ),
        # A forward that returns no loss (a detector's post-processing may be
        # inference only), and a loss forward's host tensors.
        Valid(
            "import torch\nfrom torch import nn\n\n\nclass Head(nn.Module):\n"
            "    def forward(self, x):\n"
            "        scores = self.cls(x)\n"
            "        return x[scores > 0.5]\n\n\n"
            "class CountLoss(nn.Module):\n"
            "    def forward(self, x, target):\n"
            "        t = target.cpu()\n"
            "        kept = t[t > 0]\n"
            "        return (x.sum() - kept.numel()) ** 2\n",
            target="cuda",
        ),
        Valid(
            "import torch\nimport torch.nn.functional as F\n"
            "for x, labels in loader:\n"
            "    logits = model(x)\n"
            "    keep = labels != -100\n"
            "    loss = F.cross_entropy(logits[keep], labels[keep])\n"
            "    loss.backward()\n"
            "    opt.step()\n",
            target="cpu",
        ),
        Valid(
            "import torch\nimport numpy as np\n"
            "for step, (x, y) in enumerate(loader):\n"
            "    idx = torch.randperm(x.shape[0])\n"
            "    loss = criterion(model(x[idx]), y[idx])\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    a = np.asarray(history)\n"
            "    good = a[a > 0]\n"
            "    pred = model(x).cpu()\n"
            "    hits = pred[pred > 0.5]\n"
            "    x[x < 0] = 0\n"
            "    if step % 100 == 0:\n"
            "        print(loss[loss > 0].sum())\n"
            "    valid = torch.where(y > 0, y, 0)\n",
            target="cuda",
        ),
        Valid(
            "import torch\n"
            "for x, y in val_loader:\n"
            "    with torch.no_grad():\n"
            "        out = model(x)\n"
            "    wrong = out[out.argmax(-1) != y]\n",
            target="cuda",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        if isinstance(node, ast.Subscript):
            if not _may_be_masked(node, ctx):
                return
        elif not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and (node.func.attr in SIZED_BY_DATA or node.func.attr == "where")):
            return
        # Whether the node runs every step is cheaper to ask than what its index holds.
        loop = ctx.training_loop(node) or _loss_forward(ctx)
        if loop is None:
            return
        tensors: T.Tensors | _ForwardTensors = T.tensors_at(ctx)
        if _is_module_forward(ctx, loop):
            tensors = _ForwardTensors(tensors, loop)
        found = (self._masked_index(node, ctx, tensors) if isinstance(node, ast.Subscript)
                 else self._sized_call(node, ctx))
        if found is None or T.rarely_run(ctx, loop, node) or _evaluation_only(ctx, loop):
            return
        what, operand = found
        if operand is not None and (not tensors.is_tensor(operand) or _on_host(operand, tensors)):
            return
        dev = T.DEVICE_WORD[ctx.target]
        yield ctx.finding(
            self,
            node,
            f"`{T.describe(ctx, node, 60)}` {what}: its size is the number of selected elements, which the host "
            f"reads from the {dev} before it can allocate the result, so {T.sync_cost(ctx.target)} (and "
            "torch.compile breaks its graph here); keep the shape fixed (weight by the mask, torch.where, "
            "ignore_index) or, for a mask that never changes, build the indices once before the loop",
            replacement="(loss * mask).sum() / mask.sum().clamp(min=1)  # or torch.where(mask, x, 0)",
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY),
        )

    @staticmethod
    def _masked_index(node: ast.Subscript, ctx: FileContext, tensors: T.Tensors | _ForwardTensors
                      ) -> tuple[str, ast.AST] | None:
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        mask = next((p for p in parts if _is_mask(ctx, tensors, p, 0)), None)
        if mask is None:
            return None
        return f"indexes with the boolean mask `{T.describe(ctx, mask, 30)}`", node.value

    @staticmethod
    def _sized_call(node: ast.Call, ctx: FileContext) -> tuple[str, ast.AST | None] | None:
        func = node.func
        assert isinstance(func, ast.Attribute)  # visit asked
        if ctx.call_name(node) is not None:
            short = _torch_function(ctx, node)
            if short == "where":
                if len(node.args) == 1 and not node.keywords:
                    return "is torch.where with a condition only (the positions where it holds)", None
                return None
            if short in SIZED_BY_DATA and node.args:
                return f"is torch.{short}", node.args[0]
            return None  # another library's function, or another torch one
        if func.attr in SIZED_BY_DATA:
            return f"is .{func.attr}()", func.value
        return None


def _is_module_forward(ctx: FileContext, loop: ast.AST) -> bool:
    """Whether the training step found is a class's ``forward`` method."""
    if not (isinstance(loop, ast.FunctionDef) and loop.name == "forward"):
        return False
    at = next((i for i, parent in enumerate(ctx.parents) if parent is loop), 0)
    return at > 0 and isinstance(ctx.parents[at - 1], ast.ClassDef)


def _evaluation_only(ctx: FileContext, loop: ast.AST) -> bool:
    """Whether the visited node runs only in evaluation mode: under ``if not
    self.training:``, or in the ``else`` of ``if self.training:`` (a metric a loss
    module computes when it is not training)."""
    path = ctx.parents  # an If's child on the way is a statement, so among them
    at = next((i for i, parent in enumerate(path) if parent is loop), None)
    if at is None:
        return False
    for parent, child in zip(path[at:], path[at + 1:]):
        if not isinstance(parent, ast.If):
            continue
        test, negated = parent.test, False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negated = test.operand, True
        if not (isinstance(test, ast.Attribute) and test.attr == "training"):
            continue
        in_body = any(child is s for s in parent.body)
        if in_body == negated:
            return True
    return False


def _loss_forward(ctx: FileContext) -> ast.FunctionDef | None:
    """The ``forward`` method around the visited node when it computes a loss (a
    loss module's, or a model's that returns its training loss): it runs on every
    training step wherever the loop is. Its nested functions are not it."""
    for i in range(len(ctx.parents) - 1, 0, -1):
        parent = ctx.parents[i]
        if isinstance(parent, BOUNDARY_TYPES):
            owner = ctx.parents[i - 1]
            if isinstance(parent, ast.FunctionDef) and parent.name == "forward" and isinstance(owner, ast.ClassDef) \
                    and _computes_loss(ctx, owner, parent):
                return parent
            return None
    return None


def _computes_loss(ctx: FileContext, owner: ast.ClassDef, forward: ast.FunctionDef) -> bool:
    """Whether a module's ``forward`` is a loss: the class is named for one
    (``LabelSmoothingLoss``, ``Criterion``), or a value it returns is a loss by name
    (``loss``, ``total_loss``) or by what computes it (``F.cross_entropy(...)``,
    ``self.criterion(...)``, ``self.loss_fn(...)``)."""
    key = ("ax307.computes_loss", id(forward))
    if key not in ctx.cache:
        low = owner.name.lower()
        found = "loss" in low or "criterion" in low
        stack: list[ast.AST] = list(forward.body)
        while stack and not found:
            node = stack.pop()
            if isinstance(node, ast.Return) and node.value is not None:
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                found = any(_is_loss_value(ctx, v) for v in values)
            if not isinstance(node, BOUNDARY_TYPES):
                stack.extend(ast.iter_child_nodes(node))
        ctx.cache[key] = found
    return ctx.cache[key]


def _is_loss_value(ctx: FileContext, node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return "loss" in node.id.lower()
    if not isinstance(node, ast.Call):
        return False
    qualified = ctx.call_name(node) or ""
    if qualified.startswith("torch.nn.functional."):
        short = qualified.rsplit(".", 1)[1]
        return "loss" in short or short in _FUNCTIONAL_LOSSES
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    low = name.lower()
    return not name[:1].isupper() and ("loss" in low or "criterion" in low)


class _ForwardTensors:
    """What :class:`_tensors.Tensors` knows, and also that a loss ``forward``'s
    arguments are tensors (``forward(self, logits, target)``): ``target.data ==
    pad`` is a mask there."""

    def __init__(self, tensors: T.Tensors, forward: ast.FunctionDef) -> None:
        self.tensors = tensors
        arguments = forward.args
        self.params = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs][1:]}

    def values_of(self, node: ast.Name) -> list[ast.AST] | None:
        return self.tensors.values_of(node)

    def is_tensor(self, node: ast.AST | None) -> bool:
        return self.tensors.is_tensor(node) or self._from_argument(node, 0)

    def _from_argument(self, node: ast.AST | None, depth: int) -> bool:
        """An argument itself, its ``.data``, a comparison or arithmetic of it, or what
        a tensor method of it returns."""
        if node is None or depth > _DEPTH:
            return False
        if isinstance(node, ast.Name):
            if node.id in self.params:
                return not self.tensors.values_of(node)  # never reassigned in the function
            values = self.tensors.values_of(node)
            return bool(values) and all(self._from_argument(v, depth + 1) for v in values)
        if isinstance(node, ast.Attribute):
            return node.attr == "data" and self._from_argument(node.value, depth + 1)
        if isinstance(node, ast.Compare):
            return any(self._from_argument(side, depth + 1) for side in (node.left, *node.comparators))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return self._from_argument(node.operand, depth + 1)
        if isinstance(node, ast.BinOp):
            return self._from_argument(node.left, depth + 1) or self._from_argument(node.right, depth + 1)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func.attr not in _NOT_TENSOR_METHODS and self._from_argument(node.func.value, depth + 1)
        return False


#: Tensor methods whose result is not a tensor.
_NOT_TENSOR_METHODS = frozenset("item tolist size dim numel numpy nelement element_size data_ptr".split())


def _may_be_masked(node: ast.Subscript, ctx: FileContext) -> bool:
    """What the syntax alone says, before any reading of values: a read (``x[mask] -= 1``
    reads ``x[mask]`` first; a plain store of a number does not) with an index part
    shaped like a mask, or a name the file assigns one to."""
    parent = ctx.parents[-1] if ctx.parents else None
    if not isinstance(node.ctx, ast.Load) and not (isinstance(parent, ast.AugAssign) and parent.target is node):
        return False
    parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return any(_mask_shaped(part) or isinstance(part, ast.Name) and part.id in _mask_shaped_names(ctx)
               for part in parts)


def _mask_shaped(node: ast.AST) -> bool:
    """An expression whose form can make a mask: a comparison, ``~``, ``&``/``|``/``^``/
    ``*``, or a call of a mask-making or mask-keeping method or factory."""
    if isinstance(node, ast.Compare):
        return True
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.Invert)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor, ast.Mult))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in _MASK_CALLS
    return False


_MASK_CALLS = MASK_OPS | MASK_KEEPING | BOOL_FACTORIES | {"bool"}


def _mask_shaped_names(ctx: FileContext) -> frozenset[str]:
    """The names the file assigns a mask-shaped expression to, anywhere (a filter only:
    which assignment reaches a read is asked later)."""
    key = "ax307.mask_names"
    if key not in ctx.cache:
        ctx.cache[key] = frozenset(t.id for node in ctx.nodes(ast.Assign) if _mask_shaped(node.value)
                                   for t in node.targets if isinstance(t, ast.Name))
    return ctx.cache[key]


def _torch_function(ctx: FileContext, call: ast.Call) -> str | None:
    """``where`` for ``torch.where(...)`` (however torch is imported); None for any
    other call."""
    qualified = ctx.call_name(call) or ""
    if not qualified.startswith("torch.") or qualified.count(".") != 1:
        return None
    return qualified.split(".", 1)[1]


def _is_mask(ctx: FileContext, tensors: T.Tensors | _ForwardTensors, node: ast.AST, depth: int) -> bool:
    """Whether ``node`` is a boolean tensor by how it is made (positive evidence only)."""
    if depth > _DEPTH:
        return False
    if isinstance(node, ast.Compare):
        return (len(node.ops) == 1 and isinstance(node.ops[0], _COMPARISONS)
                and any(tensors.is_tensor(side) for side in (node.left, node.comparators[0])))
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.Invert) and _is_mask(ctx, tensors, node.operand, depth + 1)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Mult):  # bool * bool is a bool tensor (Rainbow's ``(u > 0) * (l == u)``)
            return _is_mask(ctx, tensors, node.left, depth + 1) and _is_mask(ctx, tensors, node.right, depth + 1)
        return isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)) and (
            _is_mask(ctx, tensors, node.left, depth + 1) or _is_mask(ctx, tensors, node.right, depth + 1))
    if isinstance(node, ast.Name):
        values = tensors.values_of(node)
        return bool(values) and all(_is_mask(ctx, tensors, v, depth + 1) for v in values)
    if not isinstance(node, ast.Call):
        return False
    if ctx.call_name(node) is not None:
        short = _torch_function(ctx, node)
        if short in MASK_OPS:
            return True
        dtype = T.keyword(node, "dtype")
        return short in BOOL_FACTORIES and dtype is not None and ctx.qualified_name(dtype.value) == "torch.bool"
    func = node.func
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "bool" and not node.args:
        return tensors.is_tensor(func.value)
    if func.attr in MASK_OPS:
        return tensors.is_tensor(func.value)
    if func.attr == "to" and any(ctx.qualified_name(a) == "torch.bool" for a in
                                 [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]):
        return tensors.is_tensor(func.value)
    if func.attr in MASK_KEEPING:
        return _is_mask(ctx, tensors, func.value, depth + 1)
    return False


def _on_host(node: ast.AST, tensors: T.Tensors | _ForwardTensors, depth: int = 0) -> bool:
    """Whether the indexed tensor was moved to the host (``.cpu()``), directly or by
    every assignment of the name holding it."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "cpu":
            return True
        if node.func.attr in ("to", "cuda", "npu"):
            return False
        if node.func.attr not in MASK_KEEPING and node.func.attr not in ("float", "double", "long", "int", "numpy"):
            return False
        node = node.func.value
    if isinstance(node, ast.Name) and depth < _DEPTH:
        values = tensors.values_of(node)
        return bool(values) and all(_on_host(v, tensors, depth + 1) for v in values)
    return False
