"""Loop-free tensor helpers shared by the jagged types (nothing iterates over ids in Python).

Functions that return Python numbers read the device once and say so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate, pairwise

import torch
from torch import Tensor


def offsets_from_lengths(lengths: Tensor) -> Tensor:
    """Return the complete offsets of 1-D ``lengths``: ``[0, l0, l0+l1, ...]`` in their dtype."""
    out = torch.empty(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    out[0] = 0
    torch.cumsum(lengths, 0, dtype=lengths.dtype, out=out[1:])
    return out


def lengths_from_offsets(offsets: Tensor) -> Tensor:
    """Return the segment lengths of complete ``offsets`` (one entry fewer than ``offsets``)."""
    return torch.diff(offsets)


def cumulative(sizes: Iterable[int]) -> list[int]:
    """Return ``[0, s0, s0+s1, ...]`` for Python ints (one entry more than ``sizes``)."""
    return list(accumulate(sizes, initial=0))


def differences(running: Sequence[int]) -> list[int]:
    """Return ``[r1-r0, r2-r1, ...]`` for Python ints (the inverse of ``cumulative``)."""
    return [b - a for a, b in pairwise(running)]


def offsets_at(offsets: Tensor, positions: Sequence[int], uniform_step: int = 0) -> list[int]:
    """Read ``offsets[p]`` for each ``p`` in ``positions`` back to Python (one device sync).

    Traced (``torch.export``), the values stay symbolic sizes, checked to be non-decreasing, so a
    sequence collection's per-feature outputs export without fixing them to the example's.

    Args:
        uniform_step: when positive, ``positions`` is ``0, step, 2*step, ...`` and a strided
            view replaces the index tensor.
    """
    if uniform_step > 0:
        read = offsets[::uniform_step].tolist()
    else:
        index = torch.tensor(list(positions), dtype=torch.long, device=offsets.device)
        read = offsets.index_select(0, index).tolist()
    if torch.compiler.is_compiling():
        # Traced (torch.export): unbacked sizes, known only to be non-decreasing from 0.
        for a, b in pairwise(read):
            torch._check(b >= a)
        return list(read)
    return [int(v) for v in read]


def gather_segments(tensor: Tensor, bounds: Sequence[int], order: Sequence[int]) -> Tensor:
    """Concatenate the segments ``tensor[bounds[i]:bounds[i+1]]`` for ``i`` in ``order``.

    ``order`` may repeat or leave out segments; when it is ``0..n-1`` the input is returned.
    """
    if len(order) == len(bounds) - 1 and all(i == j for j, i in enumerate(order)):
        return tensor
    pieces = _merge_runs(bounds, order)
    if not pieces:
        return tensor[:0]
    if len(pieces) == 1:
        start, stop = pieces[0]
        return tensor[start:stop]
    return torch.cat([tensor[start:stop] for start, stop in pieces])


def _merge_runs(bounds: Sequence[int], order: Sequence[int]) -> list[tuple[int, int]]:
    """Turn segment indices into slices, merging runs of adjacent segments into one slice."""
    pieces: list[tuple[int, int]] = []
    for i in order:
        start, stop = bounds[i], bounds[i + 1]
        if pieces and pieces[-1][1] == start:
            pieces[-1] = (pieces[-1][0], stop)
        else:
            pieces.append((start, stop))
    return pieces


def split_sizes(tensor: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Split ``tensor`` along dim 0 into views of the given ``sizes`` (they must add up)."""
    return list(torch.split(tensor, list(sizes), dim=0))
