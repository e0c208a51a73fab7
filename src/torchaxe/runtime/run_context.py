"""What a run was made of, read at its end: the Python files it imported and the
process-wide settings it left on (anomaly detection, deterministic algorithms, a
profiler, thread counts, garbage-collector thresholds, the environment variables that
change speed).

``advise`` uses the files to scan the third-party code the run actually executed
(not only the script's folder) and the settings for its environment checks. Read in
the process that ran the script, after its last step; written as JSON next to the
profile.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from torchaxe.atomic import write_text_atomic
from torchaxe.backends.cpu import bfloat16_matrix_units, native_bfloat16
from torchaxe.runtime.dynamo import graphs_compiled

SCHEMA = "torchaxe.run-context/1"

#: Environment variables whose value changes training speed (environment checks).
SPEED_VARIABLES = (
    "CUDA_LAUNCH_BLOCKING", "ASCEND_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_LOGS", "TORCHDYNAMO_VERBOSE", "NCCL_DEBUG", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES",
    "TORCH_CPP_LOG_LEVEL", "PYTHONMALLOC", "PYTHONDEVMODE", "PYTHONTRACEMALLOC",
    # torchrun's: how many ranks share this node's cores (the thread checks divide by it).
    "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    # torch_npu's and HCCL's (distributed/candidates.py leaves a variable the run sets alone).
    "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF", "COMBINED_ENABLE", "HCCL_BUFFSIZE",
)


def _stdlib_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if k in paths}
    return tuple(r.rstrip(os.sep) + os.sep for r in roots)


def imported_files() -> list[str]:
    """Real paths of the ``.py`` files of the modules the run imported, stdlib, torch
    and torchaxe left out (nothing of theirs is the user's to change). The script's
    own modules, dropped from ``sys.modules`` when it ended (runtime/command.py), count."""
    from torchaxe.runtime.command import FORGOTTEN_FILES

    stdlib = _stdlib_roots()
    site = tuple(os.path.realpath(p).rstrip(os.sep) + os.sep for p in sys.path if p and "site-packages" in p)
    # The bootstrap runs as __main__, so its name does not give it away.
    own = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).rstrip(os.sep) + os.sep
    out = set(FORGOTTEN_FILES)
    for name, module in list(sys.modules.items()):
        if name.split(".", 1)[0] in ("torch", "torchaxe", "torchgen", "functorch", "triton", "numpy", "_pytest",
                                      "pytest", "click", "rich", "jinja2", "sympy", "mpmath", "networkx", "filelock",
                                      "fsspec", "markupsafe", "typing_extensions", "_distutils_hack", "setuptools",
                                      "pkg_resources", "packaging", "yaml", "PIL", "tomli", "psutil"):
            continue
        filename = getattr(module, "__file__", None)
        if not filename or not filename.endswith(".py"):
            continue
        real = os.path.realpath(filename)
        if (real.startswith(stdlib) and not real.startswith(site)) or real.startswith(own):
            continue
        out.add(real)
    return sorted(out)


#: What the model probe saw at the model's first call (see :class:`ModelProbe`), and
#: ``loader_epochs``, what each DataLoader's epoch holds (:func:`loader_epoch`).
OBSERVED: dict[str, Any] = {}

#: The most DataLoaders whose epochs are noted.
_MOST_LOADERS = 8


def partial_batch(samples: int | None, batch_size: int | None, drop_last: bool) -> int | None:
    """Samples in an epoch's last, smaller batch: None when every batch is full, the
    loader drops it, or the epoch's size is not known."""
    if not batch_size or samples is None or drop_last:
        return None
    return samples % batch_size or None


def loader_epoch(loader: Any) -> dict[str, Any] | None:
    """A DataLoader's epoch as the batches it makes: batch size, samples per epoch
    (this process's share, under a DistributedSampler), ``drop_last`` and the samples
    of its last, smaller batch (None when every batch is full). None when the loader
    does not batch by a size or its sampler has no length (an IterableDataset)."""
    batch_size = getattr(loader, "batch_size", None)
    if not isinstance(batch_size, int) or batch_size < 1:
        return None
    try:
        samples = len(loader.sampler)
    except Exception:  # noqa: BLE001 - no length: the epoch cannot be known
        return None
    drop_last = bool(getattr(loader, "drop_last", False))
    return {"batch_size": batch_size, "samples": samples, "drop_last": drop_last,
            "last_batch_samples": partial_batch(samples, batch_size, drop_last)}


def _iterable(loader: Any) -> bool:
    """Whether a DataLoader iterates an ``IterableDataset``."""
    from torch.utils.data import IterableDataset

    return isinstance(getattr(loader, "dataset", None), IterableDataset)


def note_loader(loader: Any, site: str | None) -> None:
    """Notes the epoch of a DataLoader just built at ``site`` (``path:line``)."""
    from torchaxe.runtime.tensor_batches import batchable

    # How many loaders of each kind: a loader over an IterableDataset keeps its worker
    # count under the dataloader knob (data/knob.py), so no worker count is offered
    # for a run whose loaders are all of that kind.
    kinds = OBSERVED.setdefault("loader_kinds", {"map": 0, "iterable": 0})
    kinds["iterable" if _iterable(loader) else "map"] += 1
    epochs = OBSERVED.setdefault("loader_epochs", [])
    epoch = loader_epoch(loader)
    if epoch is not None and len(epochs) < _MOST_LOADERS:
        # batched_fetch: its batches come from in-memory tensors, sample by sample
        # (the dataloader knob's batched_fetch takes them with one indexing).
        epochs.append({"site": site, **epoch, "batched_fetch": batchable(loader)})

#: What code the run executed, where it was recorded (absent: not recorded):
#: ``step_functions``, real path -> [first line, last line] runs of the lines of the
#: functions a counted training step called or ran inside (runtime/opstats.py), and ``loader_sites``, the
#: ``path:line`` of the frames outside torch that built each DataLoader
#: (runtime/probes.py), and ``dataset_classes``, ``path:first:last`` of the classes of
#: the datasets the loaders were built on (and the datasets those wrap), and
#: ``loader_workers``, ``path:line`` of those frames -> the most worker processes a
#: loader built there had, and ``training_loader_sites``, those frames of the loaders
#: whose batches fed a training step (recorded with the batch shapes). advise leaves
#: out findings in installed packages whose code the run never executed.
EXECUTED: dict[str, Any] = {}

#: How deep wrapped datasets are followed (Subset of a ConcatDataset of ...).
_WRAPPED_DEPTH = 3


def dataset_class_ranges(dataset: Any, depth: int = 0) -> list[str]:
    """``path:first:last`` of the classes a dataset is an instance of (its own and its
    bases outside torch), and of the datasets it wraps (``.dataset``, ``.datasets``):
    where its ``__getitem__`` may run, in the main process or in loader workers."""
    import inspect

    out: list[str] = []
    if dataset is None or depth > _WRAPPED_DEPTH:
        return out
    torch_root = os.sep + "torch" + os.sep
    for cls in type(dataset).__mro__:
        if cls is object:
            continue
        try:
            path = inspect.getsourcefile(cls)
            lines, first = inspect.getsourcelines(cls)
        except (TypeError, OSError):
            continue
        if path is None or torch_root in path:
            continue
        out.append(f"{os.path.realpath(path)}:{first}:{first + len(lines) - 1}")
    inner = getattr(dataset, "datasets", None)
    wrapped = list(inner) if isinstance(inner, (list, tuple)) else []
    if getattr(dataset, "dataset", None) is not None:
        wrapped.append(dataset.dataset)
    for item in wrapped[:8]:
        out.extend(p for p in dataset_class_ranges(item, depth + 1) if p not in out)
    return out


def used_dataset(context: dict[str, Any], path: str, line: int, end_line: int | None = None) -> bool | None:
    """Whether the code at ``path:line`` (to ``end_line``) is in the class of a dataset
    a DataLoader of the run was built on: None when that was not recorded."""
    classes = context.get("dataset_classes")
    if classes is None:
        return None
    real, end = os.path.realpath(path), end_line or line
    for place in classes:
        where, _, span = place.rpartition(":")
        where, _, first = where.rpartition(":")
        if where == real and first.isdigit() and span.isdigit() and int(first) <= line and end <= int(span):
            return True
    return False


def function_ranges(codes: Any) -> dict[str, list[list[int]]]:
    """The lines the code objects are made of, as sorted ``[first, last]`` runs by real
    path of their file: torch's, torchaxe's and frozen or generated code left out.
    A code object's own lines only: the body of a function defined in it is another
    code object (the module's code holds every line of the file between its first and
    last, the functions it never called included)."""
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines_of: dict[str, set[int]] = {}
    real_paths: dict[str, str | None] = {}
    for code in codes:
        name = code.co_filename
        if name not in real_paths:
            real = os.path.realpath(name) if name.endswith(".py") and os.path.isabs(name) else None
            skip = real is None or real.startswith(own + os.sep) or f"{os.sep}torch{os.sep}" in real
            real_paths[name] = None if skip else real
        real = real_paths[name]
        if real is None:
            continue
        lines = lines_of.setdefault(real, set())
        lines.add(code.co_firstlineno)
        lines.update(line for _, _, line in code.co_lines() if line is not None)
    out: dict[str, list[list[int]]] = {}
    for real, lines in lines_of.items():
        runs: list[list[int]] = []
        for line in sorted(lines):
            if runs and line == runs[-1][1] + 1:
                runs[-1][1] = line
            else:
                runs.append([line, line])
        out[real] = runs
    return out


def executed(context: dict[str, Any], path: str, line: int, end_line: int | None = None) -> bool | None:
    """Whether the run executed code at ``path:line`` (to ``end_line``) in a counted
    step (``step_functions``): None when that was not recorded."""
    functions = context.get("step_functions")
    if functions is None:
        return None
    end = end_line or line
    return any(first <= end and line <= last for first, last in functions.get(os.path.realpath(path), ()))


#: How many frames outside torch are noted as the builders of a DataLoader or an
#: optimizer (a subclass's ``__init__``, the function that called it, ...).
BUILDER_FRAMES = 3


def caller_sites(frame: Any, limit: int = BUILDER_FRAMES) -> list[str]:
    """``path:line`` of the first ``limit`` frames outside torch from ``frame`` out:
    the lines that built what torch's ``__init__`` is making."""
    torch_root = os.sep + "torch" + os.sep
    out: list[str] = []
    while frame is not None and len(out) < limit:
        name = frame.f_code.co_filename
        if torch_root not in name:
            out.append(f"{os.path.realpath(name)}:{frame.f_lineno}")
        frame = frame.f_back
    return out


class OptimizerProbe:
    """Notes, in the run's context (``optimizer_sites``), the lines outside torch that
    built each ``torch.optim`` optimizer: a fix of an optimizer call the run never
    made (a branch it did not take) cannot change its speed. And each optimizer
    (``settings()["optimizers"]``): its class and module, the line that built it,
    whether it is fused, and whether its caller chose an implementation (``fused``,
    ``foreach`` or ``differentiable``)."""

    def __init__(self) -> None:
        self._original: Any = None

    def install(self) -> "OptimizerProbe":
        import torch

        sites: list[str] = []
        EXECUTED["optimizer_sites"] = sites
        built: list[dict[str, Any]] = []
        OBSERVED["optimizers"] = built
        original = self._original = torch.optim.Optimizer.__init__

        def __init__(optimizer, *args, **kwargs):
            found: list[str] = []
            try:
                found = caller_sites(sys._getframe(1))
                sites.extend(site for site in found if site not in sites and len(sites) < 64)
            except Exception:  # noqa: BLE001 - an observation must never break the user's run
                pass
            result = original(optimizer, *args, **kwargs)
            try:
                if len(built) < 16:
                    defaults = optimizer.defaults
                    built.append({"class": type(optimizer).__name__, "module": type(optimizer).__module__,
                                  "site": found[0] if found else None, "fused": bool(defaults.get("fused")),
                                  "chosen": defaults.get("fused") is not None or defaults.get("foreach") is not None
                                  or bool(defaults.get("differentiable"))})
            except Exception:  # noqa: BLE001 - an observation must never break the user's run
                pass
            return result

        torch.optim.Optimizer.__init__ = __init__
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            import torch

            torch.optim.Optimizer.__init__ = self._original
            self._original = None


def built_optimizer(context: dict[str, Any], path: str, line: int, end_line: int | None = None) -> bool | None:
    """Whether an optimizer was built by the call at ``path:line`` (to ``end_line``):
    None when optimizer sites were not recorded."""
    return _built_at(context.get("optimizer_sites"), path, line, end_line)


def built_loader(context: dict[str, Any], path: str, line: int, end_line: int | None = None) -> bool | None:
    """Whether a DataLoader was built by the call at ``path:line`` (to ``end_line``):
    None when loader sites were not recorded."""
    return _built_at(context.get("loader_sites"), path, line, end_line)


def fed_training(context: dict[str, Any], path: str, line: int, end_line: int | None = None) -> bool | None:
    """Whether a DataLoader built by the call at ``path:line`` (to ``end_line``) gave
    batches that a training step's backward pass followed: None when not recorded."""
    return _built_at(context.get("training_loader_sites"), path, line, end_line)


def loader_workers(context: dict[str, Any], path: str, line: int, end_line: int | None = None) -> int | None:
    """The most worker processes a DataLoader built by the call at ``path:line`` (to
    ``end_line``) had in the run: None when that was not recorded or no loader was
    built there."""
    counts = context.get("loader_workers")
    if not isinstance(counts, dict):
        return None
    found = [n for site, n in counts.items() if isinstance(n, int) and site_within(site, path, line, end_line)]
    return max(found) if found else None


def site_within(site: str, path: str, line: int, end_line: int | None = None) -> bool:
    """Whether ``site`` (``real path:line``, as the run notes its build sites) lies in
    ``path`` between ``line`` and ``end_line``."""
    where, _, number = site.rpartition(":")
    return where == os.path.realpath(path) and number.isdigit() and line <= int(number) <= (end_line or line)


def _built_at(sites: list[str] | None, path: str, line: int, end_line: int | None) -> bool | None:
    if sites is None:
        return None
    return any(site_within(site, path, line, end_line) for site in sites)


def _autocast_dtype(torch: Any, device_type: str) -> str | None:
    """The autocast dtype in force for ``device_type`` now, or None when it is off."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # torch < 2.4: per-device functions
        if device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        else:
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return str(dtype).replace("torch.", "") if enabled else None


class ModelProbe:
    """Notes, at the model's first call (runtime/first_model.py), whether the script
    runs it under autocast itself: then trying mixed precision again is pointless; and
    its parameters' floating dtypes (``model_dtypes``)."""

    def __init__(self) -> None:
        from torchaxe.runtime.first_model import FirstModel

        self.finder = FirstModel(self.observe)

    def observe(self, module: Any) -> None:
        import torch

        try:
            device_type = next(module.parameters()).device.type
            OBSERVED["autocast"] = _autocast_dtype(torch, device_type)
            # float64 parameters: autocast lowers float32 operations only.
            OBSERVED["model_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()
                                               if p.is_floating_point()})
        except Exception:  # noqa: BLE001 - an observation must never break the user's run
            pass

    def install(self) -> "ModelProbe":
        self.finder.install()
        return self

    def uninstall(self) -> None:
        self.finder.uninstall()


def settings() -> dict[str, Any]:
    """The process-wide switches that slow training when left on, the speed-ups the
    script already makes itself (its own compile, its own autocast), and its
    DataLoaders' epochs (``loader_epochs``, see :func:`loader_epoch`)."""
    out: dict[str, Any] = {
        "env": {k: os.environ[k] for k in SPEED_VARIABLES if k in os.environ},
        "gc_enabled": gc.isenabled(),
        "gc_threshold": list(gc.get_threshold()),
        "cpu_count": os.cpu_count(),
        # Whether bfloat16 autocast can pay off on this CPU (backends/cpu.py).
        "cpu_bfloat16": native_bfloat16(),
        # Whether it has bfloat16 matrix units (AMX), where bf16 autocast is likely the
        # largest change a budget can try.
        "cpu_bfloat16_matrix_units": bfloat16_matrix_units(),
    }
    if hasattr(os, "sched_getaffinity"):
        out["allowed_cpus"] = len(os.sched_getaffinity(0))
    torch = sys.modules.get("torch")
    if torch is not None:
        out["anomaly_detection"] = bool(torch.is_anomaly_enabled())
        out["deterministic_algorithms"] = bool(torch.are_deterministic_algorithms_enabled())
        out["cudnn_deterministic"] = bool(torch.backends.cudnn.deterministic)
        out["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
        out["num_threads"] = torch.get_num_threads()
        out["interop_threads"] = torch.get_num_interop_threads()
        out["matmul_precision"] = torch.get_float32_matmul_precision()
        try:
            out["profiler_enabled"] = bool(torch.autograd.profiler._is_profiler_enabled)
        except AttributeError:  # pragma: no cover - older torch
            pass
        out["compiled_graphs"] = graphs_compiled()  # the script's own compiles
    for key in ("autocast", "model_dtypes", "loader_epochs", "loader_kinds", "optimizers"):
        if key in OBSERVED:
            out[key] = OBSERVED[key]
    return out


def collect() -> dict[str, Any]:
    return {"schema": SCHEMA, "modules": imported_files(), "settings": settings(), **EXECUTED}


def write(path: str | Path) -> None:
    write_text_atomic(path, json.dumps(collect(), indent=1) + "\n")


def load(path: str | Path) -> dict[str, Any]:
    """The context written by :func:`write`; an empty one when the file is missing
    or unreadable (the run may have died before writing it)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"schema": SCHEMA, "modules": [], "settings": {}}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return {"schema": SCHEMA, "modules": [], "settings": {}}
    return data
