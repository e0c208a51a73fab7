"""``torch.compile`` of one module in place, in a way that compiles it.

``module.compile()`` compiles ``nn.Module``'s call for that instance and keeps the
object, its class and its ``state_dict`` keys, which is what a knob or a tuned
strategy wants. But torch.compile does not trace into torch's own layers and
containers (``torch.nn.modules``: ``nn.Linear``, ``nn.Sequential``, ``nn.LayerNorm``,
...) from there: for those it is a silent no-op, and the module stays eager.

Such a module gets its ``forward`` compiled instead, as an instance attribute
(runtime/instance_forward.py): a compiled function that calls the class's
``forward``, bound to the instance. A copy (``copy.deepcopy``: an EMA copy of the
model) or a pickled model leaves it out and runs eager on its own parameters, as
torch's ``module.compile()`` does. The function is made afresh for each module (its own code object, so its
own compile cache: no module's graphs count against another's recompile limit), with
the globals of the user code inside the module: torch.compile looks the globals of an
inlined function up by its module's name unless they are the root function's, and a
script's classes name ``__main__``, which once the script has stopped (the tuner
measures then) is no longer the script.
"""

from __future__ import annotations

import types
from typing import Any

from torchaxe.runtime.instance_forward import set_forward

#: How :func:`compile_in_place` compiled a module.
MODULE = "module"
FORWARD = "forward"


def is_torch_layer(module: Any) -> bool:
    """Whether ``module``'s ``forward`` is one of torch's own layers or containers."""
    forward = getattr(type(module), "forward", None)
    return (getattr(forward, "__module__", None) or "").startswith("torch.nn.modules.")


def inner_of_wrapper(module: Any) -> Any:
    """The module a ``DistributedDataParallel`` wrapper holds (``module.module``), else
    ``module``. torch's guide on where to apply torch.compile says it does not handle
    the distributed wrappers well and to compile the module inside (as rule AX606
    says of the scripts' own code); DDP's forward marks itself active around the
    inner call, so the compiler still splits the graph at DDP's buckets."""
    from torch import nn

    inner = getattr(module, "module", None)
    if isinstance(module, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        return inner
    return module


#: Logger methods a library calls from a model's forward to say something once
#: (``transformers`` adds them to ``logging.Logger``): dynamo breaks the graph at each
#: such call (GPT-2's loss-type notice split its compiled forward in two, and its
#: compile from the caches took 3.6 s as one graph, 5.4 to 7.4 s as two).
ONCE_LOGGING = ("warning_once", "info_once")


def ignore_once_logging() -> None:
    """Have dynamo skip the once-only logger methods a library added (``ONCE_LOGGING``)
    in compiled code, where torch has the setting
    (``torch._dynamo.config.ignore_logging_functions``). The message is not printed
    from compiled code: it says something once, at most."""
    import logging

    from torch._dynamo import config

    ignored = getattr(config, "ignore_logging_functions", None)
    if not isinstance(ignored, set):
        return
    for name in ONCE_LOGGING:
        method = getattr(logging.Logger, name, None)
        if callable(method):
            ignored.add(method)


def compile_in_place(module: Any, **kwargs: Any) -> str:
    """Compile ``module`` in place with ``torch.compile(**kwargs)``; returns how:
    :data:`MODULE` (``module.compile``) or :data:`FORWARD` (its forward, for torch's
    own layers). A ``DistributedDataParallel`` wrapper has the module inside it
    compiled (:func:`inner_of_wrapper`); a library's once-only logging in its forward
    does not break the graph (:func:`ignore_once_logging`)."""
    module = inner_of_wrapper(module)
    ignore_once_logging()
    if not is_torch_layer(module):
        module.compile(**kwargs)
        return MODULE
    import torch

    set_forward(module, types.MethodType(torch.compile(_forward_caller(module), **kwargs), module))
    return FORWARD


def _call_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    return type(self).forward(self, *args, **kwargs)


def _forward_caller(module: Any) -> types.FunctionType:
    """A new function running ``type(module).forward``, with the globals of the first
    module inside ``module`` that is not torch's own (else this file's)."""
    namespace = globals()
    for sub in module.modules():
        if not is_torch_layer(sub):
            found = getattr(getattr(type(sub), "forward", None), "__globals__", None)
            if isinstance(found, dict):
                namespace = found
                break
    return types.FunctionType(_call_forward.__code__.replace(), namespace, "forward")


def is_compiled_in_place(module: Any) -> bool:
    """Whether :func:`compile_in_place` (or ``module.compile``) compiled ``module``."""
    return getattr(module, "_compiled_call_impl", None) is not None or "forward" in vars(module)
