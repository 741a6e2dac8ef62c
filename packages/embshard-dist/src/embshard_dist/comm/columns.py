"""Reordering the columns of pooled embeddings ``[batch, width]``, one copy in each direction.

``index_select(1, ...)``'s backward scatters along the columns, slowly on the CPU; here runs of
consecutive columns are copied both ways (parts concatenated and reordered at once). Exact:
values are moved, never combined; a column list that is not a permutation is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor


class ColumnAssembly:
    """Several ``[batch, w_i]`` parts put side by side and reordered, in one copy each way:
    ``torch.cat(parts, dim=1)[:, columns]`` (``columns`` ``None``: in order).

    Args:
        widths: the parts' widths.
        columns: the permutation of ``range(sum(widths))``, or ``None``.

    Raises:
        ValueError: ``columns`` is not a permutation of the parts' columns.
    """

    def __init__(self, widths: Sequence[int], columns: Sequence[int] | None = None) -> None:
        self.widths = [int(w) for w in widths]
        total = sum(self.widths)
        cols = list(range(total)) if columns is None else [int(c) for c in columns]
        if sorted(cols) != list(range(total)):
            raise ValueError(
                f"ColumnAssembly: {len(cols)} columns must be a permutation of the parts' "
                f"{total} columns"
            )
        part_of: list[int] = []
        offset_in: list[int] = []
        for p, w in enumerate(self.widths):
            part_of.extend([p] * w)
            offset_in.extend(range(w))
        # runs: (part, first column in the part, first output column, width)
        self.runs = _runs((j, part_of[c], offset_in[c]) for j, c in enumerate(cols))
        self.width = total
        self.placed = False

    def place(self, destinations: Sequence[int], width: int) -> ColumnAssembly:
        """This assembly writing its output column ``j`` to column ``destinations[j]`` of a
        ``width``-wide output whose other columns other parts fill (:meth:`assemble` with
        ``out``; :meth:`split` reads the same columns of the whole output's gradient).

        Raises:
            ValueError: ``destinations`` does not give each output column its own column of
                ``range(width)``.
        """
        dests = [int(d) for d in destinations]
        if len(dests) != self.width or len(set(dests)) != len(dests):
            raise ValueError(
                f"ColumnAssembly.place: {len(dests)} destinations for {self.width} columns "
                "must be distinct"
            )
        if dests and (min(dests) < 0 or max(dests) >= width):
            raise ValueError(f"ColumnAssembly.place: destinations must lie in 0..{width - 1}")
        placed = copy.copy(self)
        placed.runs = _runs(
            sorted((dests[dst + i], p, src + i) for p, src, dst, w in self.runs for i in range(w))
        )
        placed.width = int(width)
        placed.placed = True
        return placed

    def __call__(self, parts: Sequence[Tensor]) -> Tensor:
        """The assembled ``[batch, sum(widths)]``, differentiable in every part."""
        if self.placed:
            raise TypeError("ColumnAssembly: a placed assembly fills part of an output: use out=")
        shapes = [tuple(p.shape) for p in parts]
        if len(parts) != len(self.widths) or any(
            len(s) != 2 or s[1] != w or s[0] != shapes[0][0]
            for s, w in zip(shapes, self.widths, strict=True)
        ):
            raise ValueError(
                f"ColumnAssembly: expected parts [batch, w] of widths {self.widths}, got {shapes}"
            )
        if len(parts) == 1 and self.runs == [(0, 0, 0, self.width)]:
            return parts[0]
        out: Tensor = _Assemble.apply(self, *parts)
        return out

    def assemble(self, parts: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
        """The parts side by side in order, no autograd (shapes unchecked), in a new tensor or
        in ``out`` (``[batch, width]``; required for a placed assembly)."""
        if out is None:
            if self.placed:
                raise TypeError("ColumnAssembly: a placed assembly writes into a given out")
            first = parts[0]
            out = first.new_empty(first.shape[0], self.width)
        for p, src, dst, width in self.runs:
            out[:, dst : dst + width] = parts[p][:, src : src + width]
        return out

    def split(
        self,
        values: Tensor,
        out: Tensor | None = None,
        scale: float = 1.0,
        direct: tuple[int, Tensor] | None = None,
    ) -> list[Tensor]:
        """The inverse of :meth:`assemble`: one contiguous ``[batch, w_i]`` per part, the parts
        one after another in one buffer (so an all-to-all sends them without a copy).

        Args:
            values: ``[batch, width]``.
            out: a flat buffer of at least ``batch * width`` elements to hold the parts
                (``None``: a new one).
            scale: multiply the values by this while moving them (``values * scale``, the
                same bits as scaling first).
            direct: ``(i, target)``: part ``i`` goes into ``target`` (contiguous
                ``[batch, w_i]``) instead, and the buffer holds the other parts, in order.
        """
        batch = values.shape[0]
        widths = [0 if direct and p == direct[0] else w for p, w in enumerate(self.widths)]
        total = batch * sum(widths)
        flat = values.new_empty(total) if out is None else out[:total]
        parts = [
            chunk.view(batch, w)
            for chunk, w in zip(flat.split([batch * w for w in widths]), widths, strict=True)
        ]
        if direct is not None:
            parts[direct[0]] = direct[1]
        for p, src, dst, width in self.runs:
            if scale == 1.0:
                parts[p][:, src : src + width] = values[:, dst : dst + width]
            else:
                torch.mul(values[:, dst : dst + width], scale, out=parts[p][:, src : src + width])
        return parts


def _runs(columns: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """``(output column, part, column in the part)`` in output order, merged into runs
    ``(part, first column in the part, first output column, width)``."""
    runs: list[tuple[int, int, int, int]] = []
    for j, p, o in columns:
        if runs:
            lp, lo, lj, lw = runs[-1]
            if lp == p and lo + lw == o and lj + lw == j:
                runs[-1] = (p, lo, lj, lw + 1)
                continue
        runs.append((p, o, j, 1))
    return runs


class _Assemble(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, assembly: ColumnAssembly, *parts: Tensor) -> Tensor:
        ctx.assembly = assembly
        return assembly.assemble(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *ctx.assembly.split(grad))


class ColumnOrder:
    """Output column ``j`` is input column ``columns[j]``: a one-part :class:`ColumnAssembly`.

    Raises:
        ValueError: ``columns`` is not a permutation of ``range(len(columns))``.
    """

    def __init__(self, columns: Sequence[int]) -> None:
        cols = [int(c) for c in columns]
        if sorted(cols) != list(range(len(cols))):
            raise ValueError(
                f"ColumnOrder: {len(cols)} columns must be a permutation of 0..{len(cols) - 1}"
            )
        self.width = len(cols)
        self._assembly = ColumnAssembly([self.width], cols)

    @staticmethod
    def of(columns: Sequence[int] | None) -> ColumnOrder | None:
        """The order of ``columns``, or ``None`` when there is nothing to reorder."""
        if columns is None or list(columns) == list(range(len(columns))):
            return None
        return ColumnOrder(columns)

    def __call__(self, values: Tensor) -> Tensor:
        """``values[:, columns]``, differentiable."""
        if values.dim() != 2 or values.shape[1] != self.width:
            raise ValueError(
                f"ColumnOrder: expected [batch, {self.width}] values, got {tuple(values.shape)}"
            )
        return self._assembly([values])
