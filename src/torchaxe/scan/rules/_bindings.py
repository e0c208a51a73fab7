"""Where a module or a value of a file comes from, for rules that follow one to its
construction: the values a class binds to ``self.<attr>``, the arguments a file's
calls pass to a function's parameter, the function holding a node, the methods that
return the module they are called on, and the assignments a name may hold the value
of at a line (:func:`reaching`), the one reading of that every rule shares."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from torchaxe.scan.context import FileContext, walk_scope

#: Methods that return the module they are called on (``Net().to(device).train()``).
MODULE_METHODS = frozenset(
    "to cuda npu cpu train eval float half bfloat16 double requires_grad_ share_memory to_empty".split()
)

#: Methods whose result holds the values of the tensor they are called on (its layout,
#: dtype or device aside): ``p.view(-1).float()`` holds what ``p`` does.
VALUE_KEEPING_METHODS = frozenset({"view", "reshape", "squeeze", "unsqueeze", "flatten", "contiguous", "float",
                                   "double", "view_as", "reshape_as", "permute", "transpose", "t", "to", "cpu",
                                   "cuda", "type_as"})

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def assigned_values(ctx: FileContext) -> dict[str, list[ast.expr]]:
    """Every value the file assigns to a name or to an attribute of that name
    (``x = ...``, ``self.x = ...``, ``x: T = ...``, and each element of ``a, b = A(),
    B()``), by name, scope-blind; indexed once per file."""
    key = "bindings.assigned_values"
    if key not in ctx.cache:
        values: dict[str, list[ast.expr]] = {}
        for node in ctx.nodes(ast.Assign, ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is None:
                continue
            for target in targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) and \
                        len(target.elts) == len(node.value.elts):
                    pairs = list(zip(target.elts, node.value.elts))
                for name, value in pairs:
                    if isinstance(name, ast.Name):
                        values.setdefault(name.id, []).append(value)
                    elif isinstance(name, ast.Attribute):
                        values.setdefault(name.attr, []).append(value)
        ctx.cache[key] = values
    return ctx.cache[key]


def unmoved(value: ast.AST, ctx: FileContext) -> ast.AST:
    """``Net()`` for ``Net().to(device).train()``: the value under a chain of
    :data:`MODULE_METHODS` (a call that resolves to an import, such as
    ``torch.cuda(...)``, is not a method chain)."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and \
            value.func.attr in MODULE_METHODS and ctx.qualified_name(value.func) is None:
        value = value.func.value
    return value


def self_bindings(cls: ast.ClassDef, attr: str, ctx: FileContext) -> list[ast.expr]:
    """The values the methods of ``cls`` assign to ``self.<attr>`` (plain and
    annotated assignments), in source order."""
    key = ("bindings.self", id(cls))
    table = ctx.cache.get(key)
    if table is None:
        table = ctx.cache[key] = {}
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                            target.value.id == "self":
                        table.setdefault(target.attr, []).append(node.value)
    return table.get(attr, [])


def scope_of(node: ast.AST, ctx: FileContext) -> ast.AST:
    """The innermost function of the file holding ``node`` (the module when none)."""
    table = ctx.cache.get("bindings.scope")
    if table is None:
        table = ctx.cache["bindings.scope"] = {}
        for function in ctx.nodes(*_FUNCTIONS):
            for inner in walk_scope(function):
                table[id(inner)] = function
    return table.get(id(node), ctx.tree)


def owner_of(function: ast.AST, ctx: FileContext) -> ast.ClassDef | None:
    """The class whose body defines ``function`` (None for other functions)."""
    table = ctx.cache.get("bindings.owner")
    if table is None:
        table = ctx.cache["bindings.owner"] = {}
        for cls in ctx.nodes(ast.ClassDef):
            for statement in cls.body:
                if isinstance(statement, _FUNCTIONS):
                    table[id(statement)] = cls
    return table.get(id(function))


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The method ``name`` defined in the body of ``cls``."""
    return next((f for f in cls.body if isinstance(f, _FUNCTIONS) and f.name == name), None)


def calls_of(function: ast.FunctionDef | ast.AsyncFunctionDef, ctx: FileContext) -> list[ast.Call] | None:
    """The file's calls of ``function``, read by how it is named: a function of the
    module by its name, an ``__init__`` by its class's name, another method as
    ``self.<name>(...)`` inside its class, a function nested in another by its name
    inside that one. None for a function called in other ways (a decorated method,
    a ``staticmethod``)."""
    owner = owner_of(function, ctx)
    if owner is not None:
        if function.decorator_list:
            return None
        if function.name == "__init__":
            return [c for c in ctx.nodes(ast.Call) if isinstance(c.func, ast.Name) and c.func.id == owner.name]
        return [c for c in ast.walk(owner) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                and c.func.attr == function.name and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"]
    if function in ctx.tree.body:
        return [c for c in ctx.nodes(ast.Call) if isinstance(c.func, ast.Name) and c.func.id == function.name]
    outer = scope_of(function, ctx)
    if outer is ctx.tree:
        return None  # defined in a block of the module (an ``if``): not followed
    return [c for c in _walk_inside(outer) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
            and c.func.id == function.name]


def _walk_inside(function: ast.AST):
    """Every node under ``function``, nested functions included."""
    for statement in getattr(function, "body", []):
        yield from ast.walk(statement)


def parameter_arguments(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str,
                        ctx: FileContext) -> list[tuple[ast.expr, ast.AST]] | None:
    """What the file's calls of ``function`` (see :func:`calls_of`) pass as its
    parameter ``name``, positionally or by keyword, each with the function (or
    module) the call is in. None when ``name`` is not a parameter, when the file
    never calls ``function``, or when a call passes the parameter in a way not read
    here (through ``*args`` or ``**kwargs``, or not at all: its default)."""
    args = function.args
    if name not in {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}:
        return None
    calls = calls_of(function, ctx)
    if not calls:
        return None
    found = []
    for call in calls:
        arg = argument_of(call, function, name, ctx)
        if arg is None:
            return None
        found.append((arg, scope_of(call, ctx)))
    return found


def argument_of(call: ast.Call, function: ast.FunctionDef | ast.AsyncFunctionDef, name: str,
                ctx: FileContext) -> ast.expr | None:
    """What ``call`` (a call of ``function``, see :func:`calls_of`) passes as the
    parameter ``name``; None when it passes it through ``*args`` or ``**kwargs``,
    or leaves it to its default."""
    args = function.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    arg = next((k.value for k in call.keywords if k.arg == name), None)
    if arg is not None or name not in positional:
        return arg
    position = positional.index(name) - (1 if owner_of(function, ctx) is not None else 0)  # ``self``
    if position < 0 or any(isinstance(a, ast.Starred) for a in call.args[:position + 1]):
        return None
    return call.args[position] if position < len(call.args) else None


# ---------------------------------------------------------------- the value of a name at a line

#: Statements that bind names (``ast.NamedExpr`` is an expression that does too).
_BINDERS = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.NamedExpr)


def binding_targets(statement: ast.AST) -> list[ast.AST]:
    """The targets a statement binds (assignments, ``for``, ``with ... as``, ``:=``)."""
    if isinstance(statement, ast.Assign):
        return list(statement.targets)
    if isinstance(statement, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
        return [statement.target]
    if isinstance(statement, (ast.With, ast.AsyncWith)):
        return [item.optional_vars for item in statement.items if item.optional_vars is not None]
    return []


def bound_names(statement: ast.AST) -> set[str]:
    """The plain names a statement binds (``h, c = ...`` binds ``h`` and ``c``)."""
    return {n.id for t in binding_targets(statement) for n in ast.walk(t)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


@dataclass(frozen=True)
class Binding:
    """One statement binding a name: its ``value`` (``x * s`` for ``x *= s``; None
    when it is not an assignment: a loop target, ``with ... as`` or ``:=``), and
    ``index``, the name's position when an assignment unpacks a tuple into it."""

    statement: ast.AST
    value: ast.expr | None
    index: int | None = None


def _binding(node: ast.AST, name: str, ctx: FileContext) -> Binding | None:
    if not isinstance(node, _BINDERS) or name not in bound_names(node):
        return None
    if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
        return Binding(node, _augmented_value(node, ctx))
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(target, ast.Name) and target.id == name:
                return Binding(node, node.value)
            if isinstance(target, (ast.Tuple, ast.List)):
                position = next((i for i, e in enumerate(target.elts) if isinstance(e, ast.Name) and e.id == name), None)
                if position is not None:
                    return Binding(node, node.value, position)
    return Binding(node, None)


def _augmented_value(node: ast.AugAssign, ctx: FileContext) -> ast.expr:
    """``x * s`` for ``x *= s``: the name, read on the statement's line (so that it
    holds the value before it), and the operand; one node per statement."""
    key = ("bindings.augmented", id(node))
    value = ctx.cache.get(key)
    if value is None:
        read = ast.copy_location(ast.Name(id=node.target.id, ctx=ast.Load()), node.target)  # type: ignore[attr-defined]
        value = ctx.cache[key] = ast.copy_location(ast.BinOp(left=read, op=node.op, right=node.value), node)
    return value


def bindings_before(name: str, scope: ast.AST, line: int, ctx: FileContext) -> list[Binding]:
    """Every binding of ``name`` in ``scope`` (nested functions and classes aside) on
    a line before ``line``, in source order."""
    key = ("bindings.binders", id(scope))
    by_name = ctx.cache.get(key)
    if by_name is None:
        # Each name's binding statements, in source order, found once per scope.
        by_name = ctx.cache[key] = {}
        for n in sorted((n for n in walk_scope(scope) if isinstance(n, _BINDERS)),
                        key=lambda n: (n.lineno, n.col_offset)):
            for bound in bound_names(n):
                by_name.setdefault(bound, []).append(n)
    found = (_binding(n, name, ctx) for n in by_name.get(name, ()) if n.lineno < line)
    return [b for b in found if b is not None]


def reaching(name: str, scope: ast.AST, line: int, ctx: FileContext) -> list[Binding] | None:
    """The assignments whose value ``name`` may hold when ``line`` of ``scope`` runs:
    the last binding before it alone when it always runs before that line (see
    :func:`dominates`), else every one before it. Empty when nothing in ``scope``
    binds ``name`` before ``line`` (a parameter, a global); None when one of those is
    not an assignment (a loop target, ``with``, ``:=``: its value is not read)."""
    found = bindings_before(name, scope, line, ctx)
    if found and dominates(found[-1].statement, line, scope, ctx):
        found = found[-1:]
    return None if any(b.value is None for b in found) else found


def dominates(statement: ast.AST, line: int, scope: ast.AST, ctx: FileContext) -> bool:
    """Whether ``statement`` of ``scope`` runs whenever ``line`` (after it) does: the
    block holding it also holds the line, or it sits in ``with`` blocks whose
    enclosing block holds the line."""
    blocks = _blocks(scope, ctx)
    node: ast.AST = statement
    while id(node) in blocks:
        block, owner = blocks[id(node)]
        if any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in block if s is not node):
            return True
        if not isinstance(owner, (ast.With, ast.AsyncWith)):
            return False
        node = owner
    return False


def _blocks(scope: ast.AST, ctx: FileContext) -> dict[int, tuple[list[ast.stmt], ast.AST]]:
    """Each statement of ``scope`` (by id): the statement list holding it and the
    node owning that list."""
    key = ("bindings.blocks", id(scope))
    table = ctx.cache.get(key)
    if table is None:
        table = ctx.cache[key] = {}
        owners = [scope, *(n for n in walk_scope(scope) if isinstance(n, (ast.stmt, ast.excepthandler, ast.match_case)))]
        for owner in owners:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                block = getattr(owner, field, None)
                if isinstance(block, list):
                    for statement in block:
                        if isinstance(statement, ast.stmt):
                            table[id(statement)] = (block, owner)
    return table
