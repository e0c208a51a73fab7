"""AX605: a model moved to its device after DistributedDataParallel wrapped it."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules._bindings import binding_targets
from torchaxe.scan.rules._distributed import (
    dotted_name,
    parent_map,
    statements,
    stored_texts,
    wraps,
)
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Module methods that move or convert every parameter.
_MOVES = frozenset({"to", "cuda", "npu", "xpu", "half", "bfloat16", "float", "double", "to_empty"})
_HEAD = "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"


class DdpBeforeDeviceMove(Rule):
    """
    ## What it does
    Flags `model.to(device)` / `model.cuda()` (or a dtype conversion such as
    `.half()`) that runs after the same function wrapped that model (or the
    wrapper's `.module`) in `DistributedDataParallel`.

    ## Why is this bad?
    DDP reads the parameters when it is built: it broadcasts them from rank 0,
    registers a gradient hook on each and lays out its communication buckets on
    their device and dtype. Moving or converting the parameters afterwards leaves
    the buckets on the old device or dtype, so the backward pass fails or copies
    every gradient across devices; torch's documentation says never to change the
    parameters after wrapping.

    ## Example
    ```python
    model = DDP(model)
    model.cuda()
    ```

    ## Use instead
    ```python
    model = DDP(model.cuda(), device_ids=[local_rank])
    ```

    ## Fix safety
    No automatic fix: moving the call before the wrapper is right when nothing in
    between depends on where the parameters are, which is not checked. Only a move
    that certainly runs after the wrapping is flagged: in the same function, later
    in the same block or in a block that follows it, on the name bound to the
    wrapper, on its `.module`, or on the module given to it.
    """

    code = "AX605"
    name = "ddp-before-device-move"
    category = "ddp_wrap_order"
    message = "the model is moved to its device after DistributedDataParallel was built around it"
    requires_text = ("DistributedDataParallel",)
    references = ("https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html",)
    examples = (
        Invalid(_HEAD + "def main():\n    model = DDP(net)\n    model.cuda()\n", lines=(5,)),
        Invalid(_HEAD + "def main():\n    ddp = DDP(net, device_ids=[0])\n    net.to('cuda:0')\n", target="cuda", lines=(5,)),
        Invalid(_HEAD + "def main():\n    if distributed:\n        model = DDP(model)\n"
                "    model = model.to(device)\n", lines=(6,)),
        Invalid(_HEAD + "model = DDP(model)\nmodel.module.half()\n", lines=(4,)),
        Invalid(_HEAD + "def main():\n    model = DDP(model).to(device)\n", lines=(4,)),
        Valid(_HEAD + "def main():\n    model = DDP(model.to(device), device_ids=[rank]).to(device)\n"),
        Valid(_HEAD + "def main():\n    model = net.cuda()\n    model = DDP(model, device_ids=[0])\n"),
        Valid(_HEAD + "def main():\n    if distributed:\n        model = DDP(model)\n    else:\n"
              "        model = model.cuda()\n"),
        Valid(_HEAD + "def main():\n    model = DDP(net)\n    x = x.cuda()\n    out = model(x).to('cpu')\n"),
        Valid(_HEAD + "def main():\n    model = DDP(net)\n    model = Other(net)\n    model.cuda()\n"),
        Valid(_HEAD + "def main():\n    model = DDP(net)\n    model.cuda()  # noqa: AX605\n"),
    )

    def check_module(self, ctx: FileContext) -> Iterable[Finding]:
        for wrap in wraps(ctx):
            if wrap.kind != "ddp" or wrap.statement is None:
                continue
            chained = next((n for n in ast.walk(wrap.statement) if isinstance(n, ast.Call)
                            and isinstance(n.func, ast.Attribute) and n.func.value is wrap.call
                            and n.func.attr in _MOVES and (n.func.attr != "to" or n.args or n.keywords)), None)
            if chained is not None and not any(k.arg == "device_ids" for k in wrap.call.keywords) \
                    and len(wrap.call.args) < 2:
                # ``DistributedDataParallel(model).to(device)``. With ``device_ids`` the
                # module was on that device already (DDP refuses a CPU module given
                # device ids): the trailing move is a no-op (HiFi-GAN's).
                yield ctx.finding(
                    self, chained,
                    f"`.{chained.func.attr}(...)` changes the parameters of the DistributedDataParallel just built "
                    "around the model: DDP has already broadcast them, hooked them and laid out its gradient buckets "
                    "on their old device and dtype; move the model first, `DistributedDataParallel(model.to(device), "
                    "...)`. Advice only",
                    replacement="DDP(model.to(device), device_ids=[local_rank])",
                    fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
                continue
            names = set()
            if wrap.target:
                names |= {wrap.target, wrap.target + ".module"}
            if wrap.call.args and (inner := dotted_name(wrap.call.args[0])):
                names.add(inner)
            for statement in _after(wrap.statement, wrap.scope):
                move = _move_of(statement, names)
                if move is None:
                    continue
                if _rebinds_between(wrap, statement, names):
                    break
                message = (
                    f"`{ctx.text(move)}` changes the parameters after DistributedDataParallel was built at line "
                    f"{wrap.call.lineno}: DDP has already broadcast them, hooked them and laid out its gradient "
                    "buckets on their old device and dtype, so the backward pass fails or copies every gradient "
                    "across devices; move (and convert) the model before wrapping it. Advice only"
                )
                yield ctx.finding(self, move, message, replacement="DDP(model.to(device), device_ids=[local_rank])",
                                  fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
                break


def _after(statement: ast.stmt, scope: ast.AST) -> list[ast.stmt]:
    """The statements of ``scope`` that certainly run after ``statement``: later
    siblings in its block and in each enclosing block (and everything inside them)."""
    parents = parent_map(scope)
    found: list[ast.stmt] = []
    current: ast.AST = statement
    while current is not scope:
        parent = parents.get(id(current))
        if parent is None or isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and parent is not scope:
            break
        for field_name in ("body", "orelse", "finalbody"):
            block = getattr(parent, field_name, None)
            if isinstance(block, list) and any(s is current for s in block):
                later = block[[id(s) for s in block].index(id(current)) + 1:]
                for s in later:
                    found.extend(st for _, st in statements(s) if not isinstance(st, ast.FunctionDef))
                    found.append(s)
        current = parent
    return sorted(found, key=lambda s: (s.lineno, s.col_offset))


def _move_of(statement: ast.stmt, names: set[str]) -> ast.Call | None:
    """The ``<name>.to(...)``/``.cuda()``/... call a statement makes directly
    (an expression statement, or the value of an assignment)."""
    value = statement.value if isinstance(statement, (ast.Expr, ast.Assign)) else None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _MOVES \
            and dotted_name(value.func.value) in names:
        if value.func.attr == "to" and not (value.args or value.keywords):
            return None
        return value
    return None


def _rebinds_between(wrap, statement: ast.stmt, names: set[str]) -> bool:
    """Whether a name the move uses is bound again between the wrapper and it."""
    for _, s in statements(wrap.scope):
        if wrap.statement.lineno < s.lineno < statement.lineno and names & stored_texts(binding_targets(s)):
            return True
    return False
