"""K1 kernel benchmarks (``nox -s bench``): forward and forward+backward+update per contender.

Ratios between contenders come from ``k1_ratios.py`` (interleaved in one run); this suite tracks
each contender's own time from commit to commit and fails on a regression against the previous
saved run (see the ``bench`` session).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("pytest_benchmark", reason="benchmarks need pytest-benchmark (nox -s bench)")

from k1_contenders import embshard_collection, fbgemm_tbe, torch_embedding_bags
from workloads import K1

_W = K1()
_BUILDERS: dict[str, Callable[[K1], tuple[Callable[[], None], Callable[[], None]]]] = {
    "embshard_fused_rowwise_adagrad": embshard_collection,
    "fbgemm_tbe_rowwise_adagrad": fbgemm_tbe,
    "torch_embedding_bag_sparse_adagrad": torch_embedding_bags,
}


@pytest.mark.parametrize("contender", list(_BUILDERS))
def test_k1_step(benchmark, contender: str) -> None:  # type: ignore[no-untyped-def]
    step, _ = _BUILDERS[contender](_W)
    benchmark.pedantic(step, rounds=10, warmup_rounds=3, iterations=1)


@pytest.mark.parametrize("contender", list(_BUILDERS))
def test_k1_forward(benchmark, contender: str) -> None:  # type: ignore[no-untyped-def]
    _, forward = _BUILDERS[contender](_W)
    benchmark.pedantic(forward, rounds=10, warmup_rounds=3, iterations=1)
