"""AX201: an optimizer built without its fused implementation."""

from __future__ import annotations

import ast
import re
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext, walk_scope
from torchaxe.scan.rules._bindings import reaching, scope_of
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: torch.optim class -> (torch_npu.optim replacement, keywords the replacement accepts).
#: Signatures from the torch_npu API reference (torch_npu.optim.NpuFused*).
NPU_FUSED = {
    "Adam": ("NpuFusedAdam", {"lr", "betas", "eps", "weight_decay", "amsgrad"}),
    "AdamW": ("NpuFusedAdamW", {"lr", "betas", "eps", "weight_decay", "amsgrad"}),
    "SGD": ("NpuFusedSGD", {"lr", "momentum", "dampening", "weight_decay", "nesterov"}),
    "Adadelta": ("NpuFusedAdadelta", {"lr", "rho", "eps", "weight_decay"}),
    "RMSprop": ("NpuFusedRMSprop", {"lr", "alpha", "eps", "weight_decay", "momentum", "centered"}),
}

NPU_CONSTRAINTS = (
    "NpuFused optimizers take fp16/fp32 parameters only, refuse zero_grad(set_to_none=True), "
    "and break if a parameter is reallocated (model.cpu(), a parameter set to a new tensor or None)"
)


class UnfusedOptimizer(Rule):
    """
    ## What it does
    Flags a `torch.optim` optimizer built without its fused implementation when the
    installed torch has one for the target (read from the real signature: `Adam`,
    `AdamW`, `SGD` and `Adagrad` take `fused=` in torch 2.13), and on Ascend NPU any
    optimizer that `torch_npu.optim` has a fused twin for.

    ## Why is this bad?
    An unfused optimizer launches several small kernels per parameter (or per group of
    parameters with `foreach`) every step; on an NPU the host spends its time issuing
    them and the device waits. A fused optimizer updates all parameters in one or a
    few kernels.

    ## Example
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ```

    ## Use instead
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)   # cpu, cuda
    opt = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-3)   # npu
    ```

    ## Fix safety
    Unsafe. The fused kernels round differently in the last bits, `fused=True` raises at
    the first step when a parameter is not a floating-point tensor on a supported device
    or has a sparse gradient (a file that builds an embedding with `sparse=` set gets
    advice only: split that embedding's parameters off first), and the NPU optimizers
    accept fp16/fp32 parameters only, refuse `zero_grad(set_to_none=True)` and must keep
    the same parameter objects. A call with `**opt_args` is flagged only when `opt_args`
    is a dict built earlier in the same function (a literal or `dict(...)`, then item
    assignments, `setdefault`, `pop`) and nothing in that function gives it `fused` or
    `foreach`; the function's own `**kwargs` may be merged into it. A dict given keys
    read at run time (`kwargs[key] = value`, options parsed from the command line) gets
    advice only: set `fused` as a default those keys can override. Keywords from
    anywhere else (a config object, a parameter) may already choose an implementation
    and are not flagged. A class called through a local name is read from the one
    assignment that reaches the call (`optimizer_class = torch.optim.SGD`). NPU
    replacements are unverified on Ascend hardware.
    """

    code = "AX201"
    name = "unfused-optimizer"
    category = "optimizer_unfused"
    message = "optimizer built without its fused implementation"
    fix_title = "use the fused optimizer"
    fix_safety = Applicability.UNSAFE
    requires_text = ("optim",)
    #: The class name appears in the file even when imported under another name.
    #: "Adam" also covers AdamW, NAdam, RAdam, Adamax and SparseAdam.
    also_requires_text = ("Adam", "SGD", "Adagrad", "Adadelta", "RMSprop", "Rprop", "LBFGS", "Adafactor", "Muon")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/optim.html#algorithms",
        "https://www.hiascend.com/document (torch_npu.optim.NpuFusedAdamW)",
    )
    examples = (
        Invalid(
            "import torch\nopt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n",
            fixed="import torch\nopt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)\n", lines=(2,),
        ),
        Invalid(
            "import torch.optim as optim\nopt = optim.SGD(\n    params,\n    lr=0.1,\n)\n",
            target="cuda",
            fixed="import torch.optim as optim\nopt = optim.SGD(\n    params,\n    lr=0.1,\n    fused=True,\n)\n", lines=(2,),
        ),
        Invalid(
            "from torch.optim import Adam as A\nopt = A(params, foreach=True)\n",
            fixed="from torch.optim import Adam as A\nopt = A(params, fused=True)\n", lines=(2,),
        ),
        Invalid(
            "import torch\nopt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n",
            target="npu",
            fixed="import torch\nimport torch_npu\nopt = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-3)\n", lines=(2,),
        ),
        Invalid("import torch\nopt = torch.optim.RMSprop(params, lr=1e-2, foreach=False)\n", target="npu", lines=(2,)),
        Valid("import torch\nopt = torch.optim.AdamW(params, fused=True)\n"),
        Invalid(
            "import torch\ndef make(params, lr):\n    args = dict(lr=lr)\n    args['weight_decay'] = 0.1\n"
            "    return torch.optim.AdamW(params, **args)\n",
            fixed="import torch\ndef make(params, lr):\n    args = dict(lr=lr)\n    args['weight_decay'] = 0.1\n"
            "    return torch.optim.AdamW(params, **args, fused=True)\n", lines=(5,),
        ),
        Valid("import torch\nopt = torch.optim.AdamW(params, **cfg)\n"),
        Invalid("import torch\ndef make(params):\n    optimizer_class = torch.optim.AdamW\n"
                "    return optimizer_class(params, lr=1e-4)\n", lines=(4,), message="fused=True",
                fixed="import torch\ndef make(params):\n    optimizer_class = torch.optim.AdamW\n"
                      "    return optimizer_class(params, lr=1e-4, fused=True)\n"),
        Valid("import torch\ndef make(params, name):\n    optimizer_class = torch.optim.AdamW\n"
              "    if name == 'sgd':\n        optimizer_class = torch.optim.SGD\n"
              "    return optimizer_class(params, lr=1e-4, fused=True)\n"),
        # kohya's sd-scripts: --optimizer_args parsed into the dict at run time.
        Invalid(
            "import torch\ndef make(params, args):\n    kw = {}\n    for arg in args.optimizer_args:\n"
            "        key, value = arg.split('=')\n        kw[key] = value\n"
            "    return torch.optim.AdamW(params, lr=1e-4, **kw)\n", lines=(7,), message="setdefault",
        ),
        Valid("import torch\ndef make(params, cuda):\n    args = dict(fused=True) if cuda else dict()\n"
              "    return torch.optim.AdamW(params, **args)\n"),
        Valid("import torch\ndef make(params):\n    args = {'lr': 1e-3}\n    args['fused'] = True\n"
              "    return torch.optim.AdamW(params, **args)\n"),
        Valid("import torch\nopt = torch.optim.AdamW(params, differentiable=True)\n"),
        Valid("import torch\nopt = torch.optim.RMSprop(params)\n", target="cuda"),
        Invalid(
            # Sparse gradients: fused kernels refuse them, so the fix is advice only.
            "import torch\nimport torch.nn as nn\n"
            "emb = nn.EmbeddingBag(1000, 64, sparse=True)\n"
            "opt = torch.optim.SGD(emb.parameters(), lr=4.0)\n",
            lines=(4,), message="refuses sparse gradients",
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n"
            "emb = nn.Embedding(1000, 64, sparse=args.sparse)\n"
            "opt = torch.optim.SGD(emb.parameters(), lr=4.0)\n",
            target="npu", lines=(4,), message="refuses sparse gradients (when it is true)",
        ),
        Valid("import torch\nopt = torch.optim.AdamW(params)  # noqa: AX201\n"),
        Valid("from mylib import AdamW\nopt = AdamW(params)\n"),
        # The embedding's share of a dense/sparse split (Transformer-XL): no fused form takes it.
        Valid("import torch\noptimizer_sparse = torch.optim.SGD(sparse_params, lr=0.1)\n"),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        name = ctx.call_name(node) or _class_held(node, ctx)
        if not name or not name.startswith("torch.optim.") or name.count(".") != 2:
            return
        cls = name.rsplit(".", 1)[1]
        keywords = {k.arg: k for k in node.keywords}
        spread: set[str] = set()
        for keyword in node.keywords:
            if keyword.arg is None:
                known = _dict_keys(keyword.value, ctx)
                if known is None:
                    return  # keywords from elsewhere may choose an implementation
                spread |= known
        if "fused" in keywords or spread & {"fused", "foreach", "differentiable"}:
            return  # fused= is the user's choice
        if RUN_TIME_KEYS in spread:
            if ctx.target != "npu":
                yield from self._run_time_keys(node, ctx, cls)
                return
            spread = (spread - {RUN_TIME_KEYS}) | {UNKNOWN_KEYS}  # the NPU optimizer's keywords: advice only
        if _is_true(keywords.get("differentiable")):
            return  # fused kernels do not support differentiable=True
        if _sparse_parameters(node, ctx):
            return  # the parameters split off for their sparse gradients: no fused form takes them
        sparse = _sparse_gradients(ctx)
        if ctx.target == "npu":
            if sparse:
                yield from self._sparse(node, ctx, cls, f"torch_npu.optim.{NPU_FUSED[cls][0]}", sparse) \
                    if cls in NPU_FUSED else ()
                return
            yield from self._npu(node, ctx, cls, {**keywords, **dict.fromkeys(spread)})
            return
        if cls not in ctx.capabilities.get("fused_optimizers", ()):
            return
        if sparse:
            yield from self._sparse(node, ctx, cls, "fused=True", sparse)
            return
        if "foreach" in keywords:
            edits = [ctx.replace(keywords["foreach"], "fused=True")]
        else:
            edits = ctx.add_keyword(node, "fused=True")
        yield ctx.finding(
            self,
            node,
            f"torch.optim.{cls} runs unfused on {ctx.target}: fused=True updates all parameters "
            f"in one kernel per step (torch {_release(ctx.capabilities.get('torch_version'))} supports it)",
            replacement=f"torch.optim.{cls}(..., fused=True)",
            fix=ctx.fix(self, edits, title="pass fused=True"),
        )

    def _run_time_keys(self, node: ast.Call, ctx: FileContext, cls: str) -> Iterable[Finding]:
        """Advice only: the keywords spread into the call are set at run time (parsed
        from the command line), and may choose fused there; passing ``fused=True`` as
        well would then fail with a repeated keyword."""
        if cls not in ctx.capabilities.get("fused_optimizers", ()) or _sparse_gradients(ctx):
            return
        spread = next(k.value for k in node.keywords if k.arg is None and _dict_keys(k.value, ctx) is not None)
        name = ctx.text(spread)
        yield ctx.finding(
            self, node,
            f"torch.optim.{cls} runs unfused on {ctx.target} unless the keys the run puts in `{name}` (set from "
            "values read at run time) choose it: fused=True updates all parameters in one kernel per step; make "
            f"it a default those keys can override, `{name}.setdefault(\"fused\", True)` before this call "
            "(fused=True beside them would fail when they hold it too)",
            replacement=f'{name}.setdefault("fused", True)',
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY,
                        title=f'{name}.setdefault("fused", True) before the call'),
        )

    def _sparse(self, node: ast.Call, ctx: FileContext, cls: str, fused: str, sparse: list[tuple[int, bool]]
                ) -> Iterable[Finding]:
        """Advice only: the file makes sparse gradients, which fused kernels refuse."""
        line, certain = sparse[0]
        built = "with sparse=True" if certain else "whose sparse= is chosen at run time"
        when = "" if certain else " (when it is true)"
        yield ctx.finding(
            self, node,
            f"torch.optim.{cls} runs unfused, but this file builds an embedding {built} (line {line}): {fused} "
            f"refuses sparse gradients{when} and would fail at the first step; give the sparse embedding its own "
            "optimizer and fuse the one for the other parameters",
            replacement=(f"torch.optim.{cls}(<the dense parameters>, ..., fused=True)" if fused == "fused=True"
                         else f"{fused}(<the dense parameters>, ...)"),
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY,
                        title="split the sparse embedding's parameters off, then fuse the rest"),
        )

    def _npu(self, node: ast.Call, ctx: FileContext, cls: str, keywords: dict) -> Iterable[Finding]:
        if cls not in NPU_FUSED:
            return
        fused, accepted = NPU_FUSED[cls]
        keywords = {k: v for k, v in keywords.items() if k is not None}
        replacement = f"torch_npu.optim.{fused}"
        message = (
            f"torch.optim.{cls} issues many small operators per step on the NPU; "
            f"{replacement} fuses the update ({NPU_CONSTRAINTS}; unverified on Ascend hardware)"
        )
        extra = sorted(set(keywords) - accepted - {UNKNOWN_KEYS})
        if UNKNOWN_KEYS in keywords:
            fix = ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY,
                          title=f"use {replacement} if the keywords passed on hold only {', '.join(sorted(accepted))}")
        elif extra:
            fix = ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY, title=f"use {replacement} (drop {', '.join(extra)})")
        else:
            fix = ctx.fix(self, [ctx.replace(node.func, replacement)], imports=("import torch_npu",), title=f"use {replacement}")
        yield ctx.finding(self, node, message, replacement=f"{replacement}(...)", fix=fix)


def _class_held(node: ast.Call, ctx: FileContext) -> str | None:
    """The class a local name holds when it is called (``optimizer_class =
    torch.optim.SGD`` then ``optimizer_class(params, ...)``, as kohya's sd-scripts picks
    one per branch): the dotted name of the one assignment that reaches the call."""
    if not isinstance(node.func, ast.Name):
        return None
    found = reaching(node.func.id, scope_of(node, ctx), node.lineno, ctx)
    if not found or len(found) != 1:
        return None
    return ctx.qualified_name(found[0].value)


#: A name for parameters (or their optimizer) kept apart for sparse gradients.
_SPARSE_NAME = re.compile(r"(^|_)sparse(_|$)", re.IGNORECASE)


def _sparse_parameters(node: ast.Call, ctx: FileContext) -> bool:
    """Whether the optimizer is given parameters split off as sparse (``optim.SGD(
    sparse_params, ...)``), or is bound to a name saying so (``optimizer_sparse =
    ...``): the embedding's share of a dense/sparse split."""
    params = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "params"), None)
    names = [params.id] if isinstance(params, ast.Name) else []
    parent = ctx.parents[-1] if ctx.parents else None
    if isinstance(parent, ast.Assign) and parent.value is node:
        names += [t.id for t in parent.targets if isinstance(t, ast.Name)]
    return any(_SPARSE_NAME.search(n) for n in names)


def _sparse_gradients(ctx: FileContext) -> list[tuple[int, bool]]:
    """Where the file builds an embedding with ``sparse=`` set (``nn.EmbeddingBag(n, d,
    sparse=True)``, ``F.embedding(..., sparse=True)``), and whether it is the literal
    True (else a value that may be): such modules make sparse gradients."""
    key = "ax201.sparse"
    if key not in ctx.cache:
        found: list[tuple[int, bool]] = []
        if "sparse" in ctx.source:
            for node in ctx.nodes(ast.Call):
                name = ctx.call_name(node) or ""
                if not name.rsplit(".", 1)[-1].lower().startswith("embedding"):
                    continue
                keyword = next((k for k in node.keywords if k.arg == "sparse"), None)
                if keyword is None or (isinstance(keyword.value, ast.Constant) and not keyword.value.value):
                    continue
                found.append((node.lineno, _is_true(keyword)))
        ctx.cache[key] = sorted(found, key=lambda f: (not f[1], f[0]))
    return ctx.cache[key]


#: Stands for the keys of a ``**kwargs`` parameter merged into an optimizer's dict.
UNKNOWN_KEYS = "**"
#: Stands for keys the function sets at run time (``kwargs[key] = value``, kohya's
#: ``--optimizer_args`` parsed into the dict): the run may choose fused there.
RUN_TIME_KEYS = "[]"


def _dict_keys(value: ast.expr, ctx: FileContext) -> set[str] | None:
    """The keys of ``**value`` when ``value`` names a dict built in the enclosing
    function: assigned once from a literal or ``dict(...)`` (whose own ``**`` may only
    be the function's ``**kwargs`` parameter, then counted as ``UNKNOWN_KEYS``), and
    afterwards only given string keys (``d["k"] = v``, ``d.setdefault("k", v)``,
    ``d.update(k=v)``) or emptied of them (``pop``). None when anything else touches
    it, or when any key in it cannot be read."""
    if not isinstance(value, ast.Name):
        return None
    function = next((p for p in reversed(ctx.parents)
                     if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if function is None:
        return None
    spread_ok = function.args.kwarg.arg if function.args.kwarg else None
    name = value.id
    keys: set[str] = set()
    built = False
    for node in walk_scope(function):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id == name:
                    if built or not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                        return None
                    found = _literal_keys(node.value, spread_ok)
                    if found is None:
                        return None
                    keys |= found
                    built = True
                elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                        and target.value.id == name:
                    key = target.slice
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        keys.add(key.value)
                    elif isinstance(key, ast.Name):
                        keys.add(RUN_TIME_KEYS)
                    else:
                        return None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name:
            method = node.func.attr
            if method in ("setdefault", "pop", "get") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                if method == "setdefault":
                    keys.add(node.args[0].value)
            elif method == "update" and not node.args and all(k.arg for k in node.keywords):
                keys.update(k.arg for k in node.keywords if k.arg)
            elif method not in ("items", "keys", "values", "copy"):  # those only read it
                return None
        elif isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
            return None
    return keys if built else None


def _literal_keys(value: ast.expr, spread_ok: str | None) -> set[str] | None:
    """The keys of a dict literal or ``dict(k=v, ...)`` call."""
    keys: set[str] = set()
    if isinstance(value, ast.Dict):
        for key, item in zip(value.keys, value.values):
            if key is None:
                if not (isinstance(item, ast.Name) and item.id == spread_ok):
                    return None
                keys.add(UNKNOWN_KEYS)
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                keys.add(key.value)
            else:
                return None
        return keys
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict" and not value.args:
        for keyword in value.keywords:
            if keyword.arg is None:
                if not (isinstance(keyword.value, ast.Name) and keyword.value.id == spread_ok):
                    return None
                keys.add(UNKNOWN_KEYS)
            else:
                keys.add(keyword.arg)
        return keys
    return None


def _is_true(keyword: ast.keyword | None) -> bool:
    return keyword is not None and isinstance(keyword.value, ast.Constant) and keyword.value.value is True


def _release(version: str | None) -> str:
    """The installed torch's release without its build label (``2.13.0``, not
    ``2.13.0+cpu``): the scan's target may be another device than the build's."""
    return (version or "2.x").split("+")[0]
