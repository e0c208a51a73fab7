"""Where a module or a value of a file comes from, for rules that follow one to its
construction: the values a class binds to ``self.<attr>``, the arguments a file's
calls pass to a function's parameter, the function holding a node, and the methods
that return the module they are called on."""

from __future__ import annotations

import ast

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
