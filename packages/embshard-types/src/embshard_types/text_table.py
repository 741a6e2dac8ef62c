"""A tiny plain-text table formatter for printing plans (no third-party ``tabulate``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["tabulate"]


def tabulate(rows: Sequence[Sequence[object]], headers: Sequence[str]) -> str:
    """Format ``rows`` (one ``str()``-ed cell per header) under ``headers`` as a text table.

    Raises:
        ValueError: a row has a different number of cells than there are headers.
    """
    cells = [[str(c) for c in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(
                f"table row {i} has {len(row)} cells but there are {len(headers)} headers"
            )
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = [
        " | ".join(h.center(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
        " | ".join("-" * w for w in widths),
    ]
    lines.extend(
        " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )
    return "\n".join(lines)
