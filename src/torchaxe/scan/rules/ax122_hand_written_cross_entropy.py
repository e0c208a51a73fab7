"""AX122: a cross-entropy written out from log-softmax, softmax or exp."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterable, Iterator

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import BOUNDARY_TYPES, FileContext, walk_scope
from torchaxe.scan.rules._bindings import VALUE_KEEPING_METHODS, owner_of, reaching, self_bindings, unmoved
from torchaxe.scan.rules._distributed import parent_map
from torchaxe.scan.rules.base import Invalid, Rule, Valid

_LOG_SOFTMAX = frozenset({"torch.nn.functional.log_softmax", "torch.log_softmax", "torch.special.log_softmax"})
_SOFTMAX = frozenset({"torch.nn.functional.softmax", "torch.softmax", "torch.special.softmax"})
_LOG = frozenset({"torch.log"})
_EXP = frozenset({"torch.exp"})
_LOGSUMEXP = frozenset({"torch.logsumexp", "torch.special.logsumexp"})
_SUM = frozenset({"torch.sum"})
_MODULES = {"torch.nn.LogSoftmax": "logprob", "torch.nn.Softmax": "prob",
            "torch.nn.modules.activation.LogSoftmax": "logprob", "torch.nn.modules.activation.Softmax": "prob"}
#: Methods whose result holds what the tensor does (exponentials stay exponentials when
#: some are selected).
_KEEPS = VALUE_KEEPING_METHODS | {"masked_select"}
_DEPTH = 6
#: Methods after which a per-sample quantity is one number (or leaves autograd).
_REDUCTIONS = frozenset({"mean", "sum", "item", "detach", "tolist", "numpy", "cpu"})


@dataclass(frozen=True)
class _Kind:
    """What an expression holds: ``logprob`` (a log-softmax of ``logits``), ``prob``
    (a softmax of them), ``exp`` (exponentials), ``expsum`` (a sum of exponentials),
    ``picked`` (the entries of a log-softmax at given indices); ``negated`` when the
    expression is minus that."""

    kind: str
    logits: str = ""
    negated: bool = False
    #: Written out (``log(softmax(x))``, ``x - log(exp(x).sum())``, ``log(exp / sum)``)
    #: rather than ``log_softmax``.
    written: bool = False

    def flipped(self) -> "_Kind":
        return _Kind(self.kind, self.logits, not self.negated, self.written)


_WRITTEN = "log of a softmax, or log of exp over a sum of exps, written out"
_SMOOTHED = "one-hot or label-smoothed targets built by hand"


class HandWrittenCrossEntropy(Rule):
    """
    ## What it does
    Flags a cross-entropy computed by hand where one `F.cross_entropy` call is faster:
    one-hot or label-smoothed targets built by hand (`scatter_`, `F.one_hot`) times a
    log-softmax and summed over the classes, the same written as `(1 - eps) * nll + eps
    * smooth` over a log-softmax picked at the targets, and any cross-entropy whose
    log-softmax is written out: the log of a softmax (`torch.log(F.softmax(x))`, picked
    at the targets or times targets), a contrastive loss written as
    `-log(exp(pos) / exp(sim).sum(1))` (NT-Xent, InfoNCE), and `x - log(exp(x).sum())`.
    Left alone: a `log_softmax` times probability targets or picked at the targets
    (what `F.cross_entropy` itself computes: no speed to gain), entropies (a softmax
    times its own log-softmax), KL divergences, log-probabilities weighted by
    advantages, rewards or a focal factor, and `nll_loss` of a `log_softmax`.

    ## Why is this bad?
    Targets built as a batch x classes tensor are read and kept for the backward pass;
    with the class indices and `label_smoothing=`, `F.cross_entropy` needs neither: 1.5x
    (256 x 1,000) to 2.0x (2,048 tokens x 8,000 classes) forward and backward on a
    2-core CPU. A written-out log-softmax runs exp, sum, divide and log as separate
    kernels and keeps their outputs; one log-softmax replaces them (2.1x for one-hot
    targets times `log(softmax)`, 1.4-2.1x for NT-Xent at batch 256), and it stays
    finite where `log(softmax(x))` or `log(exp / sum)` underflows to `-inf`
    (`benchmarks/cross_entropy.py`, same losses to 1e-6).

    ## Example
    ```python
    log_probs = F.log_softmax(logits, dim=-1)
    true_dist = torch.zeros_like(log_probs).scatter_(1, target.unsqueeze(1), 1)
    true_dist = true_dist * (1 - eps) + eps / n_classes
    loss = (-true_dist * log_probs).sum(dim=-1).mean()
    ```

    ## Use instead
    ```python
    loss = F.cross_entropy(logits, target, label_smoothing=eps)
    ```

    ## Fix safety
    Display-only: the class indices (or, for a contrastive loss, the positive's index
    with the diagonal masked to `-inf`) are what the written-out form builds, which
    only reading the code can say; the reduction must match (`mean` by default).
    """

    code = "AX122"
    name = "hand-written-cross-entropy"
    category = "cross_entropy"
    message = "cross-entropy computed by hand from a log-softmax, softmax or exp"
    fix_title = "use F.cross_entropy (class indices with label_smoothing=, or the logits of a contrastive loss)"
    fix_safety = Applicability.DISPLAY_ONLY
    requires_text = ("softmax", "Softmax", "exp(", "logsumexp")
    also_requires_text = ("log",)
    references = ("https://pytorch.org/docs/stable/generated/torch.nn.functional.cross_entropy.html",)
    examples = (
        Invalid(
            "import torch\nimport torch.nn.functional as F\n"
            "def loss_fn(logits, target, eps, n):\n"
            "    log_probs = F.log_softmax(logits, dim=-1)\n"
            "    true_dist = torch.zeros_like(log_probs).scatter_(1, target.unsqueeze(1), 1)\n"
            "    true_dist = true_dist * (1 - eps) + eps / n\n"
            "    return (-true_dist * log_probs).sum(dim=-1).mean()\n", lines=(7,), message="one-hot or label-smoothed targets built by hand"
        ),
        Invalid(
            "import torch\nimport torch.nn.functional as F\n"
            "def nll(x, y):\n    p = F.softmax(x, dim=-1)\n"
            "    return -torch.log(p.gather(1, y.unsqueeze(1))).mean()\n",
            target="npu", lines=(5,), message="log-softmax written out",
        ),
        # Label smoothing as a picked log-softmax and its mean over the classes.
        Invalid(
            "import torch.nn.functional as F\n"
            "def ls(x, y, eps):\n    logp = F.log_softmax(x, dim=-1)\n"
            "    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)\n    smooth = -logp.mean(dim=-1)\n"
            "    return ((1 - eps) * nll + eps * smooth).mean()\n", lines=(4,),
        ),
        # NT-Xent written out.
        Invalid(
            "import torch\n"
            "def nt_xent(z1, z2, t):\n    out = torch.cat([z1, z2])\n"
            "    sim = torch.exp(out @ out.t() / t)\n    pos = torch.exp((z1 * z2).sum(-1) / t)\n"
            "    pos = torch.cat([pos, pos])\n    return -torch.log(pos / sim.sum(dim=-1)).mean()\n",
            target="cuda", lines=(7,),
        ),
        # What F.cross_entropy itself computes: nothing to gain.
        Valid(
            "import torch.nn.functional as F\n"
            "def soft(s, t, y):\n    logp = F.log_softmax(s, -1)\n"
            "    distil = -(F.softmax(t, -1) * logp).sum(-1).mean()\n"
            "    return distil - logp.gather(1, y.unsqueeze(1)).mean()\n"
        ),
        # Entropy: a softmax times its own log-softmax.
        Valid(
            "import torch.nn.functional as F\n"
            "def entropy(logits):\n    p = F.softmax(logits, -1)\n    logp = F.log_softmax(logits, -1)\n"
            "    return -(p * logp).sum(-1).mean()\n"
        ),
        # A policy gradient: log-probabilities of the actions taken, weighted by returns.
        Valid(
            "import torch.nn.functional as F\n"
            "def pg(logits, actions, returns):\n    logp = F.log_softmax(logits, dim=1)\n"
            "    return -(returns * logp[range(len(actions)), actions]).mean()\n"
        ),
        # KL divergence, and log-softmax passed to nll_loss.
        Valid(
            "import torch.nn.functional as F\n"
            "def kd(s, t, y):\n    p = F.softmax(t, -1)\n"
            "    kl = (p * (F.log_softmax(t, -1) - F.log_softmax(s, -1))).sum(-1).mean()\n"
            "    return kl + F.nll_loss(F.log_softmax(s, -1), y)\n"
        ),
    )

    def check_module(self, ctx: FileContext) -> Iterable[Finding]:
        scopes = [ctx.tree, *ctx.nodes(ast.FunctionDef, ast.AsyncFunctionDef)]
        # A softmax module kept in an attribute (``self.lsm = nn.LogSoftmax(-1)``) is
        # called by a name that says nothing: then every function is read.
        modules = "Softmax(" in ctx.source
        for scope in scopes:
            if scope is not ctx.tree and not modules and not _may_hold(scope, ctx):
                continue
            yield from _Scope(scope, ctx).findings(self)


def _may_hold(function: ast.AST, ctx: FileContext) -> bool:
    """Whether a function's text names a log and a softmax or an exp (the words the
    rule asks of the file): the others, most functions of a large file, are not read."""
    text = "".join(ctx.lines[function.lineno - 1:function.end_lineno or function.lineno])  # type: ignore[attr-defined]
    return "log" in text and any(word in text for word in ("softmax", "Softmax", "exp("))


class _Scope:
    """One function (or the module) read for hand-written cross-entropies."""

    def __init__(self, scope: ast.AST, ctx: FileContext) -> None:
        self.scope, self.ctx = scope, ctx
        self.nodes = list(walk_scope(scope))
        self.statements = sorted((n for n in self.nodes if isinstance(n, ast.stmt)),
                                 key=lambda s: (s.lineno, s.col_offset))
        self._parents: dict[int, ast.AST] | None = None

    # ------------------------------------------------------------------ reading values

    def value(self, name: str, line: int) -> tuple[ast.expr, int] | None:
        """The value of the last assignment to ``name`` before ``line`` that it may
        hold there (:func:`reaching`); None when it is bound another way (a loop,
        ``+=``, an unpacked tuple) or not in this scope."""
        found = reaching(name, self.scope, line, self.ctx)
        if not found or found[-1].index is not None:
            return None
        return found[-1].value, found[-1].statement.lineno

    def resolved(self, node: ast.AST, line: int) -> tuple[ast.AST, int]:
        """``node``, or the value a name it is holds at ``line`` (through names)."""
        for _ in range(_DEPTH):
            if not isinstance(node, ast.Name):
                break
            found = self.value(node.id, line)
            if found is None:
                break
            node, line = found
        return node, line

    def module_kind(self, func: ast.AST, line: int) -> str | None:
        """``logprob``/``prob`` for a call of an ``nn.LogSoftmax``/``nn.Softmax`` kept in
        a name or a ``self`` attribute."""
        values: list[ast.expr] = []
        if isinstance(func, ast.Call):
            values = [func]
        elif isinstance(func, ast.Name):
            found = self.value(func.id, line)
            values = [found[0]] if found else list(self.ctx.name_values().get(func.id, ()))
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            cls = owner_of(self.scope, self.ctx)
            values = self_bindings(cls, func.attr, self.ctx) if cls is not None else []
        kinds = {_MODULES.get(self.ctx.call_name(v) or "") if isinstance(v, ast.Call) else None
                 for v in (unmoved(v, self.ctx) for v in values)}
        return kinds.pop() if len(kinds) == 1 else None

    def kind(self, node: ast.AST | None, line: int, depth: int = 0) -> _Kind | None:
        """What ``node`` (read at ``line``) holds; None when none of :class:`_Kind`."""
        if node is None or depth > _DEPTH:
            return None
        ctx = self.ctx
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _KEEPS \
                and ctx.qualified_name(node.func) is None:
            node = node.func.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = self.kind(node.operand, line, depth + 1)
            return inner.flipped() if inner is not None else None
        if isinstance(node, ast.Name):
            found = self.value(node.id, line)
            return self.kind(found[0], found[1], depth + 1) if found else None
        if isinstance(node, ast.BinOp):
            return self._binop_kind(node, line, depth)
        if isinstance(node, ast.Subscript) or _is_gather(node, ctx):
            source = _gathered_from(node, ctx)
            inner = self.kind(source, line, depth + 1) if source is not None else None
            if inner is not None and inner.kind in ("logprob", "prob"):
                return _Kind("picked" if inner.kind == "logprob" else "picked-prob", inner.logits, inner.negated,
                             inner.written)
            return None
        if not isinstance(node, ast.Call):
            return None
        name = ctx.call_name(node) or ""
        method = node.func.attr if isinstance(node.func, ast.Attribute) and ctx.qualified_name(node.func) is None \
            else None
        first = node.args[0] if node.args else None
        if name in _LOG_SOFTMAX and first is not None:
            return _Kind("logprob", ctx.text(first))
        if method == "log_softmax":
            return _Kind("logprob", ctx.text(node.func.value))
        if name in _SOFTMAX and first is not None:
            return _Kind("prob", ctx.text(first))
        if method == "softmax":
            return _Kind("prob", ctx.text(node.func.value))
        if name in _LOG or method == "log":
            inner_node = first if name in _LOG else node.func.value  # type: ignore[union-attr]
            return self._log_kind(inner_node, line, depth)
        if name in _EXP or method == "exp":
            return _Kind("exp", ctx.text(first if name in _EXP else node.func.value))  # type: ignore[union-attr]
        if name == "torch.cat" and first is not None and isinstance(first, (ast.List, ast.Tuple)) and first.elts:
            kinds = [self.kind(e, line, depth + 1) for e in first.elts]
            if all(k is not None and k.kind == "exp" for k in kinds):
                return _Kind("exp")
            return None
        if (name in _SUM and first is not None) or method == "sum":
            inner = self.kind(first if name in _SUM else node.func.value, line, depth + 1)  # type: ignore[union-attr]
            return _Kind("expsum") if inner is not None and inner.kind in ("exp", "expsum") else None
        if isinstance(node.func, (ast.Name, ast.Attribute)) and first is not None and len(node.args) == 1:
            module = self.module_kind(node.func, line)
            if module is not None:
                return _Kind(module, ctx.text(first))
        return None

    def _binop_kind(self, node: ast.BinOp, line: int, depth: int) -> _Kind | None:
        ctx = self.ctx
        if isinstance(node.op, ast.Sub):
            # ``x - log(exp(x).sum())``, ``x - x.logsumexp()``: a log-softmax by hand.
            right = node.right
            if isinstance(right, ast.Call):
                name = ctx.call_name(right) or ""
                if name in _LOGSUMEXP or (isinstance(right.func, ast.Attribute) and right.func.attr == "logsumexp"
                                          and ctx.qualified_name(right.func) is None):
                    return _Kind("logprob", ctx.text(node.left), written=True)
                if name in _LOG and right.args:
                    inner = self.kind(right.args[0], line, depth + 1)
                    if inner is not None and inner.kind == "expsum":
                        return _Kind("logprob", ctx.text(node.left), written=True)
            return None
        if isinstance(node.op, ast.Mult):
            # ``exp(x) * mask`` keeps exponentials; a constant times a log-softmax keeps it.
            for one, other in ((node.left, node.right), (node.right, node.left)):
                kind = self.kind(one, line, depth + 1)
                if kind is None:
                    continue
                if kind.kind == "exp" and not _is_constant(other):
                    return _Kind("exp", kind.logits)
                if kind.kind in ("logprob", "picked") and _is_constant(other):
                    return kind.flipped() if _negative(other) else kind
            return None
        if isinstance(node.op, ast.Div):
            kind = self.kind(node.left, line, depth + 1)
            if kind is not None and kind.kind in ("logprob", "exp") and _is_constant(node.right):
                return kind
        return None

    def _log_kind(self, node: ast.AST | None, line: int, depth: int) -> _Kind | None:
        """``log(p)``, ``log(p + eps)``, ``log(p[y])``, ``log(exp(pos) / exp(sim).sum())``."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _is_constant(node.right):
            node = node.left
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            top = self.kind(node.left, line, depth + 1)
            bottom = self.kind(node.right, line, depth + 1)
            if top is not None and top.kind == "exp" and bottom is not None and bottom.kind == "expsum":
                return _Kind("picked", "", written=True)  # the positive's log-probability among all
            right, at = self.resolved(node.right, line)
            if top is not None and top.kind == "exp" and isinstance(right, ast.BinOp) and \
                    isinstance(right.op, ast.Add) and any(
                        (k := self.kind(side, at, depth + 1)) is not None and k.kind in ("exp", "expsum")
                        for side in (right.left, right.right)):
                return _Kind("picked", "", written=True)  # log(exp(pos) / (exp(pos) + exp(neg).sum()))
            return None
        inner = self.kind(node, line, depth + 1)
        if inner is None:
            return None
        if inner.kind == "prob":
            return _Kind("logprob", inner.logits, written=True)
        if inner.kind == "picked-prob":
            return _Kind("picked", inner.logits, written=True)
        return None

    # ------------------------------------------------------------------ uses

    def parents(self) -> dict[int, ast.AST]:
        if self._parents is None:
            self._parents = parent_map(self.scope)
        return self._parents

    def statement_of(self, node: ast.AST) -> ast.stmt | None:
        parents = self.parents()
        while node is not None and not isinstance(node, ast.stmt):
            node = parents.get(id(node))  # type: ignore[assignment]
        return node

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        """``node``'s ancestors up to its statement."""
        parents = self.parents()
        parent = parents.get(id(node))
        while parent is not None and not isinstance(parent, ast.stmt):
            yield parent
            parent = parents.get(id(parent))

    def bound_name(self, statement: ast.stmt | None) -> str | None:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and \
                isinstance(statement.targets[0], ast.Name):
            return statement.targets[0].id
        if isinstance(statement, ast.AugAssign) and isinstance(statement.target, ast.Name):
            return statement.target.id
        return None

    def binding(self, node: ast.AST) -> tuple[str, ast.stmt] | None:
        """The name the statement holding ``node`` binds, with that statement."""
        statement = self.statement_of(node)
        name = self.bound_name(statement)
        return (name, statement) if name is not None and statement is not None else None

    def uses_after(self, node: ast.AST) -> list[ast.Name]:
        """Where later statements read the name the statement holding ``node`` binds."""
        bound = self.binding(node)
        return [use for use, _ in self.later_uses(bound[0], bound[1].lineno)] if bound is not None else []

    def later_uses(self, name: str, after: int) -> list[tuple[ast.Name, ast.stmt]]:
        out = []
        for statement in self.statements:
            if statement.lineno <= after or isinstance(statement, BOUNDARY_TYPES):
                continue
            for node in ast.walk(statement):
                if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load):
                    out.append((node, statement))
        return out

    def negated(self, node: ast.AST, kind: _Kind, hops: int = 2) -> bool:
        """Whether the expression ``node`` (holding ``kind``) ends up negated: minus the
        expression, times a negative constant, subtracted (``loss -= ...``), or bound to
        a name that a later statement negates (``loss = -picked``, ``nce /= -n``)."""
        if kind.negated:
            return True
        for parent in self.ancestors(node):
            if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.USub):
                return True
            if isinstance(parent, ast.BinOp) and isinstance(parent.op, (ast.Mult, ast.Div)) and \
                    any(_negative(side) for side in (parent.left, parent.right)):
                return True
        statement = self.statement_of(node)
        if isinstance(statement, ast.AugAssign) and isinstance(statement.op, ast.Sub):
            return True
        bound = self.binding(node)
        if bound is None or hops == 0:
            return False
        name, statement = bound
        for later in self.statements:
            if later.lineno > statement.lineno and isinstance(later, ast.AugAssign) and \
                    isinstance(later.target, ast.Name) and later.target.id == name and \
                    isinstance(later.op, (ast.Mult, ast.Div)) and _negative(later.value):
                return True  # ``nce /= -n``
        return any(self.negated(use, _Kind(kind.kind), hops - 1) for use in self.uses_after(node))

    def weighted(self, node: ast.AST, hops: int = 2) -> bool:
        """Whether the picked log-probabilities ``node`` are multiplied by a tensor (an
        advantage, a reward, a focal factor): a policy gradient, not a cross-entropy."""
        for parent in self.ancestors(node):
            if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and \
                    parent.func.attr in _REDUCTIONS:
                return False  # reduced first: a loss weight (or a logged total) comes after
            if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Mult) and \
                    not all(_scalar(side) or _contains(side, node) or self.is_mask(side, getattr(side, "lineno", 0))
                            for side in (parent.left, parent.right)):
                return True
        return hops > 0 and any(self.weighted(use, hops - 1) for use in self.uses_after(node))

    def is_mask(self, node: ast.AST, line: int) -> bool:
        """A padding mask: a comparison (``target != pad``, ``target.ne(pad)``), as
        a float or not, through names."""
        node, line = self.resolved(node, line)
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("float", "to", "type_as", "unsqueeze", "view", "reshape", "detach"):
            node, line = self.resolved(node.func.value, line)
        if isinstance(node, ast.Compare):
            return True
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr in ("ne", "eq", "gt", "lt", "ge", "le")

    def reduced(self, node: ast.AST, hops: int = 1) -> bool:
        """Whether ``node`` is summed (``.sum(...)``, ``torch.sum(...)``) in its
        statement or, bound to a name, in a later one."""
        for parent in self.ancestors(node):
            if isinstance(parent, ast.Call) and ((self.ctx.call_name(parent) or "") in _SUM or (
                    isinstance(parent.func, ast.Attribute) and parent.func.attr == "sum")):
                return True
        return hops > 0 and any(self.reduced(use, hops - 1) for use in self.uses_after(node))

    def same_logits(self, node: ast.AST, logits: str, line: int, depth: int = 0) -> bool:
        """Whether ``node`` holds a softmax (or exp) of ``logits``, or the exp of a
        log-softmax, through the names it reads: an entropy's ``p``."""
        if depth > _DEPTH:
            return False
        for inner in ast.walk(node):
            if isinstance(inner, ast.Name) and depth < _DEPTH:
                found = self.value(inner.id, line)
                if found is not None and self.same_logits(found[0], logits, found[1], depth + 1):
                    return True
            kind = self.kind(inner, line)
            if kind is not None and kind.kind in ("prob", "exp") and kind.logits and \
                    kind.logits == logits:
                return True
            if isinstance(inner, ast.Call) and (self.ctx.call_name(inner) in _EXP or (
                    isinstance(inner.func, ast.Attribute) and inner.func.attr == "exp")):
                arg = inner.args[0] if self.ctx.call_name(inner) in _EXP and inner.args else \
                    getattr(inner.func, "value", None)
                inner_kind = self.kind(arg, line) if arg is not None else None
                if inner_kind is not None and inner_kind.kind == "logprob":
                    return True
        return False

    def findings(self, rule: Rule) -> Iterator[Finding]:
        seen: set[int] = set()
        for node in self.nodes:
            line = getattr(node, "lineno", 0)
            how = self.use(node, line)
            if how is None:
                continue
            statement = self.statement_of(node)
            if statement is None or id(statement) in seen:
                continue
            seen.add(id(statement))
            if how == _SMOOTHED:
                message = ("cross-entropy with one-hot or label-smoothed targets built by hand: "
                           "F.cross_entropy(logits, class_indices, label_smoothing=eps) runs it as one log-softmax "
                           "and NLL without the batch x classes target tensor (1.4-2.0x forward and backward on a "
                           "2-core CPU, benchmarks/cross_entropy.py)")
            else:
                message = ("cross-entropy with its log-softmax written out (log of a softmax, or log of exp over a "
                           "sum of exps): F.cross_entropy on the logits (class indices, the positive's index for a "
                           "contrastive loss, or probability targets) runs one log-softmax instead of exp, sum, "
                           "divide and log, and stays finite where these underflow to -inf (2.1x for one-hot "
                           "targets, 1.4-2.1x for NT-Xent, forward and backward on a 2-core CPU, "
                           "benchmarks/cross_entropy.py)")
            yield self.ctx.finding(rule, node, message,
                                   fix=self.ctx.fix(rule, [], applicability=Applicability.DISPLAY_ONLY))

    def use(self, node: ast.AST, line: int) -> str | None:
        """How ``node`` computes a cross-entropy, in words; None when it does not."""
        ctx = self.ctx
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for one, other in ((node.left, node.right), (node.right, node.left)):
                kind = self.kind(one, line)
                if kind is None or kind.kind != "logprob" or _is_constant(other):
                    continue
                other_kind = self.kind(other, line)
                if other_kind is not None and other_kind.kind in ("logprob", "picked"):
                    continue
                if self.same_logits(other, kind.logits, line):
                    continue  # an entropy
                if not (_negative(other) or self.negated(node, kind) or self.reduced(node)):
                    continue
                if kind.written:
                    return _WRITTEN
                if self.one_hot(other, line):
                    return _SMOOTHED
                # Probability targets times log_softmax: F.cross_entropy computes the same
                # composite (no speed change measured), nothing to gain.
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            # ``logsumexp(x) - x.gather(1, y)``
            return None
        if isinstance(node, ast.Subscript) or _is_gather(node, ctx):
            kind = self.kind(node, line)
            if kind is None or kind.kind != "picked":
                return None
            if isinstance(self.parents().get(id(node)), (ast.Subscript, ast.Call)) and \
                    _is_gather(self.parents().get(id(node)), ctx):
                return None  # the outer pick is the one to judge
            if not self.negated(node, kind):
                return None
            if not kind.written:
                # ``-log_softmax(x).gather(1, y)`` is what F.cross_entropy runs (nll_loss of a
                # log_softmax); with ``-log_softmax(x).mean(-1)`` beside it, label smoothing
                # (weighted by the smoothing factor).
                return _SMOOTHED if self.smoothing_beside(node, kind, line) else None
            return None if self.weighted(node) else _WRITTEN
        if isinstance(node, ast.Call) and ((ctx.call_name(node) or "") in _LOG or (
                isinstance(node.func, ast.Attribute) and node.func.attr == "log"
                and ctx.qualified_name(node.func) is None)):
            arg = node.args[0] if (ctx.call_name(node) or "") in _LOG and node.args else \
                getattr(node.func, "value", None)
            kind = self._log_kind(arg, line, 0)
            if kind is None or kind.kind != "picked":
                return None
            if self.weighted(node) or not self.negated(node, kind):
                return None
            return _WRITTEN
        return None

    def one_hot(self, node: ast.AST, line: int, depth: int = 0) -> bool:
        """Whether the targets ``node`` are one-hot or label-smoothed class indices:
        built with ``scatter``/``one_hot`` (through names, and ``name.scatter_(...)``
        statements)."""
        if depth > _DEPTH:
            return False
        for inner in ast.walk(node):
            if isinstance(inner, ast.Call) and (
                    (self.ctx.call_name(inner) or "") in ("torch.nn.functional.one_hot", "torch.scatter")
                    or (isinstance(inner.func, ast.Attribute)
                        and inner.func.attr in ("scatter", "scatter_", "one_hot"))):
                return True
            if isinstance(inner, ast.Name):
                for statement in self.statements:
                    if statement.lineno < line and isinstance(statement, ast.Expr) and \
                            isinstance(statement.value, ast.Call) and \
                            isinstance(statement.value.func, ast.Attribute) and \
                            statement.value.func.attr in ("scatter_", "index_fill_") and \
                            isinstance(statement.value.func.value, ast.Name) and \
                            statement.value.func.value.id == inner.id:
                        return True
                found = self.value(inner.id, line)
                if found is not None and self.one_hot(found[0], found[1], depth + 1):
                    return True
        return False

    def smoothing_beside(self, node: ast.AST, kind: _Kind, line: int) -> bool:
        """Whether the scope also takes the negated mean (or sum) over the classes of
        the log-softmax ``node`` picks from: label smoothing written as
        ``(1 - eps) * nll + eps * smooth``."""
        source = _gathered_from(node, self.ctx)
        source_text = self.ctx.text(source) if source is not None else None
        for other in self.nodes:
            if isinstance(other, ast.Call) and isinstance(other.func, ast.Attribute) and \
                    other.func.attr in ("mean", "sum") and other.func.value is not None and \
                    self.ctx.text(other.func.value) == source_text:
                inner = self.kind(other.func.value, getattr(other, "lineno", line))
                if inner is not None and inner.kind == "logprob" and inner.logits == kind.logits and \
                        self.negated(other, inner):
                    return True
        return False


def _is_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _is_constant(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_constant(node.left) and _is_constant(node.right)
    return False


def _scalar(node: ast.AST) -> bool:
    """A constant or a setting kept on ``self`` (``self.confidence``): a loss weight,
    not a per-sample tensor such as an advantage."""
    if isinstance(node, ast.UnaryOp):
        return _scalar(node.operand)
    if isinstance(node, ast.BinOp):
        return _scalar(node.left) and _scalar(node.right)
    return _is_constant(node) or (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                                  and node.value.id == "self")


def _negative(node: ast.AST) -> bool:
    """``-1``, ``-1.0 * n``, ``-x``: a factor that flips the sign."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value < 0
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        return _negative(node.left) != _negative(node.right)
    return False


def _contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(tree))


def _is_gather(node: ast.AST | None, ctx: FileContext) -> bool:
    """``x.gather(...)``, ``torch.gather(x, ...)``, ``torch.diag(x)``, ``x.diag()``."""
    if not isinstance(node, ast.Call):
        return False
    name = ctx.call_name(node) or ""
    if name in ("torch.gather", "torch.diag", "torch.diagonal") and node.args:
        return True
    return isinstance(node.func, ast.Attribute) and node.func.attr in ("gather", "diag", "diagonal") and \
        ctx.qualified_name(node.func) is None


def _gathered_from(node: ast.AST, ctx: FileContext) -> ast.AST | None:
    """The tensor a pick reads: ``x`` of ``x[..., y]`` (an index that is not only
    slices), ``x.gather(...)``, ``torch.gather(x, ...)``, ``torch.diag(x)``."""
    if isinstance(node, ast.Subscript):
        index = node.slice
        parts = index.elts if isinstance(index, ast.Tuple) else [index]
        if all(isinstance(p, ast.Slice) for p in parts):
            return None
        return node.value
    if isinstance(node, ast.Call):
        name = ctx.call_name(node) or ""
        if name in ("torch.gather", "torch.diag", "torch.diagonal"):
            return node.args[0] if node.args else None
        if isinstance(node.func, ast.Attribute):
            return node.func.value
    return None
