"""Keeping torchaxe's probes out of the user's compiled graphs.

A script that calls ``torch.compile`` itself has dynamo trace every global module hook
and every patch of ``nn.Module.__call__`` into its graphs. torchaxe's probes keep
Python state (dicts of the modules seen, thread-locals) that dynamo cannot or should
not trace, so each returns at once while dynamo traces: :func:`compiling` is True
then (dynamo treats it as a constant) and False in eager code.
"""

from __future__ import annotations

import contextlib

from typing import Any, Callable, Iterator


def compiling_check() -> Callable[[], bool]:
    """torch's own "is dynamo tracing now?" function (``torch.compiler.is_compiling``
    from torch 2.3, ``torch._dynamo``'s before), or one that always says no. A probe
    that patches tensor methods calls it directly: dynamo knows it as a constant."""
    import torch

    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if check is None:
        check = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return check or (lambda: False)


_check: Callable[[], bool] | None = None


def compiling() -> bool:
    """Whether dynamo is tracing the code that calls this (torch imported already)."""
    global _check
    if _check is None:
        _check = compiling_check()
    return _check()


def quiet_global_hook_warning() -> None:
    """torch warns, at the script's own ``torch.compile(module)`` call, that global
    module hooks fire an extra time for the compiled wrapper. Those hooks are
    torchaxe's probes, which count that call once (see :func:`compiling`), so the
    warning would only point the user at their own line for nothing."""
    import warnings

    warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")


def add_global_forward_pre_hook(hook: Callable[..., object]) -> object:
    """``hook`` registered before every ``nn.Module`` call of the process; returns its
    handle. torch's warning about global hooks and compiled modules is silenced (see
    :func:`quiet_global_hook_warning`)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    handle = register_module_forward_pre_hook(hook)
    quiet_global_hook_warning()
    return handle


def frames_compiled() -> int:
    """How many frames dynamo has set out to compile in this process so far (0 when it
    was never loaded). A global module hook registered before such a compile may be
    traced into its graph, whose guards then check how many global hooks there are:
    removing the hook afterwards would make the graph recompile."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["total"])
    except Exception:  # noqa: BLE001 - a torch without the counter: assume a compile happened
        return 1 << 30


class OneShotModuleHook:
    """Runs ``action`` at the first ``nn.Module`` call made outside a compiled graph (a
    global forward pre-hook), then removes itself -- unless dynamo compiled a frame
    while it was registered: the hook then stays registered and does nothing more, so
    that the count of global hooks a compiled graph guards on does not change (a
    change would recompile the model, possibly in the middle of a measured step)."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action
        self.fired = False
        self._handle = None
        self._frames_at_install = 0

    def install(self) -> None:
        self._frames_at_install = frames_compiled()

        def hook(module, args):
            if compiling() or self.fired:
                return
            self.fired = True
            if frames_compiled() == self._frames_at_install:
                self.uninstall()
            self.action()

        self._handle = add_global_forward_pre_hook(hook)

    def uninstall(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def eager_stance() -> Any:
    """torch.compile told to run eagerly until the returned context is exited (its
    ``__exit__`` called); None where torch has no stances (before 2.6) or the
    compiler is not loaded: a script that compiles nothing has nothing to protect."""
    import sys

    compiler = sys.modules.get("torch.compiler")
    set_stance = getattr(compiler, "set_stance", None)
    if set_stance is None or "torch._dynamo" not in sys.modules:
        return None
    try:
        stance = set_stance("force_eager")
        stance.__enter__()
    except Exception:  # noqa: BLE001 - the caller goes on without it
        return None
    return stance


def compiled_by_script(model: Any) -> Any:
    """The module that a script's own ``torch.compile(model)`` wraps (the compiled
    wrapper's ``_orig_mod``), or None for a module that is not such a wrapper."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ != "OptimizedModule" or inner is None:
        return None
    from torch import nn

    return inner if isinstance(inner, nn.Module) else None


def refresh_tensor_attributes() -> None:
    """After torchaxe's wrappers of ``torch.Tensor`` methods are removed, have dynamo
    see torch's own methods again. Dynamo keeps one snapshot of the tensor class's
    attributes, taken when its tensor module is first imported: imported while the
    wrappers were installed (a script or a library imports dynamo during the watched
    steps), the snapshot holds them, and a later compile in this process (the tuner's)
    traced the removed wrapper of ``Tensor.to`` and failed building its guards
    ("'method_descriptor' object has no attribute '__closure__'", an HF ViT's loss).
    Nothing to do when dynamo was never imported."""
    import sys

    module = sys.modules.get("torch._dynamo.variables.tensor")
    if module is None or not hasattr(module, "all_tensor_attrs"):
        return
    import torch

    module.all_tensor_attrs = torch._C.TensorBase.__dict__ | torch.Tensor.__dict__


def graphs_compiled() -> int:
    """How many graphs dynamo has made in this process so far (0 when it was never
    loaded): a compile that adds none ran its code eagerly (code it cannot trace, an
    input such as a sparse tensor, the recompile limit)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    try:
        return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0


def fresh_caches() -> None:
    """Forget every frame dynamo compiled in this process (``torch._dynamo.reset()``),
    so that the next compile starts anew. Candidates compiled one after another share
    their modules' code: each new compile of it (another backend, another mode) adds a
    cache entry, and past the recompile limit (8) dynamo runs the code eagerly without
    a word, so later candidates were timed as eager. Nothing to do when dynamo was
    never imported."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return
    import torch._dynamo

    torch._dynamo.reset()


def fallback_reasons() -> dict[str, int]:
    """Why dynamo ran code eagerly so far, by reason (its ``unimplemented`` and
    ``graph_break`` counters: a graph break, the recompile limit), with counts."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    out: dict[str, int] = {}
    try:
        for kind in ("unimplemented", "graph_break"):
            for reason, count in utils.counters[kind].items():  # type: ignore[union-attr]
                out[str(reason)] = out.get(str(reason), 0) + int(count)
    except (AttributeError, KeyError, TypeError, ValueError):
        return {}
    return out


@contextlib.contextmanager
def script_as_main(model: Any) -> Iterator[None]:
    """While compiling ``model`` after its script ran as ``__main__`` (the run is over:
    ``sys.modules["__main__"]`` is torchaxe's own again), ``__main__`` is a module
    holding the script's globals. Dynamo looks the globals of a function it inlines up
    by the function's module name when they are not its root frame's (a method whose
    globals the replace strategy swapped calls one of the script's own), and found
    torchaxe's ``__main__``: "module '__main__' has no attribute 'math'". Nothing
    changes for a model whose classes come from importable modules."""
    import sys
    import types

    namespace = None
    for sub in model.modules() if hasattr(model, "modules") else ():
        for value in vars(type(sub)).values():
            if isinstance(value, types.FunctionType) and value.__globals__.get("__name__") == "__main__":
                namespace = value.__globals__
                break
        if namespace is not None:
            break
    current = sys.modules.get("__main__")
    if namespace is None or getattr(current, "__dict__", None) is namespace:
        yield
        return
    main = types.ModuleType("__main__")
    main.__dict__.update(namespace)
    sys.modules["__main__"] = main
    try:
        yield
    finally:
        if current is not None:
            sys.modules["__main__"] = current
        else:
            sys.modules.pop("__main__", None)
