"""Stable sorts of 1-D integer keys at radix-sort speed for every length.

``torch.sort`` on the CPU radix-sorts 1-D integer keys only from ``RADIX_MIN`` elements up (ATen's
grain size); shorter keys take a comparison sort several times slower per element (see
``benchmarks/README.md``). :func:`stable_sort` pads keys of ``PAD_FROM`` to ``RADIX_MIN``
elements with copies of their largest key (after every equal key, and no more radix passes),
so they take the radix sort, then drops the padding: the result is
``torch.sort(keys, stable=True)``'s, values and order. :func:`unique_with_inverse` is
``torch.unique(sorted=True, return_inverse=True)``, through that sort where it is faster.
"""

from __future__ import annotations

import torch
from torch import Tensor

RADIX_MIN = 32768
"""Shortest length ``torch.sort`` radix-sorts on the CPU (``at::internal::GRAIN_SIZE``)."""

PAD_FROM = 6144
"""Shortest length worth padding: below it the comparison sort is as fast."""


def stable_sort(keys: Tensor) -> tuple[Tensor, Tensor]:
    """``(sorted keys, order)``, equal to ``torch.sort(keys, stable=True)``."""
    n = keys.numel()
    if (
        not PAD_FROM <= n < RADIX_MIN
        or keys.dim() != 1
        or keys.device.type != "cpu"
        or keys.is_floating_point()
        or keys.is_complex()
        or keys.dtype == torch.bool
    ):
        values, order = torch.sort(keys, stable=True)
        return values, order
    padded = torch.empty(RADIX_MIN, dtype=keys.dtype)
    padded[:n] = keys
    padded[n:] = keys.max()
    values, order = torch.sort(padded, stable=True)
    return values[:n], order[:n]


def unique_with_inverse(ids: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.unique(ids, sorted=True, return_inverse=True)`` of 1-D integer ``ids``; where
    :func:`stable_sort` pads, from its sort (twice as fast or more; longer or shorter ids:
    ``torch.unique``'s own sort is the faster)."""
    if not PAD_FROM <= ids.numel() < RADIX_MIN or ids.device.type != "cpu":
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        return rows, inverse
    keys, order = stable_sort(ids)
    rows, sorted_inverse = torch.unique_consecutive(keys, return_inverse=True)
    inverse = torch.empty_like(sorted_inverse)
    inverse[order] = sorted_inverse
    return rows, inverse
