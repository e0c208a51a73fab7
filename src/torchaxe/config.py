"""Configuration from ``[tool.torchaxe]`` in pyproject.toml or a ``torchaxe.toml``,
found from the working folder upwards; command-line flags override it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchaxe.errors import TorchaxeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

#: Keys accepted in the configuration, with the type each must have.
KEYS: dict[str, type | tuple[type, ...]] = {
    "target": str,
    "select": list,
    "ignore": list,
    "exclude": list,
    "jobs": int,
    "format": str,
}


def home() -> Path:
    """The one folder torchaxe keeps its files in (caches, the knowledge base, kept
    originals): ``$TORCHAXE_HOME``, else ``$XDG_CACHE_HOME/torchaxe``, else
    ``~/.cache/torchaxe``. Read at each call, so that a changed environment counts."""
    own = os.environ.get("TORCHAXE_HOME")
    if own:
        return Path(own)
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache) if cache else Path.home() / ".cache") / "torchaxe"


@dataclass
class Config:
    values: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def find_config(start: Path | None = None) -> Config:
    """The nearest ``torchaxe.toml``, or pyproject.toml with a ``[tool.torchaxe]``
    table, in ``start`` or a parent folder; an empty Config when there is none."""
    folder = (start or Path.cwd()).resolve()
    for candidate in (folder, *folder.parents):
        own = candidate / "torchaxe.toml"
        if own.is_file():
            return Config(_validate(_load(own), own), own)
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file():
            table = _load(pyproject).get("tool", {}).get("torchaxe")
            if table is not None:
                return Config(_validate(table, pyproject), pyproject)
    return Config()


def _load(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise TorchaxeError(f"{path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise TorchaxeError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _validate(table: Any, path: Path) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise TorchaxeError(f"{path}: [tool.torchaxe] must be a table")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in ("scan",) and isinstance(value, dict):
            out.update(_validate(value, path))
            continue
        if key == "run":
            # The runtime knobs `torchaxe apply` writes and `torchaxe run` applies;
            # validated as a knob set when used (runtime/knobs.py).
            if not isinstance(value, dict):
                raise TorchaxeError(f"{path}: torchaxe setting 'run' must be a table of knobs")
            out["run"] = value
            continue
        key_norm = key.replace("-", "_")
        if key_norm not in KEYS:
            raise TorchaxeError(f"{path}: unknown torchaxe setting {key!r} (known: {', '.join(KEYS)})")
        expected = KEYS[key_norm]
        if not isinstance(value, expected) or isinstance(value, bool) and expected is int:
            kind = {str: "a string", list: "a list", int: "an integer"}.get(expected, "a value")  # type: ignore[call-overload]
            raise TorchaxeError(f"{path}: torchaxe setting {key!r} must be {kind}")
        if expected is list and not all(isinstance(v, str) for v in value):
            raise TorchaxeError(f"{path}: torchaxe setting {key!r} must be a list of strings")
        out[key_norm] = value
    return out
