"""Where steps come from: the three sources that tell the harness's step recorder a
training step ended.

- :class:`OptimizerStepProbe`: a ``torch.optim`` optimizer finished ``step()``. The
  preferred source: once any optimizer has stepped, it alone cuts the run.
- :class:`BackwardStepProbe`: the fallback for loops that update their parameters by
  hand (``p.data.add_(p.grad, alpha=-lr)``, ``p -= lr * p.grad`` under ``no_grad``).
  A step begins at a backward pass that finds the gradients of the last step cleared.
- :class:`StepMarker`: ``--step-marker MODULE:FUNCTION``, each outermost return of the
  function. When given, it is the only source.

Each reports into the recorder through ``step_end(source)``, naming itself, so that
the profile says where its steps came from (``step_source``).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.command import ScriptCommand

#: Backward passes whose autograd graph is walked for the leaf tensors it reaches
#: (a GAN's second model shows up in the second pass); later passes are checked
#: against the leaves found by then.
GRAPH_WALKS = 8
#: Leaf tensors followed at most (a model with more parameter tensors than this is
#: judged by its first ones).
MAX_LEAVES = 20_000


# ------------------------------------------------------------------------- optimizer


class OptimizerStepProbe:
    """A step ends whenever the run's optimizer finishes ``step()``. With several
    optimizers (a GAN's two), the first one to step marks the boundaries. Every
    optimizer's ``step()`` is timed on the host (``add_optimizer``): what a fused
    optimizer could save at most, where the device is the host. A closure handed to
    ``step()`` (LBFGS, Lightning's automatic optimisation) runs the forward and
    backward inside it: its time is left out of the optimizer's."""

    def __init__(self, recorder: Any, clock: Callable[[], float] | None = None) -> None:
        import time

        self.recorder = recorder
        self.clock = clock or time.perf_counter
        self._handles: list[Any] = []
        self._optimizer: Any = None
        #: By optimizer: how deep its step() calls are nested, and when the outermost began.
        self._started: dict[int, tuple[int, float | None]] = {}
        #: By optimizer: seconds its step()'s closure has run in the step in progress.
        self._in_closure: dict[int, float] = {}
        self.calls = 0

    def _timed_closure(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The step's arguments with its closure (``step(closure)``) timed, as an
        optimizer step pre-hook returns them; None when there is no closure."""
        # torch hands the hooks step()'s arguments with the optimizer itself first.
        skip = 1 if args and args[0] is optimizer else 0
        positional = len(args) > skip and callable(args[skip])
        closure = args[skip] if positional else kwargs.get("closure")
        if not callable(closure):
            return None
        key = id(optimizer)

        def timed(*a: Any, **k: Any) -> Any:
            began = self.clock()
            try:
                return closure(*a, **k)
            finally:
                self._in_closure[key] = self._in_closure.get(key, 0.0) + self.clock() - began

        if positional:
            return (*args[:skip], timed, *args[skip + 1:]), kwargs
        return args, {**kwargs, "closure": timed}

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def before(optimizer, args, kwargs):
            # A subclass's step() that calls its parent's (both hooked) nests: only the
            # outermost call is the optimizer's step.
            depth, started = self._started.get(id(optimizer), (0, None))
            self._started[id(optimizer)] = (depth + 1, self.clock() if depth == 0 else started)
            if depth == 0:
                self._in_closure[id(optimizer)] = 0.0
                return self._timed_closure(optimizer, args, kwargs)
            return None

        def after(optimizer, args, kwargs):
            depth, started = self._started.pop(id(optimizer), (1, None))
            if depth > 1:
                self._started[id(optimizer)] = (depth - 1, started)
                return
            closure = self._in_closure.pop(id(optimizer), 0.0)
            if started is not None:
                # The closure (forward and backward, called by step(): LBFGS, Lightning)
                # is not the optimizer's update.
                self.recorder.add_optimizer(max(self.clock() - started - closure, 0.0))
            current = self._optimizer() if self._optimizer is not None else None
            if current is None:
                self._optimizer = weakref.ref(optimizer)
            elif current is not optimizer:
                return
            self.calls += 1
            self.recorder.step_end("optimizer")

        self._handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# -------------------------------------------------------------------------- backward


class _Leaf:
    """What the probe remembers of one leaf tensor (a parameter): its gradient as the
    last backward pass left it, and the step in which that gradient was started."""

    __slots__ = ("tensor", "grad", "version", "step")

    def __init__(self, tensor: Any) -> None:
        self.tensor = weakref.ref(tensor)
        self.grad: Any = None  # a weak reference to the gradient tensor, or None
        self.version = -1
        self.step: int | None = None  # None: it never had a gradient


class BackwardStepProbe:
    """Steps from the backward pass, for loops without a ``torch.optim`` optimizer.

    Wraps ``torch.autograd.backward`` (what ``loss.backward()`` calls). The parameters
    are the leaf tensors the first backward passes' autograd graphs reach. Between two
    passes the probe looks at their gradients: one that is gone (``zero_grad()``,
    ``p.grad = None``), replaced, or changed in place (``p.grad.zero_()``, clipping) was
    consumed by an update. A backward pass starts a new step when a parameter whose
    gradient it finds consumed had already started one in the step in progress; so
    micro-batches that accumulate into the same gradients are one step, and a GAN's
    two models, each cleared and updated once an iteration, are one step too.

    The optimizer hook is preferred: backward passes inside an optimizer's ``step()``
    (an LBFGS closure) are not looked at, and once any optimizer has stepped the probe
    stands aside for good. Its check costs a few attribute reads per parameter per
    backward pass, and nothing once an optimizer steps.
    """

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.backwards = 0
        self.boundaries = 0
        self._leaves: dict[int, _Leaf] = {}
        self._walks = 0
        self._step = 1
        self._optimizer_depth = 0
        self._optimizer_stepped = False
        self._inside = False
        self._original: Callable | None = None
        self._handles: list[Any] = []

    @property
    def active(self) -> bool:
        return not self._optimizer_stepped and not self._optimizer_depth and not self._inside

    def install(self) -> None:
        import functools

        import torch.autograd
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def before_optimizer(optimizer, args, kwargs):
            self._optimizer_depth += 1

        def after_optimizer(optimizer, args, kwargs):
            self._optimizer_depth = max(0, self._optimizer_depth - 1)
            self._optimizer_stepped = True
            self._leaves.clear()

        self._handles = [register_optimizer_step_pre_hook(before_optimizer),
                         register_optimizer_step_post_hook(after_optimizer)]
        original = self._original = torch.autograd.backward
        probe = self

        @functools.wraps(original)
        def backward(tensors, *args, **kwargs):
            if not probe.active:
                return original(tensors, *args, **kwargs)
            probe.before(tensors)
            probe._inside = True  # a reentrant checkpoint's inner backward is the same pass
            try:
                return original(tensors, *args, **kwargs)
            finally:
                probe._inside = False
                probe.after()

        torch.autograd.backward = backward

    def uninstall(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        if self._original is not None:
            import torch.autograd

            torch.autograd.backward = self._original
            self._original = None

    # -- the check

    def before(self, tensors: Any) -> None:
        """At the start of a backward pass: a step boundary when the gradients of the
        step in progress were consumed."""
        recorder = self.recorder
        recorder.check_stop()
        self.backwards += 1
        if self.backwards == 1:
            recorder.activity()
        if self._walks < GRAPH_WALKS:
            self._walks += 1
            self._walk(tensors)
        step = self._step
        started: list[_Leaf] = []
        boundary = False
        for leaf in self._leaves.values():
            tensor = leaf.tensor()
            if tensor is None:
                continue
            grad = tensor.grad
            if leaf.step is None:
                started.append(leaf)  # its first gradient is about to start
                continue
            if grad is None:
                consumed = leaf.grad is not None
            else:
                consumed = leaf.grad is None or leaf.grad() is not grad or grad._version != leaf.version
            if consumed:
                started.append(leaf)
                boundary = boundary or leaf.step == step
        if boundary:
            self._step = step = step + 1
        for leaf in started:
            leaf.step = step
            leaf.grad = None
            leaf.version = -1
        if boundary:
            self.boundaries += 1
            recorder.step_end("backward")

    def after(self) -> None:
        """At the end of a backward pass: remember each gradient as it was left."""
        for leaf in self._leaves.values():
            tensor = leaf.tensor()
            grad = tensor.grad if tensor is not None else None
            if grad is None:
                leaf.grad = None
            else:
                if leaf.grad is None or leaf.grad() is not grad:
                    leaf.grad = weakref.ref(grad)
                leaf.version = grad._version

    def _walk(self, tensors: Any) -> None:
        """Add the leaf tensors this pass's graph reaches (its ``AccumulateGrad`` nodes)."""
        import torch

        roots = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        leaves = self._leaves
        stack: list[Any] = []
        for root in roots:
            if not isinstance(root, torch.Tensor):
                continue
            if root.grad_fn is not None:
                stack.append(root.grad_fn)
            elif root.requires_grad and id(root) not in leaves:
                leaves[id(root)] = _Leaf(root)
        seen: set[int] = set()
        kept: list[Any] = []  # the nodes stay alive, so that their ids are not reused during the walk
        while stack and len(leaves) < MAX_LEAVES:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            kept.append(node)
            variable = getattr(node, "variable", None)
            if variable is not None:
                if id(variable) not in leaves or leaves[id(variable)].tensor() is not variable:
                    leaves[id(variable)] = _Leaf(variable)
                continue
            for child, _ in getattr(node, "next_functions", ()):
                if child is not None and id(child) not in seen:
                    stack.append(child)


# ---------------------------------------------------------------------------- marker


@dataclass
class StepMarker:
    """``--step-marker module:function``: each outermost return of the function ends a
    step (the returns of its calls to itself are inside the step).

    ``function`` may be dotted (``Trainer.train_step``). The module is imported
    before the script runs, with the script's folder on ``sys.path``. A function of
    the script itself (``__main__:train_step``, or the script's own name) is found
    when it is first called, through a trace function that is removed as soon as
    that call returns (the start-up runs slower until then)."""

    module: str
    qualname: str
    calls: int = 0
    _restore: list[Callable[[], None]] = field(default_factory=list)
    _imported: str | None = None
    _local: threading.local = field(default_factory=threading.local)

    @classmethod
    def parse(cls, text: str) -> "StepMarker":
        module, sep, qualname = text.partition(":")
        parts = qualname.split(".")
        if not sep or not module or not all(p.isidentifier() for p in parts) or \
                not all(p.isidentifier() for p in module.split(".")):
            raise TorchaxeError(f"--step-marker {text}: expected MODULE:FUNCTION, e.g. train:train_step or mylib.loop:Trainer.step")
        return cls(module, qualname)

    def _in_script(self, command: ScriptCommand) -> bool:
        if self.module == "__main__":
            return True
        if command.kind == "path":
            return self.module == Path(command.target).stem
        return self.module == command.target

    def install(self, recorder: Any, command: ScriptCommand) -> None:
        if self._in_script(command):
            self._install_traced(recorder, command)
        else:
            self._install_imported(recorder, command)

    # -- nesting: only the outermost call is a step

    def _enter(self, recorder: Any) -> int:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            recorder.activity()
        self._local.depth = depth + 1
        return depth

    def _leave(self, depth: int, recorder: Any, returned: bool) -> None:
        self._local.depth = depth
        if depth == 0 and returned:
            self.calls += 1
            recorder.step_end("marker")

    def _wrap(self, function: Callable, recorder: Any) -> Callable:
        import functools

        @functools.wraps(function)
        def marked(*args, **kwargs):
            depth = self._enter(recorder)
            returned = False
            try:
                result = function(*args, **kwargs)
                returned = True
            finally:
                self._leave(depth, recorder, returned)
            return result

        return marked

    def _install_imported(self, recorder: Any, command: ScriptCommand) -> None:
        import importlib

        folder = str(command.folder)
        before = set(sys.modules)
        sys.path.insert(0, folder)
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            raise TorchaxeError(f"--step-marker {self.module}:{self.qualname}: cannot import {self.module} ({exc})") from None
        finally:
            sys.path.remove(folder)
        if self.module not in before:
            self._imported = self.module
        *owners, name = self.qualname.split(".")
        owner: Any = module
        for part in owners:
            owner = getattr(owner, part, None)
        function = getattr(owner, name, None) if owner is not None else None
        if not callable(function):
            raise TorchaxeError(f"--step-marker {self.module}:{self.qualname}: no function {self.qualname} in {self.module}")
        original = owner.__dict__.get(name, function) if hasattr(owner, "__dict__") else function
        if isinstance(original, (staticmethod, classmethod)):
            wrapped: Any = type(original)(self._wrap(original.__func__, recorder))
        else:
            wrapped = self._wrap(function, recorder)
        setattr(owner, name, wrapped)
        self._restore.append(lambda: setattr(owner, name, original))

    def _install_traced(self, recorder: Any, command: ScriptCommand) -> None:
        import importlib.util

        if command.kind == "path":
            filename = os.path.realpath(command.target)
        else:
            spec = importlib.util.find_spec(command.target)
            filename = os.path.realpath(spec.origin) if spec and spec.origin else ""
        qualname = self.qualname
        last = qualname.rsplit(".", 1)[-1]
        marker = self
        first: dict[str, int] = {}  # the depth the first, traced call entered at

        def on_return(frame, event, arg):
            if event == "return":
                sys.settrace(None)
                marker._leave(first["depth"], recorder, returned=True)
            return on_return

        def on_call(frame, event, arg):
            code = frame.f_code
            if first or event != "call" or code.co_name != last or getattr(code, "co_qualname", qualname) != qualname:
                return None
            if os.path.realpath(code.co_filename) != filename:
                return None
            # Its calls to itself and every later call go through the wrapper.
            marker._replace_in(frame.f_globals, recorder)
            first["depth"] = marker._enter(recorder)
            frame.f_trace_lines = False
            return on_return

        sys.settrace(on_call)
        self._restore.append(lambda: sys.settrace(None))

    def _replace_in(self, namespace: dict, recorder: Any) -> None:
        *owners, name = self.qualname.split(".")
        owner: Any = None
        if owners:
            owner = namespace.get(owners[0])
            for part in owners[1:]:
                owner = getattr(owner, part, None)
            if owner is None:
                return
            original = owner.__dict__.get(name)
            if original is None:
                return
            if isinstance(original, (staticmethod, classmethod)):
                setattr(owner, name, type(original)(self._wrap(original.__func__, recorder)))
            else:
                setattr(owner, name, self._wrap(original, recorder))
        elif callable(namespace.get(name)):
            namespace[name] = self._wrap(namespace[name], recorder)

    def uninstall(self) -> None:
        while self._restore:
            self._restore.pop()()
        if self._imported:
            sys.modules.pop(self._imported, None)
            self._imported = None
