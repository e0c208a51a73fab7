"""AX702: a loss scaler where autocast computes in bfloat16."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Finding
from torchaxe.scan.context import FileContext
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: The gradient scalers of torch and torch_npu.
SCALERS = frozenset({
    "torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.GradScaler",
    "torch.cpu.amp.GradScaler", "torch.npu.amp.GradScaler", "torch_npu.npu.amp.GradScaler",
})
#: Where ``enabled`` sits among a scaler's positional arguments (after the device for
#: ``torch.amp.GradScaler``).
_ENABLED_AT = {"torch.amp.GradScaler": 5, "torch.amp.grad_scaler.GradScaler": 5}
#: Autocast entry points, with the dtype they use when given none (None: it depends on
#: the device argument).
AUTOCASTS = {
    "torch.autocast": None, "torch.amp.autocast": None, "torch.amp.autocast_mode.autocast": None,
    "torch.cuda.amp.autocast": "float16", "torch.cpu.amp.autocast": "bfloat16",
    "torch.npu.amp.autocast": "float16", "torch_npu.npu.amp.autocast": "float16",
}
#: ``torch.autocast(device_type)``'s default dtype by device (torch's documentation).
_DEVICE_DEFAULT = {"cpu": "bfloat16", "cuda": "float16", "npu": "float16", "xpu": "bfloat16"}
_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.half": "float16"}


class GradScalerWithBfloat16(Rule):
    """
    ## What it does
    Flags a `GradScaler` that is always on in a file whose every autocast region
    computes in bfloat16: `dtype=torch.bfloat16` (directly or through a name assigned
    once), or a CPU autocast without a dtype (bfloat16 is its default). A scaler built
    with `enabled=` anything, or a file with a float16 autocast or one whose dtype is
    not known from the file (`dtype=ptdtype` read from a config), is left alone. Also
    flags a scaler built or enabled only when a setting that says bfloat16 holds
    (`GradScaler() if use_bfloat16 else None`, `GradScaler(enabled=args.bf16)`, under
    `if cfg.dtype == torch.bfloat16:`), the autocast often being in another file,
    unless an autocast of the file computes in float16 (the setting misnamed). Also
    flags `scaler.scale(loss).backward()` run only under `if FLAG:` where the file's
    autocast is `dtype=torch.bfloat16, enabled=FLAG` (the scaler built in another
    file): shown, not rewritten.

    ## Why is this bad?
    Loss scaling keeps float16's small gradients from underflowing to zero. bfloat16
    has float32's exponent range, so its gradients do not underflow and the scaling
    buys nothing, while the scaler still costs every step: it multiplies the loss,
    checks every gradient for inf/NaN and divides them back (extra kernels over all
    gradients), and its `step()` reads the check's result back to the host before the
    optimizer may run, a device synchronisation every step that stalls the launch
    queue. PyTorch's AMP recipe uses a scaler with float16 only.

    ## Example
    ```python
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).loss
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    ```

    ## Use instead
    ```python
    scaler = torch.amp.GradScaler("cuda", enabled=False)  # scale/step/update pass through
    ```
    or drop the scaler and call `loss.backward()` and `opt.step()`.

    ## Fix safety
    Unsafe: with the scaler off, a step whose gradients hold inf or NaN is no longer
    skipped (the check that skipped it is what costs the sync), and the gradients
    differ from the scaled ones by rounding. NPU: unverified on Ascend hardware.
    """

    code = "AX702"
    name = "grad-scaler-with-bfloat16"
    category = "unneeded_loss_scaling"
    message = "a gradient scaler where autocast computes in bfloat16, which needs no loss scaling"
    fix_title = "turn the scaler off (enabled=False): its calls pass through"
    fix_safety = Applicability.UNSAFE
    requires_text = ("GradScaler", ".scale(")
    also_requires_text = ("autocast", "bfloat16", "bf16", "BF16")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/docs/stable/amp.html#gradient-scaling",
        "https://pytorch.org/docs/stable/notes/amp_examples.html",
    )
    examples = (
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler('cuda')\n"
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)\n",
            target="cuda",
            fixed="import torch\nscaler = torch.amp.GradScaler('cuda', enabled=False)\n"
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)\n", lines=(2,),
        ),
        # CPU autocast computes in bfloat16 unless told otherwise.
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler('cpu')\nwith torch.autocast(device_type='cpu'):\n"
            "    loss = model(x)\n",
            fixed="import torch\nscaler = torch.amp.GradScaler('cpu', enabled=False)\n"
            "with torch.autocast(device_type='cpu'):\n    loss = model(x)\n", lines=(2,),
        ),
        # The old spellings, and the dtype through a name assigned once.
        Invalid(
            "import torch\nfrom torch.cuda.amp import GradScaler, autocast\nAMP_DTYPE = torch.bfloat16\n"
            "scaler = GradScaler()\nwith autocast(dtype=AMP_DTYPE):\n    loss = model(x)\n",
            target="cuda",
            fixed="import torch\nfrom torch.cuda.amp import GradScaler, autocast\nAMP_DTYPE = torch.bfloat16\n"
            "scaler = GradScaler(enabled=False)\nwith autocast(dtype=AMP_DTYPE):\n    loss = model(x)\n", lines=(4,),
        ),
        Invalid(
            "import torch\nscaler = torch.cuda.amp.GradScaler(enabled=True)\n"
            "with torch.cuda.amp.autocast(dtype=torch.bfloat16):\n    loss = model(x)\n",
            target="npu",
            fixed="import torch\nscaler = torch.cuda.amp.GradScaler(enabled=False)\n"
            "with torch.cuda.amp.autocast(dtype=torch.bfloat16):\n    loss = model(x)\n", lines=(2,),
        ),
        # The scaler built elsewhere, used only under the flag that makes autocast bfloat16.
        Invalid(
            "import torch\nwith torch.cuda.amp.autocast(dtype=torch.bfloat16, enabled=use_bfloat16):\n"
            "    loss = model(x)\nif use_bfloat16:\n    scaler.scale(loss).backward()\n    scaler.step(opt)\n"
            "else:\n    loss.backward()\n",
            target="cuda", lines=(5,), message="only when `use_bfloat16` is set",
        ),
        # Built only when a bfloat16 setting holds; the autocast is in another file.
        Invalid(
            "import torch\ndef init_opt(model, use_bfloat16=False):\n"
            "    opt = torch.optim.AdamW(model.parameters())\n"
            "    scaler = torch.cuda.amp.GradScaler() if use_bfloat16 else None\n    return opt, scaler\n",
            target="cuda",
            fixed="import torch\ndef init_opt(model, use_bfloat16=False):\n"
            "    opt = torch.optim.AdamW(model.parameters())\n"
            "    scaler = torch.cuda.amp.GradScaler(enabled=False) if use_bfloat16 else None\n    return opt, scaler\n",
            lines=(4,), message="only when `use_bfloat16` holds",
        ),
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler('cuda', enabled=args.bf16)\n"
            "if args.amp and args.amp_dtype == 'bfloat16':\n    scaler2 = torch.amp.GradScaler('cuda')\n",
            target="cuda",
            fixed="import torch\nscaler = torch.amp.GradScaler('cuda', enabled=False)\n"
            "if args.amp and args.amp_dtype == 'bfloat16':\n    scaler2 = torch.amp.GradScaler('cuda', enabled=False)\n",
            lines=(2, 4),
        ),
        # The setting is misnamed (the file's autocast is float16), turned round, or the
        # scaler is built on the other branch.
        Valid(
            "import torch\nscaler = torch.cuda.amp.GradScaler() if use_bfloat16 else None\n"
            "with torch.cuda.amp.autocast(dtype=torch.float16, enabled=use_bfloat16):\n    loss = model(x)\n",
            target="cuda",
        ),
        Valid(
            "import torch\nscaler = torch.cuda.amp.GradScaler() if not args.bf16 else None\n"
            "scaler = torch.cuda.amp.GradScaler(enabled=args.no_bf16)\n"
            "if args.bf16:\n    pass\nelse:\n    scaler = torch.cuda.amp.GradScaler()\n"
            "scaler = torch.cuda.amp.GradScaler(enabled=args.dtype in ('float16', 'bfloat16'))\n",
            target="cuda",
        ),
        Valid(
            "import torch\nwith torch.cuda.amp.autocast(dtype=torch.float16, enabled=use_bfloat16):\n"
            "    loss = model(x)\nif use_bfloat16:\n    scaler.scale(loss).backward()\n"
        ),
        # float16 needs the scaler.
        Valid(
            "import torch\nscaler = torch.amp.GradScaler('cuda')\nwith torch.autocast('cuda'):\n    loss = model(x)\n",
            target="cuda",
        ),
        Valid(
            "import torch\nscaler = torch.amp.GradScaler('cuda')\n"
            "with torch.autocast('cuda', dtype=torch.float16):\n    loss = model(x)\n"
        ),
        # Already conditional on the dtype (nanoGPT), or the dtype is a setting.
        Valid(
            "import torch\nptdtype = {'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]\n"
            "scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))\n"
            "ctx = torch.amp.autocast(device_type='cuda', dtype=ptdtype)\n"
        ),
        Valid(
            "import torch\nscaler = torch.amp.GradScaler('cuda')\n"
            "with torch.autocast('cuda', dtype=args.amp_dtype):\n    loss = model(x)\n"
        ),
        # One region in each dtype: the float16 one may need it.
        Valid(
            "import torch\nscaler = torch.amp.GradScaler('cuda')\n"
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n    a = f(x)\n"
            "with torch.autocast('cuda', dtype=torch.float16):\n    b = g(x)\n"
        ),
        # No autocast in the file: nothing known about the dtype.
        Valid("import torch\nscaler = torch.amp.GradScaler('cuda')\nautocast_dtype = None\n"),
        Valid(
            "import torch\nscaler = torch.amp.GradScaler('cpu')  # noqa: AX702\nwith torch.autocast('cpu'):\n"
            "    loss = model(x)\n"
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        name = ctx.call_name(node)
        if name not in SCALERS:
            yield from self._scaled_under_bfloat16_flag(node, ctx)
            return
        enabled = next((k.value for k in node.keywords if k.arg == "enabled"), None)
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            return
        if len(node.args) >= _ENABLED_AT.get(name, 4) + 1:
            return  # enabled given by position
        always_on = enabled is None or isinstance(enabled, ast.Constant) and enabled.value is True
        dtypes = _autocast_dtypes(ctx)
        if always_on and dtypes == {"bfloat16"}:
            why = "GradScaler with bfloat16 autocast"
        else:
            # The scaler is built only when a setting that names bfloat16 holds, and no
            # autocast of the file computes in another dtype it knows.
            flag = _bfloat16_guard(node, enabled, ctx)
            if flag is None or dtypes - {"bfloat16", "unknown"}:
                return
            why = f"GradScaler built only when `{flag}` holds, a bfloat16 setting"
        if enabled is not None:
            fix = ctx.fix(self, [ctx.replace(enabled, "False")])
        else:
            fix = ctx.fix(self, ctx.add_keyword(node, "enabled=False"))
        device = "the host" if ctx.target == "cpu" else f"the {ctx.target} device"
        unverified = " (unverified on Ascend hardware)" if ctx.target == "npu" else ""
        message = (
            f"{why}: bfloat16 keeps float32's exponent range, so gradients do not "
            "underflow and need no loss scaling, but the scaler still scales the loss, checks every gradient for "
            f"inf/NaN and unscales them, and its step() waits for {device} to read that check back every step; "
            f"enabled=False makes scale/step/update pass through{unverified}. Fix is unsafe: steps with inf/NaN "
            "gradients are no longer skipped"
        )
        yield ctx.finding(self, node, message, replacement="enabled=False", fix=fix)


    def _scaled_under_bfloat16_flag(self, node: ast.Call, ctx: FileContext) -> Iterable[Finding]:
        """``scaler.scale(loss).backward()`` run only under ``if FLAG:`` where the
        file's autocast is ``dtype=torch.bfloat16, enabled=FLAG``: the scaler (built
        elsewhere) works only when autocast computes in bfloat16."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr == "backward" and isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Attribute) and func.value.func.attr == "scale"):
            return
        flags = _bfloat16_flags(ctx)
        if not flags:
            return
        for test in _guards(ctx, node, statements_only=True):
            flag = ast.unparse(test)
            if flag in flags:
                unverified = " (unverified on Ascend hardware)" if ctx.target == "npu" else ""
                message = (
                    f"loss scaling only when `{flag}` is set, which is when this file's autocast computes in "
                    "bfloat16: bfloat16 keeps float32's exponent range and needs no loss scaling, but the scaler "
                    "still checks every gradient for inf/NaN and its step() reads that back every step; build "
                    f"the scaler with enabled=False (or call loss.backward() and the optimizer's step()) under "
                    f"`{flag}`{unverified}. Display-only: the scaler is built elsewhere"
                )
                yield ctx.finding(self, node, message, replacement="loss.backward()",
                                  fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY))
                return


#: Words of a setting's name that turn its meaning round (``no_bf16``, ``disable_bf16``).
_NEGATING = frozenset({"no", "not", "disable", "disabled", "without", "skip"})
_BFLOAT16_WORDS = frozenset({"bf16", "bfloat16"})


def _bfloat16_guard(node: ast.Call, enabled: ast.expr | None, ctx: FileContext) -> str | None:
    """The text of the test that says bfloat16 and under which the scaler is built or
    enabled: ``GradScaler(enabled=args.bf16)``, ``GradScaler() if use_bfloat16 else
    None``, ``if cfg.dtype == torch.bfloat16: scaler = GradScaler()``. None when no
    such test holds the scaler."""
    if enabled is not None:
        return ast.unparse(enabled) if _says_bfloat16(enabled, ctx) else None
    return next((ast.unparse(test) for test in _guards(ctx, node) if _says_bfloat16(test, ctx)), None)


def _guards(ctx: FileContext, node: ast.AST, statements_only: bool = False) -> Iterable[ast.expr]:
    """The tests of the ``if`` statements (and, unless ``statements_only``, the
    conditional expressions) whose true branch holds ``node``, innermost first, up to
    the enclosing definition."""
    chain = [*ctx.parents, node]
    for parent, child in zip(reversed(chain[:-1]), reversed(chain[1:])):
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        if isinstance(parent, ast.If) and child in parent.body:
            yield parent.test
        elif not statements_only and isinstance(parent, ast.IfExp) and child is parent.body:
            yield parent.test


def _says_bfloat16(test: ast.expr, ctx: FileContext) -> bool:
    """Whether a test holds only for bfloat16: a setting named for it (``use_bfloat16``,
    ``args.bf16``, not ``no_bf16``), a comparison equal to ``torch.bfloat16`` or
    ``"bfloat16"``/``"bf16"``, or an ``and`` with one such part."""
    if isinstance(test, ast.BoolOp):
        return isinstance(test.op, ast.And) and any(_says_bfloat16(v, ctx) for v in test.values)
    if isinstance(test, (ast.Name, ast.Attribute)):
        words = set((test.id if isinstance(test, ast.Name) else test.attr).lower().split("_"))
        return bool(words & _BFLOAT16_WORDS) and not words & _NEGATING
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        if isinstance(op, ast.Eq):
            return _names_bfloat16(test.left, ctx) or _names_bfloat16(right, ctx)
        if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)) and right.elts:
            return all(_names_bfloat16(e, ctx) for e in right.elts)
    return False


def _names_bfloat16(node: ast.expr, ctx: FileContext) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.lower() in _BFLOAT16_WORDS
    return ctx.qualified_name(node) == "torch.bfloat16"


def _bfloat16_flags(ctx: FileContext) -> frozenset[str]:
    """The ``enabled=`` texts of the file's autocast calls in bfloat16, less any that
    also enable an autocast in another dtype."""
    key = "ax702.flags"
    if key not in ctx.cache:
        by_flag: dict[str, set[str]] = {}
        for call in ctx.nodes(ast.Call):
            if ctx.call_name(call) not in AUTOCASTS:
                continue
            enabled = next((k.value for k in call.keywords if k.arg == "enabled"), None)
            if enabled is None or not isinstance(enabled, (ast.Name, ast.Attribute)):
                continue
            by_flag.setdefault(ast.unparse(enabled), set()).add(_dtype_of_call(ctx, call))
        ctx.cache[key] = frozenset(flag for flag, dtypes in by_flag.items() if dtypes == {"bfloat16"})
    return ctx.cache[key]


def _autocast_dtypes(ctx: FileContext) -> set[str]:
    """The dtypes of the file's autocast calls (``"unknown"`` where the file does not
    say)."""
    key = "ax702.dtypes"
    if key not in ctx.cache:
        ctx.cache[key] = {_dtype_of_call(ctx, call) for call in ctx.nodes(ast.Call)
                          if ctx.call_name(call) in AUTOCASTS}
    return ctx.cache[key]


def _dtype_of_call(ctx: FileContext, call: ast.Call) -> str:
    """The dtype an autocast call computes in (``"unknown"`` where the file does not say)."""
    name = ctx.call_name(call) or ""
    dtype = next((k.value for k in call.keywords if k.arg == "dtype"), None)
    if dtype is None and name in ("torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast") \
            and len(call.args) > 1:
        dtype = call.args[1]
    if dtype is not None:
        return _dtype_of(ctx, dtype)
    default = AUTOCASTS.get(name)
    if default is None:
        device = next((k.value for k in call.keywords if k.arg == "device_type"), call.args[0] if call.args else None)
        default = (_DEVICE_DEFAULT.get(device.value, "unknown")
                   if isinstance(device, ast.Constant) and isinstance(device.value, str) else "unknown")
    return default


def _dtype_of(ctx: FileContext, node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        assigned = ctx.single_assignments().get(node.id)
        if assigned is not None:
            node = assigned
    return _DTYPES.get(ctx.qualified_name(node) or "", "unknown")
