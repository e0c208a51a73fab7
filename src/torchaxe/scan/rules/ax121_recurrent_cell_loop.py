"""AX121: a recurrent cell stepped in a Python loop over a sequence known before it."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import BOUNDARY_TYPES, LOOP_TYPES, FileContext, walk_scope
from torchaxe.scan.rules._bindings import (
    argument_of, bound_names, calls_of, owner_of, parameter_arguments, reaching, scope_of, self_bindings, unmoved,
)
from torchaxe.scan.rules._distributed import function_of, parent_map
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Cell class -> the layer that runs a whole sequence in one call.
CELLS = {"torch.nn.LSTMCell": "nn.LSTM", "torch.nn.GRUCell": "nn.GRU", "torch.nn.RNNCell": "nn.RNN",
         "torch.nn.modules.rnn.LSTMCell": "nn.LSTM", "torch.nn.modules.rnn.GRUCell": "nn.GRU",
         "torch.nn.modules.rnn.RNNCell": "nn.RNN"}


class RecurrentCellLoop(Rule):
    """
    ## What it does
    Flags an `nn.LSTMCell`, `nn.GRUCell` or `nn.RNNCell` called once per iteration of
    a Python loop whose input at each step comes from a tensor known before the loop
    (`x[:, t]`, `for x_t in x.unbind(1)`, an embedding of the given tokens), while the
    only thing carried from one step to the next is the cell's own state. A loop that
    feeds back an output (autoregressive decoding, attention over the previous state,
    a prediction fed as the next input) or changes the state between steps is left
    alone. The cell is followed through the class that holds it, constructor and
    function arguments, closures, factory functions of the file, a method that steps
    it once and returns its state (`h, c = self.step(t, x, h, c)` in the loop), and
    stacked cells in an `nn.ModuleList` stepped layer by layer inside the time loop
    with each layer's state kept in a list.

    ## Why is this bad?
    Each step is a separate call: two small matrix products, the gates and the state
    update as separate kernels, and as many autograd nodes, launched from Python one
    step at a time. `nn.LSTM` / `nn.GRU` / `nn.RNN` run the whole sequence in one call:
    the input projection of all steps as one matrix product, the steps in native code
    (cuDNN's fused kernels on CUDA). On a 2-core CPU, forward and backward, an
    `LSTMCell` loop took 2.4x as long as `nn.LSTM` with the same weights over 100 steps
    (batch 32, 64 -> 128) and 5.8x over 50 steps (batch 8, 32 -> 64), with the same
    outputs to 1e-7; a `GRUCell` loop 1.1x (`benchmarks/cell_loop.py`).

    ## Example
    ```python
    self.cell = nn.LSTMCell(64, 128)
    ...
    for t in range(x.size(1)):
        h, c = self.cell(x[:, t], (h, c))
        outputs.append(h)
    out = torch.stack(outputs, 1)
    ```

    ## Use instead
    ```python
    self.rnn = nn.LSTM(64, 128, batch_first=True)
    ...
    out, (h, c) = self.rnn(x, (h[None], c[None]))
    ```

    ## Fix safety
    Display-only: the layer's parameters have the cell's shapes under other names
    (`weight_ih` -> `weight_ih_l0`, ...), so checkpoints need their keys renamed, and
    the loop's other work (dropout between steps, masks) must move with it.
    """

    code = "AX121"
    name = "recurrent-cell-loop"
    category = "recurrent_cell_loop"
    message = "a recurrent cell is stepped in a Python loop over a sequence known before it"
    fix_title = "run the sequence through nn.LSTM / nn.GRU / nn.RNN in one call"
    fix_safety = Applicability.DISPLAY_ONLY
    requires_text = ("LSTMCell", "GRUCell", "RNNCell")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/generated/torch.nn.LSTM.html",
        "https://pytorch.org/docs/stable/generated/torch.nn.LSTMCell.html",
    )
    examples = (
        Invalid(
            "import torch\nimport torch.nn as nn\n"
            "class Enc(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.cell = nn.LSTMCell(8, 16)\n"
            "    def forward(self, x, h, c):\n        outs = []\n"
            "        for t in range(x.size(1)):\n            h, c = self.cell(x[:, t], (h, c))\n"
            "            outs.append(h)\n        return torch.stack(outs, 1)\n", lines=(10,)
        ),
        Invalid(
            "import torch\nfrom torch import nn\ngru = nn.GRUCell(8, 16).cuda()\nh = None\n"
            "for x_t in seq.unbind(0):\n    e = emb(x_t)\n    h = gru(e, h)\n",
            target="cuda", lines=(7,),
        ),
        # Two cells stacked in the same step.
        Invalid(
            "import torch.nn as nn\nc1 = nn.LSTMCell(8, 16)\nc2 = nn.LSTMCell(16, 16)\n"
            "for i, x_t in enumerate(x.chunk(x.size(1), dim=1)):\n"
            "    h1, s1 = c1(x_t.squeeze(1), (h1, s1))\n    h2, s2 = c2(h1, (h2, s2))\n",
            target="npu", lines=(5, 6),
        ),
        # The prediction is fed back as the next input.
        Valid(
            "import torch.nn as nn\ncell = nn.LSTMCell(1, 16)\nlinear = nn.Linear(16, 1)\n"
            "for t in range(future):\n    h, c = cell(output, (h, c))\n    output = linear(h)\n"
        ),
        # Attention over the previous state decides the input.
        Valid(
            "import torch\nimport torch.nn as nn\ncell = nn.GRUCell(24, 16)\n"
            "for t in range(T):\n    ctx = attend(enc, h)\n    h = cell(torch.cat([emb[:, t], ctx], -1), h)\n"
        ),
        # The state is reset between steps.
        Valid(
            "import torch.nn as nn\ncell = nn.GRUCell(8, 16)\n"
            "for t in range(T):\n    h = cell(x[t], h)\n    h = h * (1 - done[t])\n"
        ),
        # Called once: not a loop over time, or not a cell.
        Valid("import torch.nn as nn\ncell = nn.LSTMCell(8, 16)\nh, c = cell(x, (h, c))\n"),
        Valid("import torch.nn as nn\nlstm = nn.LSTM(8, 16)\nfor t in range(T):\n    y, s = lstm(x[t:t+1], s)\n"),
        # QMIX: the Q network keeps its GRUCell's hidden state on the module; the
        # training loop feeds it each step of the stored episode.
        Invalid(
            "import torch.nn as nn\n"
            "class QRNN(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.fc = nn.Linear(4, 8)\n        self.rnn = nn.GRUCell(8, 8)\n        self.h = None\n"
            "    def forward(self, x):\n        self.h = self.rnn(self.fc(x), self.h)\n        return self.h\n"
            "net = QRNN()\nfor t in range(T):\n    q = net(inputs[:, t].reshape(-1, 4))\n",
            lines=(13,), message="once per call, its state kept on the module",
        ),
        # ... not when the loop feeds it what it decides (an environment's observation).
        Valid(
            "import torch.nn as nn\n"
            "class QRNN(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.rnn = nn.GRUCell(8, 8)\n        self.h = None\n"
            "    def forward(self, x):\n        self.h = self.rnn(x, self.h)\n        return self.h\n"
            "net = QRNN()\nfor t in range(T):\n    q = net(obs)\n    obs = env.step(q)\n",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        scope = function_of(ctx.parents, ctx.tree)
        layer = _layer_of(node.func, scope, node.lineno, ctx)
        if layer is None and node.args:
            yield from self._module_held_state(node, scope, ctx)
            return
        if layer is None or not node.args:
            return
        statement = _statement_of(node, ctx)
        if statement is None:
            return
        loop = next((p for p in reversed(ctx.parents) if isinstance(p, (*LOOP_TYPES, *BOUNDARY_TYPES))), None)
        if isinstance(loop, ast.For) and isinstance(node.func, ast.Name) and node.func.id in bound_names(loop):
            stepped = _layers_stepped(node, statement, loop, ctx)
        elif isinstance(loop, ast.For):
            stepped = _steps_over_known_sequence(node, node.args[0], _state_argument(node), statement, loop, ctx)
        elif isinstance(loop, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stepped = _helper_stepped_in_loop(node, statement, loop, ctx)
        else:
            stepped = False
        if not stepped:
            return
        cell = ctx.text(node.func)
        message = (f"`{cell}` is an {layer}Cell stepped once per iteration over a sequence "
                   f"the loop is given: each step is its own small matrix products and gate kernels launched "
                   f"from Python; {layer} runs the whole sequence in one call (the input projection of all steps "
                   "as one matrix product, the steps in native code"
                   + (", cuDNN's fused kernels on CUDA" if ctx.target == "cuda" else "")
                   + ") with the same parameters under other names (weight_ih -> weight_ih_l0, ...). "
                   "Display-only: move the loop's other work with it and rename checkpoint keys")
        yield ctx.finding(self, node, message, fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))


    def _module_held_state(self, node: ast.Call, scope: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        """A model of the file whose ``forward`` steps a cell once, its state kept on
        the module (``self.h = self.rnn(x, self.h)``), called in a loop with the
        loop's element of a sequence the loop is given (QMIX's ``self.eval_Q_net(
        inputs[:, t])`` for every ``t``)."""
        loop = next((p for p in reversed(ctx.parents) if isinstance(p, (*LOOP_TYPES, *BOUNDARY_TYPES))), None)
        if not isinstance(loop, ast.For) or not _indexes_with(node.args[0], bound_names(loop)):
            return
        # Several classes (``Q_network_RNN(...) if args.use_rnn else Q_network_MLP(...)``):
        # the one that steps a cell is the one such a loop runs.
        stepping = [(c, h) for c in _models_of(node.func, scope, ctx) for h in [_held_state_step(c, ctx)] if h]
        if len(stepping) != 1:
            return
        cls, (layer, state) = stepping[0]
        message = (f"`{ctx.text(node.func)}` steps {cls.name}'s {layer}Cell once per call, its state kept on the "
                   f"module (`self.{state}`), and the loop calls it with each step of a sequence it is given: "
                   f"each step is its own small matrix products and gate kernels launched from Python; {layer} over "
                   "the whole sequence runs the steps in native code in one call (the layers around the cell "
                   "applied to every step at once). Display-only: the module and its callers change together")
        yield ctx.finding(self, node, message, fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))


def _indexes_with(value: ast.AST, names: set[str]) -> bool:
    """``inputs[:, t]`` (through ``.reshape(...)`` and the like): an element of a
    sequence taken at a loop variable."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        value = value.func.value
    return isinstance(value, ast.Subscript) and any(
        isinstance(n, ast.Name) and n.id in names for n in ast.walk(value.slice))


def _models_of(func: ast.AST, scope: ast.AST, ctx: FileContext) -> list[ast.ClassDef]:
    """The classes of the file that ``self.<attr>`` (the values its class gives it) or
    a name (its assignments in the file) is built from; none when one of them is
    something else."""
    if _is_self_attribute(func):
        values = [v for v, _ in _self_values(func, scope, ctx)]  # type: ignore[arg-type]
    elif isinstance(func, ast.Name):
        values = ctx.name_values(chains=True).get(func.id, [])
    else:
        return []
    classes: dict[int, ast.ClassDef] = {}
    for value in values:
        value = unmoved(value, ctx)
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
            return []
        found = [c for c in ctx.nodes(ast.ClassDef) if c.name == value.func.id]
        if len(found) != 1:
            return []
        classes[id(found[0])] = found[0]
    return list(classes.values())


def _held_state_step(cls: ast.ClassDef, ctx: FileContext) -> tuple[str, str] | None:
    """(layer, state attribute) when ``cls.forward`` steps a cell of the class once,
    ``self.<state> = self.<cell>(x, self.<state>)``, outside any loop."""
    forward = next((f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and f.name == "forward"), None)
    if forward is None:
        return None
    found = None
    for stmt in walk_scope(forward):
        if isinstance(stmt, LOOP_TYPES):
            return None
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _is_self_attribute(stmt.targets[0])
                and isinstance(stmt.value, ast.Call) and _is_self_attribute(stmt.value.func)
                and len(stmt.value.args) == 2 and _is_self_attribute(stmt.value.args[1])):
            continue
        state = stmt.targets[0].attr  # type: ignore[attr-defined]
        if stmt.value.args[1].attr != state:  # type: ignore[attr-defined]
            continue
        layers = {_constructed_layer(v, ctx) if isinstance(v, ast.Call) else None
                  for v in (unmoved(v, ctx) for v in self_bindings(cls, stmt.value.func.attr, ctx))}  # type: ignore
        layer = _single(layers)
        if layer is None or found is not None:
            return None
        found = (layer, state)
    return found


#: How many hops (an assignment, a parameter, a closure) a cell is followed through.
_DEPTH = 6
_CELL_NAMES = frozenset({"LSTMCell", "GRUCell", "RNNCell"})


def _single(layers: set[str | None]) -> str | None:
    return layers.pop() if len(layers) == 1 else None


def _layer_of(value: ast.AST, scope: ast.AST, line: int, ctx: FileContext, depth: int = 0) -> str | None:
    """The sequence layer for the cell ``value`` is, read in ``scope`` (a function
    or the module) at ``line``: a cell's construction (moved with ``.to(...)``), a
    ``self.<attr>`` the class binds to one, a name whose last assignment before
    ``line`` is one, a parameter every call of the function in the file fills with
    one, a variable of the function around a nested one; the file's assignments of
    a name found in none of these."""
    if depth > _DEPTH:
        return None
    value = unmoved(value, ctx)
    if isinstance(value, ast.Call):
        factory = _module_function(value.func, ctx)
        if factory is not None:  # ``def LSTMCell(...): m = nn.LSTMCell(...); ...; return m``
            returns = [r for r in walk_scope(factory) if isinstance(r, ast.Return) and r.value is not None]
            return _single({_layer_of(r.value, factory, r.lineno, ctx, depth + 1) for r in returns}) \
                if returns else None
        return _constructed_layer(value, ctx)
    if _is_self_attribute(value):
        return _single({_layer_of(v, at, v.lineno, ctx, depth + 1) for v, at in _self_values(value, scope, ctx)})
    if isinstance(value, ast.Name):
        return _name_layer(value.id, scope, line, ctx, depth)
    return None


def _name_layer(name: str, scope: ast.AST, line: int, ctx: FileContext, depth: int) -> str | None:
    key = ("ax121.loops", id(scope))
    by_name = ctx.cache.get(key)
    if by_name is None:  # each name's for-loops in the scope, found once
        by_name = ctx.cache[key] = {}
        for f in walk_scope(scope):
            if isinstance(f, ast.For):
                for bound in bound_names(f):
                    by_name.setdefault(bound, []).append(f)
    loops = [f for f in by_name.get(name, ()) if f.lineno <= line and (f.end_lineno or f.lineno) >= line]
    if loops:  # ``for i, rnn in enumerate(self.layers)``: a cell of the container
        loop = max(loops, key=lambda f: f.lineno)
        return _element_layer(loop, name, scope, ctx, depth + 1)
    local = reaching(name, scope, line, ctx)
    if local is None or any(b.index is not None for b in local):
        return None  # bound by a loop, ``with``, ``+=`` or an unpacked tuple: not followed
    if local:
        return _single({_layer_of(b.value, scope, b.statement.lineno, ctx, depth + 1) for b in local})
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        arguments = parameter_arguments(scope, name, ctx)
        if arguments is not None:
            return _single({_layer_of(a, s, a.lineno, ctx, depth + 1) for a, s in arguments})
        if name not in _parameters(scope):
            outer = scope_of(scope, ctx)
            if outer is not ctx.tree:  # a variable of the function the nested one is defined in
                return _name_layer(name, outer, scope.lineno, ctx, depth + 1)
    values = ctx.name_values().get(name, ())
    return _single({_layer_of(v, ctx.tree, v.lineno, ctx, depth + 1) for v in values})


def _module_function(func: ast.AST, ctx: FileContext) -> ast.FunctionDef | None:
    if not isinstance(func, ast.Name):
        return None
    found = [f for f in ctx.tree.body if isinstance(f, ast.FunctionDef) and f.name == func.id]
    return found[0] if len(found) == 1 else None


def _element_layer(loop: ast.For, name: str, scope: ast.AST, ctx: FileContext, depth: int) -> str | None:
    """The layer of ``name`` bound by ``for name in cells`` (``enumerate(cells)``:
    the second element) over a container every element of which is one cell class."""
    container, target = loop.iter, loop.target
    if isinstance(container, ast.Call) and isinstance(container.func, ast.Name) and \
            container.func.id == "enumerate" and container.args:
        container = container.args[0]
        if not (isinstance(target, ast.Tuple) and len(target.elts) == 2):
            return None
        target = target.elts[1]
    if not (isinstance(target, ast.Name) and target.id == name):
        return None
    return _container_layer(container, scope, loop.lineno, ctx, depth)


def _container_layer(value: ast.AST, scope: ast.AST, line: int, ctx: FileContext, depth: int) -> str | None:
    """The layer of every element of ``nn.ModuleList([...])``, a list (or list
    comprehension) of cells, through names and ``self`` attributes."""
    if depth > _DEPTH:
        return None
    if isinstance(value, ast.Call) and ctx.call_name(value) in ("torch.nn.ModuleList", "torch.nn.modules.container.ModuleList") \
            and value.args:
        value = value.args[0]
    if isinstance(value, (ast.ListComp, ast.GeneratorExp)):
        return _layer_of(value.elt, scope, line, ctx, depth + 1)
    if isinstance(value, (ast.List, ast.Tuple)) and value.elts:
        return _single({_layer_of(e, scope, line, ctx, depth + 1) for e in value.elts})
    if _is_self_attribute(value):
        return _single({_container_layer(v, at, v.lineno, ctx, depth + 1)
                        for v, at in _self_values(value, scope, ctx)})
    return None


def _is_self_attribute(value: ast.AST) -> bool:
    return isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self"


def _self_values(attribute: ast.Attribute, scope: ast.AST, ctx: FileContext) -> list[tuple[ast.expr, ast.AST]]:
    """What the class of the method ``scope`` assigns to ``self.<attr>``, each with the
    method it is assigned in; none outside a class (its layer is then unknown)."""
    cls = owner_of(scope, ctx)
    return [(v, scope_of(v, ctx)) for v in self_bindings(cls, attribute.attr, ctx)] if cls is not None else []


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


def _constructed_layer(call: ast.Call, ctx: FileContext) -> str | None:
    """``nn.LSTM`` for ``nn.LSTMCell(...)``: torch's cells, by import or written as
    ``nn.<Cell>`` in a snippet that does not import ``nn``, or from a package that
    wraps torch's layers in a module the file imports as ``nn`` (nni's
    ``nni.nas.nn.pytorch``)."""
    name = ctx.call_name(call)
    written_nn = isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and \
        call.func.value.id == "nn" and call.func.attr in _CELL_NAMES
    if name is None and written_nn and "nn" not in ctx.imports:
        name = f"torch.nn.{call.func.attr}"
    if name in CELLS:
        return CELLS[name]
    if written_nn and name is not None and "nn" in name.split(".")[1:-1]:
        return f"nn.{call.func.attr[:-len('Cell')]}"
    return None


def _state_argument(call: ast.Call) -> ast.AST | None:
    """The state a cell call is given (``hx``)."""
    return call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "hx"), None)


def _scope_assignments(scope: ast.AST, ctx: FileContext) -> list[ast.stmt]:
    key = ("ax121_assignments", id(scope))
    if key not in ctx.cache:
        ctx.cache[key] = [n for n in walk_scope(scope) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))]
    return ctx.cache[key]


def _statement_of(call: ast.Call, ctx: FileContext) -> ast.stmt | None:
    """The assignment statement the cell call is the value of (``h, c = cell(...)``)."""
    parent = ctx.parents[-1] if ctx.parents else None
    if isinstance(parent, ast.Assign) and parent.value is call:
        return parent
    return None


def _names(node: ast.AST | None) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node is not None else set()


def _body_statements(loop: ast.For) -> list[ast.stmt]:
    """The loop body's statements in source order, nested blocks included (not
    nested functions)."""
    out: list[ast.stmt] = []
    stack: list[ast.AST] = list(reversed(loop.body))
    while stack:
        stmt = stack.pop()
        if isinstance(stmt, BOUNDARY_TYPES):
            continue
        if isinstance(stmt, ast.stmt):
            out.append(stmt)
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(stmt, field, None)
            if isinstance(children, list):
                stack.extend(reversed(children))
    return sorted(out, key=lambda s: (s.lineno, s.col_offset))


def _steps_over_known_sequence(call: ast.Call, cell_input: ast.AST, hx: ast.AST | None, statement: ast.Assign,
                                loop: ast.For, ctx: FileContext) -> bool:
    """The cell's input (``cell_input`` of ``call``, assigned by ``statement``)
    varies with the loop and depends on nothing the loop computes from a cell's
    state; its state argument ``hx`` is what it returned last; and nothing else in
    the loop rebinds that state. ``call`` is the cell's call, or the call of a
    function that steps the cell (see :func:`_helper_stepped_in_loop`)."""
    scope = scope_of(loop, ctx)
    body = _body_statements(loop)
    state = bound_names(statement)
    if not state:
        return False
    # ``state = cell(x, (h, c)); h = state[0]; c = state[1]``: names unpacked from the
    # returned state, straight after it, are the state too.
    unpacked: set[int] = set()
    for stmt in body:
        if stmt.lineno > statement.lineno and isinstance(stmt, ast.Assign) and _unpacks(stmt.value, state):
            state |= bound_names(stmt)
            unpacked.add(id(stmt))
    if hx is not None and not (isinstance(hx, (ast.Name, ast.Tuple, ast.Constant)) and
                               _names(hx) <= state):
        return False  # the state passed in is made from something else (masked, reset)
    for stmt in body:
        if stmt is not statement and id(stmt) not in unpacked and bound_names(stmt) & state:
            return False  # the state is rebound elsewhere in the loop
    loop_names = _names(loop.target)
    by_line = [s for s in body if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign))]

    def depends_on_state(names: set[str], before: int, seen: frozenset[int]) -> tuple[bool, bool]:
        """(whether ``names`` read a cell's state or a value carried from the last
        step, whether they vary with the loop)."""
        varies = bool(names & loop_names)
        for name in names:
            writers = [s for s in by_line if name in bound_names(s)]
            if not writers:
                continue  # known before the loop (or a global)
            earlier = [s for s in writers if s.lineno < before]
            if len(earlier) != len(writers):
                return True, varies  # written later in the loop: last step's value
            for writer in earlier:
                if id(writer) in seen:
                    return True, varies
                value = writer.value
                other = _other_cell_call(value, scope, ctx)
                if other is not None:
                    # Another cell's output of this step: clean if that cell's own input is.
                    if other[0] is call:
                        return True, varies
                    tainted, moves = depends_on_state(_names(other[1]), writer.lineno, seen | {id(writer)})
                else:
                    tainted, moves = depends_on_state(_names(value), writer.lineno, seen | {id(writer)})
                if tainted:
                    return True, varies
                varies = varies or moves or isinstance(writer, ast.AugAssign)
        return False, varies

    tainted, varies = depends_on_state(_names(cell_input), statement.lineno, frozenset({id(statement)}))
    return varies and not tainted


def _unpacks(value: ast.AST, state: set[str]) -> bool:
    """``state[0]``, ``state``, ``out[1][0]``: a part of a name in ``state``."""
    while isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant):
        value = value.value
    return isinstance(value, ast.Name) and value.id in state


def _other_cell_call(value: ast.AST | None, scope: ast.AST, ctx: FileContext) -> tuple[ast.Call, ast.AST] | None:
    """``(call, its input)`` when ``value`` is a call of a cell in ``scope``."""
    if isinstance(value, ast.Call) and value.args and _layer_of(value.func, scope, value.lineno, ctx) is not None:
        return value, value.args[0]
    return None


def _helper_stepped_in_loop(call: ast.Call, statement: ast.Assign, function: ast.FunctionDef | ast.AsyncFunctionDef,
                            ctx: FileContext) -> bool:
    """A function (a method) that steps the cell once and returns its new state,
    called from loops: ``h, c = self.step(t, x, h, c)`` over ``for t in range(T)``
    with ``def step(self, t, x, h, c): ...; h, c = self.cell(f(x[:, t]), (h, c));
    return h, c``. Every call of the function in the file must step over a known
    sequence, its input read from the parameters the cell's input is made from and
    its state from those it passes as the cell's state."""
    returns = [n for n in walk_scope(function) if isinstance(n, ast.Return)]
    state = bound_names(statement)
    if len(returns) != 1 or not isinstance(returns[0].value, (ast.Name, ast.Tuple)) or \
            not _names(returns[0].value) or not _names(returns[0].value) <= state:
        return False
    params = [p for p in _parameters(function) if p not in ("self", "cls")]
    hx = _state_argument(call)
    state_params = [p for p in params if p in _names(hx)]
    if hx is None or not isinstance(hx, (ast.Name, ast.Tuple)) or set(state_params) != _names(hx):
        return False
    input_params = _parameters_read(_names(call.args[0]), statement.lineno, function, set(params), ctx)
    if input_params is None or input_params & set(state_params):
        return False
    sites = calls_of(function, ctx)
    if not sites:
        return False
    for site in sites:
        scope = scope_of(site, ctx)
        parents = parent_map(scope)
        assignment = parents.get(id(site))
        loop = assignment
        while loop is not None and not isinstance(loop, (*LOOP_TYPES, *BOUNDARY_TYPES)):
            loop = parents.get(id(loop))
        if not isinstance(assignment, ast.Assign) or assignment.value is not site or not isinstance(loop, ast.For):
            return False
        inputs = [argument_of(site, function, p, ctx) for p in sorted(input_params)]
        states = [argument_of(site, function, p, ctx) for p in state_params]
        if any(a is None for a in (*inputs, *states)):
            return False
        site_input, site_state = ast.Tuple(elts=inputs, ctx=ast.Load()), ast.Tuple(elts=states, ctx=ast.Load())
        if not _steps_over_known_sequence(site, site_input, site_state, assignment, loop, ctx):
            return False
    return True


def _parameters_read(names: set[str], before: int, function: ast.AST, params: set[str],
                     ctx: FileContext) -> set[str] | None:
    """The parameters of ``function`` that ``names`` are computed from through the
    function's assignments (all of them before line ``before``); None when a name
    is assigned after it, or is a parameter the function rebinds."""
    assignments = _scope_assignments(function, ctx)
    found: set[str] = set()
    pending, seen = list(names), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        writers = [a for a in assignments if name in bound_names(a)]
        if not writers:
            if name in params:
                found.add(name)
            continue
        if any(w.lineno >= before for w in writers) or name in params:
            return None
        for writer in writers:
            pending.extend(_names(writer.value))
    return found


def _layers_stepped(call: ast.Call, statement: ast.Assign, layers: ast.For, ctx: FileContext) -> bool:
    """Stacked cells stepped layer by layer inside a loop over time (fairseq's LASER
    decoder): ``for j in range(T): input = f(x[j]); for i, rnn in enumerate(self.layers):
    h, c = rnn(input, (hs[i], cs[i])); input = h; hs[i], cs[i] = h, c``. Each layer's
    state lives in a list indexed by the layer; the input of the first layer varies with
    time and reads nothing the time loop carries from the last step; the others read the
    layer below."""
    time = next((p for p in reversed(ctx.parents[:ctx.parents.index(layers)])
                 if isinstance(p, (*LOOP_TYPES, *BOUNDARY_TYPES))), None) if layers in ctx.parents else None
    if not isinstance(time, ast.For):
        return False
    state = bound_names(statement)
    index = bound_names(layers) - {call.func.id}  # type: ignore[attr-defined]
    hx = _state_argument(call)
    parts = hx.elts if isinstance(hx, ast.Tuple) else [hx]
    lists = set()
    for part in parts:
        if not (isinstance(part, ast.Subscript) and isinstance(part.value, ast.Name) and
                isinstance(part.slice, ast.Name) and part.slice.id in index):
            return False
        lists.add(part.value.id)
    layer_body = _body_statements(layers)
    for name in lists:  # each layer's state is written back from what the cell returned
        writes = [s for s in layer_body if isinstance(s, ast.Assign) and any(
            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name for t in s.targets)]
        if not writes or any(not (isinstance(w.value, ast.Name) and w.value.id in state) for w in writes):
            return False
    inputs = _names(call.args[0])
    for stmt in layer_body:
        if stmt is not statement and bound_names(stmt) & inputs and not (_names(getattr(stmt, "value", None)) & state):
            return False  # the next layer's input is not the layer below's output
    inside = {id(s) for s in layer_body} | {id(layers)}
    time_body = [s for s in _body_statements(time) if id(s) not in inside]
    carried = {n for s in time_body if s.lineno > layers.lineno for n in bound_names(s)} | state | lists
    if any(bound_names(s) & lists for s in time_body):
        return False  # the states are reset or changed between steps
    varies = False
    for name in inputs:
        writers = [s for s in time_body if name in bound_names(s) and s.lineno < layers.lineno]
        for writer in writers:
            read = _names(getattr(writer, "value", None))
            if read & carried:
                return False  # fed back from the last step (input feeding)
            varies = varies or bool(read & _names(time.target))
    return varies
