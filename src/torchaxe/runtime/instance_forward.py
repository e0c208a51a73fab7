"""A knob's new ``forward`` for one module instance, which copies and pickles leave out.

Knobs that change how one model runs without touching its class -- mixed precision
(autocast), ``torch.compile`` of torch's own layers, activation checkpointing -- put a
new ``forward`` in the instance's ``__dict__``. Scripts copy and save their models
whole: ``torch.save(model, path)`` for the best checkpoint (pytorch/examples'
word_language_model), ``copy.deepcopy(model)`` for an EMA or a frozen teacher. A
closure in the instance's ``__dict__`` breaks both: pickle cannot store it (it is not
importable by name), and a deep copy shares it, so the copy's ``forward`` runs the
original's parameters.

So the instance also gets a ``__getstate__`` (looked up on the instance by pickle and
by ``copy``) that hands back the state the script made: without the knob's forward
(or with the script's own instance ``forward``, if it had one) and without itself. A
copy or a saved model is the model as the script wrote it, eager and full precision,
as ``nn.Module.__getstate__`` already does for ``module.compile()``.
"""

from __future__ import annotations

import types
from typing import Any

#: Instance-``__dict__`` key of the script's own ``forward`` before the first knob's:
#: ``(True, value)`` when the instance had one, ``(False, None)`` when it used its class's.
BEFORE = "_torchaxe_forward_before"


def set_forward(module: Any, forward: Any) -> None:
    """Make ``forward`` the instance's ``forward``; copies and pickles leave it out."""
    state = vars(module)
    if BEFORE not in state:
        state[BEFORE] = ("forward" in state, state.get("forward"))
        state["__getstate__"] = types.MethodType(_state_as_written, module)
    state["forward"] = forward


def _state_as_written(module: Any) -> dict[str, Any]:
    state = dict(type(module).__getstate__(module))
    had, forward = state.pop(BEFORE)
    state.pop("__getstate__", None)
    if had:
        state["forward"] = forward
    else:
        state.pop("forward", None)
    return state
