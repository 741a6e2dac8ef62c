"""The one plain-text table style of embshard's printed output (no third-party ``tabulate``).

Plans, the planner's stats and ``embshard checkpoint inspect`` all print through
:func:`tabulate`: an optional title line, a header, a rule of dashes, columns separated by
``" | "``, each as wide as its widest cell. Number columns (every cell a number, optionally with
a short unit such as ``"1.5 KiB"`` or ``"2.00 ms"``; ``"-"`` stands for none) are right-aligned
with their header, the others left-aligned. A table with no rows is not drawn: one line says so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["tabulate"]

_NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?([eE][-+]?\d+)?( ?[A-Za-z%]{1,3})?")
_NONE = ("", "-")


def _is_number_column(values: Sequence[object]) -> bool:
    """Every value a number (``"-"`` and empty cells aside), and at least one."""
    shown = [v for v in values if str(v) not in _NONE]
    return bool(shown) and all(
        not isinstance(v, bool)
        and (isinstance(v, int | float) or _NUMBER.fullmatch(str(v)) is not None)
        for v in shown
    )


def tabulate(
    rows: Sequence[Sequence[object]],
    headers: Sequence[str],
    *,
    title: str = "",
    empty: str = "none",
) -> str:
    """Format ``rows`` (one ``str()``-ed cell per header) under ``headers`` as a text table.

    Args:
        title: a line above the table (e.g. ``"per rank:"``).
        empty: what to print instead of a table without rows (after the title).

    Raises:
        ValueError: a row has a different number of cells than there are headers.
    """
    cells = [[str(c) for c in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(
                f"table row {i} has {len(row)} cells but there are {len(headers)} headers"
            )
    if not cells:
        return f"{title} {empty}" if title else empty
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    right = [_is_number_column([row[j] for row in rows]) for j in range(len(headers))]

    def line(texts: Sequence[str]) -> str:
        return " | ".join(
            t.rjust(w) if r else t.ljust(w) for t, w, r in zip(texts, widths, right, strict=True)
        ).rstrip()

    lines = [title] if title else []
    lines += [line(headers), " | ".join("-" * w for w in widths)]
    lines += [line(row) for row in cells]
    return "\n".join(lines)
