"""Reading ``torch.utils.data.DataLoader(...)`` calls for the AX4xx rules: which
argument sets a setting (by keyword or by position), what literal it holds, and an
edit that sets it. Not a rule module (the leading underscore keeps the registry out).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from torchaxe.findings import Edit
from torchaxe.scan.context import FileContext, fast_walk

LOADER_NAMES = frozenset({"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"})
TENSOR_DATASET_NAMES = frozenset({"torch.utils.data.TensorDataset", "torch.utils.data.dataset.TensorDataset"})

#: The positional order of ``DataLoader.__init__`` (torch 2.x); the settings after
#: ``generator`` (prefetch_factor, persistent_workers, ...) are keyword-only.
POSITIONS = (
    "dataset",
    "batch_size",
    "shuffle",
    "sampler",
    "batch_sampler",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
)

#: DataLoader subclasses that hand every setting they do not take themselves on to
#: torch's (``**kwargs``), with their own positional order: PyTorch Geometric's
#: (``DataLoader(dataset, batch_size=1, shuffle=False, follow_batch=None,
#: exclude_keys=None, **kwargs)``, its collate batching graphs).
_PYG = ("dataset", "batch_size", "shuffle", "follow_batch", "exclude_keys")
SUBCLASS_POSITIONS: dict[str, tuple[str, ...]] = {
    "torch_geometric.loader.DataLoader": _PYG,
    "torch_geometric.loader.dataloader.DataLoader": _PYG,
    "torch_geometric.data.DataLoader": _PYG,
}

_NO_VALUE = object()


class _Marker:
    """A named sentinel (its repr shows in test failures)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


MISSING = _Marker("MISSING")
NOT_LITERAL = _Marker("NOT_LITERAL")


@dataclass(frozen=True)


class LoaderCall:
    """A DataLoader call whose arguments can all be read (no ``*args``/``**kwargs``)."""

    call: ast.Call
    #: The loader's positional order: torch's, or a subclass's (``SUBCLASS_POSITIONS``).
    positions: tuple[str, ...] = POSITIONS

    def argument(self, name: str) -> ast.expr | None:
        """The expression passed for ``name``, by keyword or by position, or None."""
        for kw in self.call.keywords:
            if kw.arg == name:
                return kw.value
        if name in self.positions:
            index = self.positions.index(name)
            if index < len(self.call.args):
                return self.call.args[index]
        return None

    def literal(self, name: str) -> object:
        """The literal value passed for ``name``; ``MISSING`` when the argument is
        absent, ``NOT_LITERAL`` when it is an expression."""
        node = self.argument(name)
        if node is None:
            return MISSING
        value = literal_value(node)
        return NOT_LITERAL if value is _NO_VALUE else value


def dataloader_kind(ctx: FileContext, call: ast.Call) -> str | None:
    """Which DataLoader ``call`` builds: ``"torch"`` for torch's own (through any
    import alias) or a subclass that passes torch's settings on
    (``SUBCLASS_POSITIONS``), ``"other"`` for another callable named ``DataLoader``
    (a subclass such as MONAI's, or a name no import binds), None for anything else. Rules that
    edit arguments by torch's positions take only the first; rules that ask whether
    batches come from a host-side loader take both."""
    name = ctx.call_name(call)
    if name in LOADER_NAMES or name in SUBCLASS_POSITIONS:
        return "torch"
    if (name or ast.unparse(call.func)).rsplit(".", 1)[-1] == "DataLoader":
        return "other"
    return None


def is_dataloader_call(ctx: FileContext, call: ast.Call) -> bool:
    """Whether ``call`` builds a DataLoader, torch's or another (see :func:`dataloader_kind`)."""
    return dataloader_kind(ctx, call) is not None


def loader_call(node: ast.AST, ctx: FileContext) -> LoaderCall | None:
    """The call as a :class:`LoaderCall` when it builds torch's own DataLoader and
    every argument is visible; None otherwise (unpacked arguments may set anything,
    and another loader's arguments need not follow torch's positions)."""
    if not isinstance(node, ast.Call) or dataloader_kind(ctx, node) != "torch":
        return None
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    return LoaderCall(node, SUBCLASS_POSITIONS.get(ctx.call_name(node) or "", POSITIONS))


def literal_value(node: ast.AST) -> object:
    """The value of a constant (``-1`` included), or a private sentinel."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
    return _NO_VALUE


def set_argument(ctx: FileContext, loader: LoaderCall, name: str, value_text: str) -> list[Edit]:
    """Edits that make the call pass ``value_text`` for ``name``: the existing
    argument's value is replaced in place, or ``name=value`` is appended."""
    node = loader.argument(name)
    if node is not None:
        return [ctx.replace(node, value_text)]
    return ctx.add_keyword(loader.call, f"{name}={value_text}")


def dataset_expression(ctx: FileContext, loader: LoaderCall) -> ast.expr | None:
    """The expression that builds the loader's dataset: the ``dataset`` argument, or
    the value assigned (once) in this file to the name passed there."""
    node = loader.argument("dataset")
    if isinstance(node, ast.Name):
        return ctx.single_assignments().get(node.id, node)
    return node


def _tensor_dataset_call(ctx: FileContext, node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and ctx.call_name(node) in TENSOR_DATASET_NAMES


def _values_bound_to(tree: ast.AST, name: str) -> list[ast.expr]:
    """Every value a plain ``name = value`` binds ``name`` to in ``tree``."""
    return [node.value for node in fast_walk(tree)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)]


def _only_tensor_datasets(ctx: FileContext, values: list[ast.expr], scope: ast.AST) -> bool:
    """Whether every value is a ``TensorDataset(...)`` call, or a name that ``scope``
    binds only to such calls."""
    if not values:
        return False
    for value in values:
        if isinstance(value, ast.Name):
            bound = _values_bound_to(scope, value.id)
            if not bound or not all(_tensor_dataset_call(ctx, v) for v in bound):
                return False
        elif not _tensor_dataset_call(ctx, value):
            return False
    return True


def is_tensor_dataset(ctx: FileContext, loader: LoaderCall) -> bool:
    """Whether the dataset is a ``TensorDataset`` built in this file: its samples
    are already tensors in memory, so there is nothing to load in parallel. Found
    through the name passed (every binding of it in the file a ``TensorDataset``
    call) or a function of this file called there (every ``return`` one)."""
    node = loader.argument("dataset")
    if isinstance(node, ast.Name):
        return _only_tensor_datasets(ctx, [node], ctx.tree)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        functions = list(ctx.functions().get(node.func.id, ()))
        if len(functions) == 1:
            returns = [r.value for r in fast_walk(functions[0]) if isinstance(r, ast.Return)]
            if returns and all(r is not None for r in returns):
                return _only_tensor_datasets(ctx, returns, functions[0])  # type: ignore[arg-type]
    return _tensor_dataset_call(ctx, node)


def builds_tensor_dataset(ctx: FileContext) -> bool:
    """Whether this file builds a ``TensorDataset`` anywhere."""
    return any(_tensor_dataset_call(ctx, n) for n in ctx.nodes(ast.Call))


ITERABLE_DATASET_NAMES = frozenset({"torch.utils.data.IterableDataset", "torch.utils.data.dataset.IterableDataset"})


def unsharded_iterable_dataset(ctx: FileContext, loader: LoaderCall) -> str | None:
    """The name of the loader's dataset class when it is an ``IterableDataset``
    defined in this file (directly or through its own base classes) that never calls
    ``get_worker_info()``: every worker would yield the whole data set."""
    node = dataset_expression(ctx, loader)
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None
    classes = {c.name: c for c in ctx.nodes(ast.ClassDef)}
    seen: set[str] = set()

    def iterable(name: str) -> bool:
        cls = classes.get(name)
        if cls is None or name in seen:
            return False
        seen.add(name)
        for base in cls.bases:
            if ctx.qualified_name(base) in ITERABLE_DATASET_NAMES:
                return True
            if isinstance(base, ast.Name) and iterable(base.id):
                return True
        return False

    if not iterable(node.func.id):
        return None
    shards = any(isinstance(n, (ast.Name, ast.Attribute)) and (getattr(n, "id", None) or getattr(n, "attr", None))
                 == "get_worker_info" for name in seen for n in fast_walk(classes[name]))
    return None if shards else node.func.id


#: The methods a map-style or iterable dataset makes its samples in.
SAMPLE_METHODS = ("__getitem__", "__getitems__", "__iter__")
#: Tensor methods that move a tensor to a device (``.to`` only with a device argument).
DEVICE_MOVES = ("cuda", "npu")


def _moves_to_device(call: ast.Call) -> bool:
    """Whether ``call`` moves a tensor to a device: ``x.cuda()``, ``x.npu()``,
    ``x.to(device)`` / ``x.to("cuda")`` / ``x.to(device=...)`` (not ``x.to(torch.float16)``
    or ``x.to(dtype=...)``), or makes one there (``torch.zeros(..., device=d)``) with a
    device other than the cpu."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in DEVICE_MOVES:
        return True
    for kw in call.keywords:
        if kw.arg == "device":
            return not (isinstance(kw.value, ast.Constant) and kw.value.value == "cpu")
    if isinstance(func, ast.Attribute) and func.attr == "to" and call.args:
        first = call.args[0]
        if isinstance(first, ast.Constant):
            return isinstance(first.value, str) and first.value != "cpu"
        if isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name) and first.value.id == "torch":
            return False  # torch.float16 and the like: a dtype
        return isinstance(first, (ast.Name, ast.Attribute)) and "dtype" not in ast.unparse(first).lower()
    return False


def dataset_moving_to_device(ctx: FileContext, loader: LoaderCall) -> tuple[str, int] | None:
    """``(class name, line)`` when the loader's dataset is an instance of a class
    defined in this file whose ``__getitem__`` (or ``__iter__``) moves tensors to a
    device (``.cuda()``, ``.to(device)``): in worker processes that fails (CUDA
    cannot be initialised in a forked process) or makes every worker hold a device
    context. None otherwise."""
    node = dataset_expression(ctx, loader)
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None
    classes = {c.name: c for c in ctx.nodes(ast.ClassDef)}
    name, seen = node.func.id, set()
    while name in classes and name not in seen:
        seen.add(name)
        cls = classes[name]
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in SAMPLE_METHODS:
                for sub in fast_walk(item):
                    if isinstance(sub, ast.Call) and _moves_to_device(sub):
                        return node.func.id, sub.lineno
        base = next((b.id for b in cls.bases if isinstance(b, ast.Name)), None)
        if base is None:
            break
        name = base
    return None


def holds_device_tensors(ctx: FileContext, loader: LoaderCall) -> bool:
    """Whether the dataset is a TensorDataset of tensors moved to a device here
    (``x.cuda()``, ``x.to(device)``...): such batches cannot be pinned."""
    node = dataset_expression(ctx, loader)
    if not (isinstance(node, ast.Call) and ctx.call_name(node) in TENSOR_DATASET_NAMES):
        return False
    for sub in fast_walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in ("cuda", "npu", "to"):
            return True
        if isinstance(sub, ast.keyword) and sub.arg == "device":
            return True
    return False
