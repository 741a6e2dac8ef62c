"""Huge-page buffers: always plain zero-filled tensors; the advice is asked for only where it
can be given, and only for large CPU buffers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from embshard_kernels import hugepages


@pytest.fixture(autouse=True)
def _fresh_probe() -> Iterator[None]:
    hugepages._madvise.cache_clear()
    yield
    hugepages._madvise.cache_clear()


def _anon_huge_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("numel", [0, 7, hugepages.MIN_BYTES // 4 + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_filled_of_the_asked_size(numel: int, dtype: torch.dtype) -> None:
    out = hugepages.zeros(numel, dtype)
    assert out.shape == (numel,) and out.dtype == dtype and out.device.type == "cpu"
    assert not out.any()
    out.fill_(1)  # an ordinary, writable tensor
    assert bool((out == 1).all())


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBSHARD_HUGEPAGES", "0")
    assert hugepages._madvise() is None
    assert not hugepages.zeros(hugepages.MIN_BYTES // 4, torch.float32).any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux")
def test_large_buffers_get_huge_pages_where_the_kernel_gives_them_on_request() -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip("this kernel's THP mode is not 'madvise' (nothing to ask for)")
    assert hugepages._madvise() is not None
    before = _anon_huge_kib()
    out = hugepages.zeros(256 * 2**20 // 4, torch.float32)  # 256 MiB
    # 2 MiB pages where the kernel has them free (most of the buffer on a quiet machine)
    assert _anon_huge_kib() - before >= 2048, "not one huge page was given"
    del out


@pytest.mark.parametrize("numel", [5, hugepages.MIN_BYTES // 4 + 1])
def test_empty_has_the_asked_shape_and_is_writable(numel: int) -> None:
    out = hugepages.empty((numel, 1), torch.float32)
    assert out.shape == (numel, 1) and out.dtype == torch.float32 and out.is_contiguous()
    out.fill_(2.0)
    assert bool((out == 2.0).all())


def test_sequence_lookup_without_autograd_equals_the_autograd_path() -> None:
    from embshard_kernels.lookup import sequence_lookup

    torch.manual_seed(0)
    tables = [torch.randn(50, 8), torch.randn(30, 8)]
    lengths = torch.tensor([2, 0, 3, 1, 4, 2])  # 2 features x batch 3
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.cat([torch.randint(0, 50, (5,)), torch.randint(0, 30, (7,))])
    with torch.no_grad():
        fast = sequence_lookup(tables, [0, 1], ids, offsets)
    grads = [t.clone().requires_grad_() for t in tables]
    slow = sequence_lookup(grads, [0, 1], ids, offsets)
    assert slow.requires_grad and not fast.requires_grad
    assert torch.equal(fast, slow.detach())
    assert torch.equal(fast, torch.cat([tables[0][ids[:5]], tables[1][ids[5:]]]))
