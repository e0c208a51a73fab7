"""AX305: a tensor built in host memory by a torch factory, then copied to the device."""

from __future__ import annotations

import ast
from typing import Iterable

from torchaxe.findings import Applicability, Edit, Finding
from torchaxe.scan.context import LOOP_TYPES, FileContext, fast_walk
from torchaxe.scan.rules import _tensors as T
from torchaxe.scan.rules.base import Invalid, Rule, Valid

#: Factories that compute their values: on the device there is no copy at all.
COMPUTED = frozenset(
    {
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "range",
        "linspace",
        "logspace",
        "eye",
        "tril_indices",
        "triu_indices",
        "empty_strided",
    }
)
#: Factories that copy Python or numpy data: device= saves the second copy step.
FROM_DATA = frozenset({"tensor", "as_tensor"})
#: Factories whose device kernels compute floating-point values differently from the
#: CPU kernels (accumulation type, libm), so the last bits may differ.
APPROXIMATE = frozenset({"linspace", "logspace"})
_FLOAT_DTYPES = frozenset({"float", "float32", "float64", "double", "half", "float16", "bfloat16"})
#: Random factories: the device generator draws different numbers than the CPU's.
RANDOM = frozenset({"rand", "randn", "randint", "randperm"})
#: from_numpy takes no device: the data must cross from host memory.
FROM_NUMPY = "from_numpy"
FACTORIES = COMPUTED | FROM_DATA | RANDOM | {FROM_NUMPY}

#: Methods between the factory and the move that give the same values wherever
#: they run (dtype casts, reshapes): the fix leaves them after the factory.
SAME_VALUES = frozenset(
    {
        "float",
        "double",
        "half",
        "bfloat16",
        "long",
        "int",
        "short",
        "bool",
        "byte",
        "unsqueeze",
        "squeeze",
        "view",
        "reshape",
        "t",
        "transpose",
        "permute",
        "contiguous",
        "flatten",
        "expand",
        "repeat",
        "tril",
        "triu",
    }
)


def _factory_of(ctx: FileContext, node: ast.AST) -> tuple[ast.Call, str] | None:
    """The torch factory call at the root of ``node`` (through SAME_VALUES methods)
    and its short name."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SAME_VALUES:
        if ctx.qualified_name(node.func) is not None:
            break  # torch.float(...) is not a method
        node = node.func.value
    if not isinstance(node, ast.Call):
        return None
    name = ctx.call_name(node) or ""
    if not name.startswith("torch.") or name.count(".") != 1:
        return None
    short = name.split(".", 1)[1]
    return (node, short) if short in FACTORIES else None


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _enclosing_loop(ctx: FileContext) -> ast.AST | None:
    """The loop or comprehension of the same function that runs the visited node
    repeatedly, or None."""
    for parent in reversed(ctx.parents):
        if isinstance(parent, T.BOUNDARY_TYPES):
            return None
        if isinstance(parent, (*LOOP_TYPES, *_COMPREHENSIONS)):
            return parent
    return None


def _repeated(ctx: FileContext, loop: ast.AST | None) -> str:
    """How often the visited node runs, for the message: which loop repeats it (an
    epoch loop's iteration is not a step, so the loop is named)."""
    if loop is None:
        return ""
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        head = f"for {T.describe(ctx, loop.target, 20)} in {T.describe(ctx, loop.iter, 30)}"
        return f" on every iteration of `{head}`"
    if isinstance(loop, ast.While):
        return f" on every iteration of `while {T.describe(ctx, loop.test, 30)}`"
    return " for every element of the comprehension"


class HostTensorMovedToDevice(Rule):
    """
    ## What it does
    Flags a tensor made by a torch factory (`torch.tensor`, `as_tensor`, `zeros`,
    `ones`, `empty`, `full`, `arange`, `linspace`, `eye`, `rand`, `randn`, `randint`,
    `randperm`, ...) and then moved with `.cuda()`, `.npu()` or `.to(device)`:
    `torch.zeros(n).cuda()`. Also flags `torch.from_numpy(a).cuda()` inside a loop.
    The `*_like` factories are not flagged: they follow their input's device.

    ## Why is this bad?
    The tensor is first allocated and filled in host memory, then copied to the device
    through a second allocation; a copy from pageable host memory also blocks the host
    until it is done. With `device=` a computed tensor (`zeros`, `arange`, ...) is
    filled on the device directly: no host allocation and no copy. For `torch.tensor`
    and `as_tensor` the data still has to cross, but in one call and without the
    intermediate host tensor. In a loop this is paid every iteration.

    `torch.from_numpy` cannot take a device: in a loop, copy from pinned memory
    (`torch.from_numpy(a).pin_memory()`, or a `DataLoader` with `pin_memory=True`)
    with `.to(device, non_blocking=True)` so the copy overlaps compute.

    Not reported on the `cpu` target, where there is nothing to copy.

    ## Example
    ```python
    mask = torch.ones(seq, seq).tril().cuda()
    pos = torch.arange(seq).to(device)
    ```

    ## Use instead
    ```python
    mask = torch.ones(seq, seq, device="cuda").tril()
    pos = torch.arange(seq, device=device)
    ```

    ## Fix safety
    Safe for data factories and exact computed ones (`zeros`, `ones`, `full`, `eye`,
    an integer `arange`...): the values are identical, and dtype casts or reshapes
    between factory and move (`.float()`, `.view(...)`) now run on the device with the
    same result. Unsafe for random factories (the device's generator draws different
    numbers than the CPU generator did), for `linspace`, `logspace` and a floating-point
    `arange` (device kernels may round the last bits differently; a float held in a
    variable is not seen and counts as exact), and for a factory with
    `requires_grad=True` (its moved copy was a non-leaf tensor; built on the device it
    is the leaf that receives `.grad`).
    No fix when the move has more arguments than a device (`.to(device, dtype)`,
    `non_blocking=`), when `.cuda(i)` names an index, or when the factory was told
    `device="cpu"`. Skipped: factories with `**kwargs`, `out=`, `pin_memory=` or
    `generator=` (a CPU generator cannot draw on the device), and random factories
    told `device="cpu"` (drawn on the CPU on purpose, for the same numbers everywhere).
    """

    code = "AX305"
    name = "host-tensor-moved-to-device"
    category = "host_tensor_to_device"
    message = "a tensor is built in host memory and then copied to the device"
    fix_title = "build the tensor on the device with device="
    fix_safety = Applicability.SAFE
    targets = ("cuda", "npu")
    requires_text = (".cuda(", ".npu(", ".to(")
    node_types = (ast.Call,)
    references = (
        "https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#create-tensors-directly-on-the-target-device",
        "https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers",
    )
    examples = (
        Invalid(
            "import torch\nmask = torch.ones(n, n).tril().cuda()\nx = torch.tensor(data).cuda()\n",
            target="cuda",
            fixed='import torch\nmask = torch.ones(n, n, device="cuda").tril()\nx = torch.tensor(data, device="cuda")\n', lines=(2, 3),
        ),
        Invalid(
            "import torch as T\npos = T.arange(seq).long().to(device)\n",
            target="npu",
            fixed="import torch as T\npos = T.arange(seq, device=device).long()\n", lines=(2,),
        ),
        Invalid(
            "from torch import zeros\nbuf = zeros(3, dtype=torch.float16).npu()\n",
            target="npu",
            fixed='from torch import zeros\nbuf = zeros(3, dtype=torch.float16, device="npu")\n', lines=(2,),
        ),
        Invalid(
            "import torch\nnoise = torch.randn(\n    batch,\n    dim,\n).to(device=args.device)\n",
            target="cuda",
            fixed="import torch\nnoise = torch.randn(\n    batch,\n    dim,\n    device=args.device,\n)\n", lines=(2,),
        ),
        Invalid(
            "import torch\nw = torch.zeros(3, requires_grad=True).to('cuda:0')\n",
            target="cuda",
            fixed="import torch\nw = torch.zeros(3, requires_grad=True, device='cuda:0')\n", lines=(2,),
        ),
        Invalid(
            "import torch\n"
            "for a in arrays:\n"
            "    x = torch.from_numpy(a).cuda()\n"
            "    y = torch.tensor(a).to(device, non_blocking=True)\n"
            "    z = torch.zeros(3, device='cpu').cuda()\n"
            "    i = torch.arange(4).cuda(rank)\n",
            target="cuda", lines=(3, 4, 5, 6),
        ),
        Valid("import torch\nx = torch.tensor(data).cuda()\n", target="cpu"),
        Valid(
            "import torch\n"
            "x = torch.tensor(data, device='cuda')\n"
            "y = torch.zeros_like(x).cuda()\n"
            "z = torch.zeros(3, **kw).cuda()\n"
            "p = torch.tensor(data, pin_memory=True).cuda(non_blocking=True)\n"
            "h = torch.from_numpy(a).cuda()\n"
            "c = torch.ones(3).to(torch.float16)\n"
            "d = torch.ones(3).to(other)\n"
            "e = torch.ones(3).to('cpu')\n"
            "f = (torch.ones(3) + 1).cuda()\n"
            "g = torch.rand(3, generator=gen).to(device)\n"
            "r = torch.randn(3, device='cpu').to(device)\n",
            target="cuda",
        ),
        Valid(
            "import torch\n"
            "from mylib import tensor\n"
            "x = tensor(data).cuda()\n"
            "y = torch.ones(3).cuda()  # noqa: AX305\n",
            target="npu",
        ),
    )

    def visit(self, node: ast.AST, ctx: FileContext) -> Iterable[Finding]:
        assert isinstance(node, ast.Call)
        device = T.move_device(ctx, node)
        if device is False:
            return
        assert isinstance(node.func, ast.Attribute)
        found = _factory_of(ctx, node.func.value)
        if found is None:
            return
        factory, short = found
        if T.has_double_star(factory) or any(T.keyword(factory, k) for k in ("out", "pin_memory", "generator")):
            return  # a generator fixes the device it draws on
        loop = _enclosing_loop(ctx)
        in_loop = loop is not None
        if short == FROM_NUMPY and not in_loop:
            return  # one copy at start-up; nothing to gain
        made_on = T.keyword(factory, "device")
        if made_on is not None and not T.is_cpu_device(ctx, made_on.value):
            return  # device-to-device move, not this rule's business
        if made_on is not None and short in RANDOM:
            return  # drawn on the CPU on purpose: the same numbers on every device
        dev = T.DEVICE_WORD[ctx.target]
        every = _repeated(ctx, loop)
        move = T.describe(ctx, node, 60)
        device_text = _device_text(ctx, node, device)

        if short == FROM_NUMPY:
            yield ctx.finding(
                self,
                node,
                f"`{move}` copies from pageable host memory{every}, which blocks the host until the copy is "
                f"done: copy from pinned memory (`torch.from_numpy(a).pin_memory()`, or a DataLoader with "
                f"pin_memory=True) with `.to(device, non_blocking=True)` so the copy overlaps {dev} work",
                replacement="torch.from_numpy(a).pin_memory().to(device, non_blocking=True)",
                fix=ctx.fix(
                    self,
                    [],
                    applicability=Applicability.DISPLAY_ONLY,
                    title="copy from pinned memory with non_blocking=True",
                ),
            )
            return

        if short in COMPUTED:
            why = (
                f"fills it in host memory and then copies it to the {dev}{every}; "
                f"with device= it is filled on the {dev}: no host allocation, no copy"
            )
        elif short in FROM_DATA:
            why = (
                f"builds a host tensor and then copies it to the {dev} in a second step{every}; "
                "with device= one call does both, without the intermediate tensor"
            )
        else:
            why = (
                f"draws the numbers on the host and then copies them to the {dev}{every}; "
                f"with device= the {dev} draws them (from its own generator: the numbers differ)"
            )
        message = f"`{move}` {why}"
        if T.keyword(factory, "requires_grad") is not None:
            message += "; note that the moved copy is not a leaf (it gets no .grad), the tensor built on the device is"
        title = f"pass device={device_text or '...'} to torch.{short}()"
        if made_on is not None or device_text is None:
            fix = ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY, title=title)
        else:
            safety = Applicability.SAFE
            if short in RANDOM or not _exact_on_device(ctx, factory, short):
                safety = Applicability.UNSAFE
            if T.keyword(factory, "requires_grad") is not None:
                safety = Applicability.UNSAFE
            edits = [
                *ctx.add_keyword(factory, f"device={device_text}"),
                Edit(ctx.end(node.func.value), ctx.end(node), ""),
            ]
            fix = ctx.fix(self, edits, applicability=safety, title=title)
        yield ctx.finding(
            self, node, message, replacement=f"torch.{short}(..., device={device_text or 'device'})", fix=fix
        )


def _exact_on_device(ctx: FileContext, factory: ast.Call, short: str) -> bool:
    """Whether the factory gives bit-identical values on the device: not linspace or
    logspace, nor an arange over floats (a float literal or division among its
    arguments, or a float dtype), whose device kernels accumulate differently."""
    if short in APPROXIMATE:
        return False
    if short != "arange":
        return True
    for arg in factory.args:
        for node in fast_walk(arg):
            if isinstance(node, ast.Constant) and isinstance(node.value, float):
                return False
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                return False
    dtype = T.keyword(factory, "dtype")
    return dtype is None or (ctx.qualified_name(dtype.value) or "").rsplit(".", 1)[-1] not in _FLOAT_DTYPES


def _device_text(ctx: FileContext, move: ast.Call, device: ast.AST | bool) -> str | None:
    """The ``device=`` value for the factory when the move is a plain device move
    (``.cuda()``, ``.npu()``, ``.to(device)``, ``.to(device=d)``); None otherwise."""
    assert isinstance(move.func, ast.Attribute)
    if device is True:
        return f'"{move.func.attr}"' if not move.keywords else None
    if len(move.args) + len(move.keywords) != 1 or move.func.attr != "to":
        return None
    return ctx.text(device)  # type: ignore[arg-type]
