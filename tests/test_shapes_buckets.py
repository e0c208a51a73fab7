"""Bucket boundaries: the dynamic program against brute force, the K table, grids."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from torchaxe.shapes.buckets import bucket_of, bucket_table, optimal_boundaries, plan_buckets


def padding(counts, boundaries):
    return sum(c * (bucket_of(v, boundaries) - v) for v, c in counts.items())


def brute_force(counts, k):
    values = sorted(counts)
    best = None
    for n in range(1, min(k, len(values)) + 1):
        for inner in itertools.combinations(values[:-1], n - 1):
            bounds = tuple(sorted(inner)) + (values[-1],)
            cost = padding(counts, bounds)
            if best is None or cost < best:
                best = cost
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_program_finds_the_least_padding(seed):
    rng = random.Random(seed)
    counts = Counter(rng.randint(1, 60) for _ in range(rng.randint(3, 40)))
    for k in (1, 2, 3, 4):
        bounds = optimal_boundaries(counts, k)
        assert len(bounds) <= k and bounds[-1] == max(counts)
        assert padding(counts, bounds) == brute_force(counts, k)


def test_known_distribution():
    # two clusters: 10-12 (many) and 50 (few); with two buckets the clusters split
    counts = Counter({10: 30, 11: 30, 12: 30, 50: 2})
    assert optimal_boundaries(counts, 1) == (50,)
    assert optimal_boundaries(counts, 2) == (12, 50)
    assert optimal_boundaries(counts, 8) == (10, 11, 12, 50)


def test_bucket_of_and_bad_k():
    assert bucket_of(5, (4, 8, 16)) == 8
    assert bucket_of(8, (4, 8, 16)) == 8
    assert bucket_of(17, (4, 8, 16)) is None
    with pytest.raises(ValueError):
        optimal_boundaries({3: 1}, 0)


def test_table_padding_falls_and_shapes_are_bounded():
    rng = random.Random(1)
    points = Counter((rng.randint(20, 64),) for _ in range(200))
    table = bucket_table(points, dims=(1,))
    assert [p.k for p in table] == list(range(1, 9))
    extras = [p.extra_fraction for p in table]
    assert all(a >= b for a, b in zip(extras, extras[1:]))
    assert all(p.shapes <= p.k for p in table)
    assert table[0].boundaries == ((64,),)
    # K=1: every batch padded to 64
    actual = sum(v * c for (v,), c in points.items())
    assert table[0].extra_fraction == pytest.approx(sum((64 - v) * c for (v,), c in points.items()) / actual)
    assert table[0].to_dict()["dims"] == [1]


def test_two_dimensions_get_a_grid_within_k():
    points = Counter({(32, 32): 10, (32, 64): 5, (64, 32): 5, (64, 64): 10, (48, 48): 1})
    plan = plan_buckets(points, 4, dims=(2, 3))
    assert plan.shapes <= 4
    assert len(plan.boundaries) == 2
    assert plan.boundaries[0][-1] == 64 and plan.boundaries[1][-1] == 64
    one = plan_buckets(points, 1, dims=(2, 3))
    assert one.boundaries == ((64,), (64,)) and one.shapes == 1
    assert plan.extra_fraction < one.extra_fraction
