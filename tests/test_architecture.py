"""The package's shape: layers import downwards only, and no private name crosses a
module boundary (DESIGN.md, "Dependency direction").

The imports are read from the source (module level and inside functions), never
executed. A failure names the importing module, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

#: cli -> advise -> axis packages -> {runtime, kb} -> {findings, backends, config, errors}.
LAYERS = {
    "torchaxe.cli": 5,
    "torchaxe.__main__": 5,
    "torchaxe.advise": 4,
    "torchaxe.scan": 3,
    "torchaxe.shapes": 3,
    "torchaxe.tune": 3,
    "torchaxe.bind": 3,
    "torchaxe.data": 3,
    "torchaxe.precision": 3,
    "torchaxe.environment": 3,
    "torchaxe.compare": 3,
    "torchaxe.memory": 3,
    "torchaxe.kernels": 3,
    "torchaxe.distributed": 3,
    "torchaxe.runtime": 2,
    "torchaxe.kb": 2,
    "torchaxe.findings": 1,
    "torchaxe.backends": 1,
    "torchaxe.config": 1,
    "torchaxe.errors": 1,
    "torchaxe.atomic": 1,
    "torchaxe.cpulist": 1,
    "torchaxe.console": 1,
    "torchaxe.units": 1,
    "torchaxe.lazy": 1,
    # Renderers sit on the layer of the data they render: the advice with advise,
    # findings and rule documentation with scan, profiles and trials with runtime.
    "torchaxe.report.advice_html": 4,
    "torchaxe.report.advice_text": 4,
    "torchaxe.report": 3,
    "torchaxe.report.profile_text": 2,
    "torchaxe.report.trial_text": 2,
    # The package itself only holds the version.
    "torchaxe": 0,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int | None:
    """The layer of the longest registered prefix of ``module``."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / "torchaxe").rglob("*.py"))}


def _imports(path: Path):
    """(line, imported module, imported name or None) for every torchaxe import."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torchaxe":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == "torchaxe":
                for alias in node.names:
                    yield node.lineno, base, alias.name


def test_every_module_has_a_layer():
    unplaced = [m for m in _modules() if _layer(m) is None]
    assert not unplaced, f"modules with no layer in tests/test_architecture.py LAYERS: {unplaced}"


def test_no_layer_imports_a_higher_one():
    upward = []
    for module, path in _modules().items():
        own = _layer(module)
        for line, target, name in _imports(path):
            full = f"{target}.{name}" if name and f"{target}.{name}" in _modules() else target
            if (_layer(full) or 0) > (own or 0):
                upward.append(f"{module}:{line} imports {full} (layer {_layer(full)} above {own})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_private_name_crosses_a_module():
    """``from torchaxe.x import _name`` is refused unless ``_name`` is a private
    module of the importer's own package (``scan/rules/_formula.py`` for the rules)."""
    modules = _modules()
    crossing = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for line, target, name in _imports(path):
            names = [name] if name else target.split(".")
            for part in names:
                if not part.startswith("_") or part.startswith("__"):
                    continue
                private_module = f"{target}.{part}" if name else target
                if private_module in modules and private_module.rpartition(".")[0] == package:
                    continue
                crossing.append(f"{module}:{line} imports {part} from {target}")
    assert not crossing, "private names imported across modules:\n" + "\n".join(crossing)


def test_no_private_attribute_of_another_module_is_read():
    """``analysis._compute()`` through a module imported by name is the same crossing."""
    modules = _modules()
    crossing = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchaxe") and not node.level:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torchaxe.") and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and aliases[node.value.id] != module:
                crossing.append(f"{module}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not crossing, "private attributes of other modules read:\n" + "\n".join(crossing)


def _knob_references() -> tuple[str, ...]:
    from torchaxe.runtime.knobs import KNOB_SPECS

    return KNOB_SPECS


@pytest.mark.parametrize("reference", _knob_references())
def test_every_registered_knob_is_a_spec(reference):
    """Each knob registered by import string loads as a spec whose key is unique and
    whose example reads back as it was written."""
    import importlib

    from torchaxe.runtime.knobs import KnobCheck, knob_set_from_dict, knob_specs

    module, _, name = reference.partition(":")
    spec = getattr(importlib.import_module(module), name)
    for attribute in ("key", "attribute", "before_torch", "conflicts", "example", "default", "parse", "to_json",
                      "patch"):
        assert hasattr(spec, attribute), f"{reference} lacks {attribute}"
    assert [s.key for s in knob_specs()].count(spec.key) == 1
    assert spec.example is not None, f"{reference} has no example"
    assert spec.to_json(spec.parse(spec.example, KnobCheck(reference))) == spec.example
    knobs = knob_set_from_dict({spec.key: spec.example}, reference)
    assert knobs.to_dict() == {"name": "knobs", spec.key: spec.example}
    assert getattr(knobs, spec.attribute) == spec.parse(spec.example, KnobCheck(reference))
    assert getattr(knob_set_from_dict({}, reference), spec.attribute) == spec.default()


def test_knob_sets_are_read_without_torch():
    """The bootstrap reads the knob file before torch is imported (environment
    variables and CPU affinity must act on torch's own start-up)."""
    import subprocess
    import sys

    code = ("import json, sys; from torchaxe.runtime.knobs import knob_set_from_dict, knob_specs; "
            "examples = {s.key: s.example for s in knob_specs() if s.key != 'bind'}; "
            "knob_set_from_dict(examples, 'k'); print(json.dumps(sorted(m for m in sys.modules if m == 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
