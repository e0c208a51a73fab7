"""Bucket boundaries from an observed distribution of sizes: at most K distinct
shapes with the least padding.

Pure Python (no torch): the input is how often each size was seen (a batch padded to
its own longest sequence has one size per batch), the output the sizes to pad to.

One varying dimension is solved exactly: sizes sorted ``v1 < ... < vn`` with counts
``c``; a bucket covering ``vi..vj`` pads every batch in it to ``vj``; a dynamic
program over (sizes covered, buckets used) finds the K boundaries with the fewest
padded elements, ``O(K n^2)``. Several varying dimensions (image height and width)
get a grid: each dimension's own optimal boundaries for ``k_d`` buckets, with
``prod(k_d) <= K``, the split with the fewest padded elements overall chosen by
counting them exactly over the observed shapes.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

#: The K values the report shows.
TABLE_KS = tuple(range(1, 9))


def optimal_boundaries(counts: Mapping[int, int], k: int) -> tuple[int, ...]:
    """The at most ``k`` sizes to pad to that cover every size in ``counts`` with the
    fewest padded elements (the largest size is always a boundary)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    values = sorted(v for v, c in counts.items() if c > 0)
    if not values:
        return ()
    n = len(values)
    if k >= n:
        return tuple(values)
    weights = [counts[v] for v in values]
    # prefix sums of counts and of count * size: the cost of padding values[i..j] to
    # values[j] is values[j] * sum(c) - sum(c * v) over i..j.
    pc = [0] * (n + 1)
    pv = [0] * (n + 1)
    for i, (v, c) in enumerate(zip(values, weights)):
        pc[i + 1] = pc[i] + c
        pv[i + 1] = pv[i] + c * v

    def cost(i: int, j: int) -> int:  # values[i..j] inclusive padded to values[j]
        return values[j] * (pc[j + 1] - pc[i]) - (pv[j + 1] - pv[i])

    inf = math.inf
    # best[b][j]: least cost covering values[0..j] with b buckets, the last ending at j.
    best = [[inf] * n for _ in range(k + 1)]
    back = [[-1] * n for _ in range(k + 1)]
    for j in range(n):
        best[1][j] = cost(0, j)
    for b in range(2, k + 1):
        for j in range(b - 1, n):
            row_best, row_back = inf, -1
            for i in range(b - 2, j):  # previous bucket ends at i
                candidate = best[b - 1][i] + cost(i + 1, j)
                if candidate < row_best:
                    row_best, row_back = candidate, i
            best[b][j] = row_best
            back[b][j] = row_back
    used = min(range(1, k + 1), key=lambda b: (best[b][n - 1], b))
    out = []
    j, b = n - 1, used
    while j >= 0 and b >= 1:
        out.append(values[j])
        j = back[b][j]
        b -= 1
    return tuple(sorted(out))


def bucket_of(size: int, boundaries: Sequence[int]) -> int | None:
    """The smallest boundary at least ``size``; None when ``size`` is above them all."""
    at = bisect.bisect_left(boundaries, size)
    return boundaries[at] if at < len(boundaries) else None


@dataclass(frozen=True)
class BucketPlan:
    """Boundaries per varying dimension and what they cost on the observed shapes.

    ``dims`` are the positions of the varying dimensions in the shape; ``shapes`` the
    number of distinct padded shapes the observed batches fall into;
    ``extra_fraction`` the elements added by padding to the bucket over the elements
    of the batches as they were (already padded to their own longest):
    ``sum(count * (padded - actual)) / sum(count * actual)``, over the varying
    dimensions' product."""

    k: int
    dims: tuple[int, ...]
    boundaries: tuple[tuple[int, ...], ...]
    shapes: int
    extra_fraction: float

    def to_dict(self) -> dict:
        return {"k": self.k, "dims": list(self.dims), "boundaries": [list(b) for b in self.boundaries],
                "shapes": self.shapes, "extra_padding": round(self.extra_fraction, 6)}


def _product(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _evaluate(points: Mapping[tuple[int, ...], int], boundaries: Sequence[Sequence[int]]) -> tuple[int, float]:
    padded_shapes = set()
    actual = extra = 0
    for point, count in points.items():
        padded = tuple(bucket_of(v, b) for v, b in zip(point, boundaries))
        padded_shapes.add(padded)
        size, padded_size = _product(point), _product(p or 0 for p in padded)
        actual += count * size
        extra += count * (padded_size - size)
    return len(padded_shapes), (extra / actual if actual else 0.0)


def _splits(k: int, d: int) -> list[tuple[int, ...]]:
    """Every (k_1..k_d), each at least 1, with a product of at most k."""
    return [combo for combo in itertools.product(range(1, k + 1), repeat=d) if _product(combo) <= k]


def plan_buckets(points: Mapping[tuple[int, ...], int], k: int, dims: Sequence[int] | None = None) -> BucketPlan:
    """The plan with at most ``k`` shapes for observed size tuples (one entry per
    varying dimension) and how often each was seen."""
    if not points:
        raise ValueError("no observed sizes to bucket")
    d = len(next(iter(points)))
    dims = tuple(dims) if dims is not None else tuple(range(d))
    marginals = [Counter() for _ in range(d)]
    for point, count in points.items():
        for i, v in enumerate(point):
            marginals[i][v] += count
    cache: dict[tuple[int, int], tuple[int, ...]] = {}

    def per_dim(i: int, ki: int) -> tuple[int, ...]:
        if (i, ki) not in cache:
            cache[(i, ki)] = optimal_boundaries(marginals[i], ki)
        return cache[(i, ki)]

    best: BucketPlan | None = None
    for split in _splits(k, d):
        boundaries = tuple(per_dim(i, ki) for i, ki in enumerate(split))
        shapes, extra = _evaluate(points, boundaries)
        plan = BucketPlan(k=k, dims=dims, boundaries=boundaries, shapes=shapes, extra_fraction=extra)
        if best is None or (plan.extra_fraction, plan.shapes) < (best.extra_fraction, best.shapes):
            best = plan
    assert best is not None
    return best


def bucket_table(points: Mapping[tuple[int, ...], int], dims: Sequence[int] | None = None,
                 ks: Sequence[int] = TABLE_KS) -> list[BucketPlan]:
    """One plan per K (the report's K = 1..8 table)."""
    return [plan_buckets(points, k, dims) for k in ks]
