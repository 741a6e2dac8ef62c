"""How many distinct rows a step touches: uniform ids, or ids with hot rows (a Zipf law).

Updates and row exchanges cost per distinct row, not per id. The Zipf sum is exact over the
hottest rows and integrated on a log grid over the rest, so its cost does not grow with the
table; a row block gets its share of the table's distinct rows (hot rows are spread by hashing).

Guarantees: pure, deterministic and cached; the result is in ``[0, min(n, R)]`` up to rounding
and grows with ``n``; exponent 0 or ``None`` is the uniform case.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

__all__ = ["distinct_rows"]

_EXACT = 4096
_GRID = 256


def distinct_rows(rows: float, draws: float, zipf_exponent: float | None = None) -> float:
    """Expected distinct rows among ``draws`` ids over ``rows`` rows (of a table or a block).

    Args:
        zipf_exponent: the Zipf exponent of the ids (``None`` or 0: uniform ids).
    """
    if rows <= 0 or draws <= 0:
        return 0.0
    if not zipf_exponent:
        return -rows * math.expm1(-draws / rows)
    return _zipf_distinct(round(rows), float(draws), float(zipf_exponent))


def _power_sum(lo: float, hi: float, s: float) -> float:
    """``integral of x**-s from lo to hi``."""
    if abs(s - 1.0) < 1e-12:
        return math.log(hi / lo)
    return (hi ** (1 - s) - lo ** (1 - s)) / (1 - s)


@lru_cache(maxsize=4096)
def _zipf_distinct(rows: int, draws: float, s: float) -> float:
    rows = max(1, rows)
    exact = min(rows, _EXACT)
    weights = [k**-s for k in range(1, exact + 1)]
    norm = sum(weights)
    if rows > exact:
        norm += _power_sum(exact + 0.5, rows + 0.5, s)
    total = sum(-math.expm1(-draws * w / norm) for w in weights)
    if rows > exact:
        # midpoint rule on a log grid over (exact, rows]: each cell holds (hi - lo) rows
        edges = [exact + 0.5]
        ratio = ((rows + 0.5) / (exact + 0.5)) ** (1 / _GRID)
        for _ in range(_GRID):
            edges.append(edges[-1] * ratio)
        edges[-1] = rows + 0.5
        for lo, hi in itertools.pairwise(edges):
            mid = math.sqrt(lo * hi)
            total += (hi - lo) * -math.expm1(-draws * mid**-s / norm)
    return min(total, float(rows), draws)
