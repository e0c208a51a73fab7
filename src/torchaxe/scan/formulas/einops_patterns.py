"""einops' ``rearrange`` and ``repeat`` on probe tensors, from their pattern strings.

Much hand-written attention and rotary code moves axes with einops
(``rearrange(t, 'b n (h d) -> b h n d', h=h)``). The interpreter evaluates these
with plain reshapes, permutes and expands, so that scanning never needs einops
installed and never calls into it. Only what the two functions document is read:
named axes, parenthesised compositions, ``...``, and anonymous axes given as numbers
(``1`` in ``rearrange``; any size on the right of ``repeat``). Anything else raises
``PatternError``, and the interpreter then treats the call as an opaque layout.
"""

from __future__ import annotations

import math
import re
from typing import Any

_TOKEN = re.compile(r"\s*(\.\.\.|\(|\)|[A-Za-z_][A-Za-z0-9_]*|\d+)")
ELLIPSIS = "..."
COMPOSED_ELLIPSIS = "(...)"


class PatternError(ValueError):
    """A pattern, or a tensor, that the operation does not apply to."""


def _tokens(side: str) -> list[str]:
    found, pos = [], 0
    side = side.rstrip()
    while pos < len(side):
        match = _TOKEN.match(side, pos)
        if match is None:
            raise PatternError(f"unreadable pattern {side!r}")
        found.append(match.group(1))
        pos = match.end()
    return found


def parse_side(side: str) -> list[list[str]]:
    """The groups of one side: ``'b (h d) ...'`` -> ``[['b'], ['h', 'd'], ['...']]``.
    Numbers stay strings (``'1'``); ``()`` is an empty group (an axis of size one);
    a parenthesised ``(...)`` is ``['(...)']``."""
    groups: list[list[str]] = []
    current: list[str] | None = None
    for token in _tokens(side):
        if token == "(":
            if current is not None:
                raise PatternError("nested parentheses")
            current = []
        elif token == ")":
            if current is None:
                raise PatternError("unbalanced parentheses")
            groups.append(current if current != [ELLIPSIS] else [COMPOSED_ELLIPSIS])
            current = None
        elif current is not None:
            current.append(token)
        else:
            groups.append([token])
    if current is not None:
        raise PatternError("unbalanced parentheses")
    names = [ELLIPSIS if t == COMPOSED_ELLIPSIS else t for g in groups for t in g if not t.isdigit()]
    if len(names) != len(set(names)):
        raise PatternError("an axis named twice")
    return groups


def _expand_ellipsis(groups: list[list[str]], count: int) -> list[list[str]]:
    """``...`` replaced by ``count`` axes named ``...0``, ``...1``, ... (inside a
    parenthesis they stay one composed group)."""
    names = [f"{ELLIPSIS}{i}" for i in range(count)]
    out: list[list[str]] = []
    for group in groups:
        if group == [ELLIPSIS]:
            out.extend([name] for name in names)
        elif group == [COMPOSED_ELLIPSIS] or ELLIPSIS in group:
            i = group.index(ELLIPSIS if ELLIPSIS in group else COMPOSED_ELLIPSIS)
            out.append(group[:i] + names + group[i + 1:])
        else:
            out.append(group)
    return out


def _sizes(groups: list[list[str]], shape: tuple[int, ...], lengths: dict[str, int]) -> dict[str, int]:
    """Every axis size of the left side, from the tensor's shape and the given lengths."""
    if len(groups) != len(shape):
        raise PatternError(f"pattern has {len(groups)} dimensions, the tensor {len(shape)}")
    sizes = dict(lengths)
    for group, dim in zip(groups, shape):
        known, unknown = 1, []
        for axis in group:
            if axis.isdigit():
                known *= int(axis)
            elif axis in sizes:
                known *= sizes[axis]
            else:
                unknown.append(axis)
        if len(unknown) > 1:
            raise PatternError("a composed axis with two unknown sizes")
        if unknown:
            if known <= 0 or dim % known:
                raise PatternError("a composed axis that does not divide")
            sizes[unknown[0]] = dim // known
        elif known != dim:
            raise PatternError("an axis size that does not match the tensor")
    return sizes


def apply(tensor: Any, pattern: str, repeat: bool = False, **lengths: Any) -> Any:
    """``einops.rearrange(tensor, pattern, **lengths)`` (or ``einops.repeat`` when
    ``repeat``), computed with torch's own view operations."""
    if not isinstance(pattern, str) or pattern.count("->") != 1:
        raise PatternError("not a rearrangement pattern")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16 for v in lengths.values()):
        raise PatternError("axis lengths must be small positive integers")
    left_text, right_text = pattern.split("->")
    left, right = parse_side(left_text), parse_side(right_text)
    shape = tuple(tensor.shape)
    flat_left = [t for g in left for t in g]
    if ELLIPSIS in flat_left or COMPOSED_ELLIPSIS in flat_left:
        if [ELLIPSIS] not in left or COMPOSED_ELLIPSIS in flat_left:
            raise PatternError("an ellipsis inside parentheses on the left")
        extra = len(shape) - (len(left) - 1)
        if extra < 0:
            raise PatternError("the tensor has too few dimensions")
        left = _expand_ellipsis(left, extra)
        right = _expand_ellipsis(right, extra)
    elif any(ELLIPSIS in g or COMPOSED_ELLIPSIS in g for g in right):
        raise PatternError("an ellipsis on the right only")
    sizes = _sizes(left, shape, lengths)
    named_left = [t for g in left for t in g if not t.isdigit()]
    named_right = [t for g in right for t in g if not t.isdigit()]
    if not repeat and set(named_left) != set(named_right):
        raise PatternError("rearrange must keep every axis")
    if repeat and not set(named_left) <= set(named_right):
        raise PatternError("repeat cannot drop an axis")
    if not repeat and any(t != "1" for g in right for t in g if t.isdigit()):
        raise PatternError("rearrange only adds axes of size one")
    new = [t for t in named_right if t not in named_left]
    if any(t not in sizes for t in new):
        raise PatternError("a new axis without a length")
    if math.prod(sizes[t] for t in named_right) * math.prod(
            int(t) for g in right for t in g if t.isdigit()) > 1 << 16:
        raise PatternError("too large")
    # Split every axis, put the kept ones in the right side's order, add the new ones.
    out = tensor.reshape([sizes[t] for t in named_left])
    kept = [t for t in named_right if t in named_left]
    out = out.permute([named_left.index(t) for t in kept])
    elementary: list[int] = []
    full: list[int] = []
    for group in right:
        for axis in group:
            if axis.isdigit():
                elementary.append(1)
                full.append(int(axis))
            else:
                elementary.append(sizes[axis] if axis in named_left else 1)
                full.append(sizes[axis])
    out = out.reshape(elementary)
    if full != elementary:
        out = out.expand(full)
    grouped = [math.prod(int(t) if t.isdigit() else sizes[t] for t in g) for g in right]
    return out.reshape(grouped)
