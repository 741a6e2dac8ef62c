"""AUC, NE, calibration, accuracy and throughput on 2 and 3 gloo ranks equal the single-process
values of the concatenated predictions. Ranks get unequal batch sizes and rank 1 no positive
labels. scikit-learn is not installed: the reference AUC is the Mann-Whitney statistic (ties one
half, as ``roc_auc_score``), the reference NE the direct formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks

from embshard_dist.metrics.auc import AUCMetric
from embshard_dist.metrics.ne import NEMetric
from embshard_dist.metrics.pointwise import AccuracyMetric, CalibrationMetric
from embshard_dist.metrics.throughput import ThroughputMetric

SIZES = {2: [(37, 5), (11,)], 3: [(50, 13), (7, 1, 20), (29,)]}  # per rank, per update


def rank_data(world: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * world + rank)
    out = []
    for n in SIZES[world][rank]:
        p = (torch.rand(n, generator=g) * 30).round() / 31 + 0.01  # ties within and across ranks
        y = (torch.rand(n, generator=g) < p).float()
        if rank == 1:
            y = torch.zeros(n)  # a rank with no positive labels
        out.append((p, y))
    return out


def reference_auc(p: torch.Tensor, y: torch.Tensor) -> float:
    pp, pn = p[y == 1].double(), p[y == 0].double()
    wins = (pp[:, None] > pn[None, :]).double() + 0.5 * (pp[:, None] == pn[None, :]).double()
    return float(wins.sum() / (len(pp) * len(pn)))


def reference_ne(p: torch.Tensor, y: torch.Tensor) -> float:
    ce = sum(
        -b * math.log2(a) - (1 - b) * math.log2(1 - a)
        for a, b in zip(p.double().tolist(), y.tolist(), strict=True)
    )
    q = float(y.double().mean())
    return ce / (len(y) * (-q * math.log2(q) - (1 - q) * math.log2(1 - q)))


def _compute_on_rank(world: int) -> dict[str, float]:
    rank = dist.get_rank()
    metrics = [AUCMetric(), NEMetric(), CalibrationMetric(), AccuracyMetric()]
    throughput = ThroughputMetric(batch_size=1)
    for p, y in rank_data(world, rank):
        for m in metrics:
            m.update(p, y)
        throughput.update(len(p))
    out: dict[str, float] = {}
    for m in metrics:
        out.update({k: float(v) for k, v in m.compute().items()})
    out["total"] = float(throughput.compute()["throughput-throughput|total_examples"])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_metrics_across_ranks_equal_the_concatenated_values(world: int) -> None:
    parts = [pair for r in range(world) for pair in rank_data(world, r)]
    p = torch.cat([a for a, _ in parts])
    y = torch.cat([b for _, b in parts])
    results = run_on_ranks(world, _compute_on_rank, world)
    assert all(r == results[0] for r in results)  # every rank gets the same values
    got = results[0]
    for prefix in ("lifetime", "window"):
        assert abs(got[f"auc-DefaultTask|{prefix}_auc"] - reference_auc(p, y)) < 1e-6
        assert abs(got[f"ne-DefaultTask|{prefix}_ne"] - reference_ne(p, y)) < 1e-6
    assert (
        abs(got["calibration-DefaultTask|lifetime_calibration"] - float(p.double().sum() / y.sum()))
        < 1e-6
    )
    acc = float(((p >= 0.5).float() == y).double().mean())
    assert abs(got["accuracy-DefaultTask|lifetime_accuracy"] - acc) < 1e-6
    assert got["total"] == len(p)
