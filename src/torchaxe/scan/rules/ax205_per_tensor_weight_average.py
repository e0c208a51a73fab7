"""AX205: a moving average of a model's weights kept one tensor at a time."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext, fast_walk
from torchaxe.scan.rules.ax203_manual_parameter_update_loop import iterable_kind
from torchaxe.scan.rules.base import Invalid, Rule, Valid


class PerTensorWeightAverage(Rule):
    """
    ## What it does
    Flags a loop that keeps an exponential moving average of a model's weights one
    tensor at a time: an EMA model, a momentum (key/teacher) encoder, a mean teacher,
    a reinforcement-learning target network's soft ("Polyak") update. Each iteration
    makes a tensor a weighted sum of itself and the matching tensor of the other
    model, however it is spelled: `e.mul_(d).add_(p, alpha=1 - d)`,
    `e.data = e.data * m + p.data * (1 - m)`, `e.copy_(tau * p + (1 - tau) * e)`,
    `e.sub_((1 - d) * (e - p))`, `e.lerp_(p, 1 - d)`, `e *= d; e += (1 - d) * p`, or a
    new value stored into a dict of averages (`shadow[name] = d * shadow[name] +
    (1 - d) * p`), over `zip(ema.parameters(), model.parameters())`, `named_parameters()`,
    `state_dict().items()` or a dict looked up by the loop's key. The rule reads the
    loop's statements as arithmetic on the tensors it walks: what counts is that one
    tensor ends as `a * itself + b * the other` (weights from outside the loop, and no
    gradient), not the spelling.

    ## Why is this bad?
    Every iteration launches one to four small kernels from Python, and most spellings
    pass over the averaged tensor two or three times (a multiply, then an add, or a
    temporary). The update runs every step over every tensor of the model: for a
    model of hundreds of tensors that is hundreds of launches a step on a device, and
    on any target several passes over memory where one would do. One multi-tensor
    `torch._foreach_lerp_` call updates every tensor in one pass (what
    `torch.optim.swa_utils.get_ema_multi_avg_fn` and timm's `ModelEmaV3` use).

    ## Example
    ```python
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(decay).add_(p, alpha=1 - decay)
    ```

    ## Use instead
    ```python
    with torch.no_grad():
        torch._foreach_lerp_([e.detach() for e in ema.parameters()],
                             [p.detach() for p in model.parameters()], 1 - decay)
    ```
    (`e + w * (p - e)` is `(1 - w) * e + w * p`), or keep the averaged model in
    `torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`.

    ## Fix safety
    Unsafe, and offered only where the loop walks two modules' `.parameters()`, does
    nothing else, and its two weights add up to one: `lerp` rounds differently in the
    last bits from a multiply and an add, and both lists must hold tensors of one dtype
    each pair (an fp32 average of a bf16 model needs `_foreach_mul_` and
    `_foreach_add_`). `_foreach_lerp_` is an underscore API, the one torch's own
    averaging uses. Other loops (dicts of averages, state_dict walks that skip integer
    buffers, weights that do not add up to one) are shown, not rewritten. NPU: the
    multi-tensor call is unverified on Ascend hardware.
    """

    code = "AX205"
    name = "per-tensor-weight-average"
    category = "weight_average_unfused"
    message = "a moving average of weights updated one tensor at a time"
    fix_title = "average every tensor in one torch._foreach_lerp_ call"
    fix_safety = Applicability.UNSAFE
    # An average writes in place, through .data or *=, or stores a new value into its
    # store of averages (named for what it keeps, or for its decay).
    requires_text = ("mul_(", "add_(", "sub_(", "lerp_(", "lerp(", "copy_(", "div_(", ".data =", "*=", "shadow",
                     "decay")
    also_requires_text = ("for ",)
    #: Two weights that add up to one are written with a ``1 -`` somewhere in the file
    #: (``1 - decay``, ``1. - self.m``); other averages are a lerp or begin with an
    #: in-place multiply (``e.mul_(d).add_(p, alpha=w)``).
    requires_pattern = re.compile(r"1(?<!\w1)(?:\.0*)?\s*-|lerp|mul_\(")
    #: An EMA helper class handed the model needs no import of torch (fast-autoaugment's
    #: ``EMA.__call__(module)`` over ``module.state_dict().items()``).
    reads_files_without_torch = True
    node_types = (ast.For,)
    references = (
        "https://pytorch.org/docs/stable/generated/torch.lerp.html",
        "https://pytorch.org/docs/stable/optim.html#weight-averaging-swa-and-ema",
    )
    examples = (
        Invalid(
            "import torch\nwith torch.no_grad():\n    for e, p in zip(ema.parameters(), model.parameters()):\n"
            "        e.mul_(decay).add_(p, alpha=1 - decay)\n",
            fixed="import torch\nwith torch.no_grad():\n    torch._foreach_lerp_([e.detach() for e in ema.parameters()], "
            "[p.detach() for p in model.parameters()], 1 - decay)\n", lines=(4,),
        ),
        # MoCo's key encoder: a new value assigned to .data, weights read from self.
        Invalid(
            "import torch\nclass MoCo(torch.nn.Module):\n    @torch.no_grad()\n    def _momentum_update(self):\n"
            "        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):\n"
            "            param_k.data = param_k.data * self.m + param_q.data * (1. - self.m)\n",
            target="cuda",
            fixed="import torch\nclass MoCo(torch.nn.Module):\n    @torch.no_grad()\n    def _momentum_update(self):\n"
            "        torch._foreach_lerp_([param_k.detach() for param_k in self.encoder_k.parameters()], "
            "[param_q.detach() for param_q in self.encoder_q.parameters()], 1 - self.m)\n", lines=(6,),
        ),
        # A soft target update: the source's weight first.
        Invalid(
            "import torch\ndef soft_update(target, source, tau):\n"
            "    for t, s in zip(target.parameters(), source.parameters()):\n"
            "        t.data.copy_(t.data * (1.0 - tau) + s.data * tau)\n",
            fixed="import torch\ndef soft_update(target, source, tau):\n"
            "    torch._foreach_lerp_([t.detach() for t in target.parameters()], "
            "[s.detach() for s in source.parameters()], tau)\n", lines=(4,),
        ),
        # DINO's teacher: the source's share made before the add.
        Invalid(
            "import torch\nwith torch.no_grad():\n"
            "    for param_q, param_k in zip(student.parameters(), teacher.parameters()):\n"
            "        param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)\n",
            target="npu",
            fixed="import torch\nwith torch.no_grad():\n"
            "    torch._foreach_lerp_([param_k.detach() for param_k in teacher.parameters()], "
            "[param_q.detach() for param_q in student.parameters()], 1 - m)\n", lines=(4,),
        ),
        # Shown, not rewritten: looked up by name in a dict.
        Invalid(
            "import torch\nema_params = dict(ema.named_parameters())\n"
            "for name, param in model.named_parameters():\n"
            "    ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)\n", lines=(4,)
        ),
        # A state_dict walk that skips integer buffers, with in-place operators.
        Invalid(
            "import torch\nmsd = model.state_dict()\nfor k, v in ema.state_dict().items():\n"
            "    if v.dtype.is_floating_point:\n        v *= d\n        v += (1 - d) * msd[k].detach()\n", lines=(6,)
        ),
        # The difference form, and a dict of averages the loop stores into.
        Invalid(
            "import torch\nfor name, p in model.named_parameters():\n"
            "    shadow[name].sub_((1 - decay) * (shadow[name] - p))\n", lines=(3,)
        ),
        Invalid(
            "import torch\nfor name, param in model.named_parameters():\n    if param.requires_grad:\n"
            "        new_average = (1.0 - self.decay) * param.data + self.decay * self.shadow[name]\n"
            "        self.shadow[name] = new_average.clone()\n", lines=(5,)
        ),
        Invalid(
            "import torch\nfor p_ema, p_net in zip(ema.parameters(), net.parameters()):\n"
            "    p_ema.copy_(p_net.detach().lerp(p_ema, beta))\n",
            fixed="import torch\ntorch._foreach_lerp_([p_ema.detach() for p_ema in ema.parameters()], "
            "[p_net.detach() for p_net in net.parameters()], 1 - beta)\n", lines=(3,),
        ),
        # Names unpacked from the items of a state dict (hlb-CIFAR10): shown, not rewritten.
        Invalid(
            "import torch\nwith torch.no_grad():\n"
            "    for e, (name, p) in zip(ema.state_dict().values(), net.state_dict().items()):\n"
            "        e.mul_(decay).add_(p.detach().mul(1. - decay))\n", lines=(4,)
        ),
        # Weights that need not add up to one: shown, not rewritten.
        Invalid(
            "import torch\nfor a, b in zip(avg.parameters(), model.parameters()):\n"
            "    a.mul_(decay).add_(b, alpha=step_size)\n", lines=(3,)
        ),
        # Copies, not averages.
        Valid("import torch\nfor t, s in zip(target.parameters(), source.parameters()):\n    t.data.copy_(s.data)\n"),
        Valid("import torch\nfor t, s in zip(target.parameters(), source.parameters()):\n    t.data = s.data.clone()\n"),
        # Already one multi-tensor call, or the fallback beside it.
        Valid("import torch\ntorch._foreach_lerp_(ema_params, model_params, 1 - decay)\n"),
        Valid(
            "import torch\ndef update(ema_params, params, decay):\n    if ema_params[0].is_floating_point():\n"
            "        torch._foreach_lerp_(ema_params, params, 1 - decay)\n    else:\n"
            "        for e, p in zip(ema_params, params):\n            e.copy_(e * decay + p * (1 - decay))\n"
        ),
        # A fallback chosen by a setting runs unless the setting is on: shown.
        Invalid(
            "import torch\ndef step(self, ema_params, params, decay):\n    if self.foreach:\n"
            "        torch._foreach_lerp_(ema_params, params, 1 - decay)\n    else:\n"
            "        for e, p in zip(ema_params, params):\n            e.lerp_(p, 1 - decay)\n", lines=(7,)
        ),
        # A step from a share of other tensors (SGD over lists of gradients).
        Valid(
            "import torch\nfor i in range(len(params)):\n    params[i].add_(grads[i].detach(), alpha=-lr)\n"
        ),
        # Momentum from gradients: an optimizer (AX203), not an average.
        Valid(
            "import torch\nfor p, buf in zip(model.parameters(), bufs):\n    buf.mul_(0.9).add_(p.grad)\n"
        ),
        # A running statistic of one tensor per loop, from something computed, not a model's tensor.
        Valid("import torch\nfor x in batches:\n    running.mul_(0.9).add_(x.mean(0), alpha=0.1)\n"),
        # Gradients summed into a buffer.
        Valid("import torch\nfor acc, p in zip(accum, model.parameters()):\n    acc.add_(p.grad)\n"),
        # Weights that provably do not average (a sum).
        Valid("import torch\nfor a, b in zip(x.parameters(), y.parameters()):\n    a.add_(b)\n"),
        Valid("import torch\nfor a, b in zip(x.parameters(), y.parameters()):\n    a.mul_(0.5).add_(b, alpha=2.0)\n"),
        # Numbers, not tensors.
        Valid("losses = {}\nfor k, v in new.items():\n    smooth[k] = 0.9 * smooth[k] + 0.1 * v\n"),
        Valid(
            "import torch\nfor e, p in zip(ema.parameters(), model.parameters()):\n"
            "    e.mul_(decay).add_(p, alpha=1 - decay)  # noqa: AX205\n"
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.For)
        update = _average_in(node, ctx)
        if update is None:
            return
        weight = update.weight.text()
        fix = ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY)
        replacement = None
        rewritten = None if update.setting else _rewrite(node, update, ctx)
        if rewritten is not None:
            replacement = rewritten
            fix = ctx.fix(self, [ctx.replace(node, rewritten)], imports=("import torch",))
        instead = replacement or (f"torch._foreach_lerp_(averaged tensors, source tensors, {weight})"
                                  if update.sums_to_one else
                                  f"torch._foreach_mul_(averaged, {update.keep.text()}) and "
                                  f"torch._foreach_add_(averaged, sources, alpha={weight})")
        if ctx.target == "cpu":
            cost = "passes over every averaged tensor two or more times, one tensor per Python iteration"
        else:
            cost = (f"launches one to four small kernels per tensor from Python on {ctx.target}, hundreds a step "
                    "for a real model")
        unverified = "; unverified on Ascend hardware" if ctx.target == "npu" else ""
        if update.setting:
            how = (f"Display-only: the code around it averages with multi-tensor (_foreach_) calls when "
                   f"`{update.setting}` holds: turning that setting on is the change")
        elif rewritten is not None:
            how = ("Fix is unsafe: lerp rounds differently in the last bits, and each pair of tensors must share a "
                   "dtype")
        else:
            how = "Display-only: the averaged tensors are " + update.why_shown
        message = (f"moving average of weights kept one tensor at a time ({update.target} moved toward {update.source}): "
                   f"each time it runs it {cost}; one multi-tensor call updates them all in one pass: {instead}"
                   f"{unverified}. {how}")
        yield ctx.finding(self, update.statement, message, replacement=replacement, fix=fix)


# ----------------------------------------------------------------- arithmetic
#: A polynomial in scalar expressions: each monomial (a sorted tuple of the texts
#: multiplied) with its numeric factor. Weights like ``1 - decay`` or ``self.m``.
_Monomial = tuple[str, ...]


@dataclass(frozen=True)
class Scalar:
    terms: tuple[tuple[_Monomial, float], ...]

    @staticmethod
    def of(terms: dict[_Monomial, float]) -> Scalar:
        return Scalar(tuple(sorted((m, c) for m, c in terms.items() if abs(c) > 1e-12)))

    @staticmethod
    def number(value: float) -> Scalar:
        return Scalar.of({(): float(value)})

    @staticmethod
    def atom(text: str) -> Scalar:
        return Scalar.of({(text,): 1.0})

    def __add__(self, other: Scalar) -> Scalar:
        out = dict(self.terms)
        for m, c in other.terms:
            out[m] = out.get(m, 0.0) + c
        return Scalar.of(out)

    def __mul__(self, other: Scalar) -> Scalar:
        out: dict[_Monomial, float] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                m = tuple(sorted(m1 + m2))
                out[m] = out.get(m, 0.0) + c1 * c2
        return Scalar.of(out)

    def scaled(self, factor: float) -> Scalar:
        return Scalar.of({m: c * factor for m, c in self.terms})

    @property
    def zero(self) -> bool:
        return not self.terms

    @property
    def constant(self) -> float | None:
        if not self.terms:
            return 0.0
        if len(self.terms) == 1 and self.terms[0][0] == ():
            return self.terms[0][1]
        return None

    def text(self) -> str:
        """The weight as code: ``1 - decay``, ``self.m``, ``0.001``."""
        parts = []
        for monomial, factor in sorted(self.terms, key=lambda t: (len(t[0]) > 0, t[0])):
            magnitude = abs(factor)
            body = " * ".join(monomial)
            if not monomial:
                piece = _number(magnitude)
            elif magnitude == 1.0:
                piece = body
            else:
                piece = f"{_number(magnitude)} * {body}"
            if not parts:
                parts.append(("-" if factor < 0 else "") + piece)
            else:
                parts.append(("- " if factor < 0 else "+ ") + piece)
        return " ".join(parts) if parts else "0"


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


#: A value as a weighted sum of the loop's tensors as they were when the iteration
#: began: tensor key -> weight; key ``""`` is a scalar part (no tensor).
Linear = dict[str, Scalar]


def _plus(a: Linear, b: Linear, sign: float = 1.0) -> Linear:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, Scalar.number(0)) + v.scaled(sign)
    return {k: v for k, v in out.items() if not v.zero}


def _times(a: Linear, s: Scalar) -> Linear:
    return {k: v * s for k, v in a.items() if not (v * s).zero}


def _scalar_of(a: Linear) -> Scalar | None:
    if set(a) - {""}:
        return None
    return a.get("", Scalar.number(0))


#: Methods that return the same tensor (a view: writes through it reach the tensor).
_VIEWS = ("detach",)
#: In-place methods that leave a tensor's values as they are.
_KEEP_VALUES = ("detach_", "requires_grad_")
#: Methods that return the same values (a view, a copy, another device or dtype).
_SAME = ("detach", "clone", "contiguous", "to", "type_as", "float", "double", "half", "bfloat16", "cuda", "cpu")
#: The most paths through a loop body (one per branch taken) that are read.
_MAX_PATHS = 32
#: How deep calls to the file's own functions are followed.
_MAX_INLINE = 2


class _Unknown(Exception):
    """The loop does something this reading does not follow."""


def _paths(body: list[ast.stmt]) -> list[list[ast.stmt]]:
    """The statement sequences one pass through ``body`` may run: each ``if`` taken
    or not, ``with``/``try`` bodies inline; a ``continue``, ``break``, ``return`` or
    ``raise`` ends its path (kept last). At most ``_MAX_PATHS``."""
    paths: list[list[ast.stmt]] = [[]]
    done: list[list[ast.stmt]] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            branches = _paths(stmt.body) + _paths(stmt.orelse or [ast.Pass()])
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            branches = _paths(stmt.body)
        elif isinstance(stmt, ast.Try):
            branches = [b + f for b in _paths(stmt.body) for f in _paths(stmt.finalbody or [ast.Pass()])]
        else:
            branches = [[stmt]]
        grown = []
        for path in paths:
            for branch in branches:
                (done if _ends(branch) else grown).append(path + branch)
        paths = grown[:_MAX_PATHS]
        done = done[:_MAX_PATHS]
        if not paths:
            break
    return (done + paths)[:_MAX_PATHS]


def _ends(path: list[ast.stmt]) -> bool:
    return bool(path) and isinstance(path[-1], (ast.Continue, ast.Break, ast.Return, ast.Raise))


class _Reader:
    """Reads one path through a loop body as arithmetic on the tensors it walks."""

    def __init__(self, loop_names: set[str], ctx: FileContext, depth: int = 0) -> None:
        self.loop_names = set(loop_names)
        self.ctx = ctx
        self.depth = depth
        self.values: dict[str, Linear] = {}  # a tensor's value now, by key
        self.locals: dict[str, Linear] = {}  # names bound to a value in the body
        self.aliases: dict[str, str] = {}  # names bound to a walked tensor itself
        self.indices: set[str] = set()  # names bound to something else made from the loop's
        self.written: dict[str, ast.stmt] = {}
        self.tensor_evidence = False
        #: A statement that changes the tensors other than by value (``detach_()``).
        self.other_effects = False
        self.returned: Linear | None = None

    def derived(self) -> set[str]:
        return self.loop_names | set(self.locals) | set(self.aliases) | self.indices

    # -- keys: the tensors the loop walks
    def key(self, node: ast.AST) -> str | None:
        """The tensor ``node`` names, when it is one the loop walks: a loop variable,
        ``D[k]`` for ``k`` made from the loop, a name bound to either, or either
        through ``.data``/``.detach()``."""
        while True:
            if isinstance(node, ast.Attribute) and node.attr == "data":
                self.tensor_evidence = True
                node = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _VIEWS \
                    and not node.args and not node.keywords:
                self.tensor_evidence = True
                node = node.func.value
            else:
                break
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return self.aliases[node.id]
            if node.id in self.loop_names:
                return node.id
            return None
        if isinstance(node, ast.Subscript) and self._mentions(node.slice) and not self._mentions(node.value):
            return ast.unparse(node)
        return None

    def _mentions(self, node: ast.AST) -> bool:
        names = self.derived()
        return any(isinstance(n, ast.Name) and n.id in names for n in fast_walk(node))

    def _mentions_values(self, node: ast.AST) -> bool:
        """Whether ``node`` reads the loop's tensors' values (not only their
        ``.device`` or ``.dtype``: ``src.to(tgt.device)``)."""
        names = self.derived()
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Attribute) and n.attr in ("device", "dtype"):
                continue
            if isinstance(n, ast.Name) and n.id in names:
                return True
            stack.extend(ast.iter_child_nodes(n))
        return False

    def current(self, key: str) -> Linear:
        return self.values.get(key, {key: Scalar.number(1)})

    # -- expressions
    def value(self, node: ast.AST) -> Linear:
        key = self.key(node)
        if key is not None:
            return self.current(key)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SAME \
                and self._mentions(node.func.value) and (node.func.attr == "type_as" or (
                    not any(self._mentions_values(a) for a in node.args)
                    and not any(self._mentions_values(k.value) for k in node.keywords))):
            self.tensor_evidence = True
            return self.value(node.func.value)
        if isinstance(node, ast.Name) and node.id in self.locals:
            return self.locals[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return {"": Scalar.number(node.value)}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return _times(self.value(node.operand), Scalar.number(-1))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            if isinstance(node.op, (ast.Add, ast.Sub)):
                return _plus(self.value(node.left), self.value(node.right), 1.0 if isinstance(node.op, ast.Add) else -1.0)
            if isinstance(node.op, ast.Mult):
                left, right = self.value(node.left), self.value(node.right)
                for tensor, scalar in ((left, right), (right, left)):
                    s = _scalar_of(scalar)
                    if s is not None:
                        return _times(tensor, s)
                raise _Unknown
            if isinstance(node.op, ast.Div):
                divisor = _scalar_of(self.value(node.right))
                if divisor is None:
                    raise _Unknown
                constant = divisor.constant
                if constant:
                    return _times(self.value(node.left), Scalar.number(1.0 / constant))
                return _times(self.value(node.left), Scalar.atom(f"(1 / ({ast.unparse(node.right)}))"))
        if isinstance(node, ast.Call):
            return self.call_value(node)
        if self._mentions(node):
            raise _Unknown  # p.grad, p.shape[0], ...
        return {"": Scalar.atom(ast.unparse(node))}

    def call_value(self, node: ast.Call) -> Linear:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("mul", "add", "sub", "lerp", "div") \
                and self._mentions(func.value):
            return self._method(func.attr, self.value(func.value), node)
        name = self.ctx.qualified_name(func) or ""
        if name in ("torch.mul", "torch.add", "torch.sub", "torch.lerp") and node.args:
            result = self._method(name[6:], self.value(node.args[0]),
                                  ast.Call(func=func, args=node.args[1:],
                                           keywords=[k for k in node.keywords if k.arg != "out"]))
            out = next((k.value for k in node.keywords if k.arg == "out"), None)
            if out is not None:
                key = self.key(out)
                if key is None:
                    raise _Unknown
                self.tensor_evidence = True
                self.write(key, result, None)
            return result
        if self._mentions(node):
            inlined = self.inline(node)
            if inlined is None:
                raise _Unknown
            return inlined
        return {"": Scalar.atom(ast.unparse(node))}

    def inline(self, call: ast.Call) -> Linear | None:
        """A call of one of the file's own functions (``update_average(old, new)``,
        ``self.inplace_lerp(t, s, w)``) read with its arguments: what it returns, its
        writes applied here. None when it cannot be followed."""
        if self.depth >= _MAX_INLINE or any(isinstance(a, ast.Starred) for a in call.args) \
                or any(k.arg is None for k in call.keywords):
            return None
        func = call.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        defs = self.ctx.functions().get(name or "", [])
        if len(defs) != 1:
            return None
        (definition,) = defs
        if not _computes(definition, self.ctx):
            return None
        params = [a.arg for a in [*definition.args.posonlyargs, *definition.args.args]]
        if isinstance(func, ast.Attribute) and params and params[0] in ("self", "cls"):
            params = params[1:]
        if len(call.args) > len(params):
            return None
        inner = _Reader(set(), self.ctx, self.depth + 1)
        inner.values, inner.written = self.values, self.written
        bound = dict(zip(params, call.args))
        bound.update({k.arg: k.value for k in call.keywords if k.arg})
        for param, arg in bound.items():
            key = self.key(arg)
            if key is not None:
                inner.aliases[param] = key
            elif self._mentions(arg):
                inner.locals[param] = self.value(arg)
        body = [s for s in definition.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        paths = _paths(body)
        for index, path in enumerate(paths):
            trial = _Reader(set(), self.ctx, self.depth + 1)
            trial.values, trial.written = dict(self.values), dict(self.written)
            trial.aliases, trial.locals = dict(inner.aliases), dict(inner.locals)
            try:
                for stmt in path:
                    trial.statement_(stmt)
            except _Unknown:
                continue
            if trial.returned is not None and len(set(trial.returned) - {""}) < 2 and index < len(paths) - 1:
                continue  # an early exit (``if old is None: return new``); the main path decides
            self.values.clear()
            self.values.update(trial.values)
            self.written.clear()
            self.written.update(trial.written)
            self.tensor_evidence = self.tensor_evidence or trial.tensor_evidence
            return trial.returned if trial.returned is not None else {"": Scalar.atom("None")}
        return None

    def _method(self, name: str, receiver: Linear, call: ast.Call) -> Linear:
        """``receiver.name(*call.args)`` as a value (out of place; in-place the same)."""
        args = call.args
        keywords = {k.arg: k.value for k in call.keywords}
        if any(a for a in keywords if a not in ("alpha", "weight", "scalar", "other")) \
                or any(isinstance(a, ast.Starred) for a in args):
            raise _Unknown
        if name in ("mul", "div"):
            factor_node = args[0] if len(args) == 1 else keywords.get("scalar") or keywords.get("other")
            if factor_node is None or len(args) > 1:
                raise _Unknown
            factor = _scalar_of(self.value(factor_node))
            if factor is None:
                raise _Unknown
            if name == "div":
                constant = factor.constant
                if not constant:
                    raise _Unknown
                factor = Scalar.number(1.0 / constant)
            return _times(receiver, factor)
        if name in ("add", "sub"):
            if len(args) == 2 and "alpha" not in keywords:  # the old add_(alpha, other) order
                alpha_node, other_node = args
            elif len(args) == 1:
                alpha_node, other_node = keywords.get("alpha"), args[0]
            else:
                raise _Unknown
            other = self.value(other_node)
            if alpha_node is not None:
                alpha = _scalar_of(self.value(alpha_node))
                if alpha is None:
                    raise _Unknown
                other = _times(other, alpha)
            return _plus(receiver, other, 1.0 if name == "add" else -1.0)
        if name == "lerp":
            end_node = args[0] if args else None
            weight_node = args[1] if len(args) > 1 else keywords.get("weight")
            if end_node is None or weight_node is None:
                raise _Unknown
            weight = _scalar_of(self.value(weight_node))
            if weight is None:
                raise _Unknown
            return _plus(receiver, _times(_plus(self.value(end_node), receiver, -1.0), weight))
        raise _Unknown

    # -- statements
    def write(self, key: str, value: Linear, stmt: ast.stmt | None) -> None:
        self.values[key] = value
        self.written[key] = stmt  # type: ignore[assignment]  # None: the statement calling this sets it

    def inplace(self, node: ast.AST, stmt: ast.stmt) -> str:
        """Apply the in-place call chain ``node`` (``t.mul_(a).add_(b)``); the key written."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)) or node.func.attr in _VIEWS:
            key = self.key(node)
            if key is None:
                raise _Unknown
            return key
        name = node.func.attr
        if name not in ("mul_", "add_", "sub_", "lerp_", "copy_", "div_"):
            raise _Unknown
        self.tensor_evidence = True
        key = self.inplace(node.func.value, stmt)
        if name == "copy_":
            if len(node.args) != 1:
                raise _Unknown
            self.write(key, self.value(node.args[0]), stmt)
        else:
            self.write(key, self._method(name[:-1], self.current(key), node), stmt)
        return key

    def bind(self, target: ast.AST, value_node: ast.AST) -> None:
        """``name = value``: an alias of a walked tensor, a value, or an index."""
        assert isinstance(target, ast.Name)
        for table in (self.aliases, self.locals):
            table.pop(target.id, None)
        self.indices.discard(target.id)
        key = self.key(value_node)
        if key is not None:
            self.aliases[target.id] = key
            return
        if not self._mentions(value_node):
            return  # a name from outside the loop: a scalar when used
        try:
            self.locals[target.id] = self.value(value_node)
        except _Unknown:
            self.indices.add(target.id)  # a key or a flag made from the loop's names

    def statement_(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            func = stmt.value.func
            if isinstance(func, ast.Attribute) and func.attr in _KEEP_VALUES and self.key(func.value) is not None:
                self.tensor_evidence = True  # ``target.detach_()`` (DeepRL): the values stay,
                self.other_effects = True  # but the tensor no longer requires grad: a rewrite must keep it
                return
            if isinstance(func, ast.Attribute) and func.attr.endswith("_") and self._mentions(func.value):
                self.inplace(stmt.value, stmt)
                return
            if self._mentions(stmt.value):
                before = dict(self.written)
                self.call_value(stmt.value)
                for key, where in self.written.items():
                    if before.get(key) is not where or where is None:
                        self.written[key] = stmt
                return
            return  # a call on something else (logging)
        if isinstance(stmt, ast.AugAssign):
            if isinstance(stmt.target, ast.Name) and stmt.target.id in self.locals:
                # ``diff *= 1 - decay`` on a value of the loop (openfold: ``diff = stored -
                # v; diff *= 1 - decay; stored -= diff``).
                read = ast.copy_location(ast.Name(id=stmt.target.id, ctx=ast.Load()), stmt.target)
                self.locals[stmt.target.id] = self.value(ast.copy_location(
                    ast.BinOp(left=read, op=stmt.op, right=stmt.value), stmt))
                return
            key = self.key(stmt.target)
            op = {ast.Mult: "mul", ast.Add: "add", ast.Sub: "sub", ast.Div: "div"}.get(type(stmt.op))
            if key is None or op is None:
                raise _Unknown
            # ``stored -= diff`` through a name bound to the walked value changes that
            # value only if it is a tensor (for a number it rebinds the name alone).
            through_alias = isinstance(stmt.target, ast.Name) and stmt.target.id in self.aliases
            self.tensor_evidence = self.tensor_evidence or through_alias or _tensor_call(stmt.value)
            self.write(key, self._method(op, self.current(key), ast.Call(func=stmt.target, args=[stmt.value],
                                                                            keywords=[])), stmt)
            return
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple) \
                    and len(target.elts) == len(stmt.value.elts) and all(isinstance(t, ast.Name) for t in target.elts):
                for t, v in zip(target.elts, stmt.value.elts):
                    self.bind(t, v)
                return
            if isinstance(target, ast.Attribute) and target.attr == "data":
                key = self.key(target)
                if key is None:
                    raise _Unknown
                self.write(key, self.value(stmt.value), stmt)
                return
            if isinstance(target, ast.Subscript) and self.key(target) is not None:
                # A new value stored into a dict of tensors walked by key.
                value = self.value(stmt.value)
                self.tensor_evidence = self.tensor_evidence or _tensor_call(stmt.value)
                self.write(self.key(target), value, stmt)  # type: ignore[arg-type]
                return
            if isinstance(target, ast.Name) and target.id not in self.loop_names:
                self.bind(target, stmt.value)
                return
            raise _Unknown
        if isinstance(stmt, ast.Return):
            self.returned = self.value(stmt.value) if stmt.value is not None else None
            return
        if isinstance(stmt, (ast.Pass, ast.Continue, ast.Break, ast.Raise)):
            return
        if isinstance(stmt, ast.Assert):
            return
        raise _Unknown


def _computes(definition: ast.AST, ctx: FileContext) -> bool:
    """Whether a function of the file can compute a tensor's new value: it writes in
    place (``tgt.lerp_(src, w)``) or returns arithmetic (``old * b + (1 - b) * new``).
    Asked once per function."""
    key = ("ax205.computes", id(definition))
    if key not in ctx.cache:
        found = False
        for node in fast_walk(definition):
            if isinstance(node, ast.Attribute) and node.attr in _WRITES:
                found = True
                break
            if isinstance(node, ast.Return) and isinstance(node.value, (ast.BinOp, ast.Call)):
                found = True
                break
        ctx.cache[key] = found
    return ctx.cache[key]


def _tensor_call(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _SAME
               for n in fast_walk(node))


@dataclass
class _Update:
    statement: ast.stmt
    target: str
    source: str
    keep: Scalar
    weight: Scalar  # the source's
    sums_to_one: bool
    only_update: bool
    why_shown: str = ""
    setting: str = ""  # the test of the `if` whose other branch is multi-tensor


def _loop_names(target: ast.AST) -> set[str] | None:
    """The names a loop binds, also from nested tuples (``for e, (name, p) in zip(ema,
    model.state_dict().items())``); None for other targets (attributes, subscripts)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        names: set[str] = set()
        for element in target.elts:
            inner = _loop_names(element)
            if inner is None:
                return None
            names |= inner
        return names
    return None


#: In-place tensor methods a weight average writes with.
_WRITES = ("mul_", "add_", "sub_", "lerp_", "copy_", "div_")


#: Text a loop that writes a tensor holds: an in-place method, ``t.data =``, ``d[k] =``,
#: an augmented assignment, an ``out=`` argument.
_WRITE_TEXT = tuple(f"{m}(" for m in _WRITES) + (".data =", "] =", "+=", "-=", "*=", "/=", "out=")


#: A loop longer than this is no weight average (the longest labelled one, with its
#: function, spans 24 lines).
_MOST_LINES = 40


def _may_write(loop: ast.For, ctx: FileContext) -> bool:
    """A cheap first look at a loop's text: something that can write a tensor (see
    :data:`_WRITE_TEXT`, or a call of one of the file's own functions that computes,
    :func:`_computes`)
    and no gradient (an optimizer's loop, AX203)."""
    if (loop.end_lineno or loop.lineno) - loop.lineno > _MOST_LINES:
        return False
    text = ctx.snippet(loop)
    if ".grad" in text.replace(".grad_fn", "").replace(".gradient", ""):
        return False
    if any(w in text for w in _WRITE_TEXT):
        return True
    called = [name for name in _defined_names(ctx) if f"{name}(" in text]
    if not called:
        return False
    functions = ctx.functions()
    return any(len(functions.get(name, ())) == 1 and _computes(functions[name][0], ctx) for name in called)


def _defined_names(ctx: FileContext) -> tuple[str, ...]:
    """The names the file defines functions under, read from its text (once per file)."""
    key = "ax205.defined"
    if key not in ctx.cache:
        ctx.cache[key] = tuple(set(re.findall(r"def\s+(\w+)\s*\(", ctx.source)))
    return ctx.cache[key]


def _average_in(loop: ast.For, ctx: FileContext) -> _Update | None:
    names = _loop_names(loop.target)
    if not names or loop.orelse or not _may_write(loop, ctx):
        return None
    paths = _paths(loop.body)
    for path in paths:
        reader = _Reader(names, ctx)
        try:
            for stmt in path:
                reader.statement_(stmt)
        except _Unknown:
            continue
        if not reader.tensor_evidence and not _walks_tensors(loop.iter):
            continue
        for target, statement in reader.written.items():
            update = _averaged(target, reader.values[target], statement)
            if update is None:
                continue
            kind, test = _fallback_of_multi_tensor_path(loop, ctx)
            if kind == "dtype":
                return None
            update.only_update = len(paths) == 1 and all(_is_update(s) for s in loop.body) \
                and not reader.other_effects
            update.setting = test if kind == "setting" else ""
            return update
    return None


def _averaged(target: str, final: Linear, statement: ast.stmt | None) -> _Update | None:
    """The update, when ``final`` (the tensor's value after the iteration) is ``a *
    itself + b * one other walked tensor`` with weights that may add up to one."""
    if statement is None or "" in final or target not in final or len(final) != 2:
        return None
    source = next(k for k in final if k != target)
    keep, weight = final[target], final[source]
    total = (keep + weight).constant
    if total is not None and abs(total - 1.0) > 1e-9:
        return None  # a sum or a scaling, not an average
    if keep.constant == 1.0:
        return None  # the tensor plus a share of another: a step or a sum, not an average
    return _Update(statement=statement, target=target, source=source, keep=keep, weight=weight,
                   sums_to_one=total is not None, only_update=False)


def _fallback_of_multi_tensor_path(loop: ast.For, ctx: FileContext) -> tuple[str | None, str]:
    """``"dtype"`` when the loop is the branch of an ``if`` on a dtype whose other
    branch averages with ``torch._foreach_*`` ops (the loop takes the tensors those
    cannot: not for this rule), ``"setting"`` when that ``if`` tests something else
    (``if self.foreach:``: the loop runs unless the setting is on), else None; with
    the test's text."""
    chain = [*ctx.parents, loop]
    for parent, child in zip(reversed(chain[:-1]), reversed(chain[1:])):
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return None, ""
        if not isinstance(parent, ast.If):
            continue
        other = parent.body if child in parent.orelse else parent.orelse if child in parent.body else []
        if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.startswith("_foreach_")
                   for stmt in other for n in fast_walk(stmt)):
            continue
        test = ast.unparse(parent.test)
        return ("dtype" if any(word in test for word in ("is_floating_point", "dtype", "is_complex"))
                else "setting"), test
    return None, ""


def _is_update(stmt: ast.stmt) -> bool:
    return isinstance(stmt, (ast.Expr, ast.AugAssign, ast.Assign))


def _walks_tensors(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("parameters", "named_parameters", "state_dict", "buffers", "named_buffers")
               for n in fast_walk(node))


def _rewrite(loop: ast.For, update: _Update, ctx: FileContext) -> str | None:
    """``torch._foreach_lerp_(...)`` for a loop over ``zip`` of two modules'
    parameters that does nothing but the average, with weights adding up to one.
    ``update.why_shown`` says why not otherwise."""
    call = loop.iter
    target = loop.target
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "zip"
            and "zip" not in ctx.imports and len(call.args) == 2 and not call.keywords
            and isinstance(target, ast.Tuple) and len(target.elts) == 2
            and all(isinstance(e, ast.Name) for e in target.elts)):
        update.why_shown = "looked up by key or walked with other things, which one call cannot take as they are"
        return None
    names = [e.id for e in target.elts]  # type: ignore[attr-defined]
    if sorted(names) != sorted([update.target, update.source]):
        update.why_shown = "looked up by key, which one call cannot take as they are"
        return None
    if not all(iterable_kind(a, ctx) == "parameters" for a in call.args):
        update.why_shown = ("walked from something other than two modules' .parameters() (integer buffers or "
                            "mixed dtypes would need care)")
        return None
    if not update.only_update:
        update.why_shown = "updated among other statements of the loop"
        return None
    if not update.sums_to_one:
        update.why_shown = (f"weighted {update.keep.text()} and {update.weight.text()}, which need not add up to "
                            "one (a lerp needs they do)")
        return None
    iterables = dict(zip(names, call.args))
    averaged, source = update.target, update.source
    return (f"torch._foreach_lerp_([{averaged}.detach() for {averaged} in {ctx.text(iterables[averaged])}], "
            f"[{source}.detach() for {source} in {ctx.text(iterables[source])}], {update.weight.text()})")
