"""What the distributed rules (AX6xx) share: recognising DistributedDataParallel and
FSDP wrappers, the names the wrapped models are bound to, collectives, and the
scopes (function, class) that a name belongs to."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from torchaxe.scan.context import BOUNDARY_TYPES, FileContext, child_fields, child_nodes, fast_walk
from torchaxe.scan.rules._bindings import binding_targets

#: Qualified names of torch's DistributedDataParallel.
DDP_NAMES = frozenset({
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.nn.DistributedDataParallel",
})
#: Qualified names of FSDP (the wrapper class) and FSDP2 (``fully_shard``).
FSDP_NAMES = frozenset({
    "torch.distributed.fsdp.FullyShardedDataParallel",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
})
FULLY_SHARD_NAMES = frozenset({
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard.fully_shard",
})
#: torch.distributed's collectives (the module prefix is checked separately).
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "broadcast", "broadcast_object_list", "all_to_all",
    "all_to_all_single", "barrier",
})


@dataclass(frozen=True)
class Wrap:
    """One ``DDP(...)``/``FSDP(...)`` construction."""

    call: ast.Call
    kind: str  # "ddp" or "fsdp"
    #: The source text of the name it is bound to (``model``, ``self.model``), or None.
    target: str | None
    #: The statement that binds it.
    statement: ast.stmt | None
    #: The function (or module) that holds the statement.
    scope: ast.AST


def wrapper_kind(ctx: FileContext, call: ast.Call) -> str | None:
    """``"ddp"`` or ``"fsdp"`` for a call that builds one, else None."""
    name = ctx.call_name(call) or ""
    if name in DDP_NAMES:
        return "ddp"
    if name in FSDP_NAMES:
        return "fsdp"
    return None


def wraps(ctx: FileContext) -> list[Wrap]:
    """Every DDP/FSDP construction in the file, in source order."""
    key = "ax6.wraps"
    if key not in ctx.cache:
        found: list[Wrap] = []
        if not any(wrapper_kind(ctx, n) for n in ctx.nodes(ast.Call)):
            ctx.cache[key] = found
            return found
        for scope, statement in statements(ctx.tree):
            for node in header_nodes(statement):
                if isinstance(node, ast.Call) and (kind := wrapper_kind(ctx, node)) is not None:
                    target = None
                    if isinstance(statement, (ast.Assign, ast.AnnAssign)) and _value(statement) is node:
                        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                        if len(targets) == 1 and isinstance(targets[0], (ast.Name, ast.Attribute)):
                            target = ctx.text(targets[0])
                    found.append(Wrap(node, kind, target, statement, scope))
        found.sort(key=lambda w: (w.call.lineno, w.call.col_offset))
        ctx.cache[key] = found
    return ctx.cache[key]


def _value(statement: ast.stmt) -> ast.expr | None:
    return getattr(statement, "value", None)


def statements(tree: ast.AST):
    """Every statement with the innermost function (or the module) that holds it."""
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while stack:
        node, scope = stack.pop()
        for child in child_nodes(node):
            if isinstance(child, ast.stmt):
                yield scope, child
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                stack.append((child, inner))


def header_nodes(statement: ast.stmt):
    """The nodes of a simple statement, or of a compound statement's header (its
    test, iterable, context managers), not of its body."""
    if isinstance(statement, BOUNDARY_TYPES):
        return
    for field_name in child_fields(type(statement)):
        if field_name in ("body", "orelse", "finalbody", "handlers", "cases"):
            continue
        value = getattr(statement, field_name, None)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, ast.AST):
                yield from fast_walk(v)


def enclosing(parents: list[ast.AST], types) -> ast.AST | None:
    for node in reversed(parents):
        if isinstance(node, types):
            return node
    return None


def enclosing_class(tree: ast.Module, function: ast.AST) -> ast.ClassDef | None:
    for node in fast_walk(tree):
        if isinstance(node, ast.ClassDef) and any(s is function for s in node.body):
            return node
    return None


def collective_name(ctx: FileContext, call: ast.Call) -> str | None:
    """``all_reduce`` for ``dist.all_reduce(t)`` (through torch.distributed's import
    aliases), else None."""
    name = ctx.call_name(call) or ""
    module, _, leaf = name.rpartition(".")
    if leaf in COLLECTIVES and module in ("torch.distributed", "torch.distributed.distributed_c10d"):
        return leaf
    return None


def call_leaf(call: ast.Call) -> str:
    """``reduce_tensor`` of ``utils.reduce_tensor(x)`` or of ``reduce_tensor(x)``."""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def helper_of_another_module(ctx: FileContext, call: ast.Call) -> bool:
    """Whether the call's function is neither defined in this file, nor a method of
    ``self``/``cls``, nor torch's: a helper the project (or a library) defines
    elsewhere, known by its name only."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in ctx.functions():
        return False
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"):
        return False
    return not (ctx.qualified_name(func) or "").startswith("torch.")


def uses_lightning(ctx: FileContext) -> bool:
    return any(origin.split(".", 1)[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
               for origin in ctx.imports.values())


def stored_texts(nodes) -> set[str]:
    """The source-independent dotted forms (``step``, ``self.step``) of every name,
    attribute or subscript base assigned among ``nodes``."""
    found: set[str] = set()
    for node in nodes:
        for sub in fast_walk(node):
            if isinstance(sub, (ast.Name, ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                target = sub.value if isinstance(sub, ast.Subscript) else sub
                dotted = dotted_name(target)
                if dotted:
                    found.add(dotted)
    return found


def dotted_name(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Subscript):
        return dotted_name(node.value)
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def wrapper_bound_at(ctx: FileContext, scope: ast.AST, name: str, line: int) -> Wrap | None:
    """The DDP/FSDP construction ``name`` (``model``, ``self.model``) is bound to on
    ``line`` of ``scope``: the last statement of the scope before that line that binds
    it is ``name = DDP(...)``. None when it is anything else, or unknown."""
    last: ast.stmt | None = None
    for _, statement in statements(scope):
        if statement.lineno < line and name in stored_texts(binding_targets(statement)):
            if last is None or statement.lineno > last.lineno:
                last = statement
    if last is None:
        return None
    return next((w for w in wraps(ctx) if w.statement is last and w.target == name), None)


def function_of(parents: list[ast.AST], tree: ast.Module) -> ast.AST:
    """The innermost function among ``parents`` (the module when none)."""
    return enclosing(parents, (ast.FunctionDef, ast.AsyncFunctionDef)) or tree


def parent_map(scope: ast.AST) -> dict[int, ast.AST]:
    """Each node's parent under ``scope``, by the node's id."""
    parents: dict[int, ast.AST] = {}
    queue = [scope]
    for node in queue:  # one pass: the queue grows as the children are met
        children = child_nodes(node)
        for child in children:
            parents[id(child)] = node
        queue.extend(children)
    return parents
