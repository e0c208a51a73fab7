"""Statistics over raw samples: median, percentiles and spread.

A :class:`Samples` keeps every value it was built from, so a summary can always be
recomputed (and checked) from the data it summarises. Percentiles interpolate
linearly between the two nearest ranks, as numpy's default ``linear`` method does,
so figures agree with what a user computes from the raw samples themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

#: A spread (interquartile range over median) above this makes a measurement noisy.
NOISY_SPREAD = 0.10


def quantile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of ``values``, interpolating linearly."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside [0, 1]")
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


@dataclass(frozen=True)
class Samples:
    """Raw measurements of one quantity (seconds, bytes, a ratio, ...)."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float | int | None]) -> "Samples":
        """Samples from ``values``, leaving out the ``None`` entries (not measured)."""
        return cls(tuple(float(v) for v in values if v is not None))

    def __len__(self) -> int:
        return len(self.values)

    def __bool__(self) -> bool:
        return bool(self.values)

    @property
    def median(self) -> float | None:
        return quantile(self.values, 0.5) if self.values else None

    @property
    def p10(self) -> float | None:
        return quantile(self.values, 0.1) if self.values else None

    @property
    def p90(self) -> float | None:
        return quantile(self.values, 0.9) if self.values else None

    @property
    def iqr(self) -> float | None:
        """Interquartile range: p75 - p25."""
        if not self.values:
            return None
        return quantile(self.values, 0.75) - quantile(self.values, 0.25)

    @property
    def mean(self) -> float | None:
        return math.fsum(self.values) / len(self.values) if self.values else None

    def trimmed_mean(self, cut: float = 0.1) -> float | None:
        """The mean of the values left when the lowest and the highest ``cut`` of them
        are set aside (a whole value at a time; none of a handful of values): a rare
        spike weighs no more than in the median, while values that alternate (fast
        steps between slow ones) all count, as they do in the time a run takes."""
        if not self.values:
            return None
        if not 0.0 <= cut < 0.5:
            raise ValueError(f"trimmed mean cut {cut} outside [0, 0.5)")
        ordered = sorted(self.values)
        drop = int(len(ordered) * cut)
        kept = ordered[drop:len(ordered) - drop]
        return math.fsum(kept) / len(kept)

    @property
    def total(self) -> float:
        return math.fsum(self.values)

    @property
    def min(self) -> float | None:
        return min(self.values) if self.values else None

    @property
    def max(self) -> float | None:
        return max(self.values) if self.values else None

    @property
    def relative_spread(self) -> float | None:
        """Interquartile range over the median; ``None`` without samples or with a zero median."""
        median = self.median
        if median is None or median == 0:
            return None
        return (self.iqr or 0.0) / abs(median)

    def is_noisy(self, threshold: float = NOISY_SPREAD) -> bool:
        """Whether the spread is large enough that the median should not be trusted
        to better than a few percent."""
        spread = self.relative_spread
        return spread is not None and spread > threshold
