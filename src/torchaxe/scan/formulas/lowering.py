"""Lowering one Python expression to an expression tree.

Only names on the whitelist (``vocabulary``) become operations; everything else (a
module call such as ``self.proj(x)``, an unknown function, a comprehension) becomes an
opaque free variable named after its source text, and the expressions inside it are
handed back as separate roots so that math nested in an opaque call is still seen.
``self.eps``, ``self.weight`` and parameters are free variables too.
"""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING, Callable

from torchaxe.scan.formulas import vocabulary as V
from torchaxe.scan.formulas.ir import CONST, VAR, Builder, Node
from torchaxe.scan.formulas.probes import scalarish

if TYPE_CHECKING:
    from torchaxe.scan.formulas.inline import Scope

_BINOPS = {
    ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.FloorDiv: "floordiv", ast.Mod: "mod",
    ast.Pow: "pow", ast.MatMult: "matmul", ast.BitAnd: "and_", ast.BitOr: "or_",
}
_UNARY = {ast.USub: "neg", ast.UAdd: "pos", ast.Invert: "invert"}
_COMPARE = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge"}
#: The second part of an activation attribute (``inline.Activation``) that is a function
#: (``self.attn_fn = F.softmax``): called with the function's own arguments.
FUNCTION = "<function>"
#: Ends the name of a variable standing for the size in ``self.scale = dim ** -0.5``
#: (``self.scale.dim@init``): a size ``__init__`` was given, assumed to be the data's.
SIZE_POWER_MARK = "@init"
#: Callees whose name says they are dropout modules (``self.attn_dropout(p)``).
_DROPOUT_HINTS = ("dropout", "drop")


_ZEROS = re.compile(r"^(torch\.)?zeros(_like)?\(|^[\w.\[\]]+\.new_zeros\(")


def _zeros(node: Node) -> bool:
    """Whether ``node`` is a tensor of zeros: ``torch.zeros(...)``, ``x.new_zeros(...)``
    (opaque calls, named by their text) or ``torch.zeros_like(x)``."""
    return node.op == "zeros_like" or (node.is_var and bool(_ZEROS.match(str(node.value))))


class ExpressionLowering:
    """Lowers the expressions of one statement in one scope.

    ``made`` maps each tree node built here to the expression that built it (the first
    one); ``named`` maps every node to all the expressions (local names included) that
    evaluate to it. The rules use both to decide whether a match can be rewritten in
    place. ``subroots`` collects the expressions found inside opaque calls.
    """

    def __init__(self, scope: Scope, builder: Builder, text: Callable[[ast.AST], str]):
        self.scope = scope
        self.b = builder
        self.text = text
        self.made: dict[int, ast.AST] = {}
        self.named: dict[int, list[ast.AST]] = {}
        self.subroots: list[tuple[ast.expr, Node]] = []
        #: Results of inlined calls: built by the callee, not by this statement.
        self.inlined: set[int] = set()
        #: Every node the callees inlined here built (part of this statement's math),
        #: with the callee that built it.
        self.inlined_made: dict[int, ast.AST] = {}
        #: The statement's value and how many names it is unpacked into (``nk, nv =
        #: map(f, kv.unbind(dim=-2))``: 2), when it is.
        self.unpacked: tuple[ast.expr, int] | None = None

    # ----------------------------------------------------------------- entry
    def lower(self, node: ast.expr) -> Node:
        method = getattr(self, "_" + type(node).__name__, None)
        result = method(node) if method is not None else self.opaque(node)
        if isinstance(node, ast.Name) or id(result) in self.inlined:
            self.named.setdefault(id(result), []).append(node)
        else:
            self.made.setdefault(id(result), node)
            self.named.setdefault(id(result), []).append(node)
        return result

    # ----------------------------------------------------------------- leaves
    def _Constant(self, node: ast.Constant) -> Node:
        if isinstance(node.value, (bytes, complex)):
            return self.opaque(node)
        return self.b.const(node.value)

    def _Name(self, node: ast.Name) -> Node:
        bound = self.scope.lookup(node.id)
        if bound is not None:
            return bound
        origin = self.scope.unit.imports.get(node.id)
        if origin is not None:
            return self._qualified_leaf(origin) or self.b.var(origin)
        constant = self.scope.unit.module_constants().get(node.id)
        if constant is not None:
            return self.b.const(constant)  # SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
        return self.b.var(node.id)

    def _qualified_leaf(self, qualified: str) -> Node | None:
        if qualified in V.CONSTANTS:
            return self.b.const(V.CONSTANTS[qualified])
        if qualified in V.DTYPES:
            return self.b.const(("dtype", qualified))
        return None

    def _Attribute(self, node: ast.Attribute) -> Node:
        qualified = self.scope.unit.resolve(node)
        if qualified is not None:
            return self._qualified_leaf(qualified) or self.b.var(qualified)
        if self.scope.is_self_chain(node.value):
            if self.scope.is_self(node.value) and self.scope.cls is not None:
                constant = self.scope.unit.class_constants(self.scope.cls).get(node.attr)
                if constant is not None:
                    return self.b.const(constant)  # self.c = math.sqrt(2 / math.pi) in __init__
                power = self.scope.unit.class_size_powers(self.scope.cls).get(node.attr)
                if power is not None:
                    # self.scale = dim ** -0.5 in __init__: that power of a size.
                    return self.b.op("pow", (self.b.var(f"self.{node.attr}.{power[0]}{SIZE_POWER_MARK}"),
                                             self.b.const(power[1])))
            return self.opaque(node)  # self.eps, self.weight, self.config.eps
        if isinstance(node.value, ast.Name) and node.value.id in self.scope.unit.functions \
                and self.scope.lookup(node.value.id) is None:
            constant = self.scope.unit.function_constants(node.value.id).get(node.attr)
            if constant is not None:
                return self.b.const(constant)  # gelu_accurate._a = math.sqrt(2 / math.pi)
        attr = V.ATTRIBUTES.get(node.attr)
        if attr is None:
            return self.opaque(node)
        value = self.lower(node.value)
        if attr in ("attr_min", "attr_max", "attr_eps", "attr_tiny") and value.op != "finfo":
            return self.opaque(node)
        if value.is_var and attr not in ("shape", "T", "mT", "dtype", "ndim", "real", "imag", "device"):
            return self.opaque(node)
        return self.b.op(attr, (value,))

    # ----------------------------------------------------------------- operators
    def _BinOp(self, node: ast.BinOp) -> Node:
        op = _BINOPS.get(type(node.op))
        if op is None:
            return self.opaque(node)
        return self.b.op(op, (self.lower(node.left), self.lower(node.right)))

    def _UnaryOp(self, node: ast.UnaryOp) -> Node:
        op = _UNARY.get(type(node.op))
        if op is None:
            return self.opaque(node)
        return self.b.op(op, (self.lower(node.operand),))

    def _Compare(self, node: ast.Compare) -> Node:
        if len(node.ops) != 1 or type(node.ops[0]) not in _COMPARE:
            return self.opaque(node)
        return self.b.op(_COMPARE[type(node.ops[0])], (self.lower(node.left), self.lower(node.comparators[0])))

    def _JoinedStr(self, node: ast.JoinedStr) -> Node:
        """An f-string whose every part is a constant (``f"b h i d, {kv_eq} -> b h i j"``
        with ``kv_eq`` bound to a string): that string. Otherwise opaque."""
        parts: list[str] = []
        for part in node.values:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                parts.append(part.value)
                continue
            if not isinstance(part, ast.FormattedValue) or part.format_spec is not None or part.conversion not in (
                    -1, ord("s")):
                return self.opaque(node, lower_children=False)
            value = self.lower(part.value)
            if not value.is_const or not isinstance(value.value, (str, int)) or isinstance(value.value, bool):
                return self.opaque(node, lower_children=False)
            parts.append(str(value.value))
        return self.b.const("".join(parts))

    def _Tuple(self, node: ast.Tuple | ast.List) -> Node:
        return self.b.op("tuple", [self.lower(e) for e in node.elts])

    _List = _Tuple

    def _Starred(self, node: ast.Starred) -> Node:
        return self.b.op("star", (self.lower(node.value),))

    def _Subscript(self, node: ast.Subscript) -> Node:
        return self.b.op("getitem", (self.lower(node.value), self._index(node.slice)))

    def _index(self, node: ast.expr) -> Node:
        if isinstance(node, ast.Slice):
            parts = [self.lower(p) if p is not None else self.b.const(None) for p in (node.lower, node.upper, node.step)]
            result = self.b.op("slice", parts)
        elif isinstance(node, ast.Tuple):
            result = self.b.op("tuple", [self._index(e) for e in node.elts])
        else:
            return self.lower(node)
        self.made.setdefault(id(result), node)
        return result

    def _BoolOp(self, node: ast.BoolOp) -> Node:
        """``self.softmax_temp or 1. / sqrt(E)``: a number chosen at run time, when its
        last value is one (its first value, when set, is then a number too), read as
        ``math_or`` of the values; anything else stays opaque."""
        if isinstance(node.op, ast.Or):
            last = self.lower(node.values[-1])
            if scalarish(last):
                values = [self.lower(v) for v in node.values[:-1]]
                if all(v.op in (VAR, CONST) or scalarish(v) for v in values):
                    return self.b.op("math_or", [*values, last])
        return self.opaque(node)

    def _IfExp(self, node: ast.IfExp) -> Node:
        self.subroot(node.body)
        self.subroot(node.orelse)
        return self.opaque(node, lower_children=False)

    def _ListComp(self, node: ast.ListComp | ast.GeneratorExp | ast.SetComp) -> Node:
        """``[t * cos + rotate_half(t) * sin for t in (q, k)]``: the element is read as
        a root of its own, its loop variables free (the iterables may hold anything)."""
        if all(isinstance(g.target, ast.Name) and not g.ifs for g in node.generators):
            targets = {g.target.id for g in node.generators}  # type: ignore[union-attr]
            with self.scope.hidden(targets):
                self.subroot(node.elt)
        return self.opaque(node, lower_children=False)

    _GeneratorExp = _ListComp

    def _Lambda(self, node: ast.Lambda) -> Node:
        self.scope.unit.add_lambda(node, self.scope)
        return self.opaque(node, lower_children=False)

    # ----------------------------------------------------------------- calls
    def _Call(self, node: ast.Call) -> Node:
        func = node.func
        if any(k.arg is None for k in node.keywords):
            return self.opaque(node)  # **kwargs: unknown arguments
        qualified = self.scope.unit.resolve(func)
        if qualified is not None:
            op = V.FUNCTIONS.get(qualified)
            if op is None:
                return self.opaque(node)
            if op == "linear" and _parameter_weight(node):
                # ``F.linear(x, self.qkv.weight, bias)``: a layer's projection, read as a
                # module's output is (its weight's shape is the layer's, not the probes').
                return self.opaque(node)
            if qualified.startswith(("math.", "numpy.")):
                # Numbers only (math.sqrt(q.size(-1)), np.sqrt(2 / np.pi)): numpy code on
                # arrays has no torch replacement.
                result = self._apply(op, None, node)
                if result.is_const or all(scalarish(a) for a in result.args):
                    return result
                if len(result.args) == 1 and not result.kwargs and op in V.SCALAR_FUNCTIONS:
                    # math.sqrt(self.dim_per_head): a function of a number.
                    return self.b.op("math_" + op, result.args)
                return self.opaque(node, lower_children=False)
            return self._apply(op, None, node)
        if isinstance(func, ast.Lambda):
            return self._lambda_call(func, node)
        if isinstance(func, ast.Name):
            if func.id == "map" and func.id not in self.scope.unit.module_names and func.id not in self.scope.env:
                return self._map(node)
            if func.id in self.scope.env:
                alias = self.scope.lookup(func.id)
                chosen = self.scope.callables.get(alias.value) if alias is not None and alias.op == "$var" else None
                if isinstance(chosen, ast.FunctionDef):
                    inlined = self.scope.inline_local(chosen, node, self)
                    if inlined is not None:
                        self.inlined.add(id(inlined))
                        return inlined
                    return self.opaque(node)
                if chosen is not None:
                    # ``softmax(dots, dim=-1)`` with ``softmax`` chosen by a conditional.
                    return self.lower(ast.copy_location(ast.Call(func=chosen, args=node.args,
                                                                 keywords=node.keywords), node))
                if (alias is not None and alias.op == "$var" and alias.value in self.scope.unit.functions
                        and alias.value not in self.scope.env):
                    # rotate_fn = rotate_half (chosen by a branch), then rotate_fn(q).
                    call = ast.copy_location(ast.Call(func=ast.copy_location(ast.Name(id=alias.value, ctx=ast.Load()),
                                                                               func),
                                                      args=node.args, keywords=node.keywords), node)
                    inlined = self.scope.inline_function(alias.value, call, self)
                    if inlined is not None:
                        self.inlined.add(id(inlined))
                        return inlined
                return self.opaque(node)  # a local callable
            inlined = self.scope.inline_function(func.id, node, self)
            if inlined is not None:
                self.inlined.add(id(inlined))
                return inlined
            if func.id in V.BUILTINS and func.id not in self.scope.unit.module_names:
                return self._apply(V.BUILTINS[func.id], None, node)
            return self.opaque(node)
        if isinstance(func, ast.Call) and len(node.args) == 1 and not node.keywords:
            # nn.Softmax(dim=-1)(scores)
            if self.scope.unit.resolve(func.func) == "torch.nn.Softmax":
                dim = next((k.value for k in func.keywords if k.arg == "dim"), func.args[0] if func.args else None)
                if dim is not None:
                    return self.b.op("softmax", (self.lower(node.args[0]),), {"dim": self.lower(dim)})
            return self.opaque(node)
        if isinstance(func, ast.Attribute):
            receiver = func.value
            if isinstance(receiver, ast.Name) and self.scope.cls is not None and receiver.id == self.scope.cls.name:
                inlined = self.scope.inline_static(receiver.id, func.attr, node, self)
                if inlined is not None:
                    self.inlined.add(id(inlined))
                    return inlined
            if self.scope.is_self(receiver):
                inlined = self.scope.inline_method(func.attr, node, self)
                if inlined is not None:
                    self.inlined.add(id(inlined))
                    return inlined
                single = len(node.args) == 1 and not node.keywords
                activation = self.scope.unit.class_activations(self.scope.cls).get(func.attr) if (
                    self.scope.cls is not None) else None
                if activation is not None and activation[1] == FUNCTION:
                    # self.attn_fn = F.softmax in __init__: a call of the function itself.
                    return self._apply(activation[0], None, node)
                if activation is not None and single:
                    # self.act_fn = nn.SiLU() (or ACT2FN["silu"], nn.Softmax(dim=-1)) in __init__, and nowhere else.
                    op, extra = activation
                    if op == "softmax":
                        kwargs = {"dim": self.b.const(extra)}
                    else:
                        kwargs = {"approximate": self.b.const(extra)} if extra else None
                    return self.b.op(op, (self.lower(node.args[0]),), kwargs)
                if single and any(h in func.attr.lower() for h in _DROPOUT_HINTS):
                    return self.b.op("dropout", (self.lower(node.args[0]),))
                if single and "softmax" in func.attr.lower() and "log" not in func.attr.lower():
                    # self.softmax = nn.Softmax(dim=-1), as attention modules write it.
                    return self.b.op("softmax", (self.lower(node.args[0]),), {"dim": self.b.const(-1)})
                return self.opaque(node)
            method = V.METHODS.get(func.attr)
            if method is not None:
                return self._apply(method, self.lower(receiver), node)
        return self.opaque(node)

    def _apply(self, op: str, receiver: Node | None, node: ast.Call) -> Node:
        args = [receiver] if receiver is not None else []
        args.extend(self.lower(a) for a in node.args)
        kwargs = {k.arg: self.lower(k.value) for k in node.keywords if k.arg not in V.DROPPED_KEYWORDS}
        if op == "cast":
            return self.b.op("cast", args[:1]) if args else self.opaque(node)
        if op == "dropout":
            return self.b.op("dropout", args[:1]) if args else self.opaque(node)
        if op in ("float", "int") and len(args) == 1 and args[0].is_const and isinstance(args[0].value, str):
            try:
                return self.b.const(float(args[0].value) if op == "float" else int(args[0].value))
            except ValueError:
                return self.opaque(node)
        if op == "baddbmm":
            return self._baddbmm(args, kwargs, node)
        if op == "einsum" and receiver is None and len(args) == 2 and args[1].op == "tuple":
            # torch.einsum('ibnd,jbnd->ijbn', (q, k)): the operands given as one sequence.
            args = [args[0], *args[1].args]
        if op == "normalize":
            return self._normalize(args, kwargs, node)
        if op == "tensor":
            if len(args) == 1 and args[0].is_const and isinstance(args[0].value, (int, float)):
                return self.b.const(float(args[0].value))
            if len(args) == 1 and scalarish(args[0]):
                return args[0]  # torch.tensor(torch.finfo(x.dtype).min): a number
            return self.opaque(node)
        return self.b.op(op, args, kwargs)

    def _baddbmm(self, args: list[Node], kwargs: dict[str, Node], node: ast.Call) -> Node:
        """``baddbmm(input, b1, b2, beta=, alpha=)`` as the arithmetic it is, ``beta *
        input + alpha * (b1 @ b2)``, so that attention scores made with it (GPT-NeoX,
        Bloom, StarCoder) read like ``q @ k^T * scale + mask``. With ``beta=0`` the
        input is ignored (it is often ``torch.empty``), as torch ignores it."""
        args = args + [kwargs[k] for k in ("batch1", "batch2") if k in kwargs]  # alibi.baddbmm(batch1=q, batch2=k)
        if len(args) != 3 or set(kwargs) - {"beta", "alpha", "batch1", "batch2"}:
            return self.opaque(node)
        base, b1, b2 = args
        b = self.b
        scores = b.op("bmm", (b1, b2))
        built = [scores]
        alpha = kwargs.get("alpha")
        if alpha is not None and not (alpha.is_const and alpha.value == 1):
            scores = b.op("mul", (scores, alpha))
            built.append(scores)
        beta = kwargs.get("beta")
        if (beta is not None and beta.is_const and beta.value == 0) or _zeros(base):
            # Nothing is added: the scores start from a tensor of zeros (GPT-NeoX), not a mask.
            result = scores
        else:
            term = base if beta is None or (beta.is_const and beta.value == 1) else b.op("mul", (beta, base))
            built.append(term)
            result = b.op("add", (term, scores))
        for part in built:
            # Written in this call (which ``lower`` records as making the result).
            self.made.setdefault(id(part), node)
        return result

    def _normalize(self, args: list[Node], kwargs: dict[str, Node], node: ast.Call) -> Node:
        """``F.normalize(x, p=2, dim=1, eps=1e-12)`` as the arithmetic it is, ``x /
        clamp(vector_norm(x, dim=dim, keepdim=True), min=eps)``, so that an RMSNorm
        written with it (``F.normalize(x, dim=-1) * self.scale * self.g``) reads like
        one written with ``x.norm``. Any other ``p`` stays opaque."""
        names = ("input", "p", "dim", "eps")
        if len(args) > len(names) or set(kwargs) - set(names) or any(n in kwargs for n in names[:len(args)]):
            return self.opaque(node)
        given = dict(zip(names, args))
        given.update(kwargs)
        b = self.b
        x = given.get("input")
        p = given.get("p")
        if x is None or (p is not None and not (p.is_const and p.value in (2, 2.0))):
            return self.opaque(node)
        dim = given.get("dim", b.const(1))
        eps = given.get("eps", b.const(1e-12))
        norm = b.op("vector_norm", (x,), {"dim": dim, "keepdim": b.const(True)})
        clamped = b.op("clamp", (norm,), {"min": eps})
        result = b.op("div", (x, clamped))
        for part in (norm, clamped):
            self.made.setdefault(id(part), node)
        return result

    # ----------------------------------------------------------------- opaque
    def _map(self, node: ast.Call) -> Node:
        """``map(f, (q, k))`` (or over ``x.chunk(3, dim=-1)``), with ``f`` a lambda or a
        function of this file: the tuple of ``f`` applied to each item, so that ``q, k =
        map(lambda t: t * cos + rotate_half(t) * sin, (q, k))`` keeps what q and k are."""
        if len(node.args) != 2 or node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            return self.opaque(node)
        fn, sequence = node.args
        if isinstance(fn, ast.Lambda):
            a = fn.args
            if a.vararg or a.kwarg or a.kwonlyargs or len([*a.posonlyargs, *a.args]) != 1:
                return self.opaque(node)
        elif not isinstance(fn, ast.Name) or fn.id not in self.scope.unit.functions or fn.id in self.scope.env:
            return self.opaque(node)
        count = self.unpacked[1] if self.unpacked is not None and self.unpacked[0] is node else None
        items = self._items(self.lower(sequence), count)
        if items is None:
            return self.opaque(node)
        results = []
        for i, item in enumerate(items):
            name = f"map@item{i}"
            argument = ast.copy_location(ast.Name(id=name, ctx=ast.Load()), sequence)
            call = ast.copy_location(ast.Call(func=fn, args=[argument], keywords=[]), node)
            with self.scope.bound({name: item}):
                if isinstance(fn, ast.Lambda):
                    result = self._lambda_call(fn, call)
                else:
                    # Even a callee with no formula word (l2norm): what it does to
                    # each item is what the items are afterwards.
                    result = self.scope.inline_function(fn.id, call, self, any_callee=True)
                    if result is not None:
                        self.inlined.add(id(result))
            if result is None:
                return self.opaque(node)
            results.append(result)
        return self.b.op("tuple", results)

    def _items(self, value: Node, unpacked: int | None = None) -> list[Node] | None:
        """The items of a sequence ``map`` walks: a tuple's, the pieces of a chunk into
        a constant number of parts, or of an unbind or split whose result the statement
        unpacks into that many names."""
        if value.op == "tuple" and not value.kwargs and all(a.op != "star" for a in value.args):
            return list(value.args) if 0 < len(value.args) <= 8 else None
        count = None
        if value.op == "chunk" and len(value.args) >= 2 and value.args[1].is_const:
            count = value.args[1].value
        elif value.op in ("unbind", "split") and unpacked is not None:
            count = unpacked
        if isinstance(count, int) and not isinstance(count, bool) and 0 < count <= 8:
            return [self.b.op("getitem", (value, self.b.const(i))) for i in range(count)]
        return None

    def _lambda_call(self, fn: ast.Lambda, node: ast.Call) -> Node:
        """``(lambda t: body)(x)``: the body with its parameters bound to the arguments.
        The lambda is also read alone, its parameters free, as any lambda is."""
        self.scope.unit.add_lambda(fn, self.scope)
        a = fn.args
        params = [*a.posonlyargs, *a.args]
        if (a.vararg or a.kwarg or a.kwonlyargs or node.keywords or len(node.args) != len(params)
                or any(isinstance(x, ast.Starred) for x in node.args)):
            return self.opaque(node)
        values = {p.arg: self.lower(arg) for p, arg in zip(params, node.args)}
        with self.scope.bound(values):
            return self.lower(fn.body)

    def opaque(self, node: ast.expr, lower_children: bool = True) -> Node:
        """A free variable standing for an expression the interpreter does not know.
        The expressions inside a call are lowered as separate roots."""
        if lower_children and isinstance(node, ast.Call):
            for arg in node.args:
                self.subroot(arg.value if isinstance(arg, ast.Starred) else arg)
            for kw in node.keywords:
                self.subroot(kw.value)
        return self.b.var(self.scope.opaque_name(node, self.text(node)))

    def subroot(self, node: ast.expr) -> None:
        if isinstance(node, (ast.Constant, ast.Name)):
            return
        self.subroots.append((node, self.lower(node)))


def _parameter_weight(call: ast.Call) -> bool:
    """The weight of ``F.linear(...)`` (second argument or ``weight=``) is an attribute
    (``self.qkv.weight``, ``self.w``): a layer's parameter."""
    weight = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "weight"), None)
    return isinstance(weight, ast.Attribute)
