"""Structural signatures: what a subgraph's tuning result depends on.

Two subgraphs with the same signature compute the same function on the same shapes,
so one measurement serves both (24 identical transformer layers are tuned once) and a
later run finds the result again. The signature covers, for the module and every
submodule: the class (qualified name and a hash of its source), the plain settings it
keeps (``eps``, ``activation``, ...), the parameter and buffer shapes and dtypes; then
the input shapes, dtypes and ``requires_grad`` flags, the device type, training mode and
the torch version. Classes are named without their module, so that a script run as
``python train.py`` (``__main__``) and imported as ``train`` give the same signature;
the source hash tells apart classes of the same name that compute different things. Parameter *values* are left out on purpose: the speed of a strategy
does not depend on them.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import types
from typing import Any, Sequence

import torch
from torch import nn

#: Plain attribute types that describe a module's behaviour and go into its signature.
_PLAIN = (bool, int, float, str, type(None))


def _source(obj: Any, fallback: str) -> str:
    if isinstance(obj, type):
        found = class_source(obj)
        return found[1] if found else fallback
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return fallback


def class_file(cls: type) -> str | None:
    """The file that defines ``cls``, from its methods' code objects. (``inspect``
    goes through ``sys.modules[cls.__module__]``, which for a script run as
    ``__main__`` by the harness is no longer that script once it has stopped.)"""
    for value in vars(cls).values():
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        code = getattr(fn, "__code__", None)
        if isinstance(code, types.CodeType) and code.co_filename and not code.co_filename.startswith("<"):
            return code.co_filename
    return None


@functools.lru_cache(maxsize=256)
def _class_sources(path: str) -> dict[str, str]:
    import ast

    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        tree = ast.parse(text, filename=path)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return {}
    out: dict[str, str] = {}

    def visit(body: list[Any], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                name = prefix + node.name
                out.setdefault(name, ast.get_source_segment(text, node) or "")
                visit(node.body, name + ".")

    visit(tree.body, "")
    return out


def class_source(cls: type) -> tuple[str, str] | None:
    """(file, source text) of a class defined in Python, or None."""
    path = class_file(cls)
    if path is None:
        return None
    text = _class_sources(path).get(cls.__qualname__)
    return (path, text) if text else None


def _called_functions(cls: type) -> list[types.FunctionType]:
    """Module-level functions the class's own methods name (``gelu_tanh`` called
    from ``MLP.forward``): their source is part of what the class computes."""
    found: dict[str, types.FunctionType] = {}
    for method in vars(cls).values():
        if not isinstance(method, types.FunctionType):
            continue
        for name in _names(method.__code__):
            target = method.__globals__.get(name)
            if isinstance(target, types.FunctionType) and target.__module__ == cls.__module__:
                found[name] = target
    return [found[k] for k in sorted(found)]


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


@functools.lru_cache(maxsize=None)
def class_source_hash(cls: type) -> str:
    """A hash of a class's source and of the module-level functions its methods call,
    or of its qualified name where the source is not available (classes defined in C,
    in a REPL or a frozen app)."""
    digest = hashlib.sha1(_source(cls, cls.__qualname__).encode("utf-8", "surrogatepass"))
    for fn in _called_functions(cls):
        digest.update(_source(fn, fn.__qualname__).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def _plain(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and len(value) <= 16 and all(isinstance(v, _PLAIN) for v in value):
        return list(value)
    return None


def _settings(module: nn.Module) -> dict[str, Any]:
    out = {}
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key == "training":
            continue
        plain = _plain(value)
        if plain is not None or value is None:
            out[key] = plain
    return out


def _tensor_spec(t: torch.Tensor) -> list[Any]:
    return [list(t.shape), str(t.dtype).replace("torch.", ""), bool(t.requires_grad), t.device.type,
            bool(t.is_contiguous()), bool(t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))]


def value_spec(value: Any) -> Any:
    """The shape-level description of an input: tensors by shape/dtype/layout, plain
    values as themselves, containers element by element."""
    if isinstance(value, torch.Tensor):
        return {"tensor": _tensor_spec(value)}
    if isinstance(value, (tuple, list)):
        return [value_spec(v) for v in value]
    if isinstance(value, dict):
        return {str(k): value_spec(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    plain = _plain(value)
    if plain is not None or value is None:
        return plain
    return {"object": f"{type(value).__module__}.{type(value).__qualname__}"}


def module_structure(module: nn.Module) -> list[Any]:
    """Class, source hash, settings, parameters and buffers of every submodule."""
    rows = []
    for name, sub in module.named_modules(remove_duplicate=False):
        cls = type(sub)
        rows.append([
            name, cls.__qualname__, class_source_hash(cls), _settings(sub),
            [[n, list(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad)]
             for n, p in sub.named_parameters(recurse=False)],
            [[n, list(b.shape), str(b.dtype).replace("torch.", "")] for n, b in sub.named_buffers(recurse=False)],
        ])
    return rows


def signature_parts(module: nn.Module, spec: list[Any],
                    autocast: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """The readable parts the signature hashes (kept in the knowledge base);
    ``spec`` is ``[value_spec(list(args)), value_spec(kwargs)]`` of the inputs, and
    ``autocast`` the ``(device type, dtype)`` regions the module ran in (a part only
    when there are some, so that signatures made without autocast stay as they were)."""
    device = next((p.device.type for p in module.parameters()), None)
    if device is None:
        device = _first_device(spec) or "cpu"
    cls = type(module)
    parts: dict[str, Any] = {
        "module": cls.__qualname__,
        "source": class_source_hash(cls),
        "structure": module_structure(module),
        "inputs": spec[0],
        "kwargs": spec[1],
        "device": device,
        "training": bool(module.training),
        "torch": torch.__version__,
    }
    if autocast:
        parts["autocast"] = [list(region) for region in autocast]
    return parts


def _first_device(value: Any) -> str | None:
    if isinstance(value, dict) and "tensor" in value:
        return value["tensor"][3]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for v in items:
        found = _first_device(v)
        if found:
            return found
    return None


def signature_of(parts: dict[str, Any]) -> str:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe(parts: dict[str, Any]) -> dict[str, Any]:
    """A short readable form for the knowledge base and reports."""
    short = {"module": parts["module"], "source": parts["source"], "inputs": parts["inputs"],
             "device": parts["device"], "training": parts["training"], "torch": parts["torch"],
             "parameters": sum(len(row[4]) for row in parts["structure"])}
    if parts.get("autocast"):
        short["autocast"] = parts["autocast"]
    return short
