"""AX601: gradient accumulation under DDP that all-reduces every micro-batch."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterable

from torchaxe.findings import Applicability, Edit, Finding, Position
from torchaxe.scan.context import BOUNDARY_TYPES, FileContext, fast_walk, imported_module_names, walk_scope
from torchaxe.scan.rules._bindings import binding_targets
from torchaxe.scan.rules._distributed import (
    dotted_name,
    enclosing_class,
    header_nodes,
    parent_map,
    statements,
    stored_texts,
    uses_lightning,
    wraps,
)
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Words that name an accumulation count in a test (``accum``, ``grad_acc_steps``,
#: ``gradient_accumulation_steps``, fairseq's ``update_freq``).
_ACCUMULATION_WORDS = ("accum", "grad_acc", "update_freq")
#: Calls a condition may make and still be evaluated early with the same result.
_PURE_CALLS = frozenset({"len", "int", "min", "max", "abs"})

#: The property of a file that builds a DDP model (or prepares one with accelerate),
#: for the files it imports (see ``FileContext.facts``).
DISTRIBUTED = "distributed"

_HEAD = (
    "import contextlib\n"
    "import torch\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "model = DDP(net)\n"
)


@dataclass
class _Accumulation:
    """How a backward's micro-batch is told apart from the last one."""

    #: The statement that decides (the ``if`` that steps, or skips the step; the step
    #: after a micro-batch loop); None when the step is taken in another function.
    decider: ast.stmt | None
    #: True when gradients are synchronised on the micro-batches where ``test`` holds
    #: (the ``if`` that steps); False when they are where it does not (``continue``).
    sync_when_true: bool
    test: ast.expr | None
    #: For an inner micro-batch loop: the loop (``test`` is then None).
    micro_loop: ast.For | None = None


class AccumulationAllReducesEveryMicroBatch(Rule):
    """
    ## What it does
    Flags the `backward()` of a gradient-accumulation loop under
    `DistributedDataParallel` when every micro-batch's backward pass synchronises the
    gradients: the optimizer step is conditional on an accumulation counter
    (`if (i + 1) % accum == 0: optimizer.step()`, a `continue` that skips the step,
    an inner loop over micro-batches with the step after it, or a loss scaler that
    runs the backward and is told when to step, `loss_scaler(loss, optimizer,
    update_grad=(i + 1) % accum == 0)`), and nothing in the file turns the
    synchronisation off (`model.no_sync()`, `model.require_backward_grad_sync = ...`,
    accelerate's `accumulate`/`no_sync`). The loop is under DDP when its file builds
    a `DistributedDataParallel` (or prepares one with accelerate's `Accelerator`), or
    when a scanned file that does, in the same folder or above, imports it (`main.py`
    wraps the model and calls `engine.train_one_epoch`); scanned alone, such a file
    reports nothing. Lightning handles it by itself.

    ## Why is this bad?
    DDP all-reduces every gradient at the end of every backward pass. With
    accumulation over N micro-batches only the sum at the last one is needed, so
    N - 1 of every N all-reduces move the whole model's gradients over the network
    for nothing: on a slow interconnect the step takes close to N times the
    communication it needs. Inside `model.no_sync()` the backward pass only
    accumulates into `.grad` locally, and the first backward outside it reduces the
    accumulated sum.

    ## Example
    ```python
    for i, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y) / accum
        loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
    ```

    ## Use instead
    ```python
    for i, (x, y) in enumerate(loader):
        with (model.no_sync() if (i + 1) % accum != 0 else contextlib.nullcontext()):
            loss = loss_fn(model(x), y) / accum
            loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
    ```

    ## Fix safety
    Unsafe. The fix wraps the statements from the forward pass (DDP decides at the
    forward whether the next backward reduces, so the forward must be inside) to the
    backward in `with (model.no_sync() if <not the step's condition> else
    contextlib.nullcontext()):`. It is offered only when the condition can be
    evaluated before the forward with the same result: it reads names that the
    wrapped statements do not assign or pass to calls (a counter incremented by an
    integer literal in between, `step += 1`, is accounted for when every assignment
    to it is an integer literal), it calls nothing but `len`/`int`/`min`/`max`/`abs`,
    and the model is the name the same function (or class, for `self.model`) binds
    to `DDP(...)`. The numerics change at rounding level: the reduced gradient is the
    average over ranks of each rank's accumulated sum instead of the sum of
    per-micro-batch averages, and between synchronisations each rank's `.grad`
    holds its own partial sum, so code that reads gradients on those micro-batches
    sees other values. With accelerate the advice is `accelerator.accumulate(model)`
    or `accelerator.no_sync(model)`, shown only.
    """

    code = "AX601"
    name = "ddp-accumulation-without-no-sync"
    category = "ddp_accumulation_sync"
    message = "every accumulated micro-batch all-reduces its gradients; only the last one needs to"
    fix_title = "skip the gradient all-reduce on the micro-batches before the step with model.no_sync()"
    fix_safety = Applicability.UNSAFE
    # A file that builds DDP is read even without a backward (it may import the file
    # that has the loop); a file with an accumulation count, for that loop.
    # A loop that accumulates: a backward (or a loss scaler told when to step) and a
    # word of accumulation; a file that builds DDP is read for what it imports.
    requires_text = ("backward", "update_grad", "need_update")
    also_requires_text = ("accum", "update_freq", "grad_acc")
    sufficient_text = ("DistributedDataParallel", "Accelerator")
    references = (
        "https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html"
        "#torch.nn.parallel.DistributedDataParallel.no_sync",
        "https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation",
    )
    examples = (
        Invalid(
            _HEAD + "for i, (x, y) in enumerate(loader):\n"
            "    loss = loss_fn(model(x), y) / accum\n"
            "    loss.backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        opt.step()\n"
            "        opt.zero_grad()\n",
            fixed=_HEAD + "for i, (x, y) in enumerate(loader):\n"
            "    with (model.no_sync() if (i + 1) % accum != 0 else contextlib.nullcontext()):\n"
            "        loss = loss_fn(model(x), y) / accum\n"
            "        loss.backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        opt.step()\n"
            "        opt.zero_grad()\n", lines=(7,),
        ),
        Invalid(
            _HEAD + "step = 0\n"
            "for x in loader:\n"
            "    with torch.autocast('cuda'):\n"
            "        loss = model(x).mean()\n"
            "    scaler.scale(loss).backward()\n"
            "    step += 1\n"
            "    if step % args.grad_accum_steps != 0:\n"
            "        continue\n"
            "    scaler.step(optimizer)\n",
            target="cuda",
            fixed=_HEAD + "step = 0\n"
            "for x in loader:\n"
            "    with (model.no_sync() if (step + 1) % args.grad_accum_steps != 0 else contextlib.nullcontext()):\n"
            "        with torch.autocast('cuda'):\n"
            "            loss = model(x).mean()\n"
            "        scaler.scale(loss).backward()\n"
            "    step += 1\n"
            "    if step % args.grad_accum_steps != 0:\n"
            "        continue\n"
            "    scaler.step(optimizer)\n", lines=(9,), message="a step skipped (`continue`)",
        ),
        Invalid(
            _HEAD + "for batch in loader:\n"
            "    for micro in range(accum):\n"
            "        loss = model(batch[micro]).sum()\n"
            "        loss.backward()\n"
            "    opt.step()\n",
            fixed=_HEAD + "for batch in loader:\n"
            "    for micro in range(accum):\n"
            "        with (model.no_sync() if micro != accum - 1 else contextlib.nullcontext()):\n"
            "            loss = model(batch[micro]).sum()\n"
            "            loss.backward()\n"
            "    opt.step()\n", lines=(8,), message="an inner loop over micro-batches",
        ),
        Invalid(
            _HEAD + "for i, (x, y) in enumerate(loader):\n"
            "    loss = loss_fn(model(x), y) / accum\n"
            "    loss_scaler(loss, opt, parameters=model.parameters(), update_grad=(i + 1) % accum == 0)\n",
            fixed=_HEAD + "for i, (x, y) in enumerate(loader):\n"
            "    with (model.no_sync() if (i + 1) % accum != 0 else contextlib.nullcontext()):\n"
            "        loss = loss_fn(model(x), y) / accum\n"
            "        loss_scaler(loss, opt, parameters=model.parameters(), update_grad=(i + 1) % accum == 0)\n", lines=(7,), message="`loss_scaler(...)` runs the backward",
        ),
        # The loss is computed in another function: advice only.
        Invalid(
            _HEAD + "for i, batch in enumerate(loader):\n"
            "    loss = compute_loss(batch)\n"
            "    loss.backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        opt.step()\n", lines=(7,),
        ),
        # The counter changes in a way that cannot be undone in the condition.
        Invalid(
            _HEAD + "for i, batch in enumerate(loader):\n"
            "    loss = model(batch).sum()\n"
            "    loss.backward()\n"
            "    seen += batch.size(0)\n"
            "    if seen % accum == 0:\n"
            "        opt.step()\n", lines=(7,),
        ),
        Invalid(
            "from accelerate import Accelerator\naccelerator = Accelerator()\n"
            "model, opt = accelerator.prepare(model, opt)\n"
            "for step, batch in enumerate(loader):\n"
            "    loss = model(**batch).loss / args.gradient_accumulation_steps\n"
            "    accelerator.backward(loss)\n"
            "    if step % args.gradient_accumulation_steps == 0 or step == len(loader) - 1:\n"
            "        opt.step()\n", lines=(6,),
        ),
        Valid(_HEAD + "for x in loader:\n    model(x).sum().backward()\n    opt.step()\n"),
        Valid(
            _HEAD + "for i, x in enumerate(loader):\n"
            "    model.require_backward_grad_sync = (i + 1) % accum == 0\n"
            "    model(x).sum().backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        opt.step()\n"
        ),
        Valid(
            _HEAD + "for i, x in enumerate(loader):\n"
            "    ctx = model.no_sync if (i + 1) % accum else contextlib.nullcontext\n"
            "    with ctx():\n"
            "        model(x).sum().backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        opt.step()\n"
        ),
        Valid(
            "import torch\nfor i, x in enumerate(loader):\n    model(x).sum().backward()\n"
            "    if (i + 1) % accum == 0:\n        opt.step()\n"
        ),
        Valid(
            "from accelerate import Accelerator\naccelerator = Accelerator(gradient_accumulation_steps=4)\n"
            "for batch in loader:\n    with accelerator.accumulate(model):\n"
            "        accelerator.backward(model(batch).loss)\n        opt.step()\n"
        ),
        Valid(
            _HEAD + "import lightning as L\nfor i, x in enumerate(loader):\n    model(x).sum().backward()\n"
            "    if (i + 1) % accum == 0:\n        opt.step()\n"
        ),
        Valid(
            _HEAD + "for i, x in enumerate(loader):\n    model(x).sum().backward()\n"
            "    if i % log_every == 0:\n        print(i)\n    opt.step()\n"
        ),
        # EDM2: the project's own helper enters no_sync() on all but the last round.
        Valid(
            _HEAD + "for x in loader:\n    for r in range(rounds):\n"
            "        with misc.ddp_sync(model, r == rounds - 1):\n"
            "            model(x).sum().backward()\n    opt.step()\n"
        ),
        Valid(
            _HEAD + "for i, (x, y) in enumerate(loader):\n"
            "    loss = loss_fn(model(x), y) / accum\n"
            "    loss.backward()  # noqa: AX601\n"
            "    if (i + 1) % accum == 0:\n"
            "        opt.step()\n"
        ),
    )

    def check_module(self, ctx: FileContext) -> Iterable[Finding]:
        if uses_lightning(ctx):
            return
        ddp = [w for w in wraps(ctx) if w.kind == "ddp"]
        accelerate = not ddp and any(
            ctx.call_name(n) == "accelerate.Accelerator" for n in ctx.nodes(ast.Call))
        if ddp or accelerate:
            # The files this one imports may hold the training loop (``main.py``
            # builds DDP and calls ``engine.train_one_epoch``).
            ctx.facts[DISTRIBUTED] = imported_module_names(ctx)
        calls = [n for n in ctx.nodes(ast.Call) if isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
                 or _scaler_update(n) is not None]
        if not calls:
            return
        # The parents of the top-level statements that hold a backward (all the rule
        # climbs through), unless the file turns synchronisation off somewhere: then
        # the calls of a function may be anywhere.
        parents = parent_map(ctx.tree) if _file_turns_sync_off(ctx) else _parents_around(ctx.tree, calls)
        for scope, statement in _backward_statements(ctx.tree, calls, parents):
            backward = _backward_call(statement)
            if backward is None or _sync_handled(ctx, scope, parents):
                continue
            block, index = _block_of(statement, parents)
            if block is None:
                continue
            update = _scaler_update(backward)
            if update is not None:
                found = _Accumulation(statement, True, update) if _accumulation_test(update) else None
            else:
                found = _accumulation(ctx, block, index, parents)
            if found is None:
                continue
            if ddp or accelerate:
                yield self._finding(ctx, backward, statement, block, index, found, scope, accelerate, parents)
            else:
                # Under DDP only if a file that builds it imports this one: the scan decides.
                ctx.pending.append((DISTRIBUTED, self._finding(ctx, backward, statement, block, index, found,
                                                               scope, False, parents, elsewhere=True)))

    # ---------------------------------------------------------------- finding
    def _finding(self, ctx: FileContext, backward: ast.Call, statement: ast.stmt, block: list[ast.stmt], index: int,
                 found: _Accumulation, scope: ast.AST, accelerate: bool, parents: dict,
                 elsewhere: bool = False) -> Finding:
        if found.micro_loop is not None and found.decider is None:
            how = (f"a loop over micro-batches (`{ctx.snippet(found.micro_loop).splitlines()[0].strip()}`) whose "
                   "backward passes all come before an optimizer step taken elsewhere")
        elif found.micro_loop is not None:
            how = (f"an inner loop over micro-batches (`{ctx.snippet(found.micro_loop).splitlines()[0].strip()}`) "
                   "with the step after it")
        elif found.decider is statement:
            assert found.test is not None
            how = (f"`{ctx.text(backward.func)}(...)` runs the backward and steps only when "
                   f"`{ctx.text(found.test)}`")
        else:
            assert found.test is not None
            how = f"a step taken only when `{ctx.text(found.test)}`" if found.sync_when_true else \
                f"a step skipped (`continue`) while `{ctx.text(found.test)}`"
        under = "DistributedDataParallel (built in a file that imports this one)" if elsewhere else \
            "DistributedDataParallel"
        why = (
            f"gradient accumulation ({how}) under {under}: every micro-batch's backward "
            "all-reduces the whole model's gradients, but only the last one before the optimizer step needs "
            "to, so N-1 of every N all-reduces are network traffic the step waits for"
        )
        if accelerate:
            message = (
                f"{why}; with accelerate, run the forward and backward inside `accelerator.accumulate(model)` "
                "(with Accelerator(gradient_accumulation_steps=N)) or `accelerator.no_sync(model)` on the "
                "micro-batches before the last. Advice only"
            )
            return ctx.finding(self, backward, message, replacement="with accelerator.accumulate(model): ...",
                               fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
        if elsewhere:
            edit, reason = None, "the model is wrapped in DistributedDataParallel in another file"
        else:
            edit, replacement, reason = _wrap_edit(ctx, statement, block, index, found, scope, parents)
        if edit is None:
            message = (
                f"{why}; run the forward and backward of those micro-batches inside `model.no_sync()`. "
                f"Advice only: {reason}"
            )
            return ctx.finding(self, backward, message, replacement="with model.no_sync(): <forward and backward>",
                               fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
        message = (
            f"{why}; `{replacement}` around the forward and backward skips them (the forward must be inside: "
            "DDP decides there whether the backward reduces). Fix is unsafe: the averaged gradient is summed in "
            "another order (rounding-level differences), and .grad differs between ranks until the last "
            "micro-batch"
        )
        return ctx.finding(self, backward, message, replacement=replacement,
                           fix=ctx.fix(self, [edit], imports=("import contextlib",)))


# -------------------------------------------------------------------- structure
_SYNC_OFF = ("no_sync", "require_backward_grad_sync", "accumulate")


def _turns_sync_off(scope: ast.AST) -> bool:
    """Whether the code of ``scope`` (not its comments or docstrings) names what turns
    gradient synchronisation off: ``model.no_sync``, ``ddp.require_backward_grad_sync``,
    accelerate's ``accumulate``/``no_sync``, or a string does (``getattr(m, "no_sync")``)."""
    for node in fast_walk(scope):
        if isinstance(node, ast.Attribute) and node.attr in _SYNC_OFF:
            return True
        if isinstance(node, ast.Constant) and node.value in _SYNC_OFF:
            return True
        if isinstance(node, ast.withitem) and _sync_helper(node.context_expr):
            return True
    return False


def _sync_helper(expr: ast.AST) -> bool:
    """``with misc.ddp_sync(ddp, last_round):``: a context manager of the project's
    own, named for the synchronisation and given arguments (EDM2's helper enters
    ``no_sync()`` unless its flag says this micro-batch synchronises)."""
    if not isinstance(expr, ast.Call) or not expr.args:
        return False
    func = expr.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return "sync" in name.lower()


def _sync_handled(ctx: FileContext, scope: ast.AST, parents: dict) -> bool:
    """Whether the backward of ``scope`` (a function, or the module) may run with
    synchronisation turned off: the function itself turns it off, or the file does
    somewhere and the function is not called, in this file, outside a ``with`` that
    turns it off (a helper that every caller wraps; validation-only wrapping of a
    helper that training also calls does not count)."""
    key = ("ax601.sync_handled", id(scope))
    if key in ctx.cache:
        return ctx.cache[key]
    # Nothing in the file turns it off: no walk of the scope (the module, for a loop at top level).
    handled = _file_turns_sync_off(ctx) and _turns_sync_off(scope)
    if not handled and _file_turns_sync_off(ctx):
        handled = True
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            calls = _calls_by_name(ctx).get(scope.name, [])
            handled = not calls or all(_inside_sync_off(call, parents) for call in calls)
    ctx.cache[key] = handled
    return handled


def _file_turns_sync_off(ctx: FileContext) -> bool:
    """``_turns_sync_off`` of the whole file, once per file (not walked when no word of
    ``_SYNC_OFF`` is in its text)."""
    key = "ax601.file_sync_off"
    if key not in ctx.cache:
        ctx.cache[key] = any(word in ctx.source for word in (*_SYNC_OFF, "sync(")) and _turns_sync_off(ctx.tree)
    return ctx.cache[key]


def _parents_around(tree: ast.AST, calls: list[ast.Call]) -> dict[int, ast.AST]:
    """:func:`parent_map` of the top-level statements that hold one of ``calls``
    (each one's parent the module), the rest of the file left out."""
    lines = sorted({call.lineno for call in calls})
    parents: dict[int, ast.AST] = {}
    for top in getattr(tree, "body", []):
        first = min([top.lineno, *(d.lineno for d in getattr(top, "decorator_list", []))])
        last = getattr(top, "end_lineno", None) or top.lineno
        if any(first <= line <= last for line in lines):
            parents[id(top)] = tree
            parents.update(parent_map(top))
    return parents


def _calls_by_name(ctx: FileContext) -> dict[str, list[ast.Call]]:
    """The file's calls by the name called (``f(...)`` and ``x.f(...)`` under ``f``), once per file."""
    key = "ax601.calls"
    if key not in ctx.cache:
        calls: dict[str, list[ast.Call]] = {}
        for n in ctx.nodes(ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else \
                n.func.attr if isinstance(n.func, ast.Attribute) else None
            if name is not None:
                calls.setdefault(name, []).append(n)
        ctx.cache[key] = calls
    return ctx.cache[key]


def _inside_sync_off(node: ast.AST, parents: dict) -> bool:
    parent = parents.get(id(node))
    while parent is not None:
        if isinstance(parent, (ast.With, ast.AsyncWith)) and any(_turns_sync_off(i.context_expr) for i in parent.items):
            return True
        parent = parents.get(id(parent))
    return False


def _block_of(statement: ast.stmt, parents: dict) -> tuple[list[ast.stmt] | None, int]:
    parent = parents.get(id(statement))
    if parent is None:
        return None, -1
    for field_name in ("body", "orelse", "finalbody"):
        block = getattr(parent, field_name, None)
        if isinstance(block, list):
            for i, s in enumerate(block):
                if s is statement:
                    return block, i
    return None, -1


def _backward_statements(tree: ast.AST, calls: list[ast.Call], parents: dict) -> list[tuple[ast.AST, ast.stmt]]:
    """(the innermost function holding it, or the module; the statement) for each
    simple statement that holds one of ``calls``, once each, in source order: what
    ``statements`` would give for them, found from the calls up, not by walking the
    whole file."""
    found: dict[int, tuple[ast.AST, ast.stmt]] = {}
    for call in calls:
        node: ast.AST | None = call
        while node is not None and not isinstance(node, ast.stmt):
            node = parents.get(id(node))
        if not isinstance(node, (ast.Expr, ast.Assign)) or id(node) in found:
            continue
        statement, scope = node, parents.get(id(node))
        while scope is not None and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = parents.get(id(scope))
        found[id(statement)] = (scope if scope is not None else tree, statement)
    return sorted(found.values(), key=lambda pair: (pair[1].lineno, pair[1].col_offset))


def _backward_call(statement: ast.stmt) -> ast.Call | None:
    """The ``.backward(...)`` call a simple statement makes (``loss.backward()``,
    ``scaler.scale(loss).backward()``, ``accelerator.backward(loss)``), or a loss
    scaler's call that runs the backward (see :func:`_scaler_update`)."""
    if not isinstance(statement, (ast.Expr, ast.Assign)):
        return None
    for node in fast_walk(statement):
        if isinstance(node, ast.Call) and (isinstance(node.func, ast.Attribute) and node.func.attr == "backward"
                                           or _scaler_update(node) is not None):
            return node
    return None


#: The keyword by which a loss scaler's call is told whether this backward is the
#: last of the step (timm's ``NativeScaler(..., need_update=)``, the MAE/ConvNeXt
#: scalers' ``update_grad=``): the call runs the backward, and the optimizer step
#: only then.
_SCALER_UPDATE_KEYWORDS = ("update_grad", "need_update")


def _scaler_update(call: ast.Call) -> ast.expr | None:
    """The value a loss scaler's call is given for whether to step, when ``call``
    is one: a call that passes the loss and one of ``_SCALER_UPDATE_KEYWORDS``."""
    if not call.args:
        return None
    for keyword in call.keywords:
        if keyword.arg in _SCALER_UPDATE_KEYWORDS:
            return keyword.value
    return None


def _steps(ctx: FileContext, node: ast.AST) -> bool:
    """Whether ``node`` (walked without entering definitions) steps an optimizer."""
    nodes = [node] if not isinstance(node, BOUNDARY_TYPES) else []
    for n in nodes + list(walk_scope(node)):
        if isinstance(n, ast.Call) and ctx.is_training_call(n):
            func = n.func
            if isinstance(func, ast.Attribute) and func.attr in ("backward", "manual_backward"):
                continue
            return True
    return False


def _backwards(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
               for n in [node, *walk_scope(node)])


def _accumulation_test(test: ast.expr) -> bool:
    for node in fast_walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return True
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        if any(word in name.lower() for word in _ACCUMULATION_WORDS):
            return True
    return False


def _accumulation(ctx: FileContext, block: list[ast.stmt], index: int, parents: dict) -> _Accumulation | None:
    """The accumulation that decides when the backward at ``block[index]`` is the
    last of its step, or None when its step is not conditional on one."""
    for later in block[index + 1:]:
        if _backwards(later):
            return None
        if isinstance(later, ast.If) and not later.orelse and later.body and isinstance(later.body[-1], ast.Continue) \
                and not _steps(ctx, later) and _accumulation_test(later.test):
            rest = block[block.index(later) + 1:]
            return _Accumulation(later, False, later.test) if any(_steps(ctx, s) for s in rest) else None
        if _steps(ctx, later):
            if isinstance(later, ast.If) and _accumulation_test(later.test) \
                    and not any(_steps(ctx, s) for s in later.orelse):
                return _Accumulation(later, True, later.test)
            return None
    # A loop over micro-batches: the backward sits in its body (directly, or under
    # ``if``/``with``), the loop itself never steps, and the step comes after it, or
    # (for a loop over chunks or a range) in another function.
    child: ast.AST = block[index]
    loop = parents.get(id(child))
    while isinstance(loop, (ast.If, ast.With, ast.AsyncWith, ast.Try)):
        child, loop = loop, parents.get(id(loop))
    if not isinstance(loop, ast.For) or not any(s is child for s in loop.body) or _steps(ctx, loop):
        return None
    outer, position = _block_of(loop, parents)
    if outer is None:
        return None
    for later in outer[position + 1:]:
        if _backwards(later):
            return None
        if _steps(ctx, later):
            return _Accumulation(later, True, None, micro_loop=loop)
    function = loop
    while function is not None and not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
        function = parents.get(id(function))
    if function is None or _steps(ctx, function) or not _over_chunks(ctx, loop):
        return None
    return _Accumulation(None, True, None, micro_loop=loop)


def _over_chunks(ctx: FileContext, loop: ast.For) -> bool:
    """Whether a loop says it goes over micro-batches: its iterable or its variable
    names them (``range(grad_accum_every)``, ``split_microbatches(...)``,
    ``batch.split(n)``, ``for chunk in chunks``, ``for micro_step in ...``)."""
    text = f"{ctx.text(loop.target)} {ctx.text(loop.iter)}".lower()
    return any(word in text for word in ("split", "chunk", "micro", "accum"))


# -------------------------------------------------------------------------- fix
def _wrap_edit(ctx: FileContext, statement: ast.stmt, block: list[ast.stmt], index: int, found: _Accumulation,
               scope: ast.AST, parents: dict) -> tuple[Edit | None, str, str]:
    """The edit that wraps the forward and backward in ``no_sync``, the ``with``
    line, and (when there is no edit) why."""
    model, first = _forward(ctx, block, index, scope)
    if model is None:
        return None, "", "the forward pass through the DDP model is not in the same block as the backward"
    wrapped = block[first:index + 1]
    if found.micro_loop is not None:
        if found.decider is None:
            return None, "", "the optimizer step is taken in another function"
        if block is not found.micro_loop.body:
            return None, "", "the backward is nested inside the micro-batch loop's body"
        condition = _micro_loop_condition(ctx, found.micro_loop)
        if condition is None:
            return None, "", "the micro-batch loop is not `for <name> in range(<count>)` with both left unchanged"
    else:
        assert found.test is not None
        between = block[first:block.index(found.decider)]
        shifts = _early_shifts(ctx, found.test, between, scope, model)
        if shifts is None:
            return None, "", (f"`{ctx.text(found.test)}` may read something the forward, the backward or the "
                              "statements before the test change")
        condition = _negated(ctx, found.test, shifts) if found.sync_when_true else \
            _render(ctx, found.test, shifts)
        if isinstance(found.test, (ast.IfExp, ast.Lambda)) and not found.sync_when_true:
            condition = f"({condition})"
    for node in wrapped:
        for sub in fast_walk(node):
            if isinstance(sub, (ast.Constant, ast.JoinedStr)) and sub.lineno != sub.end_lineno:
                return None, "", "a string spans lines in the statements to wrap"
    manager = f"({model}.no_sync() if {condition} else contextlib.nullcontext())"
    line = f"with {manager}:"
    first_line, last_line = wrapped[0].lineno, wrapped[-1].end_lineno or wrapped[-1].lineno
    indent = ctx.lines[first_line - 1][: len(ctx.lines[first_line - 1]) - len(ctx.lines[first_line - 1].lstrip())]
    if ctx.lines[first_line - 1][:wrapped[0].col_offset].strip():
        return None, "", "the statements to wrap share a line with others"
    if last_line < len(ctx.lines) and index + 1 < len(block) and block[index + 1].lineno == last_line:
        return None, "", "the statements to wrap share a line with others"
    step = _indent_step(ctx, indent, block, parents)
    body = []
    for text in ctx.lines[first_line - 1:last_line]:
        body.append(text if not text.strip() else step + text)
    content = f"{indent}{line}\n" + "".join(body)
    # The replaced lines end where the originals did (the file's last line may lack a newline).
    end = Position(last_line + 1, 1) if last_line < len(ctx.lines) else Position(last_line, len(ctx.lines[-1]) + 1)
    return Edit(Position(first_line, 1), end, content), line, ""


def _indent_step(ctx: FileContext, indent: str, block: list[ast.stmt], parents: dict) -> str:
    if indent.startswith("\t"):
        return "\t"
    owner = parents.get(id(block[0]))
    if owner is not None and hasattr(owner, "lineno") and not isinstance(owner, ast.Module):
        outer = ctx.lines[owner.lineno - 1]
        outer_indent = outer[: len(outer) - len(outer.lstrip())]
        if indent.startswith(outer_indent) and len(indent) > len(outer_indent):
            return indent[len(outer_indent):]
    return "    "


def _forward(ctx: FileContext, block: list[ast.stmt], index: int, scope: ast.AST) -> tuple[str | None, int]:
    """The DDP model the block's forward pass calls (by the name this function or
    class binds it to) and the index of the first statement that calls it."""
    names = _ddp_names(ctx, scope)
    for i, node in enumerate(block[: index + 1]):
        for sub in [node, *walk_scope(node)]:
            if not isinstance(sub, ast.Call):
                continue
            func = sub.func
            called = dotted_name(func)
            if called in names:
                return called, i
            if isinstance(func, ast.Attribute) and func.attr == "forward" and dotted_name(func.value) in names:
                return dotted_name(func.value), i
            for argument in sub.args:
                if isinstance(argument, (ast.Name, ast.Attribute)) and dotted_name(argument) in names:
                    return dotted_name(argument), i
    return None, -1


def _ddp_names(ctx: FileContext, scope: ast.AST) -> set[str]:
    """Names bound to a DDP model that a statement in ``scope`` can call with
    certainty: a name this function binds once from DDP(...) and does not rebind
    after it, or ``self.<attr>`` bound from DDP(...) in a method of the same class."""
    names: set[str] = set()
    cls = enclosing_class(ctx.tree, scope) if not isinstance(scope, ast.Module) else None
    for wrap in wraps(ctx):
        if wrap.kind != "ddp" or wrap.target is None or wrap.statement is None:
            continue
        if wrap.target.startswith("self."):
            if cls is not None and enclosing_class(ctx.tree, wrap.scope) is cls:
                names.add(wrap.target)
            continue
        if wrap.scope is not scope:
            continue
        rebinds = [s for _, s in statements(scope) if s.lineno > wrap.statement.lineno
                   and wrap.target in stored_texts([t for t in binding_targets(s)])]
        if not rebinds:
            names.add(wrap.target)
    return names




def _early_shifts(ctx: FileContext, test: ast.expr, between: list[ast.stmt], scope: ast.AST,
                  model: str) -> dict[str, int] | None:
    """How much each counter the test reads changes in ``between`` (``{"step": 1}``
    for a ``step += 1`` there), so the test can be evaluated before it; None when that
    cannot be had with certainty. A call that may change what the test reads (one
    given it, or made on it) makes it uncertain; calling the DDP ``model`` does not."""
    for node in fast_walk(test):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _PURE_CALLS):
            return None
        if isinstance(node, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Lambda)):
            return None
    read = {d for n in fast_walk(test) if isinstance(n, (ast.Name, ast.Attribute)) and (d := dotted_name(n))}
    roots = {d.split(".", 1)[0] for d in read}
    shifts: dict[str, int] = {}
    for statement in between:
        for node in [statement, *walk_scope(statement)]:
            if isinstance(node, ast.Call):
                involved = [dotted_name(a) for a in [*node.args, *(k.value for k in node.keywords)]]
                called = dotted_name(node.func)
                if isinstance(node.func, ast.Attribute) and called != model and called != f"{model}.forward":
                    involved.append(dotted_name(node.func.value))
                if any(d and d.split(".", 1)[0] in roots for d in involved):
                    return None
        stored = stored_texts([statement])
        clash = {s for s in stored for r in read if s == r or r.startswith(s + ".") or s.startswith(r + ".")}
        if not clash:
            continue
        shift = _integer_increment(statement)
        if shift is None or clash != {shift[0]} or not _always_int(scope, shift[0]):
            return None
        shifts[shift[0]] = shifts.get(shift[0], 0) + shift[1]
    return shifts


def _render(ctx: FileContext, node: ast.expr, shifts: dict[str, int]) -> str:
    """The expression's text with each shifted counter ``n`` written ``(n + k)``."""
    text = ctx.text(node)
    names = [n for n in fast_walk(node) if isinstance(n, ast.Name) and shifts.get(n.id)]
    if not names:
        return text
    base = ctx.offset(ctx.start(node))
    pieces, at = [], 0
    for name in sorted(names, key=lambda n: ctx.offset(ctx.start(n))):
        start, end = ctx.offset(ctx.start(name)) - base, ctx.offset(ctx.end(name)) - base
        delta = shifts[name.id]
        pieces.append(text[at:start] + (f"({name.id} + {delta})" if delta > 0 else f"({name.id} - {-delta})"))
        at = end
    return "".join(pieces) + text[at:]


def _negated(ctx: FileContext, test: ast.expr, shifts: dict[str, int]) -> str:
    """The test negated: ``==`` and ``!=`` swap, anything else gets ``not (...)``."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq)):
        op = "!=" if isinstance(test.ops[0], ast.Eq) else "=="
        return f"{_render(ctx, test.left, shifts)} {op} {_render(ctx, test.comparators[0], shifts)}"
    return f"not ({_render(ctx, test, shifts)})"


def _integer_increment(statement: ast.stmt) -> tuple[str, int] | None:
    """``("step", 1)`` for ``step += 1`` (``-1`` for ``step -= 1``)."""
    if isinstance(statement, ast.AugAssign) and isinstance(statement.target, ast.Name) \
            and isinstance(statement.op, (ast.Add, ast.Sub)) and _int_literal(statement.value):
        value = statement.value.value  # type: ignore[attr-defined]
        return statement.target.id, value if isinstance(statement.op, ast.Add) else -value
    return None


def _int_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _always_int(scope: ast.AST, name: str) -> bool:
    """Whether every binding of ``name`` in the scope is an integer literal or an
    integer-literal increment (so ``name + k`` is exact), and nothing declares it
    global or nonlocal."""
    bound = False
    for _, statement in statements(scope):
        if isinstance(statement, (ast.Global, ast.Nonlocal)) and name in statement.names:
            return False
        if name not in stored_texts(binding_targets(statement)) and not (
                isinstance(statement, ast.Assign) and any(name in stored_texts([t]) for t in statement.targets)):
            if not any(isinstance(n, ast.NamedExpr) and n.target.id == name for n in header_nodes(statement)):
                continue
            return False
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                and isinstance(statement.targets[0], ast.Name) and _int_literal(statement.value):
            bound = True
            continue
        if _integer_increment(statement) is not None:
            continue
        return False
    return bound




def _micro_loop_condition(ctx: FileContext, loop: ast.For) -> str | None:
    """``micro != count - 1`` for ``for micro in range(count)`` whose name and count
    the loop body leaves alone."""
    it = loop.iter
    if not (isinstance(loop.target, ast.Name) and isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
            and it.func.id == "range" and ctx.imports.get("range") is None and len(it.args) == 1
            and not it.keywords):
        return None
    count = it.args[0]
    for node in fast_walk(count):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _PURE_CALLS):
            return None
    read = {d for n in fast_walk(count) if isinstance(n, (ast.Name, ast.Attribute)) and (d := dotted_name(n))}
    stored = stored_texts(loop.body)
    if loop.target.id in stored or any(s == r or r.startswith(s + ".") for s in stored for r in read):
        return None
    text = ctx.text(count)
    if not isinstance(count, (ast.Name, ast.Attribute, ast.Constant, ast.Call, ast.Subscript)):
        text = f"({text})"
    return f"{loop.target.id} != {text} - 1"

