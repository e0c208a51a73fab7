"""AX603: a collective every training step whose result is only logged."""

from __future__ import annotations

import ast
import re
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import BOUNDARY_TYPES, FileContext, fast_walk, walk_scope
from torchaxe.scan.rules._bindings import assigned_values
from torchaxe.scan.rules._distributed import (call_leaf, collective_name, dotted_name, function_of,
                                              helper_of_another_module, parent_map)
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: The argument each collective writes its result into.
_RESULT_ARGUMENT = {
    "all_reduce": (0, "tensor"), "reduce": (0, "tensor"), "all_gather": (0, "tensor_list"),
    "all_gather_into_tensor": (0, "output_tensor"), "all_gather_object": (0, "object_list"),
    "gather": (1, "gather_list"), "gather_object": (1, "object_gather_list"), "reduce_scatter": (0, "output"),
    "reduce_scatter_tensor": (0, "output"),
}
#: Calls that only report a value: print, loggers, progress bars, writers.
_SINKS = frozenset({
    "print", "info", "debug", "warning", "warn", "log", "log_dict", "log_metrics", "add_scalar", "add_scalars",
    "set_postfix", "set_postfix_str", "set_description", "write", "pprint",
})
#: ``update``/``append`` count as reporting on receivers named like meters and histories.
_RECORDERS = ("meter", "loss", "metric", "avg", "stat", "log", "record", "hist", "track")
#: Words in an ``if`` test that guard a collective without making it rarer.
_GUARDS = ("distributed", "world", "is_initialized", "ddp", "multi", "gpu", "dist")

_HEAD = "import torch\nimport torch.distributed as dist\n"
#: Names of helpers, from another module, that reduce a value across ranks and return it.
_HELPER_NAME = re.compile(r"^(all_)?reduce_(tensor|mean|dict|loss|losses|value|scalar|metric)s?$|^all_reduce_\w+$|^all_gather$"
                          r"|^(average|avg|mean)_(all|\w+_across_\w*ranks?)$")


class CollectiveOnlyForLogging(Rule):
    """
    ## What it does
    Flags a `torch.distributed` collective (`all_reduce`, `reduce`, `all_gather`,
    `gather`, ...) that runs on every step of a training loop and whose result is
    only printed or logged (`print`, `logger.info`, `writer.add_scalar`, a meter's
    `update`, possibly through `.item()` and a variable), and a `barrier()` on every
    step. A helper of the same file that all-reduces a tensor and returns it
    (`reduce_tensor(loss)`) counts as a collective, as does one of another module
    named for it (`utils.reduce_mean`, `backend.average_all`,
    `average_loss_across_dp_cp_ranks`) and accelerate's `accelerator.gather` and
    `accelerator.reduce`.

    ## Why is this bad?
    A collective is a synchronisation point: every rank waits for the slowest one,
    and the call sits on the step's critical path (a blocking network round trip,
    and usually a device-to-host sync for the `.item()` that follows). For a number
    that is printed every N steps, N - 1 of those waits buy nothing. A barrier per
    step only adds a wait: DDP's gradient all-reduce already keeps the ranks in step.

    ## Example
    ```python
    for step, (x, y) in enumerate(loader):
        ...
        reported = loss.detach()
        dist.all_reduce(reported)
        if step % log_every == 0:
            print(reported.item() / world)
    ```

    ## Use instead
    ```python
    for step, (x, y) in enumerate(loader):
        ...
        if step % log_every == 0:
            reported = loss.detach()
            dist.all_reduce(reported)
            print(reported.item() / world)
    ```

    ## Fix safety
    Advice only: the collective has to stay on every rank (moving it under a
    `rank == 0` test would hang the others), so the change is to move it into the
    logging branch that every rank takes, or to accumulate the value locally and
    reduce it every N steps, which changes what is printed. Collectives under an
    `if` that does not step the optimizer (a logging or evaluation branch) are not
    flagged; `if args.distributed:`-style guards do not count as such a branch.
    """

    code = "AX603"
    name = "collective-only-for-logging"
    category = "collective_for_logging"
    message = "a collective runs every step only to produce a number that is logged"
    # A collective needs torch.distributed imported (``from torch import distributed``
    # too); a reducing helper of another module is named ``reduce_*``/``all_reduce_*``.
    requires_text = ("distributed", "reduce_", "accelerator.")
    also_requires_text = ("reduce", "gather", "barrier", "average_", "avg_", "mean_")
    #: Only a file with a training step is reported on (see FileContext.is_training_call):
    #: a backward or step() call, or a helper handed an optimizer (opt, optim, optimizer,
    #: as a whole word or a part of a name between underscores).
    requires_pattern = re.compile(r"backward\s*\(|step\s*\(|opt(?<![A-Za-z0-9]opt)(?:imi[sz]er|im)?s?(?![A-Za-z0-9])")
    node_types = (ast.Call,)
    references = ("https://pytorch.org/docs/stable/distributed.html#collective-functions",)
    examples = (
        # The DDP tutorial's Trainer: the epoch's last reduced loss is returned, and printed.
        Invalid(
            _HEAD + "class Trainer:\n    def _run_epoch(self):\n        for x in self.loader:\n"
            "            loss = self.model(x).sum()\n            loss.backward()\n            self.opt.step()\n"
            "            reduced = loss.detach().clone()\n            dist.all_reduce(reduced)\n"
            "            if self.step % 10 == 0:\n                print(reduced.item())\n"
            "        return reduced.item()\n\n    def train(self, epochs):\n        for epoch in range(epochs):\n"
            "            last = self._run_epoch()\n        print(f'final loss {last:.4f}')\n", lines=(10,),
        ),
        Invalid(
            _HEAD + "for step, (x, y) in enumerate(loader):\n    loss = model(x).sum()\n    loss.backward()\n"
            "    opt.step()\n    reported = loss.detach()\n    dist.all_reduce(reported)\n"
            "    if step % 10 == 0:\n        print(f'loss {reported.item():.3f}')\n", lines=(8,),
        ),
        Invalid(
            _HEAD + "def reduce_tensor(t):\n    rt = t.clone()\n    dist.all_reduce(rt)\n    return rt / 2\n\n"
            "def train():\n    for x in loader:\n        loss = model(x).sum()\n        loss.backward()\n"
            "        optimizer.step()\n        if args.distributed:\n            reduced = reduce_tensor(loss.data)\n"
            "        value = reduced.item()\n        losses.update(value, x.size(0))\n",
            target="cuda", lines=(14,),
        ),
        Invalid(
            _HEAD + "for x in loader:\n    model(x).sum().backward()\n    opt.step()\n    dist.barrier()\n", lines=(6,), message="every rank waits for the slowest",
        ),
        # DALLE-pytorch: a backend's average_all, its result kept in a dict that is logged.
        Invalid(
            _HEAD + "for i, x in enumerate(loader):\n    loss = model(x).sum()\n    loss.backward()\n"
            "    opt.step()\n    avg_loss = backend.average_all(loss)\n    log = {}\n    if i % 10 == 0:\n"
            "        log = {**log, 'loss': avg_loss.item()}\n        rank0_print(avg_loss.item())\n"
            "    wandb.log(log)\n", lines=(7,),
        ),
        # accelerate: the gathered loss only feeds the running figure printed every N steps.
        Invalid(
            "from accelerate import Accelerator\naccelerator = Accelerator()\nrunning = 0.0\n"
            "for step, x in enumerate(loader):\n    loss = model(x).sum()\n"
            "    running += accelerator.gather(loss).mean().item()\n    accelerator.backward(loss)\n"
            "    opt.step()\n    if step % 10 == 0:\n        print(running / 10)\n        running = 0.0\n",
            lines=(6,),
        ),
        Valid(
            _HEAD + "for step, x in enumerate(loader):\n    loss = model(x).sum()\n    loss.backward()\n"
            "    opt.step()\n    if step % 10 == 0:\n        r = loss.detach()\n        dist.all_reduce(r)\n"
            "        print(r.item())\n",
        ),
        Valid(
            "from accelerate import Accelerator\naccelerator = Accelerator()\n"
            "for step, x in enumerate(loader):\n    loss = model(x).sum()\n"
            "    total = accelerator.gather(loss).mean()\n    accelerator.backward(loss)\n"
            "    opt.step()\n    if total > 5:\n        break\n",
        ),
        # A receiver bound to something other than a call (torch's own distributed_c10d).
        Valid(
            _HEAD + "group = a or b\nfor x in loader:\n    loss = model(x).sum()\n    loss.backward()\n"
            "    opt.step()\n    r = group.gather(loss)\n    print(r)\n",
        ),
        Valid(
            _HEAD + "for x in loader:\n    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n"
            "    stop = torch.tensor(float(loss))\n    dist.all_reduce(stop)\n    if stop > 10:\n        break\n",
        ),
        Valid(
            _HEAD + "for x in loader:\n    loss = model(x).sum()\n    loss.backward()\n"
            "    for p in model.parameters():\n        dist.all_reduce(p.grad)\n    opt.step()\n",
        ),
        Valid(
            _HEAD + "for x in loader:\n    loss = model(x).sum()\n    dist.all_reduce(loss)\n    loss.backward()\n"
            "    opt.step()\n",
        ),
        Valid(_HEAD + "for x in loader:\n    model(x).sum().backward()\n    opt.step()\n"
              "    if step % 100 == 0:\n        dist.barrier()\n        save(model)\n"),
        Valid(
            _HEAD + "for x in loader:\n    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n"
            "    r = loss.detach()\n    dist.all_reduce(r)  # noqa: AX603\n    print(r.item())\n",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        name = collective_name(ctx, node)
        helper = name is None and (_reduces(ctx, node) or _accelerate_collective(ctx, node))
        if name is None and not helper:
            return
        loop = ctx.training_loop()
        if loop is None or not _every_step(ctx, loop):
            return
        if name == "barrier":
            message = (
                "dist.barrier() on every training step: every rank waits for the slowest one each step, and "
                "DDP's gradient all-reduce already keeps the ranks in step; keep barriers around the rare "
                "events that need them (checkpoints, evaluation). Advice only"
            )
            yield ctx.finding(self, node, message, replacement="a barrier only where a rare event needs one",
                              fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
            return
        result = _result_name(node, name, ctx)
        if result is None:
            return
        function = function_of(ctx.parents, ctx.tree)
        parents = parent_map(function)
        after = (node.end_lineno or node.lineno, node.end_col_offset or 0)
        if not _only_reported(result, function, parents, after, 2, ctx.tree):
            return
        what = f"`{ctx.text(node.func)}`" if helper else f"dist.{name}"
        message = (
            f"{what} runs on every training step, but its result `{result}` is only printed or logged: each "
            "call makes every rank wait for the slowest one on the step's critical path (and the .item() "
            "after it syncs the host), for a number shown every N steps; do the collective in the logging "
            "branch (every rank must still take it) or reduce a locally accumulated value every N steps. "
            "Advice only"
        )
        yield ctx.finding(self, node, message, replacement="the collective inside the logging branch",
                          fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))


def _reduces(ctx: FileContext, call: ast.Call) -> bool:
    """A call of a helper that all-reduces its argument and returns the result: one
    this file defines so, or one of another module named for it
    (``utils.reduce_tensor``, ``misc.all_reduce_mean``, ``reduce_dict``)."""
    func = call.func
    # Cheapest tests first: this runs for every call of a file that mentions a collective.
    if isinstance(func, ast.Name) and _reducing_helper(ctx, func.id):
        return True
    if not call.args or not _HELPER_NAME.match(call_leaf(call)):
        return False
    return helper_of_another_module(ctx, call)


#: accelerate's ``Accelerator`` methods that gather or reduce a tensor across processes
#: and return the result.
_ACCELERATE_COLLECTIVES = frozenset({"gather", "reduce", "gather_for_metrics"})


def _accelerate_collective(ctx: FileContext, call: ast.Call) -> bool:
    """``accelerator.gather(loss)``, ``accelerator.reduce(x)``: a collective of an
    ``accelerate.Accelerator`` (a name the file binds to one, or named for one)."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in _ACCELERATE_COLLECTIVES and call.args):
        return False
    receiver = dotted_name(func.value) or ""
    if "accelerator" in receiver.lower():
        return True
    leaf = receiver.rsplit(".", 1)[-1]
    return any(isinstance(v, ast.Call) and ctx.call_name(v) == "accelerate.Accelerator"
               for v in assigned_values(ctx).get(leaf, ()))


def _reducing_helper(ctx: FileContext, name: str) -> bool:
    """Whether ``name`` is a module-level function that runs a collective on a name
    and returns it (``def reduce_tensor(t): rt = t.clone(); dist.all_reduce(rt); return rt / n``),
    other than a step function. Decided per name, when a call of it is first seen."""
    key = "ax603.module_functions"
    if key not in ctx.cache:
        found: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for f in ctx.tree.body:
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(f.name, []).append(f)
        ctx.cache[key] = found
    functions = ctx.cache[key].get(name)
    if not functions or not _calls_a_collective(ctx):
        return False
    decided = ("ax603.helper", name)
    if decided not in ctx.cache:
        ctx.cache[decided] = any(_returns_reduced(ctx, f) for f in functions)
    return ctx.cache[decided]


def _calls_a_collective(ctx: FileContext) -> bool:
    """Whether the file calls torch.distributed's collectives anywhere (a helper of it
    can reduce only then): asked once per file, before reading any helper's body."""
    key = "ax603.calls_collective"
    found = ctx.cache.get(key)
    if found is None:
        found = ctx.cache[key] = any(collective_name(ctx, call) for call in ctx.nodes(ast.Call))
    return found


def _returns_reduced(ctx: FileContext, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    reduced = set()
    for node in walk_scope(function):
        if isinstance(node, ast.Call) and (name := collective_name(ctx, node)) in _RESULT_ARGUMENT:
            if (result := _result_name(node, name, ctx)) is not None:
                reduced.add(result)
    if not reduced:
        return False
    for node in walk_scope(function):
        if isinstance(node, ast.Return) and node.value is not None:
            root = node.value
            while isinstance(root, (ast.BinOp, ast.Call, ast.Attribute)):
                root = root.left if isinstance(root, ast.BinOp) else \
                    root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in reduced:
                # Asked last, as it costs most: a step function's own collective is reported where it is.
                return not ctx.runs_training_step(function)
    return False


def _result_name(node: ast.Call, name: str | None, ctx: FileContext) -> str | None:
    """The plain name the collective's result lands in: its output argument, or for
    a helper, the name its call is assigned to."""
    if name is None:
        statement = ctx.parents[-1] if ctx.parents else None
        for parent in reversed(ctx.parents):
            if isinstance(parent, ast.stmt):
                statement = parent
                break
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                and isinstance(statement.targets[0], ast.Name):
            return statement.targets[0].id
        if isinstance(statement, ast.AugAssign) and isinstance(statement.target, ast.Name):
            return statement.target.id  # ``running_loss += accelerator.gather(loss).mean().item()``
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                and isinstance(statement.targets[0], ast.Subscript) \
                and isinstance(statement.targets[0].value, ast.Name):
            return statement.targets[0].value.id  # ``metrics['loss'] = accelerator.gather(...)``
        return None
    if name not in _RESULT_ARGUMENT:
        return None
    position, keyword = _RESULT_ARGUMENT[name]
    argument = node.args[position] if len(node.args) > position else \
        next((k.value for k in node.keywords if k.arg == keyword), None)
    return argument.id if isinstance(argument, ast.Name) else None


def _every_step(ctx: FileContext, loop: ast.AST) -> bool:
    """Whether nothing between the loop and the visited call makes it rarer: no
    ``if`` on the way that leaves the optimizer step out (a logging branch), other
    than a guard like ``if args.distributed:``."""
    path = ctx.parents
    start = next(i for i, p in enumerate(path) if p is loop)
    for parent in path[start + 1:]:
        if isinstance(parent, ast.If) and not any(ctx.is_training_call(n) for n in fast_walk(parent)):
            words = {(n.id if isinstance(n, ast.Name) else n.attr).lower()
                     for n in fast_walk(parent.test) if isinstance(n, (ast.Name, ast.Attribute))}
            if not any(g in w for w in words for g in _GUARDS):
                return False
    return True


def _returned_only_reported(function: ast.FunctionDef, root: ast.Module, depth: int) -> bool:
    """Whether every call of ``function`` in the file assigns the result to a name
    that is only reported (a step function that returns its reduced loss)."""
    calls = [n for n in fast_walk(root) if isinstance(n, ast.Call) and _calls(n.func, function.name)]
    if not calls:
        return False
    parents = parent_map(root)
    for call in calls:
        statement = parents.get(id(call))
        if not (isinstance(statement, ast.Assign) and statement.value is call and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)):
            return False
        caller: ast.AST = statement
        while caller is not None and not isinstance(caller, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            caller = parents.get(id(caller))
        if caller is None or not _only_reported(statement.targets[0].id, caller, parent_map(caller),
                                                (statement.lineno, statement.col_offset), depth, root):
            return False
    return True


def _only_reported(name: str, scope: ast.AST, parents: dict, after: tuple[int, int], depth: int,
                   root: ast.Module, outer: ast.AST | None = None) -> bool:
    """Whether every read of ``name`` in ``scope`` after ``after`` only feeds a
    report, directly or through a variable it is assigned to or added into (``depth``
    levels). ``outer``: the function, when ``scope`` is a loop over the result whose
    variable is read (a running total there lives in the function)."""
    uses = [n for n in fast_walk(scope) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
            and (n.lineno, n.col_offset) > after]
    if not uses:
        return False
    for use in uses:
        node: ast.AST = use
        reported = False
        while not isinstance(node, ast.stmt):
            parent = parents.get(id(node))
            if parent is None or isinstance(parent, BOUNDARY_TYPES):
                return False
            if isinstance(parent, ast.Call) and node is not parent.func and _is_sink(parent):
                reported = True
                break
            node = parent
        if reported:
            continue
        if isinstance(node, ast.Return) and depth > 0 and _value_of(node.value, use) \
                and isinstance(scope, ast.FunctionDef) and _returned_only_reported(scope, root, depth - 1):
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id == name:
            continue  # ``log = {**log, "loss": loss}``: kept in the same name, whose other reads decide
        if isinstance(node, ast.Assign) and depth > 0 and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id != name:
            if _only_reported(node.targets[0].id, scope, parents, (node.lineno, node.col_offset), depth - 1, root):
                continue
        # ``mse_sum += part["mse_sum"]``: a running total, shown and nothing else.
        if isinstance(node, ast.AugAssign) and depth > 0 and isinstance(node.target, ast.Name) \
                and node.target.id != name:
            if _only_reported(node.target.id, outer or scope, parents, (node.lineno, node.col_offset), depth - 1,
                              root):
                continue
        # ``for part in gathered: ...``: each rank's part, read as the loop variable.
        if isinstance(node, (ast.For, ast.AsyncFor)) and depth > 0 and node.iter is use \
                and isinstance(node.target, ast.Name) and node.target.id != name:
            if _only_reported(node.target.id, node, parents, (node.lineno, node.col_offset), depth - 1, root,
                              outer or scope):
                continue
        return False
    return True


def _calls(func: ast.AST, name: str) -> bool:
    """``name(...)``, or ``self.name(...)`` (a method of the same class)."""
    if isinstance(func, ast.Name):
        return func.id == name
    return isinstance(func, ast.Attribute) and func.attr == name and isinstance(func.value, ast.Name) \
        and func.value.id == "self"


#: Methods that turn a tensor into the same number or numbers elsewhere.
_SAME_VALUE = frozenset({"item", "tolist", "cpu", "detach", "numpy", "float"})


def _value_of(expression: ast.AST | None, use: ast.Name) -> bool:
    """``expression`` is ``use`` itself or its value read out (``use.item()``), or a
    dict that carries its items (``dict(lr=lr, **metrics)``, ``{**metrics}``)."""
    while isinstance(expression, ast.Call) and isinstance(expression.func, ast.Attribute) \
            and expression.func.attr in _SAME_VALUE and not expression.args:
        expression = expression.func.value
    if isinstance(expression, ast.Call) and isinstance(expression.func, ast.Name) and expression.func.id == "dict":
        return any(k.arg is None and k.value is use for k in expression.keywords)
    if isinstance(expression, ast.Dict):
        return any(key is None and value is use for key, value in zip(expression.keys, expression.values))
    return expression is use


def _is_sink(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in _SINKS or "print" in func.id.lower().split("_")  # ``log_print``, ``rank0_print``
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr in _SINKS or "print" in func.attr.lower().split("_"):
        return True
    if func.attr in ("update", "append"):
        receiver = (dotted_name(func.value) or "").lower()
        return any(word in receiver for word in _RECORDERS)
    return False
