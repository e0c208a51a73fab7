"""Facts about the installed torch that rules depend on, read from its real
signatures once per scan (in the parent process) and passed to rules as plain data.

torch is not imported (that alone takes seconds): its optimizer sources are parsed,
which gives the same signatures in a few milliseconds.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any

from torchaxe.cpulist import usable_cpus

#: The torch.optim device name per target (torch_npu registers as privateuseone).
_OPTIM_DEVICE = {"cpu": "cpu", "cuda": "cuda", "npu": "privateuseone"}

#: Used only when torch's sources cannot be read: the optimizers with ``fused=`` in 2.13.
FALLBACK_FUSED = ("Adagrad", "Adam", "AdamW", "SGD")
FALLBACK_DEVICES = ("cpu", "cuda", "privateuseone")


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _torch_root() -> Path | None:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _fused_optimizers(root: Path) -> tuple[str, ...] | None:
    """Optimizer classes exported by torch.optim whose ``__init__`` takes ``fused``."""
    init = _parse(root / "optim" / "__init__.py")
    if init is None:
        return None
    exported: dict[str, Path] = {}
    for node in init.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch.optim."):
            module = root.joinpath(*node.module.split(".")[1:]).with_suffix(".py")
            for alias in node.names:
                if alias.name[:1].isupper():
                    exported[alias.asname or alias.name] = module
    classes: dict[str, ast.ClassDef] = {}
    for module in set(exported.values()):
        tree = _parse(module)
        if tree is not None:
            classes.update({n.name: n for n in tree.body if isinstance(n, ast.ClassDef)})

    def takes_fused(name: str, seen: frozenset[str] = frozenset()) -> bool:
        cls = classes.get(name)
        if cls is None or name in seen:
            return False
        for item in cls.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                a = item.args
                return any(p.arg == "fused" for p in (*a.posonlyargs, *a.args, *a.kwonlyargs))
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        return any(takes_fused(b, seen | {name}) for b in bases)

    found = tuple(sorted(n for n in exported if takes_fused(n)))
    return found or None


def _fused_devices(root: Path) -> tuple[str, ...] | None:
    """The device list returned by ``_get_fused_kernels_supported_devices``."""
    tree = _parse(root / "utils" / "_foreach_utils.py")
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "_get_fused_kernels_supported_devices":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.List):
                    devices = [e.value for e in ret.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                    # The list ends with the privateuse1 backend's name (npu under torch_npu).
                    return (*devices, "privateuseone")
    return None


@lru_cache(maxsize=None)
def _introspect() -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
    root = _torch_root()
    if root is None:
        return FALLBACK_FUSED, FALLBACK_DEVICES, None
    try:
        version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    fused = _fused_optimizers(root) or FALLBACK_FUSED
    devices = _fused_devices(root) or FALLBACK_DEVICES
    return fused, devices, version


#: The image decoders a rule may point to, by import name.
DECODERS = ("torchvision", "cv2")


def _installed(name: str) -> bool:
    """Whether ``name`` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def torch_capabilities(target: str) -> dict[str, Any]:
    """``{"torch_version", "fused_optimizers", "cpus", "decoders"}`` for the given
    target: the optimizers whose fused implementation the installed torch offers
    there, the CPUs this process may use (what a worker count must stay within), and
    which of :data:`DECODERS` are installed."""
    fused, devices, version = _introspect()
    supported = _OPTIM_DEVICE.get(target, target) in devices
    return {"torch_version": version, "fused_optimizers": list(fused) if supported else [], "cpus": usable_cpus(),
            "decoders": [name for name in DECODERS if _installed(name)]}
