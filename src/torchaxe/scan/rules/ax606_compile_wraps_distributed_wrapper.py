"""AX606: torch.compile applied to a DDP/FSDP wrapper, or FSDP compiled without
use_orig_params=True."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules._distributed import dotted_name, function_of, wrapper_bound_at, wrapper_kind
from torchaxe.scan.rules.base import Invalid, Rule, Valid

_WHERE = "https://pytorch.org/docs/stable/compile/programming_model.where_to_apply_compile.html"
_FSDP_DOC = "https://pytorch.org/docs/stable/fsdp.html"
_DDP = "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
_FSDP = "import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
_NAMES = {"ddp": "DistributedDataParallel", "fsdp": "FullyShardedDataParallel"}


class CompileWrapsDistributedWrapper(Rule):
    """
    ## What it does
    Flags `torch.compile(...)` (or `.compile()`) applied to a
    `DistributedDataParallel` or `FullyShardedDataParallel` wrapper (the call
    itself, or the name the same function bound to it), and an FSDP wrapper built
    without `use_orig_params=True` in a file that compiles.

    ## Why is this bad?
    torch's guide on where to apply `torch.compile` says it does not handle the
    distributed wrapper modules well and to compile the inner module passed to the
    wrapper (`model.compile()`, then `DDP(model)`): compiling the wrapper makes
    graph capture go through the wrapper's hooks and state changes, which costs
    graph breaks and recompilations and can leave communication unoverlapped. The
    FSDP documentation says `use_orig_params=True` is required to use
    `torch.compile`.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank])
    model = torch.compile(model)
    ```

    ## Use instead
    ```python
    model.compile()
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    Advice only: reordering changes which object the rest of the script holds
    (`model.module`, checkpoints' key prefixes). FSDP2's `fully_shard`, which
    works in place on the module, is not flagged.
    """

    code = "AX606"
    name = "compile-wraps-distributed-wrapper"
    category = "compile_wrapper_order"
    message = "torch.compile is applied to the DDP/FSDP wrapper instead of the module inside it"
    requires_text = ("DistributedDataParallel", "FullyShardedDataParallel")
    also_requires_text = ("compile",)
    node_types = (ast.Call,)
    references = (_WHERE, _FSDP_DOC)
    examples = (
        Invalid(_DDP + "def main():\n    model = DDP(net, device_ids=[rank])\n    model = torch.compile(model)\n", lines=(5,)),
        Invalid(_DDP + "model = torch.compile(DDP(net))\n", target="cuda", lines=(3,)),
        Invalid(_DDP + "model = DDP(net)\nmodel.compile()\n", lines=(4,)),
        Invalid(_FSDP + "net = torch.compile(net)\nmodel = FSDP(net)\n", lines=(4,), message="without use_orig_params=True"),
        Invalid(_FSDP + "model = FSDP(net, use_orig_params=True)\nmodel = torch.compile(model)\n", lines=(4,)),
        Valid(_DDP + "def main():\n    model = torch.compile(net)\n    model = DDP(model, device_ids=[rank])\n"),
        Valid(_DDP + "net.compile()\nmodel = DDP(net)\n"),
        Valid(_FSDP + "net = torch.compile(net)\nmodel = FSDP(net, use_orig_params=True)\n"),
        Valid(_FSDP + "model = FSDP(net)\n"),
        Valid(_FSDP + "net = torch.compile(net)\nmodel = FSDP(net, **cfg)\n"),
        Valid(_DDP + "model = DDP(net)\nmodel = Other(model)\nmodel = torch.compile(model)\n"),
        Valid(_DDP + "model = DDP(net)\nmodel = torch.compile(model)  # noqa: AX606\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        kind = wrapper_kind(ctx, node)
        if kind == "fsdp":
            yield from self._fsdp_without_orig_params(node, ctx)
            return
        compiled = _compiled(ctx, node)
        if compiled is None:
            return
        kind = wrapper_kind(ctx, compiled) if isinstance(compiled, ast.Call) else None
        if kind is None and (name := dotted_name(compiled)):
            wrap = wrapper_bound_at(ctx, function_of(ctx.parents, ctx.tree), name, node.lineno)
            kind = wrap.kind if wrap is not None else None
        if kind is None:
            return
        message = (
            f"torch.compile is applied to the {_NAMES[kind]} wrapper: torch's guide says compile does not "
            "handle the distributed wrappers well and to compile the module passed to the wrapper instead "
            f"(model.compile(), then {_NAMES[kind]}(model)); compiling the wrapper traces through its hooks, "
            "with graph breaks, recompilations and less communication overlap. Advice only"
        )
        yield ctx.finding(self, node, message, replacement=f"model.compile(); model = {_NAMES[kind]}(model, ...)",
                          fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))

    def _fsdp_without_orig_params(self, node: ast.Call, ctx: FileContext) -> Iterable[Finding]:
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            return
        flag = next((k.value for k in node.keywords if k.arg == "use_orig_params"), None)
        if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
            return
        if not _compiles(ctx):
            return
        message = (
            "FullyShardedDataParallel without use_orig_params=True in a file that uses torch.compile: FSDP's "
            "documentation says use_orig_params=True is required to use torch.compile (without it compile sees "
            "FSDP's flattened parameters). Advice only"
        )
        yield ctx.finding(self, node, message, replacement="FullyShardedDataParallel(..., use_orig_params=True)",
                          fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))


def _compiled(ctx: FileContext, call: ast.Call) -> ast.AST | None:
    """What a ``torch.compile(x)`` or ``x.compile()`` call compiles."""
    if ctx.call_name(call) == "torch.compile":
        return call.args[0] if call.args else None
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "compile" and not call.args:
        return func.value
    return None


def _compiles(ctx: FileContext) -> bool:
    key = "ax606.compiles"
    if key not in ctx.cache:
        ctx.cache[key] = any(_compiled(ctx, n) is not None for n in ctx.nodes(ast.Call))
    return ctx.cache[key]
