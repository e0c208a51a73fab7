"""AX121: a recurrent cell stepped in a Python loop over a sequence known before it."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import BOUNDARY_TYPES, LOOP_TYPES, FileContext, walk_scope
from torchaxe.scan.rules._distributed import enclosing, function_of
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Cell class -> the layer that runs a whole sequence in one call.
CELLS = {"torch.nn.LSTMCell": "nn.LSTM", "torch.nn.GRUCell": "nn.GRU", "torch.nn.RNNCell": "nn.RNN",
         "torch.nn.modules.rnn.LSTMCell": "nn.LSTM", "torch.nn.modules.rnn.GRUCell": "nn.GRU",
         "torch.nn.modules.rnn.RNNCell": "nn.RNN"}
#: Methods that move a module and return it.
_MOVES = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "train"})


class RecurrentCellLoop(Rule):
    """
    ## What it does
    Flags an `nn.LSTMCell`, `nn.GRUCell` or `nn.RNNCell` called once per iteration of
    a Python loop whose input at each step comes from a tensor known before the loop
    (`x[:, t]`, `for x_t in x.unbind(1)`, an embedding of the given tokens), while the
    only thing carried from one step to the next is the cell's own state. A loop that
    feeds back an output (autoregressive decoding, attention over the previous state,
    a prediction fed as the next input) or changes the state between steps is left
    alone; so are cells kept in lists.

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

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.LSTM.html
    - https://pytorch.org/docs/stable/generated/torch.nn.LSTMCell.html
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
            "            outs.append(h)\n        return torch.stack(outs, 1)\n"
        ),
        Invalid(
            "import torch\nfrom torch import nn\ngru = nn.GRUCell(8, 16).cuda()\nh = None\n"
            "for x_t in seq.unbind(0):\n    e = emb(x_t)\n    h = gru(e, h)\n",
            target="cuda",
        ),
        # Two cells stacked in the same step.
        Invalid(
            "import torch.nn as nn\nc1 = nn.LSTMCell(8, 16)\nc2 = nn.LSTMCell(16, 16)\n"
            "for i, x_t in enumerate(x.chunk(x.size(1), dim=1)):\n"
            "    h1, s1 = c1(x_t.squeeze(1), (h1, s1))\n    h2, s2 = c2(h1, (h2, s2))\n",
            target="npu", count=2,
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
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        layer = _cell_layer(node.func, ctx, node)
        if layer is None or not node.args:
            return
        loop = next((p for p in reversed(ctx.parents) if isinstance(p, (*LOOP_TYPES, *BOUNDARY_TYPES))), None)
        if not isinstance(loop, ast.For):
            return
        statement = _statement_of(node, ctx)
        if statement is None or not _steps_over_known_sequence(node, statement, loop, ctx):
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


def _cell_layer(func: ast.AST, ctx: FileContext, at: ast.AST | None = None) -> str | None:
    """The sequence layer for a cell: ``func`` is ``self.attr`` that the class binds
    to an ``nn.*Cell`` (or to a constructor argument every construction in the file
    fills with one), or a name whose last assignment in the scope before ``at`` does
    (the file's assignments when that scope has none). ``func`` is in the loop being
    visited: its class and function are those of ``ctx.parents``."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        cls = enclosing(ctx.parents, (ast.ClassDef,))
        if not isinstance(cls, ast.ClassDef):
            return None
        layers = {_layer_of(v, ctx, cls) for v in _self_bindings(cls, func.attr)}
        return layers.pop() if len(layers) == 1 else None
    if not isinstance(func, ast.Name):
        return None
    scope = function_of(ctx.parents, ctx.tree)
    line = getattr(at if at is not None else func, "lineno", 0)
    local = [a for a in _scope_assignments(scope, ctx) if func.id in _assigned(a) and a.lineno < line]
    if local:
        last = max(local, key=lambda a: a.lineno)
        single = isinstance(last, ast.Assign) and len(last.targets) == 1 and isinstance(last.targets[0], ast.Name)
        return _layer_of(last.value, ctx, None) if single else None
    values = [a.value for a in ctx.nodes(ast.Assign)
              if len(a.targets) == 1 and isinstance(a.targets[0], ast.Name) and a.targets[0].id == func.id]
    layers = {_layer_of(v, ctx, None) for v in values}
    return layers.pop() if len(layers) == 1 else None


def _layer_of(value: ast.AST, ctx: FileContext, cls: ast.ClassDef | None) -> str | None:
    """The sequence layer for a cell ``value`` builds: ``nn.LSTMCell(...)`` (moved with
    ``.to(...)``), or an ``__init__`` parameter every construction of ``cls`` in the
    file fills with one cell class."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _MOVES \
            and ctx.qualified_name(value.func) is None:
        value = value.func.value
    if isinstance(value, ast.Call):
        name = ctx.call_name(value)
        if name is None and "nn" not in ctx.imports and isinstance(value.func, ast.Attribute) and \
                isinstance(value.func.value, ast.Name) and value.func.value.id == "nn":
            name = f"torch.nn.{value.func.attr}"  # a snippet that uses `nn` without importing it
        return CELLS.get(name or "")
    if isinstance(value, ast.Name) and cls is not None:
        init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        params = [a.arg for a in init.args.args][1:] if init is not None else []
        if value.id not in params:
            return None
        position = params.index(value.id)
        calls = [c for c in ctx.nodes(ast.Call) if isinstance(c.func, ast.Name) and c.func.id == cls.name]
        layers = set()
        for call in calls:
            arg = next((k.value for k in call.keywords if k.arg == value.id), None)
            if arg is None and position < len(call.args) and \
                    not any(isinstance(a, ast.Starred) for a in call.args[:position + 1]):
                arg = call.args[position]
            layers.add(_layer_of(arg, ctx, None) if arg is not None else None)
        return layers.pop() if len(layers) == 1 else None
    return None


def _self_bindings(cls: ast.ClassDef, attr: str) -> list[ast.expr]:
    """The values the class's methods assign to ``self.<attr>``."""
    out = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == attr and \
                        isinstance(target.value, ast.Name) and target.value.id == "self":
                    out.append(node.value)
    return out


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


def _assigned(stmt: ast.AST) -> set[str]:
    """Names a statement binds."""
    targets: list[ast.AST] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
        targets = [stmt.target]
    elif isinstance(stmt, (ast.For, ast.AsyncFor)):
        targets = [stmt.target]
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        targets = [i.optional_vars for i in stmt.items if i.optional_vars is not None]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


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


def _steps_over_known_sequence(call: ast.Call, statement: ast.Assign, loop: ast.For, ctx: FileContext) -> bool:
    """The cell's input varies with the loop and depends on nothing the loop computes
    from a cell's state; its state argument is what it returned last; and nothing
    else in the loop rebinds that state."""
    body = _body_statements(loop)
    state = _assigned(statement)
    if not state:
        return False
    # ``state = cell(x, (h, c)); h = state[0]; c = state[1]``: names unpacked from the
    # returned state, straight after it, are the state too.
    unpacked: set[int] = set()
    for stmt in body:
        if stmt.lineno > statement.lineno and isinstance(stmt, ast.Assign) and _unpacks(stmt.value, state):
            state |= _assigned(stmt)
            unpacked.add(id(stmt))
    hx = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "hx"), None)
    if hx is not None and not (isinstance(hx, (ast.Name, ast.Tuple, ast.Constant)) and
                               _names(hx) <= state):
        return False  # the state passed in is made from something else (masked, reset)
    for stmt in body:
        if stmt is not statement and id(stmt) not in unpacked and _assigned(stmt) & state:
            return False  # the state is rebound elsewhere in the loop
    loop_names = _names(loop.target)
    by_line = [s for s in body if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign))]

    def depends_on_state(names: set[str], before: int, seen: frozenset[int]) -> tuple[bool, bool]:
        """(whether ``names`` read a cell's state or a value carried from the last
        step, whether they vary with the loop)."""
        varies = bool(names & loop_names)
        for name in names:
            writers = [s for s in by_line if name in _assigned(s)]
            if not writers:
                continue  # known before the loop (or a global)
            earlier = [s for s in writers if s.lineno < before]
            if len(earlier) != len(writers):
                return True, varies  # written later in the loop: last step's value
            for writer in earlier:
                if id(writer) in seen:
                    return True, varies
                value = writer.value
                other = _other_cell_call(value, ctx)
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

    tainted, varies = depends_on_state(_names(call.args[0]), statement.lineno, frozenset({id(statement)}))
    return varies and not tainted


def _unpacks(value: ast.AST, state: set[str]) -> bool:
    """``state[0]``, ``state``, ``out[1][0]``: a part of a name in ``state``."""
    while isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant):
        value = value.value
    return isinstance(value, ast.Name) and value.id in state


def _other_cell_call(value: ast.AST | None, ctx: FileContext) -> tuple[ast.Call, ast.AST] | None:
    """``(call, its input)`` when ``value`` is a call of a cell."""
    if isinstance(value, ast.Call) and value.args and _cell_layer(value.func, ctx, value) is not None:
        return value, value.args[0]
    return None
