"""``stable_sort`` and ``unique_with_inverse`` give torch's results at every length."""

from __future__ import annotations

import pytest
import torch

from embshard_optim.sorting import PAD_FROM, RADIX_MIN, stable_sort, unique_with_inverse


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
@pytest.mark.parametrize(
    "n", [0, 1, PAD_FROM - 1, PAD_FROM, 10_000, RADIX_MIN - 1, RADIX_MIN, RADIX_MIN + 5]
)
def test_equal_to_torch_stable_sort(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    info = torch.iinfo(dtype)
    low = max(info.min, -1000)
    keys = torch.randint(low, 1000, (n,), generator=g).clamp(info.min, info.max).to(dtype)
    if n > 2:
        keys[0] = keys[n // 2] = info.max  # the largest key repeated: padding must follow it
    want_values, want_order = torch.sort(keys, stable=True)
    values, order = stable_sort(keys)
    assert torch.equal(values, want_values) and torch.equal(order, want_order)


def test_other_keys_are_sorted_by_torch() -> None:
    floats = torch.rand(PAD_FROM + 10)
    values, order = stable_sort(floats)
    assert torch.equal(order, torch.sort(floats, stable=True).indices)
    assert torch.equal(values, torch.sort(floats, stable=True).values)


@pytest.mark.parametrize("n", [0, 5, PAD_FROM, 20_000, RADIX_MIN + 3])
def test_unique_with_inverse_equals_torch_unique(n: int) -> None:
    ids = torch.randint(0, max(n // 3, 1), (n,), generator=torch.Generator().manual_seed(n))
    want_rows, want_inverse = torch.unique(ids, sorted=True, return_inverse=True)
    rows, inverse = unique_with_inverse(ids)
    assert torch.equal(rows, want_rows) and torch.equal(inverse, want_inverse)
