"""Local inlining: a function body read as straight-line code.

Each assignment binds its name to the tree of its value, so that ``cdf = ...;
return x * cdf`` is seen as one expression. Branches are read as taken (the first
branch's bindings win after an ``if``), names assigned in loops or by ``with`` become
fresh opaque variables, and calls to functions of the same file (``rotate_half(q)``)
or to methods of the same class (``self._norm(x)``) that hold math are inlined a few
levels deep.

Reading is lazy: a statement is lowered now only when it is *relevant* (its lines
hold a word some formula needs, it calls a function that does, or it reads a name a
relevant statement bound); any other assignment binds a thunk that is lowered only if
a relevant statement reads the name. Relevant expression statements, assignment
values and return values are the *roots* the fingerprints look into.
"""

from __future__ import annotations

import ast
import bisect
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from torchaxe.scan.formulas import vocabulary as V
from torchaxe.scan.formulas.ir import VAR, Builder, Node
from torchaxe.scan.formulas.lowering import FUNCTION, ExpressionLowering
from torchaxe.scan.formulas.probes import is_size_name

#: Inlining stops this many calls deep, and skips callees longer than this.
MAX_INLINE_DEPTH = 3
MAX_INLINE_STATEMENTS = 40
#: Scopes with more statements than this are read up to that point only.
MAX_STATEMENTS = 600

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


@dataclass
class Root:
    """One expression of a scope and its tree. ``made``/``named`` are shared by every
    root of the same statement (see ``ExpressionLowering``)."""

    expr: ast.expr
    node: Node
    scope: ast.AST
    made: dict[int, ast.AST]
    named: dict[int, list[ast.AST]]
    #: id of every tree node built by any statement of this scope.
    scope_made: set[int]
    #: ids of the nodes built by the callees this statement inlines -> the callee.
    inlined_made: dict[int, ast.AST] = field(default_factory=dict)
    #: ids of the nodes built by any callee inlined in this scope -> the callee.
    scope_inlined: dict[int, ast.AST] = field(default_factory=dict)
    #: Every expression of the scope (local names included) that evaluates to a node.
    scope_named: dict[int, list[ast.AST]] = field(default_factory=dict)


def _size_power(value: ast.expr, resolve: Callable[[ast.AST], str | None]) -> tuple[str, float] | None:
    """(NAME, power) for ``NAME ** 0.5``, ``NAME ** -0.5``, ``math.sqrt(NAME)`` and
    ``1 / math.sqrt(NAME)``; None for anything else."""
    if (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Pow) and isinstance(value.left, ast.Name)):
        exponent = value.right
        sign = 1.0
        if isinstance(exponent, ast.UnaryOp) and isinstance(exponent.op, ast.USub):
            exponent, sign = exponent.operand, -1.0
        if isinstance(exponent, ast.Constant) and exponent.value == 0.5:
            return value.left.id, sign * 0.5
        return None
    inverse = (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Div) and isinstance(value.left, ast.Constant)
               and value.left.value == 1)
    call = value.right if inverse else value  # type: ignore[attr-defined]
    if (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords and isinstance(call.args[0], ast.Name)
            and resolve(call.func) in ("math.sqrt", "numpy.sqrt")):
        return call.args[0].id, -0.5 if inverse else 0.5
    return None


def attribute_writes(tree: ast.AST) -> dict[str, int]:
    """How many times ``tree`` assigns each attribute name: ``x.NAME = ...`` anywhere,
    ``NAME = ...`` in any class body. An attribute written twice (a subclass, a
    ``set_temperature`` method) is no constant."""
    counts: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            counts[node.attr] = counts.get(node.attr, 0) + 1
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else []
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            counts[name.id] = counts.get(name.id, 0) + 1
    return counts


@dataclass
class FileUnit:
    """What the lowering needs to know about the file: import bindings, the
    functions and classes it defines, which lines matter, and the queue of lambdas
    found on the way."""

    imports: dict[str, str]
    resolve: Callable[[ast.AST], str | None]
    text: Callable[[ast.AST], str]
    tree: ast.Module
    lines: list[str] = field(default_factory=list)
    #: Sorted line numbers that hold a formula word or call a function holding one.
    relevant_lines: list[int] = field(default_factory=list)
    #: ids of the definitions that hold a formula word (worth inlining).
    hot_definitions: set[int] = field(default_factory=set)
    builder: Builder = field(default_factory=Builder)
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    methods: dict[int, dict[str, ast.FunctionDef]] = field(default_factory=dict)
    module_names: set[str] = field(default_factory=set)
    lambdas: list[tuple[ast.Lambda, ast.ClassDef | None]] = field(default_factory=list)
    lambdas_seen: set[int] = field(default_factory=set)
    inline_cache: dict[tuple, tuple[Node | None, dict[int, ast.AST]]] = field(default_factory=dict)
    _module_constants: dict[str, float | str] | None = None
    _class_constants: dict[int, dict[str, float | str]] = field(default_factory=dict)
    _class_size_powers: dict[int, dict[str, tuple[str, float]]] = field(default_factory=dict)
    _function_constants: dict[str, dict[str, float | str]] = field(default_factory=dict)
    _class_activations: dict[int, dict[str, Activation]] = field(default_factory=dict)
    _attribute_writes: dict[str, int] | None = None

    def __post_init__(self) -> None:
        for stmt in self.tree.body:
            if isinstance(stmt, _SCOPES):
                self.functions[stmt.name] = stmt  # type: ignore[assignment]
                self.module_names.add(stmt.name)
            elif isinstance(stmt, ast.ClassDef):
                self.module_names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                self.module_names.update(t.id for t in targets if isinstance(t, ast.Name))

    def module_constants(self) -> dict[str, float | str]:
        """Module-level names assigned a number or a string once (``C = math.sqrt(2 / math.pi)``)."""
        if self._module_constants is None:
            self._module_constants = {}  # while reading them, they see none
            self._module_constants = self._constants(
                [(s.targets[0].id, s.value) for s in self.tree.body
                 if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)],
                self.tree, None)
        return self._module_constants

    def attribute_writes(self) -> dict[str, int]:
        """How many times the file assigns each attribute name (``attribute_writes``)."""
        if self._attribute_writes is None:
            self._attribute_writes = attribute_writes(self.tree)
        return self._attribute_writes

    def class_constants(self, cls: ast.ClassDef) -> dict[str, float | str]:
        """Attributes a class sets to a number or a string: in its body (``eps = 1e-6``) or in
        ``__init__`` (``self.c = math.sqrt(2 / math.pi)``), and nowhere else in the file
        (no other method, subclass or outside code assigns that attribute name)."""
        found = self._class_constants.get(id(cls))
        if found is None:
            self._class_constants[id(cls)] = {}
            pairs = [(s.targets[0].id, s.value) for s in cls.body
                     if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)]
            init = self.class_methods(cls).get("__init__")
            if init is not None:
                for stmt in ast.walk(init):
                    if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                        for t in targets:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                                value = stmt.value if isinstance(stmt, ast.Assign) and len(targets) == 1 else None
                                pairs.append((t.attr, value))
            writes = self.attribute_writes()
            found = {name: value for name, value in self._constants(pairs, cls, cls).items()
                     if writes.get(name, 0) <= 1}
            self._class_constants[id(cls)] = found
        return found

    def function_constants(self, name: str) -> dict[str, float | str]:
        """Attributes the file sets once, to a number or a string, on its module-level
        function ``name``: fairseq's ``gelu_accurate._a = math.sqrt(2 / math.pi)``,
        set at the first call and read by the formula after."""
        found = self._function_constants.get(name)
        if found is None:
            self._function_constants[name] = {}  # while reading them, they see none
            pairs: list[tuple[str, ast.expr | None]] = []
            for stmt in ast.walk(self.tree):
                if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == name:
                            value = stmt.value if isinstance(stmt, ast.Assign) and len(targets) == 1 else None
                            pairs.append((t.attr, value))
            found = self._function_constants[name] = self._constants(pairs, self.tree, None) if pairs else {}
        return found

    def class_size_powers(self, cls: ast.ClassDef) -> dict[str, tuple[str, float]]:
        """Attributes ``__init__`` sets to a half power of one of its size-named
        parameters, and nothing else in the file assigns: ``self.scale = dim ** -0.5``
        gives ``{"scale": ("dim", -0.5)}`` (an RMSNorm written with ``torch.norm``
        scales by it)."""
        found = self._class_size_powers.get(id(cls))
        if found is None:
            found = self._class_size_powers[id(cls)] = {}
            init = self.class_methods(cls).get("__init__")
            if init is None:
                return found
            a = init.args
            params = {arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
            for stmt in ast.walk(init):
                if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                        and isinstance(stmt.targets[0], ast.Attribute) and isinstance(stmt.targets[0].value, ast.Name)
                        and stmt.targets[0].value.id == "self"):
                    continue
                power = _size_power(stmt.value, self.resolve)
                if power is not None and power[0] in params and is_size_name(power[0]) \
                        and self._written_once(cls, stmt.targets[0].attr):
                    found[stmt.targets[0].attr] = power
        return found

    def _written_once(self, cls: ast.ClassDef, attr: str) -> bool:
        """Whether ``cls`` writes ``self.attr`` once, and no subclass in the file nor
        code outside a class's own methods (``model.attr = ...``) writes it. Other
        classes' own ``self.attr`` are theirs."""
        inside = 0
        for other in ast.walk(self.tree):
            if not isinstance(other, ast.ClassDef):
                continue
            derived = other is not cls and any(isinstance(b, (ast.Name, ast.Attribute)) and (
                getattr(b, "id", None) == cls.name or getattr(b, "attr", None) == cls.name) for b in other.bases)
            for node in ast.walk(other):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == attr \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    if derived:
                        return False
                    if other is cls:
                        inside += 1
        outside = sum(1 for node in ast.walk(self.tree) if isinstance(node, ast.Attribute)
                      and isinstance(node.ctx, ast.Store) and node.attr == attr
                      and not (isinstance(node.value, ast.Name) and node.value.id == "self"))
        return inside == 1 and outside == 0

    def _constants(self, pairs: list[tuple[str, ast.expr | None]], node: ast.AST,
                   cls: ast.ClassDef | None) -> dict[str, float | str]:
        counts: dict[str, int] = {}
        for name, _ in pairs:
            counts[name] = counts.get(name, 0) + 1
        constants: dict[str, float | str] = {}
        scope = Scope(self, node, cls, depth=MAX_INLINE_DEPTH)  # reads nothing, inlines nothing
        for name, value in pairs:
            if counts[name] != 1 or value is None or not _may_be_constant(value):
                continue
            lowered = ExpressionLowering(scope, self.builder, self.text).lower(value)
            # Numbers, and strings (an einsum equation kept in a constant).
            if lowered.is_const and isinstance(lowered.value, (int, float, str)) and not isinstance(lowered.value, bool):
                constants[name] = lowered.value
        return constants

    def class_activations(self, cls: ast.ClassDef) -> dict[str, Activation]:
        """The attributes of ``cls`` that are certainly a known activation (see
        ``activation_attributes``)."""
        found = self._class_activations.get(id(cls))
        if found is None:
            found = self._class_activations[id(cls)] = activation_attributes(
                cls, self.class_methods(cls).get("__init__"), self.resolve, activation_tables(self.tree))
        return found

    def class_methods(self, cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
        found = self.methods.get(id(cls))
        if found is None:
            found = {s.name: s for s in cls.body if isinstance(s, _SCOPES)}  # type: ignore[misc]
            self.methods[id(cls)] = found
        return found

    def add_lambda(self, node: ast.Lambda, scope: Scope) -> None:
        """Queue a lambda to be read alone, once (``map`` applies one to each item, and a
        scope may be read twice)."""
        if scope.depth == 0 and id(node) not in self.lambdas_seen:
            self.lambdas_seen.add(id(node))
            self.lambdas.append((node, scope.cls))

    def is_relevant(self, node: ast.AST) -> bool:
        first = node.lineno  # type: ignore[attr-defined]
        last = node.end_lineno or first  # type: ignore[attr-defined]
        i = bisect.bisect_left(self.relevant_lines, first)
        return i < len(self.relevant_lines) and self.relevant_lines[i] <= last

    def identifiers(self, node: ast.AST) -> set[str]:
        """The identifiers in a statement's source lines (a cheap over-estimate of
        the names it reads)."""
        first = node.lineno  # type: ignore[attr-defined]
        last = node.end_lineno or first  # type: ignore[attr-defined]
        return set(_IDENTIFIER.findall("".join(self.lines[first - 1 : last])))


# ------------------------------------------------------------------ activation attributes
#: An activation: the operation and its ``approximate`` argument (GELU's "tanh"), the
#: ``dim`` of a softmax module (an int), or ``FUNCTION`` for a function attribute
#: (``self.attn_fn = F.softmax``), which is called with the function's own arguments.
Activation = tuple[str, "str | int | None"]

#: Activation modules (called once built: ``self.act = nn.SiLU()``).
_ACTIVATION_MODULES: dict[str, str] = {
    "torch.nn.SiLU": "silu", "torch.nn.GELU": "gelu", "torch.nn.ReLU": "relu", "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.Tanh": "tanh",
    "torch.nn.modules.activation.SiLU": "silu", "torch.nn.modules.activation.GELU": "gelu",
}
#: Softmax modules: the dimension is their argument (``self.attend = nn.Softmax(dim=-1)``).
_SOFTMAX_MODULES = frozenset({"torch.nn.Softmax", "torch.nn.modules.activation.Softmax"})
#: Activation functions (assigned, not called: ``self.act = F.silu``, ``self.attn_fn = F.softmax``).
_ACTIVATION_FUNCTIONS = frozenset({"silu", "gelu", "relu", "sigmoid", "tanh", "softmax"})
#: Hugging Face ``ACT2FN`` / ``get_activation`` names whose function is exactly one of
#: these (``gelu_new`` is the tanh approximation, written out by the library).
_ACT2FN: dict[str, Activation] = {
    "silu": ("silu", None), "swish": ("silu", None), "gelu": ("gelu", None), "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"), "relu": ("relu", None), "sigmoid": ("sigmoid", None),
    "tanh": ("tanh", None),
}
#: Words without which a file has no activation attribute worth resolving.
ACTIVATION_WORDS = ("SiLU", "GELU", "Sigmoid", "Tanh", "ReLU", "ACT2FN", "get_activation", "silu", "gelu", "sigmoid",
                    "tanh", "relu", "Softmax(")
#: A softmax function named without a call (``self.attn_fn = F.softmax``).
_SOFTMAX_REFERENCE = re.compile(r"\.softmax\b(?!\s*\()")


def has_activation_words(source: str) -> bool:
    """Whether a file may set an attribute to a known activation (see
    ``activation_attributes``): one of ``ACTIVATION_WORDS``, or a softmax function
    named without being called."""
    if any(w in source for w in ACTIVATION_WORDS):
        return True
    return ".softmax" in source and _SOFTMAX_REFERENCE.search(source) is not None


def activation_tables(tree: ast.Module) -> tuple[frozenset[str], frozenset[str]]:
    """Local names bound to Hugging Face's ``ACT2FN`` and ``get_activation``, through
    absolute imports (``transformers.activations``) or the relative ones inside the
    library (``from ...activations import ACT2FN``), which ``FileContext`` skips."""
    tables: set[str] = set()
    getters: set[str] = set()
    for stmt in tree.body:
        if not isinstance(stmt, ast.ImportFrom) or not stmt.module:
            continue
        module = stmt.module.rsplit(".", 1)[-1]
        if module not in ("activations", "transformers"):
            continue
        for alias in stmt.names:
            if alias.name == "ACT2FN":
                tables.add(alias.asname or alias.name)
            elif alias.name == "get_activation":
                getters.add(alias.asname or alias.name)
    return frozenset(tables), frozenset(getters)


def _activation_value(value: ast.expr, resolve: Callable[[ast.AST], str | None],
                      tables: tuple[frozenset[str], frozenset[str]]) -> Activation | None:
    if isinstance(value, ast.Call):
        qualified = resolve(value.func)
        if qualified in _SOFTMAX_MODULES:
            dim = next((k.value for k in value.keywords if k.arg == "dim"), value.args[0] if value.args else None)
            number = _int_constant(dim)
            return ("softmax", number) if number is not None else None  # no dim: torch's legacy choice
        if qualified in _ACTIVATION_MODULES:
            op = _ACTIVATION_MODULES[qualified]
            approximate: ast.expr | None = next((k.value for k in value.keywords if k.arg == "approximate"), None)
            if op == "gelu" and approximate is None and value.args:
                approximate = value.args[0]
            if approximate is None:
                return op, None
            if isinstance(approximate, ast.Constant) and approximate.value in ("none", "tanh"):
                return op, None if approximate.value == "none" else "tanh"
            return None  # chosen at run time
        if (isinstance(value.func, ast.Name) and value.func.id in tables[1] and len(value.args) == 1
                and isinstance(value.args[0], ast.Constant)):
            return _ACT2FN.get(value.args[0].value)  # type: ignore[arg-type]
        return None
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id in tables[0]:
        key = value.slice
        return _ACT2FN.get(key.value) if isinstance(key, ast.Constant) else None  # type: ignore[arg-type]
    qualified = resolve(value)
    op = V.FUNCTIONS.get(qualified) if qualified else None
    return (op, FUNCTION) if op in _ACTIVATION_FUNCTIONS else None


def _int_constant(node: ast.expr | None) -> int | None:
    """``-1``, ``1``: a literal integer."""
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        sign, node = -1, node.operand
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return sign * node.value
    return None


def activation_attributes(cls: ast.ClassDef, init: ast.FunctionDef | None,
                          resolve: Callable[[ast.AST], str | None],
                          tables: tuple[frozenset[str], frozenset[str]]) -> dict[str, Activation]:
    """Attributes ``self.<name>`` that are certainly a known activation: assigned
    once in the whole class, in ``__init__``'s own statements (not under an ``if``,
    a loop or a ``try``), to an activation module, function or ``ACT2FN`` entry named
    by a constant. ``ACT2FN[config.hidden_act]`` or ``act_layer()`` is decided at run
    time: such an attribute stays an opaque call."""
    if init is None or not init.args.args:
        return {}
    me = init.args.args[0].arg
    found: dict[str, Activation] = {}
    for stmt in init.body:
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        target = stmt.targets[0]
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == me:
            activation = _activation_value(stmt.value, resolve, tables)
            if activation is not None:
                found[target.attr] = activation
    # Certain only if nothing else in the class sets the same name (a class attribute
    # of that name included).
    for stmt in cls.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for t in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                if isinstance(t, ast.Name):
                    found.pop(t.id, None)
    if not found:
        return found
    counts: dict[str, int] = {}
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets
                       for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            return {}  # attributes set by name: nothing is certain
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in found:
                counts[t.attr] = counts.get(t.attr, 0) + 1
    return {name: act for name, act in found.items() if counts.get(name) == 1}


class Thunk:
    """A binding not lowered yet: the value expression with the bindings it sees."""

    __slots__ = ("expr", "env", "versions", "node", "kind", "extra")

    def __init__(self, expr: ast.expr | None, env: dict, versions: dict[str, int], kind: str = "value",
                 extra: object = None):
        self.expr = expr
        self.env = env
        self.versions = versions
        self.node: Node | None = None
        self.kind = kind
        self.extra = extra


class Scope:
    """The straight-line reading of one function, lambda or module body."""

    def __init__(self, unit: FileUnit, node: ast.AST, cls: ast.ClassDef | None, depth: int = 0,
                 stack: tuple[ast.AST, ...] = ()):
        self.unit = unit
        self.node = node
        self.cls = cls
        self.depth = depth
        self.stack = stack + (node,)
        self.env: dict[str, Node | Thunk] = {}
        self.versions: dict[str, int] = {}
        self.hot: set[str] = set()
        self.roots: list[Root] = []
        self.returns: list[Node] = []
        self.made_ids: set[int] = set()
        self.inlined_ids: dict[int, ast.AST] = {}
        self.named_ids: dict[int, list[ast.AST]] = {}
        self.self_name: str | None = None
        #: After an ``if``, whose bindings win: the branch's (optional features on:
        #: the mask is applied) or the ones before it (the softcapping is off).
        self.take_branches = True
        #: Callables a name is bound to by a conditional expression (see
        #: ``_callable_choice``), or functions defined in this scope, by the marker
        #: their name's ``$var`` node holds.
        self.callables: dict[str, ast.expr | ast.FunctionDef] = {}

    # ------------------------------------------------------------- names
    def lookup(self, name: str) -> Node | None:
        value = self.env.get(name)
        if isinstance(value, Thunk):
            return self._force(value)
        return value

    def is_self(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and self.self_name is not None and node.id == self.self_name

    def hidden(self, names: set[str]):
        """Reads inside it see ``names`` unbound (a comprehension's loop variables)."""
        return self.bound({}, names)

    @contextmanager
    def bound(self, values: dict[str, Node], hide: set[str] | frozenset[str] = frozenset()) -> Iterator[None]:
        """Reads inside it see ``values`` bound (a lambda's parameters, ``map``'s items),
        each a new version of its name, so that opaque calls of them stay distinct, and
        ``hide`` unbound."""
        names = set(values) | set(hide)
        saved = {name: self.env.pop(name) for name in names if name in self.env}
        for name, value in values.items():
            self.env[name] = value
            self._bump(name)
        try:
            yield
        finally:
            for name in names:
                self.env.pop(name, None)
            self.env.update(saved)

    def is_self_chain(self, node: ast.AST) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return self.is_self(node)

    def opaque_name(self, node: ast.AST, text: str) -> str:
        """An opaque expression's variable name: its text, qualified by the versions
        of the locals it reads (``self.fc(h)`` before and after ``h = ...`` differ)."""
        text = " ".join(text.split())
        tags = sorted({t for t in _IDENTIFIER.findall(text) if t in self.versions})
        if tags:
            text += "@" + ",".join(f"{t}{self.versions[t]}" for t in tags)
        return text

    def _force(self, thunk: Thunk) -> Node:
        if thunk.node is not None:
            return thunk.node
        b = self.unit.builder
        saved_env, saved_versions = self.env, self.versions
        self.env, self.versions = thunk.env, thunk.versions
        try:
            if thunk.kind == "item":
                source, index = thunk.extra  # type: ignore[misc]
                base = self._force(source)
                if _plain_tuple(base) and index < len(base.args):
                    node = base.args[index]
                else:
                    node = _item(b, base, index)
            else:
                low = ExpressionLowering(self, b, self.unit.text)
                if thunk.kind == "value" and isinstance(thunk.extra, int):
                    low.unpacked = (thunk.expr, thunk.extra)  # type: ignore[assignment]
                node = low.lower(thunk.expr)  # type: ignore[arg-type]
                if thunk.kind == "aug":
                    op, name = thunk.extra  # type: ignore[misc]
                    node = b.op(op, (self.lookup(name) or b.var(name), node))
                self._collect(low, None, None)
        finally:
            self.env, self.versions = saved_env, saved_versions
        thunk.node = node
        return node

    def _snapshot(self) -> tuple[dict, dict[str, int]]:
        return dict(self.env), dict(self.versions)

    def _bump(self, name: str) -> None:
        self.versions[name] = self.versions.get(name, 0) + 1

    def bind(self, target: ast.AST, value: Node | Thunk) -> None:
        b = self.unit.builder
        if isinstance(target, ast.Name):
            self.env[target.id] = value
            self._bump(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if any(isinstance(e, ast.Starred) for e in target.elts):
                for name in _names_in(target):
                    self.kill(name)
                return
            if isinstance(value, Node) and _plain_tuple(value) and len(value.args) == len(target.elts):
                for elt, part in zip(target.elts, value.args):
                    self.bind(elt, part)
            elif isinstance(value, Node):
                for i, elt in enumerate(target.elts):
                    self.bind(elt, _item(b, value, i))
            else:
                for i, elt in enumerate(target.elts):
                    self.bind(elt, Thunk(None, {}, {}, "item", (value, i)))
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                and self.lookup(target.value.id) is not None:
            # out[..., 0::2] = x1 * cos - x2 * sin: a new value of out with that part written.
            low = ExpressionLowering(self, b, self.unit.text)
            written = self._force(value) if isinstance(value, Thunk) else value
            node = b.op("setitem", (self.lookup(target.value.id), low._index(target.slice), written))
            self._collect(low, None, None)
            self.env[target.value.id] = node
            self._bump(target.value.id)
        elif isinstance(target, ast.Subscript):
            base = target.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name) and base.id in self.env:
                self.kill(base.id)  # written in place: its value is no longer known

    def kill(self, name: str) -> None:
        self._bump(name)
        self.env[name] = self.unit.builder.var(f"{name}@{self.versions[name]}")

    # ------------------------------------------------------------- reading
    def bind_parameters(self, args: ast.arguments, values: dict[str, Node] | None = None) -> None:
        """Bind parameters: to the call's arguments when inlining, otherwise to free
        variables (int, bool and str defaults to their value)."""
        b = self.unit.builder
        positional = [*args.posonlyargs, *args.args]
        if values is not None:
            self.env.update(values)
            return
        if positional and isinstance(self.node, _SCOPES) and self.cls is not None and not _is_static(self.node):
            self.self_name = positional[0].arg
        for name, default in _defaults(args).items():
            # None defaults stay variables: `if mask is not None:` branches are read as taken.
            if isinstance(default, ast.Constant) and isinstance(default.value, (bool, int, str)):
                self.env[name] = b.const(default.value)

    def read_body(self, body: list[ast.stmt]) -> None:
        self._block(body[:MAX_STATEMENTS])

    def read_expression(self, expr: ast.expr) -> None:
        self._root(expr, ExpressionLowering(self, self.unit.builder, self.unit.text))

    def _root(self, expr: ast.expr, low: ExpressionLowering) -> Node:
        node = low.lower(expr)
        self._collect(low, expr, node)
        return node

    def _collect(self, low: ExpressionLowering, expr: ast.expr | None, node: Node | None) -> None:
        self.made_ids.update(low.made)
        for key, sources in low.named.items():
            self.named_ids.setdefault(key, []).extend(sources)
        if self.depth:
            self.made_ids.update(low.inlined_made)
            return  # an inlined callee: its roots belong to its own scope
        self.inlined_ids.update(low.inlined_made)
        if expr is None:
            low.subroots.clear()
            return  # a thunk forced on demand: not a root of its own
        shared = (self.made_ids, low.inlined_made, self.inlined_ids, self.named_ids)
        self.roots.append(Root(expr, node, self.node, low.made, low.named, *shared))  # type: ignore[arg-type]
        for sub_expr, sub in low.subroots:
            self.roots.append(Root(sub_expr, sub, self.node, low.made, low.named, *shared))
        low.subroots.clear()

    def _relevant(self, stmt: ast.stmt) -> bool:
        if self.depth:
            return False
        return self.unit.is_relevant(stmt) or bool(self.hot and self.hot & self.unit.identifiers(stmt))

    def _block(self, body: list[ast.stmt]) -> bool:
        """Read statements; returns True when the block always ends (return/raise)."""
        for stmt in body:
            if self._statement(stmt):
                return True
        return False

    def _value(self, stmt: ast.stmt, expr: ast.expr, relevant: bool) -> Node | Thunk:
        unpacked = _unpacked_count(stmt)
        if relevant:
            low = ExpressionLowering(self, self.unit.builder, self.unit.text)
            low.unpacked = (expr, unpacked) if unpacked else None
            return self._root(expr, low)
        env, versions = self._snapshot()
        return Thunk(expr, env, versions, extra=unpacked)

    def _statement(self, stmt: ast.stmt) -> bool:
        relevant = isinstance(stmt, (ast.Expr, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Return)) and (
            self._relevant(stmt))
        if isinstance(stmt, ast.Expr):
            written = _written_in_place(stmt.value)
            if written is not None and written[0] in self.env:
                # score.masked_fill_(mask, -1e9): score's new value is what the method
                # without its underscore returns (a mask the formula must not leave out).
                name, out_of_place = written
                self.bind(ast.Name(id=name, ctx=ast.Store()), self._value(stmt, out_of_place, relevant))
                if relevant:
                    self.hot.add(name)
            elif relevant and not isinstance(stmt.value, ast.Constant):
                self._value(stmt, stmt.value, True)
        elif isinstance(stmt, ast.Assign) and _callable_choice(stmt) is not None:
            # ``softmax = torch.softmax if not self.stable else stable_softmax``: read
            # with the first callable, the one the expression names as its usual value.
            chosen = _callable_choice(stmt)[0]  # type: ignore[index]
            marker = f"<callable {stmt.lineno}:{stmt.col_offset}>"
            self.callables[marker] = chosen
            self.bind(stmt.targets[0], self.unit.builder.var(marker))
        elif isinstance(stmt, ast.Assign):
            value = self._value(stmt, stmt.value, relevant)
            for target in stmt.targets:
                self.bind(target, value)
                if relevant:
                    self.hot.update(_names_in(target))
        elif isinstance(stmt, ast.AnnAssign):
            if stmt.value is not None:
                self.bind(stmt.target, self._value(stmt, stmt.value, relevant))
                if relevant:
                    self.hot.update(_names_in(stmt.target))
        elif isinstance(stmt, ast.AugAssign):
            self._augmented(stmt, relevant)
        elif isinstance(stmt, ast.Return):
            if stmt.value is not None and (relevant or self.depth):
                low = ExpressionLowering(self, self.unit.builder, self.unit.text)
                node = low.lower(stmt.value)
                self._collect(low, stmt.value if relevant else None, node)
                self.returns.append(node)
            return True
        elif isinstance(stmt, (ast.Raise, ast.Continue, ast.Break)):
            return True
        elif isinstance(stmt, ast.If):
            return self._if(stmt)
        elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            self._loop(stmt)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if item.optional_vars is not None:
                    for name in _names_in(item.optional_vars):
                        self.kill(name)
            return self._block(stmt.body)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            ends = self._block(stmt.body)  # type: ignore[attr-defined]
            for handler in stmt.handlers:  # type: ignore[attr-defined]
                saved = dict(self.env)
                self._block(handler.body)
                self.env = saved
            if not ends:
                self._block(stmt.orelse)  # type: ignore[attr-defined]
            self._block(stmt.finalbody)  # type: ignore[attr-defined]
        elif isinstance(stmt, ast.Match):
            # Each case read from the state before the match; afterwards, what any
            # case bound is unknown (which case ran is not).
            before = dict(self.env)
            assigned: set[str] = set()
            for case in stmt.cases:
                self.env = dict(before)
                captured = {n.name for n in ast.walk(case.pattern)
                            if isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name}
                captured |= {n.rest for n in ast.walk(case.pattern) if isinstance(n, ast.MatchMapping) and n.rest}
                for name in captured:
                    self.kill(name)
                self._block(case.body)
                assigned |= captured | set(_assigned_names(case.body))
            self.env = before
            for name in assigned:
                self.kill(name)
        elif isinstance(stmt, _SCOPES) and not stmt.decorator_list:
            # A function defined here (minimind's ``def rotate_half(x): ...`` inside
            # ``apply_rotary_pos_emb``): its calls below are inlined as a module's are.
            marker = f"<def {stmt.name} {stmt.lineno}>"
            self.callables[marker] = stmt  # type: ignore[assignment]
            self._bump(stmt.name)
            self.env[stmt.name] = self.unit.builder.var(marker)
        elif isinstance(stmt, (*_SCOPES, ast.ClassDef)):
            self.kill(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                self.kill((alias.asname or alias.name).split(".", 1)[0])
        elif isinstance(stmt, ast.Delete):
            for target in stmt.targets:
                for name in _names_in(target):
                    self.kill(name)
        return False

    def _augmented(self, stmt: ast.AugAssign, relevant: bool) -> None:
        op = _AUG.get(type(stmt.op))
        b = self.unit.builder
        if not isinstance(stmt.target, ast.Name) or op is None:
            if relevant:
                self._value(stmt, stmt.value, True)
            self.bind(stmt.target, b.const(None))
            return
        name = stmt.target.id
        if relevant:
            low = ExpressionLowering(self, b, self.unit.text)
            current = self.lookup(name) or b.var(name)
            combined = b.op(op, (current, low.lower(stmt.value)))
            self._collect(low, stmt.value, combined)
            self.bind(stmt.target, combined)
            self.hot.add(name)
        else:
            env, versions = self._snapshot()
            self.bind(stmt.target, Thunk(stmt.value, env, versions, "aug", (op, name)))

    def _if(self, stmt: ast.If) -> bool:
        before = dict(self.env)
        body_ends = self._block(stmt.body)
        after_body = self.env
        self.env = dict(before)
        else_ends = self._block(stmt.orelse)
        after_else = self.env
        if body_ends and else_ends:
            return True
        if body_ends:
            self.env = after_else
        elif else_ends:
            self.env = after_body
        elif self.take_branches:
            self.env = {**after_else, **after_body}
        else:
            # Skipped: what the body alone bound (a parameter reassigned, ``k =
            # torch.cat([past[0], k])``) keeps its meaning from before the ``if``.
            self.env = {**{n: v for n, v in after_body.items() if n in after_else}, **after_else}
        return False

    def _loop(self, stmt: ast.For | ast.AsyncFor | ast.While) -> None:
        if not isinstance(stmt, ast.While):
            for name in _names_in(stmt.target):
                self.kill(name)
        assigned = set(_assigned_names(stmt.body))
        before = dict(self.env)
        for name in assigned:
            self.kill(name)  # loop-carried: unknown at the start of an iteration
        self._block(stmt.body)
        self.env = before
        for name in assigned:
            self.kill(name)
        self._block(stmt.orelse)

    # ------------------------------------------------------------- inlining
    def inline_function(self, name: str, call: ast.Call, low: ExpressionLowering,
                        any_callee: bool = False) -> Node | None:
        callee = self.unit.functions.get(name)
        if callee is None:
            return None
        return self._inline(callee, None, call, low, any_callee)

    def inline_local(self, callee: ast.FunctionDef, call: ast.Call, low: ExpressionLowering) -> Node | None:
        """A call of a function defined in this scope (a nested ``def``)."""
        return self._inline(callee, None, call, low)

    def inline_method(self, name: str, call: ast.Call, low: ExpressionLowering) -> Node | None:
        if self.cls is None:
            return None
        callee = self.unit.class_methods(self.cls).get(name)
        if callee is None:
            return None
        if _is_static(callee) and not any(isinstance(d, ast.Name) and d.id == "classmethod"
                                          for d in callee.decorator_list):
            return self._inline(callee, None, call, low)  # self._rotate_half(x) of a staticmethod
        receiver = self.lookup(self.self_name or "") or self.unit.builder.var(self.self_name or "self")
        return self._inline(callee, receiver, call, low, any_callee=_returns_product(callee))

    def inline_static(self, class_name: str, name: str, call: ast.Call, low: ExpressionLowering) -> Node | None:
        """``CosSinRoPE._rotate_half(x)`` inside class ``CosSinRoPE``: its staticmethod."""
        if self.cls is None or self.cls.name != class_name:
            return None
        callee = self.unit.class_methods(self.cls).get(name)
        if callee is None or not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in callee.decorator_list):
            return None
        return self._inline(callee, None, call, low)

    def _inline(self, callee: ast.FunctionDef, receiver: Node | None, call: ast.Call, low: ExpressionLowering,
                any_callee: bool = False) -> Node | None:
        if id(callee) not in self.unit.hot_definitions and not any_callee:
            return None  # no formula word in it: an opaque call loses nothing
        if self.depth >= MAX_INLINE_DEPTH or callee in self.stack or len(callee.body) > MAX_INLINE_STATEMENTS:
            return None
        if callee.decorator_list and not all(_is_harmless_decorator(d) for d in callee.decorator_list):
            return None
        values = self._arguments(callee, receiver, call, low)
        if values is None:
            return None
        key = (id(callee), tuple(sorted((k, id(v)) for k, v in values.items())))
        cached = self.unit.inline_cache.get(key)
        if cached is None:
            inner = Scope(self.unit, callee, self.cls if receiver is not None else None, self.depth + 1, self.stack)
            if receiver is not None:
                inner.self_name = [*callee.args.posonlyargs, *callee.args.args][0].arg
            inner.bind_parameters(callee.args, values)
            inner.read_body(callee.body)
            result = inner.returns[0] if inner.returns else None
            cached = (result, {made: callee for made in inner.made_ids})
            self.unit.inline_cache[key] = cached
        result, made = cached
        if result is None:
            return None
        for key_id, owner in made.items():
            low.inlined_made.setdefault(key_id, owner)
        return result

    def _arguments(self, callee: ast.FunctionDef, receiver: Node | None, call: ast.Call,
                   low: ExpressionLowering) -> dict[str, Node] | None:
        a = callee.args
        if a.vararg or a.kwarg or any(isinstance(x, ast.Starred) for x in call.args):
            return None
        positional = [*a.posonlyargs, *a.args]
        values: dict[str, Node] = {}
        if receiver is not None:
            if not positional or _is_static(callee):
                return None
            values[positional[0].arg] = receiver
            positional = positional[1:]
        if len(call.args) > len(positional):
            return None
        for param, arg in zip(positional, call.args):
            values[param.arg] = low.lower(arg)
        names = {p.arg for p in [*positional, *a.kwonlyargs]}
        for kw in call.keywords:
            if kw.arg not in names or kw.arg in values:
                return None
            values[kw.arg] = low.lower(kw.value)
        defaults = _defaults(a)
        b = self.unit.builder
        for param in [*positional, *a.kwonlyargs]:
            if param.arg in values:
                continue
            default = defaults.get(param.arg)
            if not isinstance(default, ast.Constant):
                return None
            values[param.arg] = b.const(default.value)
        return values


def _unpacked_count(stmt: ast.stmt) -> int | None:
    """How many names ``stmt`` unpacks its value into (``nk, nv = ...``: 2), if it does."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], (ast.Tuple, ast.List)):
        elts = stmt.targets[0].elts
        if elts and not any(isinstance(e, ast.Starred) for e in elts):
            return len(elts)
    return None


def _callable_choice(stmt: ast.Assign) -> tuple[ast.expr, ast.expr] | None:
    """``name = f if test else g`` with ``f`` and ``g`` plain names or attributes
    (functions, by how they are written): ``(f, g)``."""
    value = stmt.value
    if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name) or not isinstance(value, ast.IfExp):
        return None
    if not all(isinstance(e, (ast.Name, ast.Attribute)) for e in (value.body, value.orelse)):
        return None
    return value.body, value.orelse


def _plain_tuple(node: Node) -> bool:
    """A tuple whose items are its arguments: no ``*rest`` among them (``(q, *kv.chunk(2))``
    has three items, the last two inside the star)."""
    return node.op == "tuple" and not node.kwargs and all(a.op != "star" for a in node.args)


def _item(b: Builder, value: Node, index: int) -> Node:
    """Element ``index`` of a value unpacked into names. Of an opaque value (``q, k, v =
    map(lambda t: rearrange(t, ...), qkv)``) each element is a fresh variable: it is as
    likely a tensor of the layout its uses imply as a slice of one."""
    if value.op == VAR:
        return b.var(f"{value.value}[{index}]")
    return b.op("getitem", (value, b.const(index)))


_AUG = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.Pow: "pow", ast.MatMult: "matmul"}


def _defaults(args: ast.arguments) -> dict[str, ast.expr]:
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    found = dict(zip(positional[len(positional) - len(args.defaults):], args.defaults))
    found.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    return found


#: Calls that multiply two tensors as matrices.
_PRODUCTS = frozenset({"einsum", "matmul", "bmm"})


def _returns_product(callee: ast.FunctionDef) -> bool:
    """A method that only returns a product of two tensors (labml's ``get_scores``:
    ``return torch.einsum('ibhd,jbhd->ijbh', query, key)``, kept apart to be
    overridden): no formula word in it, but it makes an attention's scores."""
    body = [s for s in callee.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return False
    value = body[0].value
    if isinstance(value, ast.BinOp):
        return isinstance(value.op, ast.MatMult)
    func = value.func if isinstance(value, ast.Call) else None
    return (func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else "") \
        in _PRODUCTS


def _is_static(fn: ast.AST) -> bool:
    return any(isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod") for d in getattr(fn, "decorator_list", ()))


def _is_harmless_decorator(node: ast.AST) -> bool:
    """Decorators that keep the function's math: jit/compile markers and the like."""
    while isinstance(node, ast.Call):
        node = node.func
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("script", "jit", "compile", "torch_compile", "no_grad", "inference_mode", "wraps", "lru_cache",
                    "cache", "staticmethod", "autocast", "custom_fwd", "custom_bwd", "ignore", "unused")


_CONSTANT_PARTS = (ast.Constant, ast.Name, ast.Attribute, ast.BinOp, ast.UnaryOp, ast.Call, ast.operator, ast.unaryop,
                   ast.Load, ast.JoinedStr, ast.FormattedValue)


def _may_be_constant(node: ast.expr) -> bool:
    """Cheap test before lowering: a small expression of numbers, strings, names and
    arithmetic."""
    if not isinstance(node, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Call, ast.JoinedStr)):
        return False
    for count, part in enumerate(ast.walk(node)):
        if count > 24 or not isinstance(part, _CONSTANT_PARTS):
            return False
    return True


def _written_in_place(value: ast.expr) -> tuple[str, ast.Call] | None:
    """``(name, name.method(args))`` for a statement ``name.method_(args)`` that writes a
    tensor in place (a method ending in one underscore), else None."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and isinstance(value.func.value, ast.Name)):
        return None
    attr = value.func.attr
    if not attr.endswith("_") or attr.startswith("_") or len(attr) < 3:
        return None
    func = ast.copy_location(ast.Attribute(value=value.func.value, attr=attr[:-1], ctx=ast.Load()), value.func)
    return value.func.value.id, ast.copy_location(ast.Call(func=func, args=value.args, keywords=value.keywords), value)


def _names_in(target: ast.AST) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _names_in(elt)
    elif isinstance(target, ast.Starred):
        yield from _names_in(target.value)


def _assigned_names(body: list[ast.stmt]) -> Iterator[str]:
    """Names bound by the statements of a block (nested blocks included, expressions
    not searched)."""
    for stmt in body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                yield from _names_in(t)
        elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
            yield from _names_in(stmt.target)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            yield from _names_in(stmt.target)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if item.optional_vars is not None:
                    yield from _names_in(item.optional_vars)
        for block in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, block, None)
            if isinstance(inner, list) and not isinstance(stmt, (*_SCOPES, ast.ClassDef)):
                yield from _assigned_names(inner)
        for handler in getattr(stmt, "handlers", ()):
            yield from _assigned_names(handler.body)
        for case in getattr(stmt, "cases", ()):  # match statements
            yield from (n.name for n in ast.walk(case.pattern) if isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name)
            yield from _assigned_names(case.body)


def read_scope(unit: FileUnit, node: ast.AST, cls: ast.ClassDef | None) -> list[Root]:
    """The roots of one function, lambda or module body: read with the branches of
    its ``if`` statements taken, and, when it has any, read again with them skipped
    (an optional step such as logit soft-capping can hide the formula either way)."""
    roots = []
    for take in (True, False):
        scope = Scope(unit, node, cls)
        scope.take_branches = take
        if isinstance(node, (*_SCOPES, ast.Lambda)):
            scope.bind_parameters(node.args)  # type: ignore[attr-defined]
        if isinstance(node, ast.Lambda):
            scope.read_expression(node.body)
        elif isinstance(node, ast.Module):
            scope.read_body([s for s in node.body if not isinstance(s, (*_SCOPES, ast.ClassDef))])
        else:
            scope.read_body(node.body)  # type: ignore[attr-defined]
        roots.extend(scope.roots)
        if not _has_if(getattr(node, "body", [])):
            break
    return roots


def _has_if(body: object) -> bool:
    if not isinstance(body, list):
        return False
    for stmt in body:
        if isinstance(stmt, ast.If):
            return True
        if isinstance(stmt, (*_SCOPES, ast.ClassDef)):
            continue
        for block in ("body", "orelse", "finalbody"):
            if _has_if(getattr(stmt, block, None)):
                return True
    return False
