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
        # SimCLR's labels, built on the host on every call of the loss.
        Invalid(
            "import torch\n\n\nclass SimCLR:\n"
            "    def info_nce_loss(self, features):\n"
            "        labels = torch.cat([torch.arange(self.batch_size) for i in range(self.n_views)], dim=0)\n"
            "        labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()\n"
            "        labels = labels.to(self.device)\n"
            "        noise = (torch.rand(4) * 2 - 1).cuda()\n"
            "        return labels, noise\n",
            target="cuda", lines=(8, 9),
        ),
        Valid(
            "import torch\n"
            "mask = torch.ones(3) + 1\n"
            "mask = mask.cuda()\n\n\n"
            "class Model(torch.nn.Module):\n"
            "    def __init__(self, n):\n"
            "        pe = torch.arange(n) * 2\n"
            "        self.pe = pe.cuda()\n\n"
            "    def forward(self, x):\n"
            "        pos = torch.cat([torch.arange(4), x])\n"
            "        ids = torch.arange(4, device='cpu') + 1\n"
            "        rows = torch.full((len(x), 8), 0)\n"
            "        for i, p in enumerate(x):\n"
            "            rows[i, :len(p)] = torch.tensor(p)\n"
            "        rows = rows.cuda()\n"
            "        probe = torch.randn(4, 8)\n"
            "        expected = self.cpu_model(probe)\n"
            "        got = self.gpu_model(probe.cuda())\n"
            "        return pos.to(x.device), ids.to(x.device), (x + 1).cuda()\n",
            target="cuda",
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
            yield from self._built_before(node, ctx)
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

    def _built_before(self, node: ast.Call, ctx: FileContext) -> Iterable[Finding]:
        """A move of a tensor the function computed on the host in earlier statements
        or in one expression from torch factories (SimCLR's labels: ``torch.cat`` of
        ``arange``s, compared, cast, then moved), in a function that runs more than
        once: advice to build it on the device."""
        function = next((p for p in reversed(ctx.parents) if isinstance(p, T.FUNCTION_TYPES)), None)
        if function is None or getattr(function, "name", "") == "__init__":
            return
        assert isinstance(node.func, ast.Attribute)
        moved = node.func.value
        statement = next((p for p in reversed(ctx.parents) if isinstance(p, ast.stmt)), None)
        rebound = isinstance(statement, ast.Assign) and isinstance(moved, ast.Name) and any(
            isinstance(t, ast.Name) and t.id == moved.id for target in statement.targets for t in fast_walk(target))
        if isinstance(moved, ast.Name) and _read_elsewhere(ctx, function, moved.id, node.lineno, rebound):
            return  # the host tensor has other uses (a CPU model's input): it stays on the host anyway
        factory = _host_built(ctx, T.tensors_at(ctx), moved, 0, frozenset(_filled_in(ctx, function)))
        if factory is None:
            return
        dev = T.DEVICE_WORD[ctx.target]
        short = (ctx.call_name(factory) or "torch.?").split(".", 1)[1]
        yield ctx.finding(
            self,
            node,
            f"`{T.describe(ctx, moved, 30)}` is computed in host memory from `{T.describe(ctx, factory, 40)}` "
            f"(line {factory.lineno}) "
            f"and then copied to the {dev}{_repeated(ctx, _enclosing_loop(ctx)) or ' each time the function runs'}; "
            f"pass device= to the factories so it is computed on the {dev}, with no host work and no copy"
            + (f" (the {dev}'s generator draws other numbers)" if short in RANDOM else ""),
            replacement=f"torch.{short}(..., device=device)",
            fix=ctx.fix(self, [], applicability=Applicability.DISPLAY_ONLY, title="build it on the device with device="),
        )


def _names_used(ctx: FileContext, function: ast.AST) -> tuple[dict[str, set[int]], dict[str, set[int]], set[str]]:
    """One walk of a function, kept per file: the lines each name is read on, the lines
    of the statements assigning each name, and the names changed in place (a store into
    an item, ``t[i] = ...``, or an in-place method, ``t.scatter_(...)``)."""
    key = ("ax305.names", id(function))
    if key not in ctx.cache:
        reads: dict[str, set[int]] = {}
        assigned: dict[str, set[int]] = {}
        filled: set[str] = set()
        for node in fast_walk(function):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                reads.setdefault(node.id, set()).add(node.lineno)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                lines = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
                for target in targets:
                    for n in fast_walk(target):
                        if isinstance(n, ast.Name):
                            assigned.setdefault(n.id, set()).update(lines)
                    if isinstance(node, ast.AnnAssign):
                        continue
                    while isinstance(target, (ast.Subscript, ast.Attribute)):
                        target = target.value
                        if isinstance(target, ast.Name):
                            filled.add(target.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr.endswith("_") and not node.func.attr.startswith("_") \
                    and isinstance(node.func.value, ast.Name):
                filled.add(node.func.value.id)
        ctx.cache[key] = (reads, assigned, filled)
    return ctx.cache[key]


def _filled_in(ctx: FileContext, function: ast.AST) -> set[str]:
    """Names the function changes in place. A tensor filled from host data row by row is
    best built on the host and copied once."""
    return _names_used(ctx, function)[2]


def _read_elsewhere(ctx: FileContext, function: ast.AST, name: str, move_line: int, rebound: bool) -> bool:
    """Whether the function reads the host value of ``name`` other than in the move and
    in the statements that assign it (where it is built from itself): on any other line
    before the move, or after it unless the move's result took the name
    (``labels = labels.to(device)``)."""
    reads, assigned, _ = _names_used(ctx, function)
    others = reads.get(name, set()) - assigned.get(name, set()) - {move_line}
    return any(line < move_line or not rebound for line in others)


#: Functions that combine tensors without moving them.
_COMBINING = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "where", "outer"})
#: How deep names are followed to their values.
_DEPTH = 10


def _host_built(ctx: FileContext, tensors: T.Tensors, node: ast.AST, depth: int,
                seen: frozenset = frozenset()) -> ast.Call | None:
    """The first torch factory (computed or random, told no device) that ``node`` is
    computed from on the host, through casts and reshapes, arithmetic and comparisons
    with numbers, ``torch.cat``/``stack`` of such tensors, and names every assignment of
    which is such an expression; None when any part may be elsewhere or unknown. ``seen``
    holds the names not to follow (filled in place) and the values on the way here (to
    stop at a name computed from itself)."""
    if depth > _DEPTH:
        return None
    if isinstance(node, ast.Name):
        if node.id in seen:
            return None  # filled in place (``t[i, :n] = torch.tensor(row)``): data, copied once
        values = tensors.values_of(node)
        if not values or any(v in seen for v in values):
            return None  # unknown, or a value computed from itself (``x = x + 1`` in a loop)
        seen = seen | set(values)
        found = [_host_built(ctx, tensors, v, depth + 1, seen) for v in values]
        return found[0] if all(f is not None for f in found) else None
    if isinstance(node, ast.BinOp):
        return _combined(ctx, tensors, [node.left, node.right], depth, seen)
    if isinstance(node, ast.Compare) and len(node.comparators) == 1:
        return _combined(ctx, tensors, [node.left, node.comparators[0]], depth, seen)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert)):
        return _host_built(ctx, tensors, node.operand, depth + 1, seen)
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in SAME_VALUES and ctx.qualified_name(func) is None:
        return _host_built(ctx, tensors, func.value, depth + 1, seen)
    found = _factory_of(ctx, node)
    if found is not None:
        factory, short = found
        if short not in COMPUTED | RANDOM or T.has_double_star(factory) \
                or any(T.keyword(factory, k) for k in ("device", "out", "generator")):
            return None
        return factory
    name = ctx.call_name(node) or ""
    if name.startswith("torch.") and name.split(".", 1)[1] in _COMBINING and node.args \
            and all(k.arg == "dim" for k in node.keywords):
        first = node.args[0]
        parts = [first.elt] if isinstance(first, (ast.ListComp, ast.GeneratorExp)) else \
            list(first.elts) if isinstance(first, (ast.List, ast.Tuple)) else [first, *node.args[1:]]
        return _combined(ctx, tensors, parts, depth, seen)
    return None


def _combined(ctx: FileContext, tensors: T.Tensors, parts: list[ast.AST], depth: int,
              seen: frozenset) -> ast.Call | None:
    """The first factory of ``parts`` when each is a number or computed on the host and
    at least one is a tensor."""
    first = None
    for part in parts:
        if isinstance(part, ast.Constant) and isinstance(part.value, (int, float, bool)) or \
                isinstance(part, ast.UnaryOp) and isinstance(part.operand, ast.Constant):
            continue
        found = _host_built(ctx, tensors, part, depth + 1, seen)
        if found is None:
            return None
        first = first or found
    return first


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
