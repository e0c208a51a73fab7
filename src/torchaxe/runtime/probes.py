"""The probes the harness installs in the user's process, each with one job.

Every probe has ``install()`` and ``uninstall()``, touches only what it restores, and
reports into a :class:`StepSink` (the harness's step recorder). They are built to cost
microseconds per event: the default set (data wait, host syncs, garbage collection)
must add no more than a few percent to a training step (benchmarks/harness_overhead.py).

``CodeMap`` decides whose code a frame belongs to: torch's (and torchaxe's) own, a
library's (the standard library, site-packages), or the user's.
"""

from __future__ import annotations

import gc
import linecache
import os
import sys
import sysconfig
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from torchaxe.installs import install_folder
from torchaxe.runtime.dynamo import (OneShotModuleHook, add_global_forward_pre_hook, compiling, compiling_check,
                                     refresh_tensor_attributes)
from torchaxe.runtime.profile import HostSyncSite, InputSignature, ShapeTally

#: Distinct input signatures kept per module before it is marked ``truncated``.
MAX_SIGNATURES = 32



def patch_method(saved: list, owner: type, name: str, make: Callable[[Any], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)``, named like it, and remember the
    original in ``saved`` (``(owner, name, original)``) to be put back in reverse order."""
    original = owner.__dict__[name]
    saved.append((owner, name, original))
    wrapper = make(original)
    wrapper.__name__ = name
    wrapper.__qualname__ = f"{owner.__name__}.{name}"
    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)

def patch_attribute(saved: list, owner: Any, name: str, wrapper: Callable) -> None:
    """Set ``owner.name`` to ``wrapper`` (which takes the original's name and doc),
    remembering ``(owner, name, original, own)`` in ``saved``; ``own`` is False where
    the original is inherited (a ``torch.Tensor`` method of ``torch._C.TensorBase``)."""
    original = getattr(owner, name)
    saved.append((owner, name, original, name in vars(owner)))
    wrapper.__name__ = name
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)


def restore_patches(saved: list) -> None:
    """Undo the ``(owner, name, original, own)`` patches of ``saved``, last first; an
    inherited original is uncovered again rather than copied onto the owner."""
    import torch

    tensor = False
    while saved:
        owner, name, original, own = saved.pop()
        tensor = tensor or owner is torch.Tensor
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
    if tensor:
        refresh_tensor_attributes()


class StepSink(Protocol):
    """What the probes report to (implemented by the harness's StepRecorder)."""

    started: bool

    def activity(self) -> None: ...
    def add_data_wait(self, seconds: float, batches: int) -> None: ...
    def add_backward(self, seconds: float) -> None: ...
    #: Backward passes seen so far (``add_backward`` calls).
    backward_calls: int
    def add_sync(self) -> None: ...
    def add_gc(self, seconds: float) -> None: ...
    def add_comm(self, seconds: float) -> None: ...
    def add_no_grad(self, seconds: float) -> None: ...
    def add_optimizer(self, seconds: float) -> None: ...
    def check_stop(self) -> None: ...


# --------------------------------------------------------------------- whose code


def _package_dir(name: str) -> str | None:
    """A package's folder, found without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


class CodeMap:
    """Classifies source files: ``internal`` (torch, torch_npu, torchaxe), ``library``
    (standard library, site-packages, frozen modules) or ``user``. Results are cached
    per file name, so a lookup on a hot path is one dict access."""

    def __init__(self, internal: tuple[str, ...] | None = None, library: tuple[str, ...] | None = None,
                 cwd: str | None = None, installed: tuple[str, ...] | None = None) -> None:
        paths = sysconfig.get_paths()
        if internal is None:
            internal = tuple(d for d in (_package_dir("torch"), _package_dir("torch_npu"), _package_dir("torchaxe")) if d)
        if installed is None:
            installed = tuple({os.path.realpath(paths[k]) for k in ("purelib", "platlib") if k in paths}) \
                if library is None else ()
        if library is None:
            library = tuple({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})
        self._internal = tuple(p.rstrip(os.sep) + os.sep for p in internal)
        # Longest first: site-packages may sit inside the standard library's folder.
        self._library = tuple(sorted((p.rstrip(os.sep) + os.sep for p in library), key=len, reverse=True))
        #: Where installed packages live (site-packages), apart from the standard library.
        self._installed = tuple(p.rstrip(os.sep) + os.sep for p in installed)
        self._cwd = (cwd or os.getcwd()).rstrip(os.sep) + os.sep
        self._kinds: dict[str, str] = {}
        self._shown: dict[str, str] = {}
        torch_dir = next((p for p in self._internal if p.endswith(f"{os.sep}torch{os.sep}")), None)
        #: torch's Python-side Tensor methods (``__format__``, ``__repr__``, ``__array__``):
        #: a read they make is the caller's read. Their kind is ``tensor``.
        self._tensor_files = frozenset(
            os.path.join(torch_dir, name) for name in ("_tensor.py", "_tensor_str.py")
        ) if torch_dir else frozenset()

    def kind(self, filename: str) -> str:
        """``internal``, ``tensor`` (torch's Tensor methods), ``library`` or ``user``."""
        found = self._kinds.get(filename)
        if found is None:
            found = self._classify(filename)
            self._kinds[filename] = found
        return found

    def _classify(self, filename: str) -> str:
        if filename.startswith("<"):
            return "library"  # <frozen runpy>, <string>, <stdin>
        real = os.path.realpath(filename)
        if real in self._tensor_files:
            return "tensor"
        if real.startswith(self._internal):
            return "internal"
        if real.startswith(self._library):
            return "library"
        if install_folder(real) is not None:
            return "library"  # pip install --target FOLDER on the path, whatever its name
        return "user"

    def is_installed(self, filename: str) -> bool:
        """Whether a library file belongs to an installed package (site-packages, or a
        folder pip installed into with ``--target``), not to the standard library."""
        real = os.path.realpath(filename)
        return real.startswith(self._installed) or (
            not real.startswith(self._library) and install_folder(real) is not None)

    def show_library(self, filename: str, line: int) -> str:
        """A library's line as ``package/module.py:line``: relative to its library
        folder (``transformers/trainer.py:2345``, ``logging/__init__.py:1534``)."""
        real = os.path.realpath(filename)
        root = next((p for p in self._library if real.startswith(p)), None)
        if root is None:
            folder = install_folder(real)
            root = folder.rstrip(os.sep) + os.sep if folder else None
        return f"{real[len(root):] if root else self.show(filename)}:{line}"

    def show(self, filename: str) -> str:
        """The file name as the user would type it: relative to the working folder
        when it is below it, else absolute."""
        shown = self._shown.get(filename)
        if shown is None:
            real = os.path.abspath(filename)
            shown = real[len(self._cwd):] if real.startswith(self._cwd) else real
            self._shown[filename] = shown
        return shown


# ----------------------------------------------------------------------- data wait


#: The lines outside torch that built each DataLoader of the run (``_noting_builder``).
_LOADER_SITES: "weakref.WeakKeyDictionary[Any, list[str]]" = weakref.WeakKeyDictionary()


def _sites_of(loader: Any) -> list[str] | None:
    """The lines that built ``loader``, when noted (a loader class that cannot be
    weakly referenced or hashed is not)."""
    try:
        return _LOADER_SITES.get(loader)
    except TypeError:
        return None


def _rebuilt_from(loader: Any, found: list[str]) -> list[str]:
    """The lines that built the loaders ``loader`` was rebuilt from: a loader an
    installed package builds over the dataset of a loader built before
    (``accelerator.prepare(train_loader)``, a trainer adding a distributed sampler) is
    that loader for the run's purposes, so that batches it feeds to training count for
    the line the user wrote. Nothing for a loader built by the user's own code."""
    if not found or not (any(part in found[0] for part in _PACKAGE_DIRS)
                         or install_folder(found[0].rsplit(":", 1)[0]) is not None):
        return []
    dataset = getattr(loader, "dataset", None)
    inherited: list[str] = []
    for other, sites in list(_LOADER_SITES.items()):
        if other is not loader and dataset is not None and getattr(other, "dataset", None) is dataset:
            inherited.extend(site for site in sites if site not in found and site not in inherited)
    return inherited


#: Parts of the path of an installed package's file.
_PACKAGE_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def _noting_builder(original: Callable) -> Callable:
    """``DataLoader.__init__`` noting, in the run's context, the lines outside torch
    that built the loader."""
    from torchaxe.runtime import run_context

    sites: list[str] = []
    classes: list[str] = []
    run_context.EXECUTED["loader_sites"] = sites  # this run's, from the start
    run_context.EXECUTED["dataset_classes"] = classes
    workers: dict[str, int] = {}
    run_context.EXECUTED["loader_workers"] = workers
    run_context.OBSERVED["loader_epochs"] = []

    def __init__(loader, *args, **kwargs):
        try:
            dataset = kwargs.get("dataset", args[0] if args else None)
            for place in run_context.dataset_class_ranges(dataset):
                if place not in classes:
                    classes.append(place)
        except Exception:  # noqa: BLE001 - an observation must never break the user's run
            pass
        builder = None
        found: list[str] = []
        try:
            found = run_context.caller_sites(sys._getframe(1))
            builder = found[0] if found else None
            sites.extend(site for site in found if site not in sites)
        except Exception:  # noqa: BLE001 - an observation must never break the user's run
            pass
        result = original(loader, *args, **kwargs)
        try:
            count = getattr(loader, "num_workers", None)
            if isinstance(count, int):
                for site in found:
                    workers[site] = max(workers.get(site, 0), count)
            _LOADER_SITES[loader] = found + _rebuilt_from(loader, found)
            run_context.note_loader(loader, builder)
        except Exception:  # noqa: BLE001 - an observation must never break the user's run
            pass
        return result

    return __init__


#: Set while a DataLoader fetch runs in this thread (``DataWaitProbe``): the reads a
#: dataset makes of its host tensors then are data preparation, on the host in a
#: device run too, not reads a device would wait for.
_FETCHING = threading.local()


class DataWaitProbe:
    """Times ``DataLoader.__iter__`` (worker start-up) and the iterator's
    ``__next__`` (waiting for a batch): the time the training loop is blocked on
    data. With ``batch_shapes`` it also tallies the shapes of the training batches:
    a batch counts once a backward pass follows it before its loader yields again
    (an evaluation loop's batches, often of another size, never do), and never when
    it was fetched with gradients off. ``settle_batches`` counts the last ones."""

    def __init__(self, sink: StepSink, clock: Callable[[], float], batch_shapes: "ShapeTallier | None" = None) -> None:
        self.sink = sink
        self.clock = clock
        self.batch_shapes = batch_shapes
        self._saved: list[tuple[type, str, Any]] = []
        self._local = threading.local()
        #: Per loader iterator: its last batch's signature and the backward passes seen when it came.
        self._pending: dict[int, tuple[tuple, int]] = {}
        #: Per loader iterator: the lines that built its loader.
        self._iterator_sites: dict[int, list[str]] = {}
        #: The lines that built a loader whose batches fed a training step (a backward
        #: pass followed them), kept in the run's context; None without ``batch_shapes``.
        self._training_sites: list[str] | None = None
        self._grad_enabled: Callable[[], bool] = lambda: True

    def install(self) -> None:
        import torch
        from torch.utils.data import dataloader

        from torchaxe.runtime import run_context

        self._grad_enabled = torch.is_grad_enabled
        if self.batch_shapes is not None:
            self._training_sites = []
            run_context.EXECUTED["training_loader_sites"] = self._training_sites

        self._patch(dataloader._BaseDataLoaderIter, "__next__", self._timed_next)
        self._patch(dataloader.DataLoader, "__iter__", self._timed_iter)
        self._patch(dataloader.DataLoader, "__init__", _noting_builder)

    def _patch(self, owner: type, name: str, make: Callable[[Any], Callable]) -> None:
        patch_method(self._saved, owner, name, make)

    def uninstall(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def _timed(self, original: Callable, counts_batch: bool) -> Callable:
        sink, clock, local, shapes = self.sink, self.clock, self._local, self.batch_shapes

        def timed(loader_or_iter):
            sink.check_stop()
            if getattr(local, "depth", 0):  # a loader read inside another one's fetch
                return original(loader_or_iter)
            sink.activity()
            if counts_batch and shapes is not None:
                self._settle(id(loader_or_iter))  # its last batch had its backward pass, or never will
            local.depth = 1
            _FETCHING.active = True
            start = clock()
            fetched = False
            try:
                result = original(loader_or_iter)
                fetched = counts_batch
                return result
            finally:
                local.depth = 0
                _FETCHING.active = False
                sink.add_data_wait(clock() - start, 1 if fetched else 0)
                if fetched and shapes is not None:
                    self._batch(id(loader_or_iter), result)
                elif not counts_batch and shapes is not None:
                    sites = _sites_of(loader_or_iter)
                    if sites:
                        self._iterator_sites[id(result)] = sites

        return timed

    def _batch(self, key: int, batch: Any) -> None:
        if self._grad_enabled():
            self._pending[key] = (self.batch_shapes.signature(batch), self.sink.backward_calls)

    def _settle(self, key: int) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None and self.sink.backward_calls > pending[1]:
            self.batch_shapes.add_signature(pending[0])
            training = self._training_sites
            if training is not None:
                training.extend(s for s in self._iterator_sites.get(key, ()) if s not in training)

    def settle_batches(self) -> None:
        """Count the batches still waiting whose backward pass came."""
        for key in list(self._pending):
            self._settle(key)

    def _timed_next(self, original: Callable) -> Callable:
        return self._timed(original, counts_batch=True)

    def _timed_iter(self, original: Callable) -> Callable:
        return self._timed(original, counts_batch=False)


# ------------------------------------------------------------------------ backward


class BackwardProbe:
    """Times ``torch.autograd.backward`` (what ``loss.backward()`` calls). In
    data-parallel training a rank waits there for the others' gradients, so the
    time a rank spends outside backward tells the rank the others wait for."""

    def __init__(self, sink: StepSink, clock: Callable[[], float]) -> None:
        self.sink = sink
        self.clock = clock
        self._original: Callable | None = None
        self._local = threading.local()

    def install(self) -> None:
        import functools

        import torch.autograd

        original = self._original = torch.autograd.backward
        sink, clock, local = self.sink, self.clock, self._local

        @functools.wraps(original)
        def backward(*args, **kwargs):
            if getattr(local, "inside", False):
                return original(*args, **kwargs)
            local.inside = True
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                local.inside = False
                sink.add_backward(clock() - start)

        torch.autograd.backward = backward

    def uninstall(self) -> None:
        if self._original is not None:
            import torch.autograd

            torch.autograd.backward = self._original
            self._original = None


# ----------------------------------------------------------------------- host syncs

#: Tensor methods that read values back to the host. On a device each one waits for
#: the device to finish the work queued so far.
SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__repr__")


def _filters_changed() -> None:
    """Tell the warnings machinery its filter list was replaced (its cache is keyed
    on a version number the public functions bump)."""
    import warnings

    for name in ("_filters_mutated", "_filters_mutated_lock_held"):
        bump = getattr(warnings, name, None)
        if bump is not None:
            try:
                bump()
            except Exception:
                continue
            return


def _remember_device_constructors() -> None:
    """Have ``with torch.device(...)`` know torch's own factories before they are
    wrapped. torch keeps the set of functions that context puts on its device in a
    cache filled at its first use, by identity: filled while ``torch.tensor`` is a
    wrapper, it holds the wrapper, and the original the wrapper calls is not put on
    the device. transformers builds models under ``torch.device("meta")``: their
    non-persistent buffers (BERT's ``position_ids``) then came out as uninitialised
    memory."""
    try:
        from torch.utils._device import _device_constructors
    except ImportError:  # another torch: nothing of the kind to fill
        return
    _device_constructors()


#: torch functions that create a tensor on the host unless given a ``device``.
HOST_FACTORIES = ("arange", "randint", "randperm", "rand", "randn", "zeros", "ones", "full", "empty", "tensor",
                  "as_tensor", "linspace", "from_numpy")
#: Python arithmetic on tensors (index arithmetic such as ``i + block_size``): the
#: result of host tensors and numbers stays on the host too.
HOST_ARITHMETIC = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
                   "__rfloordiv__", "__mod__", "__neg__")


def _gives_device(args: tuple, kwargs: dict, places: tuple[type, ...]) -> bool:
    """Whether a ``Tensor.to`` call names a device (or a tensor to follow), not only a
    dtype; ``places`` are the types that name one (str, int, device, tensor)."""
    if kwargs and kwargs.get("device") is not None:
        return True
    return bool(args) and isinstance(args[0], places) and not isinstance(args[0], bool)


def _forget_compiler_lookups() -> None:
    """torch.compile looks torch's functions up by name once and keeps what it found:
    while the factories are wrapped, the wrappers. Once they are put back, that table
    is dropped (when the compiler is loaded), so a later compile in this process (the
    tuner's) finds torch's own functions again."""
    rules = sys.modules.get("torch._dynamo.trace_rules")
    clear = getattr(rules, "clear_lru_cache", None)
    if clear is not None:
        try:
            clear()
        except Exception:  # noqa: BLE001 - a compiler without the table has nothing to drop
            pass


def _script_builtins(saved: list[tuple[Any, str, Any, bool]], register: bool) -> None:
    """TorchScript compiles a call of ``torch.randint`` to its operator by looking the
    function up in its table of torch's own: the wrapper put in its place is not there,
    and ``torch.jit.script`` then tries to compile the wrapper as Python and fails (a
    script importing ``torch.distributed.optim`` scripts such functions). So each
    factory wrapper stands in that table for the same operator as the function it
    wraps while it is installed, and leaves it when it is removed (the table is keyed
    by ``id``, which a dead wrapper's successor could take)."""
    import torch

    try:
        from torch.jit import _builtins
    except ImportError:  # pragma: no cover - a torch without TorchScript
        return
    try:
        table = _builtins._get_builtin_table()
        for owner, name, original, _ in saved:
            if owner is not torch:
                continue
            wrapper = getattr(torch, name, None)
            op = table.get(id(original))
            if register and op is not None and wrapper is not original:
                table[id(wrapper)] = op
            elif not register and wrapper is not original:
                table.pop(id(wrapper), None)
    except Exception:  # noqa: BLE001 - without the table TorchScript is as it was; never break the run
        pass


def _held(ids: dict[int, Any], tensor: Any) -> bool:
    """Whether ``ids`` holds ``tensor`` or the tensor it is a view of (a hot path:
    one dict lookup, and a second for views)."""
    ref = ids.get(id(tensor))
    if ref is not None and ref() is tensor:
        return True
    base = tensor._base
    if base is None:
        return False
    ref = ids.get(id(base))
    return ref is not None and ref() is base


class HostTensors:
    """On a cpu run, the tensors that a run on a device would keep on the host: made
    by a :data:`HOST_FACTORIES` call without a ``device`` (nanoGPT's
    ``ix = torch.randint(n, (batch_size,))``), their views (``ix[0]``, ``for i in
    ix``), their dtype conversions (``t.to(torch.float32)``) and
    :data:`HOST_ARITHMETIC` of them with numbers or each other (``i + block_size``),
    until they are moved (``t.to(device)``, which on the cpu returns the same tensor).
    Results of any other operation are not tracked: they count as the device's.
    Tensors are held weakly, by identity.

    The arithmetic and ``Tensor.to`` wrappers run on every tensor of the model, so
    they do the least first: call torch's own operator, then return while nothing
    is tracked; else look the operand and the tensor it views up in the dict of
    tracked ones, inline (``id(None)`` is never a key), and return when neither is
    there. Only a tracked operand costs a function call, and only a result to track
    asks whether torch.compile is tracing (dynamo handles tensor operators and
    methods itself and does not trace the wrappers). The factories, called rarely,
    ask first: under torch.compile they trace as the originals, or are taken for
    torch's own when the run's first compile looks torch's functions up; the
    compiler's table of them is dropped after the run, so that later compiles in the
    process find the originals. The wrappers stay installed for the whole run:
    swapping class attributes of ``torch.Tensor`` as tracked tensors come and go
    would invalidate the interpreter's attribute caches for every tensor each time
    (and from Python 3.13 a class changed a thousand times is never cached again)."""

    def __init__(self) -> None:
        import weakref

        self._ref = weakref.KeyedRef
        #: id(tensor) -> a weak reference to it, dropped when the tensor dies.
        self.ids: dict[int, Any] = {}
        ids = self.ids
        self._forget = lambda dead: ids.pop(dead.key, None)
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def mark(self, tensor: Any) -> None:
        key = id(tensor)
        self.ids[key] = self._ref(tensor, self._forget, key)

    def unmark(self, tensor: Any) -> None:
        self.ids.pop(id(tensor), None)

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor`` (or the tensor it is a view of) stays on the host."""
        return bool(self.ids) and _held(self.ids, tensor)

    # -- install

    def install(self) -> None:
        import torch

        compiling = compiling_check()
        _remember_device_constructors()
        for name in HOST_FACTORIES:
            if hasattr(torch, name):
                patch_attribute(self._saved, torch, name, self._factory(getattr(torch, name), compiling))
        for name in HOST_ARITHMETIC:
            original = getattr(torch.Tensor, name)
            wrap = self._unary if name == "__neg__" else self._binary
            patch_attribute(self._saved, torch.Tensor, name, wrap(original, compiling))
        patch_attribute(self._saved, torch.Tensor, "to", self._moved(torch.Tensor.to, compiling))
        _script_builtins(self._saved, register=True)

    def uninstall(self) -> None:
        _script_builtins(self._saved, register=False)
        restore_patches(self._saved)
        self.ids.clear()
        _forget_compiler_lookups()

    def _factory(self, original: Callable, compiling: Callable[[], bool]) -> Callable:
        mark = self.mark

        def factory(*args, **kwargs):
            if compiling():
                return original(*args, **kwargs)
            out = original(*args, **kwargs)
            # Without a device argument, but on the default device a context or
            # torch.set_default_device chose (a GPU, meta): not a host tensor.
            if kwargs.get("device") is None and getattr(out, "is_cpu", False):
                mark(out)
            return out

        return factory

    def _binary(self, original: Callable, compiling: Callable[[], bool]) -> Callable:
        import torch

        ids, mark, tensor_type = self.ids, self.mark, torch.Tensor

        def arithmetic(tensor, other):
            out = original(tensor, other)
            if ids and (id(tensor) in ids or id(tensor._base) in ids) and _held(ids, tensor) \
                    and (not isinstance(other, tensor_type) or _held(ids, other)) \
                    and isinstance(out, tensor_type) and not compiling():
                mark(out)
            return out

        return arithmetic

    def _unary(self, original: Callable, compiling: Callable[[], bool]) -> Callable:
        ids, mark = self.ids, self.mark

        def arithmetic(tensor):
            out = original(tensor)
            if ids and (id(tensor) in ids or id(tensor._base) in ids) and _held(ids, tensor) and not compiling():
                mark(out)
            return out

        return arithmetic

    def _moved(self, original: Callable, compiling: Callable[[], bool]) -> Callable:
        import torch

        ids, mark = self.ids, self.mark
        places = (str, int, torch.device, torch.Tensor)

        def to(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            if ids:
                if out is tensor:  # already there: every device is the cpu
                    if id(out) in ids and _gives_device(args, kwargs, places) and not compiling():
                        ids.pop(id(out), None)
                elif (id(tensor) in ids or id(tensor._base) in ids) and _held(ids, tensor) \
                        and not _gives_device(args, kwargs, places) and not compiling():
                    mark(out)  # a dtype conversion stays where it was
            return out

        return to


class HostSyncProbe:
    """Counts host reads of tensor values made by the user's code, with the line
    that made them.

    Wraps the :data:`SYNC_METHODS` of ``torch.Tensor``. A read is counted when the
    first frame outside torch's Tensor methods is not torch's own code (the CPU
    optimizer reading its step counter is not the user's sync); a read nested in a
    counted one (``print(t)`` reads every element) is not counted again. A read from
    a library (a logger formatting the loss, a framework's trainer reading the loss)
    is attributed to the user's line that called the library, with the library's
    line that read it kept as ``via``: the innermost frame of an installed package,
    else of the standard library; each (line, call, via) is one site.

    Only reads a device would wait for count (:meth:`counts`): on an accelerator,
    reads of tensors on the device; on the cpu, where there is no device, reads of
    every tensor but those a device run would keep on the host (:class:`HostTensors`).
    """

    def __init__(self, sink: StepSink, codes: CodeMap, count_host_tensors: bool) -> None:
        self.sink = sink
        self.codes = codes
        #: The run's device is the cpu: host tensors count unless known to stay there.
        self.count_host_tensors = count_host_tensors
        self.host = HostTensors() if count_host_tensors else None
        self._local = threading.local()
        self._saved: list[tuple[str, Any, bool]] = []
        #: (file, line, call) -> [count, function, via]
        self._sites: dict[tuple[str, int, str], list] = {}
        self._restore_warnings: Callable[[], None] | None = None
        self._saved_show: Callable | None = None
        self._wrapper_code: Any = None

    # -- install

    def install(self) -> None:
        import warnings

        import torch

        compiling = compiling_check()
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved.append((name, original, name in torch.Tensor.__dict__))
            setattr(torch.Tensor, name, self._wrap(name, original, compiling))
        if self.host is not None:
            self.host.install()
        self._saved_show = warnings.showwarning
        warnings.showwarning = self._show_warning

    def uninstall(self) -> None:
        import warnings

        import torch

        if self.host is not None:
            self.host.uninstall()
        while self._saved:
            name, original, own = self._saved.pop()
            if own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)
        refresh_tensor_attributes()
        if self._saved_show is not None:
            warnings.showwarning = self._saved_show
            self._saved_show = None
        if self._restore_warnings is not None:
            self._restore_warnings()
            self._restore_warnings = None

    def counts(self, tensor: Any) -> bool:
        """Whether reading ``tensor`` is a read a device would wait for: on an
        accelerator, a tensor on the device (not one that stays on the host); on the
        cpu, any tensor but those known to stay on the host and those a DataLoader's
        fetch reads (a dataset's own)."""
        host = self.host
        if host is None:
            return not tensor.is_cpu
        if getattr(_FETCHING, "active", False):
            return False  # a dataset reading its own host tensors (int(self.targets[i]))
        return not (host.ids and _held(host.ids, tensor))

    def _wrap(self, name: str, original: Callable, compiling: Callable[[], bool]) -> Callable:
        local, hit, counts, sink = self._local, self._hit, self.counts, self.sink

        def wrapper(tensor, *args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0 and sink.started and not compiling() and counts(tensor):
                hit(name, sys._getframe(1))
            local.depth = depth + 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                local.depth = depth

        self._wrapper_code = wrapper.__code__
        wrapper.__name__ = name
        wrapper.__qualname__ = f"Tensor.{name}"
        wrapper.__doc__ = original.__doc__
        wrapper.__wrapped__ = original
        return wrapper

    def _show_warning(self, message, category, filename, lineno, file=None, line=None):
        """Count the device runtime's sync warnings; put the user's line back on the
        warnings torch raises inside a wrapper (``float(loss)`` on a tensor that
        requires grad), which would otherwise point at this file."""
        if self._restore_warnings is not None and "synchroniz" in str(message):
            if getattr(self._local, "depth", 0) == 0 and self.sink.started:
                self._hit("device-sync", sys._getframe(1), device_runtime=True)
            return
        code = self._wrapper_code
        if code is not None and filename == code.co_filename:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code is not code:
                frame = frame.f_back
            if frame is not None and frame.f_back is not None:
                caller = frame.f_back
                filename, lineno, line = caller.f_code.co_filename, caller.f_lineno, None
        self._saved_show(message, category, filename, lineno, file, line)

    # -- device runtime warnings (cuda's sync debug mode)

    def watch_sync_warnings(self, enable: Callable[[], Callable[[], None] | None]) -> None:
        """Also count the synchronisations the device runtime warns about (calls
        inside torch included), attributed to the user's line. ``enable`` switches
        the runtime's warnings on and returns what switches them off."""
        import warnings

        if self._restore_warnings is not None:
            return
        undo = enable()
        if undo is None:
            return
        saved_filters = warnings.filters[:]
        warnings.filterwarnings("always", message=r".*synchroniz")

        def restore() -> None:
            undo()
            warnings.filters[:] = saved_filters
            _filters_changed()

        self._restore_warnings = restore

    # -- attribution

    def _hit(self, call: str, frame, device_runtime: bool = False) -> None:
        codes = self.codes
        via = None
        if device_runtime:
            # The warning is raised wherever torch synchronised; the user's line is
            # the first of theirs above it.
            user = self._user_frame(frame)
            if user is None:
                return  # torch's own work with no user code above it (a hook, a thread)
            via = self._via(frame, user)
            frame = user
        else:
            kind = codes.kind
            while frame is not None and kind(frame.f_code.co_filename) == "tensor":
                frame = frame.f_back
            if frame is None:
                return
            where = kind(frame.f_code.co_filename)
            if where == "internal":
                return
            if where == "library":
                user = self._user_frame(frame.f_back)
                if user is not None:
                    via = self._via(frame, user)
                    frame = user
        self.sink.add_sync()
        key = (frame.f_code.co_filename, frame.f_lineno, call, via)
        entry = self._sites.get(key)
        if entry is None:
            self._sites[key] = [1, frame.f_code.co_name]
        else:
            entry[0] += 1

    def _via(self, frame, user) -> str | None:
        """The library line that made a read: of the frames below the user's, the
        innermost in an installed package (``transformers/trainer.py:2345``), else the
        innermost in the standard library."""
        codes = self.codes
        first = None
        while frame is not None and frame is not user:
            filename = frame.f_code.co_filename
            if codes.kind(filename) == "library":
                if codes.is_installed(filename):
                    return codes.show_library(filename, frame.f_lineno)
                if first is None:
                    first = frame
            frame = frame.f_back
        return codes.show_library(first.f_code.co_filename, first.f_lineno) if first is not None else None

    def _user_frame(self, frame, limit: int = 64):
        kind = self.codes.kind
        for _ in range(limit):
            if frame is None or kind(frame.f_code.co_filename) == "user":
                return frame
            frame = frame.f_back
        return None

    def sites(self) -> list[HostSyncSite]:
        """Every line that read tensors back, most frequent first."""
        out = []
        for (filename, line, call, via), (count, function) in self._sites.items():
            code = linecache.getline(filename, line).strip() or None
            out.append(HostSyncSite(file=self.codes.show(filename), line=line, call=call, count=count,
                                    function=function, code=code, via=via))
        out.sort(key=lambda s: (-s.count, s.file, s.line, s.call, s.via or ""))
        return out


# ----------------------------------------------------------------------------- gc


class ChildProcessProbe:
    """Notes the processes the script starts that are not DataLoader workers (their
    targets' names): training in them (Hogwild, ``mp.spawn``) is no step of the
    process the harness watches, and a run that saw none says why."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._original: Callable | None = None

    def install(self) -> None:
        from multiprocessing import process

        original = process.BaseProcess.start
        self._original = original
        started = self.started

        def start(proc: Any) -> None:
            target = getattr(proc, "_target", None)
            name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or "a process"
            if getattr(target, "__module__", "") != "torch.utils.data._utils.worker":
                started.append(str(name))
            return original(proc)

        process.BaseProcess.start = start  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._original is not None:
            from multiprocessing import process

            process.BaseProcess.start = self._original  # type: ignore[method-assign]
            self._original = None


class NoGradPassProbe:
    """Times the passes a step makes without gradients: the spans of
    ``torch.no_grad()`` and ``torch.inference_mode()`` (as ``with`` blocks or
    decorators) in which a module with parameters was called, such as an evaluation
    pass after every optimizer step, or a generator run for the next one. Spans that
    call no module (the optimizer's own ``no_grad``, gradient clipping, a hand-written
    update) do not count, nor do modules called with gradients turned back on inside
    the span (the closure LBFGS's ``no_grad`` step evaluates). A global module pre-hook is registered for the outermost
    span only until its first module call."""

    def __init__(self, sink: StepSink, clock: Callable[[], float]) -> None:
        self.sink = sink
        self.clock = clock
        self._originals: list[tuple[type, Callable, Callable]] = []
        self._local = threading.local()

    def install(self) -> None:
        import functools

        import torch

        from torchaxe.runtime.dynamo import add_global_forward_pre_hook, compiling

        sink, clock, local = self.sink, self.clock, self._local

        def module_called(module: Any, args: Any) -> None:
            if compiling():
                return
            handle = getattr(local, "handle", None)
            if handle is None or next(module.parameters(), None) is None:
                return
            if torch.is_grad_enabled():
                # Gradients back on inside the span: a closure the optimizer's own
                # no_grad step calls (LBFGS), whose forward is training, not a pass
                # without gradients.
                return
            local.modules = True
            local.handle = None
            handle.remove()

        for cls in (torch.no_grad, torch.inference_mode):
            enter, exit_ = cls.__enter__, cls.__exit__

            def patched_enter(self: Any, *args: Any, _enter: Callable = enter) -> Any:
                result = _enter(self, *args)
                if compiling() or not getattr(self, "mode", True):  # inference_mode(False) keeps gradients
                    return result
                depth = getattr(local, "depth", 0)
                local.depth = depth + 1
                if depth == 0:
                    local.start = clock()
                    local.modules = False
                    local.handle = add_global_forward_pre_hook(module_called)
                return result

            def patched_exit(self: Any, *args: Any, _exit: Callable = exit_) -> Any:
                if compiling() or not getattr(self, "mode", True) or not getattr(local, "depth", 0):
                    return _exit(self, *args)
                local.depth -= 1
                if local.depth == 0:
                    handle, local.handle = getattr(local, "handle", None), None
                    if handle is not None:
                        handle.remove()
                    if local.modules:
                        sink.add_no_grad(clock() - local.start)
                return _exit(self, *args)

            functools.update_wrapper(patched_enter, enter)
            functools.update_wrapper(patched_exit, exit_)
            self._originals.append((cls, enter, exit_))
            cls.__enter__, cls.__exit__ = patched_enter, patched_exit

    def uninstall(self) -> None:
        for cls, enter, exit_ in self._originals:
            cls.__enter__, cls.__exit__ = enter, exit_
        self._originals = []
        handle, self._local.handle = getattr(self._local, "handle", None), None
        if handle is not None:
            handle.remove()


class GcProbe:
    """Times Python's garbage collections through ``gc.callbacks``."""

    def __init__(self, sink: StepSink, clock: Callable[[], float]) -> None:
        self.sink = sink
        self.clock = clock
        self._start: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = self.clock()
        elif self._start is not None:
            self.sink.add_gc(self.clock() - self._start)
            self._start = None

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


# ------------------------------------------------------------------------- memory


class HostMemory:
    """The process's resident set size: ``/proc/self/statm`` where there is one (a
    ``pread`` on a file kept open, a couple of microseconds), else None per step and
    the peak from ``getrusage`` at the end."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None

    def rss_bytes(self) -> int | None:
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) * self._page
        except (OSError, IndexError, ValueError):
            return None

    @staticmethod
    def peak_rss_bytes() -> int | None:
        try:
            import resource
        except ImportError:  # pragma: no cover - Windows
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# -------------------------------------------------------------------------- shapes


def _dtype_name(dtype: Any, cache: dict = {}) -> str:  # noqa: B006 - a deliberate cache
    name = cache.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        cache[dtype] = name
    return name


def input_signature(values: Any, tensor_type: type) -> tuple[tuple[tuple[int, ...] | None, str | None], ...]:
    """The shapes and dtypes of the tensors among ``values`` (a tuple of arguments or
    one batch), one level into lists, tuples and mappings (a dict, or transformers'
    ``BatchEncoding``, a ``UserDict``); other values are ``(None, None)`` placeholders
    so that positions line up."""
    from collections.abc import Mapping

    if isinstance(values, Mapping):
        values = tuple(values.values())
    elif not isinstance(values, (tuple, list)):
        values = (values,)
    out = []
    for value in values:
        if isinstance(value, tensor_type):
            out.append((tuple(value.shape), _dtype_name(value.dtype)))
        elif isinstance(value, (tuple, list, Mapping)):
            inner = value.values() if isinstance(value, Mapping) else value
            for item in inner:
                if isinstance(item, tensor_type):
                    out.append((tuple(item.shape), _dtype_name(item.dtype)))
                else:
                    out.append((None, None))
        else:
            out.append((None, None))
    return tuple(out)


def batch_fields(values: Any) -> tuple[str, ...] | None:
    """The names of a mapping batch's entries in :func:`input_signature`'s order
    (``input_ids``; ``pixel_values[1]`` or ``labels.start`` one level in), so that
    its tensors can be named as the user's code names them; None for other batches."""
    from collections.abc import Mapping

    if not isinstance(values, Mapping):
        return None
    out: list[str] = []
    for key, value in values.items():
        if isinstance(value, Mapping):
            out += [f"{key}.{inner}" for inner in value]
        elif isinstance(value, (tuple, list)):
            out += [f"{key}[{i}]" for i in range(len(value))]
        else:
            out.append(str(key))
    return tuple(out)


#: Steps whose signature sets a tallier keeps (the shapes runs are a few dozen steps).
MAX_TALLIED_STEPS = 256


@dataclass
class ShapeTallier:
    """Counts the distinct input signatures of one module or of the batches; with
    ``step_of`` (the number of the step in progress), also which signatures each step
    saw, so that a module called at several places with fixed shapes (one ReLU
    after convolutions of several widths) is told from one whose shapes change
    from step to step."""

    tensor_type: type
    step_of: Callable[[], int] | None = None
    calls: int = 0
    counts: dict = field(default_factory=dict)
    truncated: bool = False
    per_step: dict = field(default_factory=dict)

    def signature(self, values: Any) -> tuple:
        return input_signature(values, self.tensor_type)

    def add(self, values: Any) -> None:
        self.add_signature(self.signature(values))

    def add_signature(self, signature: tuple) -> None:
        self.calls += 1
        if signature in self.counts:
            self.counts[signature] += 1
        elif len(self.counts) < MAX_SIGNATURES:
            self.counts[signature] = 1
        else:
            self.truncated = True
        if self.step_of is not None:
            step = self.step_of()
            seen = self.per_step.get(step)
            if seen is None and len(self.per_step) < MAX_TALLIED_STEPS:
                seen = self.per_step[step] = set()
            if seen is not None:
                seen.add(signature)

    def _considered(self) -> list[int]:
        """The finished steps compared (the first left out when there are others: it
        runs one-off work)."""
        if self.step_of is None:
            return []
        current = self.step_of()  # in progress: perhaps cut short
        finished = sorted(s for s in self.per_step if s < current)
        return [s for s in finished if s >= 2] or finished

    def step_sets(self) -> int | None:
        """How many different sets of signatures the finished steps saw; None when not
        tallied per step or no step finished."""
        considered = self._considered()
        if not considered:
            return None
        return len({frozenset(self.per_step[s]) for s in considered})

    def steady_dims(self) -> list[list[int]]:
        """``[input, dim]`` pairs that take several sizes within each compared step, the
        same sizes every step (inputs numbered without those that are no tensor)."""
        considered = self._considered()
        if len(considered) < 2:
            return []
        per_step = []
        for s in considered:
            values: dict[tuple[int, int], set] = {}
            for sig in self.per_step[s]:
                shapes = [shape for shape, _ in sig if shape is not None]
                for i, shape in enumerate(shapes):
                    for d, v in enumerate(shape):
                        values.setdefault((i, d), set()).add(v)
            per_step.append(values)
        first = per_step[0]
        return [list(key) for key in sorted(first)
                if len(first[key]) > 1 and all(step.get(key) == first[key] for step in per_step[1:])]

    def tally(self, name: str, type_name: str) -> ShapeTally:
        signatures = [
            InputSignature(shapes=[list(s) if s is not None else None for s, _ in sig],
                           dtypes=[d for _, d in sig], count=count)
            for sig, count in sorted(self.counts.items(), key=lambda kv: -kv[1])
        ]
        return ShapeTally(name=name, type=type_name, calls=self.calls, signatures=signatures, truncated=self.truncated,
                          step_sets=self.step_sets(), steady=self.steady_dims())


class ModuleShapeProbe:
    """Tallies the input shapes of every ``nn.Module`` call (a global forward
    pre-hook); module names are resolved at the end, from the roots of the modules
    seen (``GPT.blocks.0.attn``)."""

    def __init__(self, steps: list | None = None) -> None:
        #: Per module: its calls with gradients on (training) and off (evaluation,
        #: ``torch.no_grad``/``inference_mode``), tallied apart.
        self._seen: dict[int, tuple[Any, ShapeTallier, ShapeTallier]] = {}
        self._handle = None
        #: The harness's finished steps: the calls are also tallied step by step.
        self._step_of = (lambda: len(steps) + 1) if steps is not None else None

    def install(self) -> None:
        import torch

        tensor_type = torch.Tensor
        seen = self._seen
        grad_enabled = torch.is_grad_enabled
        step_of = self._step_of

        def hook(module, args):
            if compiling():
                return  # the call is being traced into the script's own compiled graph
            entry = seen.get(id(module))
            if entry is None:
                entry = seen[id(module)] = (module, ShapeTallier(tensor_type, step_of), ShapeTallier(tensor_type, step_of))
            entry[1 if grad_enabled() else 2].add(args)

        self._handle = add_global_forward_pre_hook(hook)

    def uninstall(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def tallies(self) -> list[ShapeTally]:
        """One tally per module: of its training calls, the shapes a compiled training
        step sees; of its evaluation calls only when it was never called with gradients
        on (an inference script, a frozen part). A validation pass over other lengths
        is not what makes training's shapes dynamic."""
        modules = {key: module for key, (module, _, _) in self._seen.items()}
        inside: set[int] = set()
        for module in modules.values():
            for _, sub in module.named_modules():
                if sub is not module:
                    inside.add(id(sub))
        names: dict[int, str] = {}
        roots_by_class: dict[str, int] = {}
        for key, module in modules.items():
            if key in inside:
                continue
            cls = type(module).__name__
            roots_by_class[cls] = roots_by_class.get(cls, 0) + 1
            prefix = cls if roots_by_class[cls] == 1 else f"{cls}#{roots_by_class[cls]}"
            for name, sub in module.named_modules(prefix=prefix):
                if id(sub) in modules and id(sub) not in names:
                    names[id(sub)] = name
        out = []
        for key, (module, training, evaluation) in self._seen.items():
            tally = (training if training.calls else evaluation).tally(names.get(key, type(module).__name__),
                                                                      type(module).__name__)
            if key not in inside:  # a root: what it holds (a loss module holds nothing)
                try:
                    tally.parameters = sum(p.numel() for p in module.parameters())
                except Exception:  # noqa: BLE001 - a module whose parameters cannot be listed
                    pass
            out.append(tally)
        self._seen.clear()
        return out


class FirstForwardProbe:
    """Reports the first ``nn.Module`` call as the start of training, then removes itself
    (see :class:`~torchaxe.runtime.dynamo.OneShotModuleHook`)."""

    def __init__(self, sink: StepSink) -> None:
        self.sink = sink
        self._hook = OneShotModuleHook(sink.activity)

    def install(self) -> None:
        self._hook.install()

    def uninstall(self) -> None:
        self._hook.uninstall()
