"""The rule registry, built by discovering the ``axNNN_*.py`` modules of this package.

Nothing is listed by hand: adding a rule file adds the rule.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from torchaxe.errors import TorchaxeError
from torchaxe.scan.rules.base import Invalid, Rule, Valid

__all__ = ["Invalid", "Rule", "Valid", "all_rules", "get_rule", "select_rules"]


@lru_cache(maxsize=1)
def all_rules() -> tuple[type[Rule], ...]:
    found: list[type[Rule]] = []
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("ax"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Rule) and value.code and value.__module__ == module.__name__:
                found.append(value)
    return tuple(sorted(found, key=lambda r: r.code))


def get_rule(code: str) -> type[Rule]:
    for rule in all_rules():
        if rule.code == code.upper() or rule.name == code.lower():
            return rule
    raise TorchaxeError(f"unknown rule {code!r}: `torchaxe rules` lists them")


def _check_prefixes(prefixes: tuple[str, ...], option: str) -> tuple[str, ...]:
    codes = [r.code for r in all_rules()]
    cleaned = []
    for p in prefixes:
        p = p.strip().upper()
        if not p:
            continue
        if p != "ALL" and not any(c.startswith(p) for c in codes):
            raise TorchaxeError(f"{option}: {p!r} matches no rule code (codes look like AX201; prefixes like AX2 work)")
        cleaned.append(p)
    return tuple(cleaned)


def select_rules(select: tuple[str, ...] = (), ignore: tuple[str, ...] = (),
                 what: str = "--select") -> tuple[type[Rule], ...]:
    """The rules whose code starts with a ``select`` prefix (all when empty) and with
    no ``ignore`` prefix. An unknown prefix is an error, not a silent no-op; ``what``
    names where the prefixes came from in that error."""
    sel = _check_prefixes(tuple(select), what)
    ign = _check_prefixes(tuple(ignore), "--ignore")
    chosen = []
    for rule in all_rules():
        if sel and "ALL" not in sel and not any(rule.code.startswith(p) for p in sel):
            continue
        if "ALL" in ign or any(rule.code.startswith(p) for p in ign):
            continue
        chosen.append(rule)
    return tuple(chosen)
