"""Shared analysis for the AX3xx rules (host-device syncs and transfers): which loop
runs once per training step, which expressions plausibly hold device tensors, which
names hold a batch from a data loader, and how a device is written.

Everything here is a static guess made from the syntax tree of one file; nothing
imports or runs the scanned code. The guesses lean towards silence: an expression
counts as a tensor only on positive evidence (a torch op, a model or loss call, a
tensor method, a ``.backward()`` receiver), never because of its name alone. Not a
rule module (the leading underscore keeps the registry out).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Callable

from torchaxe.scan.context import BOUNDARY_TYPES, LOOP_TYPES, FileContext, child_nodes, fast_walk
from torchaxe.scan.rules._dataloader import is_dataloader_call
from torchaxe.scan.rules._bindings import MODULE_METHODS

FUNCTION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

#: What the device is called in messages.
DEVICE_WORD = {"cuda": "GPU", "npu": "NPU", "cpu": "CPU"}
#: The module whose functions a target's code calls (torch.cuda.synchronize, ...).
DEVICE_MODULE = {"cuda": "torch.cuda", "npu": "torch.npu", "cpu": "torch.cpu"}

#: A ``% N`` guard with a literal N below this still runs too often to call rare.
RARE_MODULUS = 10


# ---------------------------------------------------------------- training steps
def rarely_run(ctx: FileContext, loop: ast.AST, *nodes: ast.AST) -> bool:
    """Whether ``nodes[-1]`` runs only on a few iterations of ``loop``: inside an
    ``if step % N == 0:`` branch (N not a literal below 10), a ``raise``, an
    ``except`` handler or an ``assert`` message."""
    path = [*ctx.parents, *nodes]
    try:
        start = next(i for i, n in enumerate(path) if n is loop)
    except StopIteration:
        return False
    for i in range(start + 1, len(path) - 1):
        parent, child = path[i], path[i + 1]
        if isinstance(parent, (ast.Raise, ast.ExceptHandler)):
            return True
        if isinstance(parent, ast.Assert) and child is parent.msg:
            return True
        if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test:
            side = modulo_guard(parent.test, lambda name: _flag_values(path[:start + 1], name),
                                module=lambda name: assigned_in(ctx.tree, name))
            body = parent.body if isinstance(parent.body, list) else [parent.body]
            in_body = any(child is s for s in body)
            if (side == "body" and in_body) or (side == "orelse" and not in_body):
                branch = body if in_body else parent.orelse
                if _runs_the_step(ctx, loop, parent, branch):
                    # The training step itself runs there (``if step % train_frequency
                    # == 0``), or its update (``if (step + 1) % accumulation == 0:
                    # optimizer.step()``): what else runs there runs once a step.
                    continue
                return True
    return False


def _flag_values(outer: list[ast.AST], name: str) -> list[ast.expr]:
    """The values ``name`` may hold in the loop ``outer[-1]``: its assignments in the
    loop, or, when the loop never binds it, in the function around the loop (StyleGAN2
    sets ``apply_path_penalty = ... and self.steps % 32 == 0`` before its accumulation
    loop)."""
    loop = outer[-1]
    values = assigned_in(loop, name)
    if values or any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
                     for n in ast.walk(loop)):
        return values
    function = next((n for n in reversed(outer[:-1]) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    return assigned_in(function, name) if function is not None else []


def _runs_the_step(ctx: FileContext, loop: ast.AST, guard: ast.AST, branch) -> bool:
    """Whether ``branch`` (a body of the ``if`` statement ``guard``) makes a kind of
    training call (a backward pass, an optimizer's step) that ``loop`` makes nowhere
    else: then the branch is the step, or the update of accumulated gradients. A branch
    whose calls the loop also makes outside it is an extra step (StyleGAN2's lazy
    regularisation every 4 or 16 iterations), rarer than the training steps."""
    statements = branch if isinstance(branch, list) else [branch]
    inside = {id(n) for s in statements for n in ast.walk(s)}
    guarded = {id(n) for n in ast.walk(guard)}
    kinds_in: set[str] = set()
    kinds_out: set[str] = set()
    for node in ast.walk(loop):
        kind = ctx.training_kind(node)
        if kind is not None:
            if id(node) in inside:
                kinds_in.add(kind)
            elif id(node) not in guarded:
                kinds_out.add(kind)
    return bool(kinds_in - kinds_out)


def assigned_in(scope: ast.AST, name: str) -> list[ast.expr]:
    """The values a plain ``name = value`` gives ``name`` inside ``scope``; none when
    the name is also bound otherwise there (a loop target, ``+=``), as then its value
    is not one of them."""
    values: list[ast.expr] = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if len(node.targets) != 1:
                return []
            values.append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            if node.value is None:
                return []
            values.append(node.value)
        elif any(isinstance(t, ast.Name) and t.id == name for bound in _other_bindings(node) for t in ast.walk(bound)):
            return []
    return values


def _other_bindings(node: ast.AST) -> list[ast.AST]:
    """What ``node`` binds other than by a plain assignment."""
    if isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor, ast.comprehension, ast.NamedExpr)):
        return [node.target]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [item.optional_vars for item in node.items if item.optional_vars is not None]
    return []


def modulo_guard(test: ast.AST, assigned: Callable[[str], list[ast.expr]] | None = None,
                 depth: int = 0, module: Callable[[str], list[ast.expr]] | None = None) -> str | None:
    """Which branch of an ``if`` on ``test`` is taken once every N steps: ``"body"``
    for ``step % N == 0``, ``"orelse"`` for ``step % N`` or ``step % N != 0``.
    ``assigned``: a name's values, to read a flag set earlier (``is_log_step = step %
    N == 0`` then ``if is_log_step:``). ``module``: a name's values in the whole file,
    to read N when it is a name (llama2.c's ``log_interval = 1``: every step)."""
    if isinstance(test, ast.Name) and assigned is not None and depth < 4:
        sides = {modulo_guard(v, assigned, depth + 1, module) for v in assigned(test.id) or [test]}
        return sides.pop() if len(sides) == 1 else None
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return "body" if any(modulo_guard(v, assigned, depth, module) == "body" for v in test.values) else None
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        # `step % N == 0 or step == last`: rare when every alternative is.
        guards = [modulo_guard(v, assigned, depth, module) == "body" for v in test.values]
        sides = [guard or _equality(v) or _set_to_equality(v, assigned, depth)
                 for guard, v in zip(guards, test.values)]
        return "body" if all(sides) and any(guards) else None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return {"body": "orelse", "orelse": "body"}.get(modulo_guard(test.operand, assigned, depth, module) or "")
    if _sparse_modulo(test, module):
        return "orelse"
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        if _sparse_modulo(test.left, module) or _sparse_modulo(test.comparators[0], module):
            if isinstance(test.ops[0], ast.Eq):
                return "body"
            if isinstance(test.ops[0], ast.NotEq):
                return "orelse"
    return None


#: A flag true on one iteration (``step % N == 0 or last_step``).
_ONE_ITERATION_FLAG = re.compile(r"(^|_)(last|final|first)(_|$)", re.IGNORECASE)


def _equality(node: ast.AST) -> bool:
    """``step == last``: true on one value of a counter (not ``mode == "train"``), or a
    flag named for one iteration (``last_step``, ``is_final``)."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if name is not None:
        return bool(_ONE_ITERATION_FLAG.search(name))
    return (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.Eq)
        and not any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in (node.left, *node.comparators))
    )


def _set_to_equality(node: ast.AST, assigned: Callable[[str], list[ast.expr]] | None, depth: int) -> bool:
    """A name set to ``count == last`` (``last_batch = i == n - 1``) only."""
    if not isinstance(node, ast.Name) or assigned is None or depth >= 4:
        return False
    values = assigned(node.id)
    return bool(values) and all(_equality(v) for v in values)


def _sparse_modulo(node: ast.AST, module: Callable[[str], list[ast.expr]] | None = None) -> bool:
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)):
        return False
    if isinstance(node.left, (ast.JoinedStr, ast.Constant)) and not isinstance(
        getattr(node.left, "value", 0), (int, float)
    ):
        return False  # "%d" % x is formatting, not a step counter
    right = node.right
    values = module(right.id) if module is not None and isinstance(right, ast.Name) else [right]
    if values and all(_small_modulus(v) for v in values):
        return False
    return True


def _small_modulus(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, int) and node.value < RARE_MODULUS


# ------------------------------------------------------------------- tensors
#: torch.<op> calls that return something other than a tensor.
_TORCH_NOT_TENSOR = frozenset(
    (
        "autocast can_cast compile device dtype enable_grad finfo from_file iinfo inference_mode "
        "load manual_seed no_grad numel promote_types result_type save seed typename vmap cond"
    ).split()
)
_TORCH_NOT_TENSOR_PREFIXES = ("is_", "get_", "set_", "use_", "_")
_TORCH_OP_MODULES = ("torch.nn.functional.", "torch.linalg.", "torch.fft.", "torch.special.")
_TORCH_OTHER_OPS = frozenset(
    {"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.autograd.grad"}
)

#: Tensor methods that numpy arrays and Python objects do not have.
TENSOR_ONLY_METHODS = frozenset(
    (
        "detach to cuda npu float half bfloat16 double long int bool clone contiguous softmax "
        "log_softmax sigmoid relu masked_fill view unsqueeze expand permute type_as view_as pow "
        "exp log sqrt square neg isnan isinf isfinite eq ne gt lt ge le logical_and logical_or "
        "logical_not div mul add sub norm clamp"
    ).split()
)
#: Methods that tensors share with numpy (a result is a tensor when the receiver is).
REDUCTION_METHODS = frozenset(
    (
        "sum mean max min std var prod abs argmax argmin all any round cumsum squeeze reshape "
        "flatten nansum nanmean amax amin"
    ).split()
)
#: Methods whose result lives on the host.
HOST_METHODS = frozenset(
    (
        "item tolist numpy size dim ndimension numel nelement element_size stride data_ptr "
        "get_device is_contiguous format join split strip keys items values __len__ state_dict "
        "parameters named_parameters"
    ).split()
)
#: Tensor attributes that are not tensors.
HOST_ATTRIBUTES = frozenset(
    "shape dtype device ndim is_cuda requires_grad is_leaf layout names grad_fn is_sparse itemsize nbytes".split()
)
#: Methods that tell a name holds a tensor.
TENSOR_EVIDENCE_METHODS = frozenset({"backward", "detach", "item", "requires_grad_", "retain_grad", "detach_"})
#: Methods that tell a name holds an nn.Module (calling it runs a forward pass).
MODULE_EVIDENCE_METHODS = frozenset(
    "parameters named_parameters train eval modules named_modules children forward register_forward_hook buffers".split()
)
_HOST_BUILTINS = frozenset(
    (
        "len int float str bool complex repr format range list dict tuple set sorted enumerate "
        "zip isinstance hasattr getattr type id hash open print input next iter"
    ).split()
)
_LITERALS = (
    ast.Constant,
    ast.JoinedStr,
    ast.List,
    ast.Tuple,
    ast.Set,
    ast.Dict,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)
#: Libraries whose functions are never taken for a model or a loss by their name.
_LIBRARIES = frozenset({"torch", "numpy", "math", "sklearn", "scipy", "statistics"})
_HOST_MODULES = ("numpy.", "math.", "time.", "random.", "datetime.", "os.", "json.", "statistics.")


def is_torch_op(qualified: str | None) -> bool:
    """Whether a qualified call name is a torch function that returns a tensor."""
    if not qualified:
        return False
    if qualified.startswith(_TORCH_OP_MODULES) or qualified in _TORCH_OTHER_OPS:
        return True
    parts = qualified.split(".")
    if len(parts) != 2 or parts[0] != "torch":
        return False
    op = parts[1]
    return op[:1].islower() and not op.startswith(_TORCH_NOT_TENSOR_PREFIXES) and op not in _TORCH_NOT_TENSOR


def _looks_like_model_or_loss(name: str) -> bool:
    """A callee name that, called, most likely runs a model or a loss."""
    if not name or name[0].isupper():
        return False  # a class: calling it builds an object
    low = name.lower()
    return (
        low in ("model", "net", "forward")
        or "loss" in low
        or "criterion" in low
        or low.startswith("model")
        or low.endswith("model")
    )


Pos = tuple[int, int]


@dataclass(eq=False)
class _Binding:
    """One place that binds a name: ``value`` (name = value), ``aug`` (name op=
    value; ``target`` is the name node), ``element`` (unpacked from value),
    ``loop`` (a for-loop variable over value) or ``unknown`` (a parameter...)."""

    kind: str
    value: ast.AST | None
    pos: Pos  # where the binding takes effect
    loops: tuple[int, ...]  # ids of the loops around it, outermost first
    blocks: frozenset[int] = frozenset()  # ids of the branches and loops around it
    target: ast.AST | None = None


@dataclass
class _Scope:
    bindings: dict[str, list[_Binding]] = field(default_factory=dict)
    #: Names that receive an argument-less tensor-only method (``loss.backward()``).
    evidence: set[str] = field(default_factory=set)
    #: The loops, and the branches and loops, around each name that is read, by id
    #: of the Name node.
    use_loops: dict[int, tuple[tuple[int, ...], frozenset[int]]] = field(default_factory=dict)


def _pos(node: ast.AST, end: bool = False) -> Pos:
    if end:
        return (getattr(node, "end_lineno", 0) or 0, getattr(node, "end_col_offset", 0) or 0)
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def _scope_facts(ctx: FileContext, scope: ast.AST) -> _Scope:
    key = ("ax3.scope", id(scope))
    if key in ctx.cache:
        return ctx.cache[key]
    facts = _Scope()

    def bind(target: ast.AST, binding: _Binding) -> None:
        if isinstance(target, ast.Name):
            facts.bindings.setdefault(target.id, []).append(binding)
        elif isinstance(target, (ast.Tuple, ast.List)):
            value = binding.value
            if (
                binding.kind == "value"
                and isinstance(value, (ast.Tuple, ast.List))
                and len(value.elts) == len(target.elts)
                and not any(isinstance(e, ast.Starred) for e in (*value.elts, *target.elts))
            ):
                for t, v in zip(target.elts, value.elts):
                    bind(t, _Binding("value", v, binding.pos, binding.loops, binding.blocks))
                return
            kind = "element" if binding.kind in ("value", "element") else binding.kind
            for t in target.elts:
                bind(t, _Binding(kind, value, binding.pos, binding.loops, binding.blocks))
        elif isinstance(target, ast.Starred):
            bind(target.value, _Binding("unknown", None, binding.pos, binding.loops, binding.blocks))

    if isinstance(scope, FUNCTION_TYPES):
        a = scope.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
            if arg is not None:
                facts.bindings.setdefault(arg.arg, []).append(_Binding("unknown", None, (0, 0), ()))

    def visit(node: ast.AST, loops: tuple[int, ...], blocks: frozenset[int]) -> None:
        here = {"loops": loops, "blocks": blocks}
        if isinstance(node, ast.Assign):
            for t in node.targets:
                bind(t, _Binding("value", node.value, _pos(node, end=True), **here))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            bind(node.target, _Binding("value", node.value, _pos(node, end=True), **here))
        elif isinstance(node, ast.AugAssign):
            bind(node.target, _Binding("aug", node.value, _pos(node, end=True), **here, target=node.target))
        elif isinstance(node, ast.NamedExpr):
            bind(node.target, _Binding("value", node.value, _pos(node, end=True), **here))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            bind(
                node.target,
                _Binding("loop", node.iter, _pos(node.iter, end=True), (*loops, id(node)), blocks | {id(node)}),
            )
        elif isinstance(node, ast.comprehension):
            bind(node.target, _Binding("loop", node.iter, _pos(node.iter, end=True), **here))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            bind(node.optional_vars, _Binding("unknown", None, _pos(node, end=True), **here))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            facts.bindings.setdefault(node.name, []).append(_Binding("unknown", None, _pos(node), **here))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            facts.use_loops[id(node)] = (loops, blocks)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
        ):
            # `loss.backward()` says loss is a tensor; `accelerator.backward(loss)` does not.
            if node.func.attr in TENSOR_EVIDENCE_METHODS and not node.args:
                facts.evidence.add(node.func.value.id)
        if isinstance(node, BOUNDARY_TYPES):
            return
        is_loop = isinstance(node, LOOP_TYPES)
        branches = is_loop or isinstance(node, (ast.If, ast.Try, ast.Match, ast.IfExp, ast.BoolOp, ast.ExceptHandler))
        for child in child_nodes(node):
            if getattr(node, "iter", None) is child:
                visit(child, loops, blocks)  # a for-loop's iterable is evaluated once
            elif getattr(node, "test", None) is child:
                # A condition runs on every path through its statement (a while
                # loop's on every iteration).
                visit(child, (*loops, id(node)) if is_loop else loops, blocks)
            else:
                visit(child, (*loops, id(node)) if is_loop else loops, blocks | {id(node)} if branches else blocks)

    for child in child_nodes(scope):
        visit(child, (), frozenset())
    ctx.cache[key] = facts
    return facts


def _reaching(bindings: list[_Binding], at: Pos, loops: tuple[int, ...], blocks: frozenset[int]) -> list[_Binding]:
    """The bindings a read of the name at ``at`` may see: going back from the read,
    each binding up to the first one that surely runs before it (one not inside a
    branch or loop that the read is not also in); then, unless that one is in the
    read's innermost loop, any later binding in a loop around the read (carried to
    the next iteration). All of them when none comes before (the name is set later
    or elsewhere). A guess from the tree, not a data-flow analysis."""
    reach: list[_Binding] = []
    sure = None
    for b in sorted((b for b in bindings if b.pos <= at), key=lambda b: b.pos, reverse=True):
        reach.append(b)
        if b.blocks <= blocks:
            sure = b
            break
    if loops and not (sure is not None and loops[-1] in sure.loops):
        around = set(loops)
        reach += [b for b in bindings if b.pos > at and around.intersection(b.loops)]
    return reach or list(bindings)


def module_names(ctx: FileContext) -> frozenset[str]:
    """Names (and attribute names, ``self.model`` giving ``model``) that hold an
    ``nn.Module`` somewhere in the file: built from a torch.nn class, a torchvision
    model, ``torch.compile``, or a class of this file derived from a Module, or used
    with ``.parameters()``, ``.train()``, ``.eval()``..."""
    key = "ax3.module_names"
    if key in ctx.cache:
        return ctx.cache[key]
    local_modules: set[str] = set()
    names: set[str] = set()
    assignments: list[ast.Assign | ast.AnnAssign] = []
    for node in ctx.nodes(ast.ClassDef, ast.Call, ast.Assign, ast.AnnAssign):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                text = (ctx.qualified_name(base) or ast.unparse(base)).rsplit(".", 1)[-1]
                if text.endswith("Module") or text in local_modules:
                    local_modules.add(node.name)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MODULE_EVIDENCE_METHODS
        ):
            receiver = node.func.value
            if isinstance(receiver, ast.Name):
                names.add(receiver.id)
            elif isinstance(receiver, ast.Attribute):
                names.add(receiver.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            assignments.append(node)
    for node in assignments:
        if is_module_constructor(ctx, node.value, local_modules):  # type: ignore[arg-type]
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                elif isinstance(t, ast.Attribute):
                    names.add(t.attr)
    ctx.cache[key] = frozenset(names)
    ctx.cache["ax3.local_modules"] = frozenset(local_modules)
    return ctx.cache[key]


def is_module_constructor(
    ctx: FileContext, value: ast.AST, local_modules: set[str] | frozenset[str] | None = None
) -> bool:
    """Whether ``value`` builds an nn.Module (possibly moved: ``Net().to(device)``)."""
    if local_modules is None:
        module_names(ctx)
        local_modules = ctx.cache["ax3.local_modules"]
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in MODULE_METHODS:
        value = value.func.value
    if not isinstance(value, ast.Call):
        return False
    if isinstance(value.func, ast.Name) and value.func.id in local_modules:
        return True
    q = ctx.call_name(value) or ""
    last = q.rsplit(".", 1)[-1]
    if q.startswith("torch.nn.") and last[:1].isupper():
        return True
    return (
        q.startswith("torchvision.models.")
        or q in ("torch.compile", "timm.create_model")
        or (q.startswith("transformers.") and last == "from_pretrained")
    )


def loader_names(ctx: FileContext) -> frozenset[str]:
    """Names bound in the file to a ``DataLoader(...)`` call."""
    key = "ax3.loader_names"
    if key not in ctx.cache:
        names: set[str] = set()
        for node in ctx.nodes(ast.Assign):
            if (
                isinstance(node.value, ast.Call)
                and is_dataloader_call(ctx, node.value)
            ):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute):
                        names.add(t.attr)
        ctx.cache[key] = frozenset(names)
    return ctx.cache[key]


def is_loader(ctx: FileContext, node: ast.AST) -> bool:
    """Whether an expression plausibly is a data loader (a name holding a
    ``DataLoader(...)`` or named like one, or the call itself)."""
    if isinstance(node, ast.Call):
        return is_dataloader_call(ctx, node)
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
    else:
        return False
    low = name.lower()
    return name in loader_names(ctx) or "loader" in low or low == "dl" or low.endswith("_dl")


def loader_of_iterable(ctx: FileContext, node: ast.AST) -> tuple[bool, bool]:
    """``(is a loader, wrapped in enumerate)`` for a for-loop's iterable, seeing
    through ``enumerate(...)``, ``tqdm(...)``, ``iter(...)`` and similar wrappers
    whose first argument is the loader."""
    enumerated = False
    while isinstance(node, ast.Call) and not is_dataloader_call(ctx, node) and node.args:
        if isinstance(node.func, ast.Name) and node.func.id == "enumerate":
            enumerated = True
        node = node.args[0]
    return is_loader(ctx, node), enumerated


class Tensors:
    """Guesses, for the scopes around one node (innermost first, module last),
    whether an expression plausibly holds a tensor or certainly a host value."""

    def __init__(self, ctx: FileContext, scopes: list[ast.AST]) -> None:
        self.ctx = ctx
        self.scopes = [_scope_facts(ctx, s) for s in scopes]
        self.modules = module_names(ctx)
        self._memos: dict[tuple[int, str], bool] = {}
        self._busy: set[tuple[int, str]] = set()

    # ------------------------------------------------------------------ names
    def _lookup(self, name: str) -> _Scope | None:
        for scope in self.scopes:
            if name in scope.bindings or name in scope.evidence:
                return scope
        return None

    def _reach(self, node: ast.Name) -> tuple[_Scope, list[_Binding]] | None:
        scope = self._lookup(node.id)
        if scope is None:
            return None
        loops, blocks = scope.use_loops.get(id(node), ((), frozenset()))
        return scope, _reaching(scope.bindings.get(node.id, []), _pos(node), loops, blocks)

    def _name_is_tensor(self, node: ast.Name) -> bool:
        found = self._reach(node)
        if found is None:
            return False
        scope, reach = found
        if any(self._binding_is_tensor(b) for b in reach):
            return True
        # Evidence such as `loss.backward()` settles names whose binding says
        # nothing (a parameter, a call to an unknown function).
        return node.id in scope.evidence and not any(self._binding_is_host(b) for b in reach)

    def _container_items(self, node: ast.AST) -> list[ast.AST] | None:
        """The items of the container literal ``node`` is (or a name every binding
        of which sets to one): a dict's values, a list's, tuple's or set's elements, a
        comprehension's element; None when it is not known to be one."""
        if isinstance(node, ast.Dict):
            return list(node.values)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return list(node.elts)
        if isinstance(node, ast.DictComp):
            return [node.value]
        if isinstance(node, (ast.ListComp, ast.SetComp)):
            return [node.elt]
        if isinstance(node, ast.Name):
            found = self._reach(node)
            if found is None or not found[1]:
                return None
            items: list[ast.AST] = []
            for b in found[1]:
                inner = self._container_items(b.value) if b.kind == "value" and b.value is not None \
                    and not isinstance(b.value, ast.Name) else None
                if inner is None:
                    return None
                items.extend(inner)
            return items
        return None

    def values_of(self, node: ast.Name) -> list[ast.AST] | None:
        """The values a read of ``node`` may see, when each binding reaching it is a
        plain assignment (``name = value``); None otherwise (a parameter, a loop
        variable, an unpacked or augmented binding, an unknown name)."""
        found = self._reach(node)
        if found is None or not found[1] or any(b.kind != "value" or b.value is None for b in found[1]):
            return None
        return [b.value for b in found[1]]  # type: ignore[misc]

    def _name_is_host(self, node: ast.Name) -> bool:
        found = self._reach(node)
        if found is None:
            return False
        scope, reach = found
        return bool(reach) and all(self._binding_is_host(b) for b in reach)

    def _binding_is_tensor(self, b: _Binding) -> bool:
        return self._memo(b, "tensor", False, self._evaluate_tensor)

    def _binding_is_host(self, b: _Binding) -> bool:
        return self._memo(b, "host", True, self._evaluate_host)

    def _memo(self, b: _Binding, what: str, on_cycle: bool, evaluate) -> bool:
        key = (id(b), what)
        if key in self._memos:
            return self._memos[key]
        if key in self._busy:
            return on_cycle  # a cycle adds no evidence either way
        self._busy.add(key)
        result = evaluate(b)
        self._busy.discard(key)
        self._memos[key] = result
        return result

    def _evaluate_tensor(self, b: _Binding) -> bool:
        if b.kind == "value":
            return self.is_tensor(b.value)
        if b.kind == "aug":
            return self.is_tensor(b.value) or (isinstance(b.target, ast.Name) and self._name_is_tensor(b.target))
        if b.kind == "element":
            return self.is_tensor(b.value) or self._is_forward_call(b.value)
        return False

    def _evaluate_host(self, b: _Binding) -> bool:
        if b.kind in ("value", "element"):
            return self.is_host(b.value)
        if b.kind == "aug":
            return self.is_host(b.value) and isinstance(b.target, ast.Name) and self._name_is_host(b.target)
        if b.kind == "loop":
            # A batch straight from a DataLoader lives in host memory.
            return loader_of_iterable(self.ctx, b.value)[0]  # type: ignore[arg-type]
        return False

    # ------------------------------------------------------------ expressions
    def is_tensor(self, node: ast.AST | None) -> bool:
        """Whether ``node`` plausibly evaluates to a tensor (positive evidence only)."""
        if node is None:
            return False
        if isinstance(node, ast.Name):
            return self._name_is_tensor(node)
        if isinstance(node, ast.Attribute):
            if node.attr in HOST_ATTRIBUTES or node.attr.startswith("is_"):
                return False
            return self.is_tensor(node.value) or self._is_forward_call(node.value)
        if isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Attribute) and node.value.attr in HOST_ATTRIBUTES:
                return False
            items = self._container_items(node.value)
            if items is not None and any(self.is_tensor(item) for item in items):
                return True
            return self.is_tensor(node.value) or self._is_forward_call(node.value)
        if isinstance(node, ast.Call):
            return self._call_is_tensor(node)
        if isinstance(node, ast.BinOp):
            if (
                isinstance(node.op, ast.Mod)
                and isinstance(node.left, (ast.Constant, ast.JoinedStr))
                and isinstance(getattr(node.left, "value", ""), str)
            ):
                return False  # "%f" % x formats a string
            return self.is_tensor(node.left) or self.is_tensor(node.right)
        if isinstance(node, ast.UnaryOp):
            return not isinstance(node.op, ast.Not) and self.is_tensor(node.operand)
        if isinstance(node, ast.Compare):
            if any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in node.ops):
                return False
            return any(self.is_tensor(n) for n in (node.left, *node.comparators))
        if isinstance(node, ast.IfExp):
            if _is_type_test(node.test) and (self.is_host(node.body) or self.is_host(node.orelse)):
                return False  # `g.item() if isinstance(g, torch.Tensor) else g`
            return self.is_tensor(node.body) or self.is_tensor(node.orelse)
        if isinstance(node, ast.NamedExpr):
            return self.is_tensor(node.value)
        return False

    def _call_is_tensor(self, node: ast.Call) -> bool:
        qualified = self.ctx.call_name(node)
        if qualified is not None:
            # An imported function: a torch op, a library function (math.exp,
            # np.mean), or the user's own (`from losses import focal_loss`).
            return is_torch_op(qualified) or self._is_forward_call(node)
        if self._is_forward_call(node):
            return True
        func = node.func
        if isinstance(func, ast.Attribute):
            if func.attr in HOST_METHODS:
                return False
            if func.attr in ("to", "cuda", "npu") and move_device(self.ctx, node) is not False:
                # A batch from a loader, on the host before, is on the device after.
                return not self._is_module(func.value)
            if func.attr in TENSOR_ONLY_METHODS:
                return not self.is_host(func.value) and not self._is_module(func.value)
            if func.attr in REDUCTION_METHODS:
                return self.is_tensor(func.value) or not (self.is_host(func.value) or self._is_module(func.value))
        if isinstance(func, ast.Name) and func.id in ("sum", "abs", "max", "min"):
            return any(
                self.is_tensor(a.elt if isinstance(a, (ast.GeneratorExp, ast.ListComp)) else a) for a in node.args
            )
        return False

    def _is_module(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.modules
        return isinstance(node, ast.Attribute) and node.attr in self.modules

    def _is_forward_call(self, node: ast.AST | None) -> bool:
        """A call that runs a model or a loss: its result holds tensors."""
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        qualified = self.ctx.qualified_name(func) or ""
        if qualified.split(".", 1)[0] in _LIBRARIES:
            return False  # library functions are judged by what they are, not their name
        if isinstance(func, ast.Name):
            name = func.id
            returns = _returns_of(self.ctx, name)
            if returns is not None:
                # The file's own function: what it returns, more than its name, says.
                judged = self._returned(name, returns)
                if judged is not None:
                    return judged
        elif isinstance(func, ast.Attribute):
            name = func.attr
            if name == "forward":
                return True
        else:
            return False
        return name in self.modules or _looks_like_model_or_loss(name)

    def _returned(self, name: str, returns: list[ast.expr]) -> bool | None:
        """Whether a function of this file returns a tensor: True when one of its
        returns plausibly is one, False when none is and one is certainly a host value
        (``return 1.0``), None when its returns say neither."""
        cached = ("ax3.returned", name)
        if cached in self.ctx.cache:
            return self.ctx.cache[cached]
        # The functions being judged, for the whole file: one that calls itself, or
        # two that call each other, add no evidence on the way round.
        judging: set[str] = self.ctx.cache.setdefault("ax3.judging", set())
        if name in judging:
            return None
        judging.add(name)
        try:
            inner = Tensors(self.ctx, [_function_of(self.ctx, name), self.ctx.tree])
            judged = True if any(inner.is_tensor(r) for r in returns) else \
                False if any(inner.is_host(r) for r in returns) else None
        finally:
            judging.discard(name)
        self.ctx.cache[cached] = judged
        return judged

    def is_host(self, node: ast.AST | None) -> bool:
        """Whether ``node`` certainly evaluates to a host value (a number, a string,
        a container literal, a numpy or math result, ``.item()``...)."""
        if node is None:
            return False
        if isinstance(node, _LITERALS):
            return True
        if isinstance(node, ast.Name):
            return self._name_is_host(node)
        if isinstance(node, ast.Attribute):
            return node.attr in HOST_ATTRIBUTES
        if isinstance(node, ast.Subscript):
            items = self._container_items(node.value)
            if items is not None:
                # An item of a container written here: host when its items are (a
                # batch moved with ``{k: v.to(device) for k, v in batch.items()}`` is not).
                return all(self.is_host(item) for item in items)
            return self.is_host(node.value)
        if isinstance(node, ast.Call):
            func = node.func
            q = self.ctx.call_name(node) or ""
            if q.startswith(_HOST_MODULES) or q.split(".", 1)[0] in ("numpy", "math", "time"):
                return True
            if isinstance(func, ast.Name) and func.id in _HOST_BUILTINS and self.ctx.qualified_name(func) is None:
                return True
            if isinstance(func, ast.Attribute):
                if func.attr in HOST_METHODS:
                    return True
                if func.attr in REDUCTION_METHODS or func.attr in ("copy", "astype", "reshape", "transpose"):
                    return self.is_host(func.value)
            return False
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Mod) and isinstance(node.left, (ast.Constant, ast.JoinedStr)):
                return True
            return self.is_host(node.left) and self.is_host(node.right)
        if isinstance(node, ast.UnaryOp):
            return isinstance(node.op, ast.Not) or self.is_host(node.operand)
        if isinstance(node, (ast.Compare, ast.BoolOp)):
            return not self.is_tensor(node)
        if isinstance(node, ast.IfExp):
            if self.is_host(node.body) and self.is_host(node.orelse):
                return True
            return _is_type_test(node.test) and not self.is_tensor(node)
        return False


def _is_type_test(test: ast.AST) -> bool:
    """``isinstance(x, ...)`` or ``torch.is_tensor(x)`` (the branches then differ in type)."""
    return any(
        isinstance(n, ast.Call)
        and (getattr(n.func, "id", "") == "isinstance" or getattr(n.func, "attr", "") == "is_tensor")
        for n in fast_walk(test)
    )


def _function_of(ctx: FileContext, name: str) -> ast.FunctionDef | None:
    """The module-level function ``name`` of the file, when it defines exactly one."""
    key = "ax3.functions"
    if key not in ctx.cache:
        defs: dict[str, list[ast.FunctionDef]] = {}
        for node in ctx.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(node.name, []).append(node)
        ctx.cache[key] = {n: d[0] for n, d in defs.items() if len(d) == 1}
    return ctx.cache[key].get(name)


def _returns_of(ctx: FileContext, name: str) -> list[ast.expr] | None:
    """The values the file's module-level function ``name`` returns (its own
    ``return``s, not those of functions inside it); None when the file has no such
    function, or it yields."""
    func = _function_of(ctx, name)
    if func is None:
        return None
    key = ("ax3.returns", name)
    if key not in ctx.cache:
        values: list[ast.expr] | None = []
        stack: list[ast.AST] = list(func.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(node, (ast.Yield, ast.YieldFrom)):
                values = None
                break
            if isinstance(node, ast.Return) and node.value is not None:
                values.append(node.value)
            stack.extend(ast.iter_child_nodes(node))
        ctx.cache[key] = values
    return ctx.cache[key]


def tensors_at(ctx: FileContext) -> Tensors:
    """The :class:`Tensors` guesser for the scopes around the node being visited."""
    scopes = [p for p in reversed(ctx.parents) if isinstance(p, FUNCTION_TYPES)]
    scopes.append(ctx.tree)
    key = ("ax3.tensors", tuple(id(s) for s in scopes))
    if key not in ctx.cache:
        ctx.cache[key] = Tensors(ctx, scopes)
    return ctx.cache[key]


# ------------------------------------------------------------------- devices
_DEVICE_WORDS = ("device", "dev", "gpu", "rank", "cuda", "npu")


def is_device_expr(ctx: FileContext, node: ast.AST) -> bool:
    """Whether an argument of ``.to(...)`` plausibly names a device (not a dtype or
    a tensor): a device string, ``torch.device(...)``, or a name like ``device``,
    ``args.gpu``, ``local_rank``, ``x.device``."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.split(":", 1)[0] in ("cuda", "npu", "cpu")
    if isinstance(node, ast.Call):
        return ctx.call_name(node) == "torch.device"
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return isinstance(first, ast.Constant) and str(first.value).startswith(("cuda", "npu"))
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
    else:
        return False
    if ctx.qualified_name(node) is not None:
        return False  # torch.float16 and other imported names
    low = name.lower()
    return any(w in low for w in _DEVICE_WORDS)


def is_cpu_device(ctx: FileContext, node: ast.AST) -> bool:
    """Whether a device expression is literally the CPU."""
    if isinstance(node, ast.Constant):
        return node.value == "cpu"
    if isinstance(node, ast.Call) and ctx.call_name(node) == "torch.device" and node.args:
        return is_cpu_device(ctx, node.args[0])
    return False


def move_device(ctx: FileContext, call: ast.Call) -> ast.AST | None | bool:
    """For ``x.to(...)``, ``x.cuda(...)`` or ``x.npu(...)``: the device argument
    node; ``True`` for ``.cuda()``/``.npu()`` with no device; ``False`` when the
    call is not a device move (``.to(torch.float16)``, ``.to(other)``, a CPU target)."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr in ("cuda", "npu"):
        if call.args:
            return call.args[0]
        device = next((k.value for k in call.keywords if k.arg == "device"), None)
        return device if device is not None else True
    if func.attr != "to":
        return False
    device = next((k.value for k in call.keywords if k.arg == "device"), None)
    if device is None and call.args and is_device_expr(ctx, call.args[0]):
        device = call.args[0]
    if device is None or is_cpu_device(ctx, device):
        return False
    return device


def keyword(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


def has_double_star(call: ast.Call) -> bool:
    return any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)


def is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def describe(ctx: FileContext, node: ast.AST, limit: int = 40) -> str:
    """Source text of a node, shortened for a message."""
    text = " ".join(ctx.text(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sync_cost(target: str) -> str:
    """Why a sync costs time, for messages."""
    dev = DEVICE_WORD.get(target, target)
    return (
        f"the host blocks until the {dev} has finished all work queued so far, every step, "
        f"so it cannot queue the next step's kernels while the {dev} is busy"
    )


#: Calls that only record a value (a log line, a list of losses, a progress bar): a
#: value read for them can wait; a value passed to any other call is needed there.
_RECORDING_CALLS = frozenset(
    "print append extend insert add add_scalar add_scalars log log_dict log_metrics info debug warning write "
    "format set_postfix set_description update put record".split()
)


def needed_now(ctx: FileContext, node: ast.AST, loop: ast.AST) -> str | None:
    """Where the host value read by ``node`` (in ``loop``) is needed before the next
    iteration, when it is: a call other than a recording one takes it (``env.step(action)``)
    or an ``if``/``while`` tests it. Its text, or None (a value only logged or kept)."""
    statement = next((p for p in reversed(ctx.parents) if isinstance(p, ast.stmt)), None)
    # ``float(loss.item())`` only converts the number: what takes the conversion decides.
    at = len(ctx.parents) - 1
    while at >= 0 and isinstance(ctx.parents[at], ast.Call) and node in ctx.parents[at].args \
            and _call_name_of(ctx.parents[at]) in _CONVERSIONS and isinstance(ctx.parents[at].func, ast.Name):
        node = ctx.parents[at]
        at -= 1
    parent = ctx.parents[at] if at >= 0 else None
    if isinstance(parent, ast.Call) and node in parent.args and _call_name_of(parent) not in _RECORDING_CALLS:
        return describe(ctx, parent)
    if not isinstance(statement, ast.Assign):
        return None
    names = {n.id for t in statement.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if not names:
        return None
    for later in fast_walk(loop):
        if not isinstance(later, ast.stmt) or later.lineno <= statement.end_lineno:  # type: ignore[operator]
            continue
        tests = [later.test] if isinstance(later, (ast.If, ast.While)) else []
        for test in tests:
            if any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(test)):
                return f"the test `{describe(ctx, test)}`"
        for call in (n for n in ast.iter_child_nodes(later) for n in ast.walk(n) if isinstance(n, ast.Call)):
            if _call_name_of(call) in _RECORDING_CALLS:
                continue
            if any(isinstance(a, ast.Name) and a.id in names for a in [*call.args, *(k.value for k in call.keywords)]):
                return f"`{describe(ctx, call)}`"
    return None


#: Built-ins that turn the number read into another number, and need it no sooner.
_CONVERSIONS = frozenset({"float", "int", "bool", "round", "abs"})


def _call_name_of(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
