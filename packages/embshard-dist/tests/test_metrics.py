"""Metrics on one process against direct formulas (scikit-learn is not installed here: the
reference AUC is the Mann-Whitney statistic, ties counted one half, as ``roc_auc_score``)."""

from __future__ import annotations

import math

import pytest
import torch

from embshard_dist.metrics.auc import AUCMetric, merge_tables, score_table
from embshard_dist.metrics.ne import NEMetric
from embshard_dist.metrics.pointwise import AccuracyMetric, CalibrationMetric
from embshard_dist.metrics.throughput import ThroughputMetric


def reference_auc(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> float:
    """Weighted Mann-Whitney AUC by comparing every positive with every negative."""
    w = torch.ones_like(p, dtype=torch.float64) if w is None else w.double()
    pos, neg = y == 1, y == 0
    pp, pn, wp, wn = p[pos].double(), p[neg].double(), w[pos], w[neg]
    wins = (pp[:, None] > pn[None, :]).double() + 0.5 * (pp[:, None] == pn[None, :]).double()
    return float((wp[:, None] * wn[None, :] * wins).sum() / (wp.sum() * wn.sum()))


def reference_ne(p: torch.Tensor, y: torch.Tensor) -> float:
    p, y = p.double(), y.double()
    ce = sum(
        -yi * math.log2(pi) - (1 - yi) * math.log2(1 - pi)
        for pi, yi in zip(p.tolist(), y.tolist(), strict=True)
    )
    q = float(y.mean())
    return ce / (len(y) * (-q * math.log2(q) - (1 - q) * math.log2(1 - q)))


def data(n: int, seed: int, ties: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g)
    if ties:
        p = (p * 20).round() / 21 + 0.01  # many tied scores
    y = (torch.rand(n, generator=g) < p).float()
    return p, y


def test_auc_matches_mann_whitney_with_ties_and_weights() -> None:
    p, y = data(700, 0)
    w = torch.rand(700, generator=torch.Generator().manual_seed(9)) + 0.5
    m = AUCMetric()
    for a, b in ((0, 100), (100, 101), (101, 700)):
        m.update(p[a:b], y[a:b], w[a:b])
    got = m.compute()["auc-DefaultTask|lifetime_auc"]
    assert abs(float(got) - reference_auc(p, y, w)) < 1e-12


def test_score_tables_merge_exactly() -> None:
    p, y = data(300, 1)
    w = torch.ones(300, dtype=torch.float64)
    whole = score_table(p, y, w)
    parts = merge_tables(
        [score_table(p[:120], y[:120], w[:120]), score_table(p[120:], y[120:], w[120:])]
    )
    assert torch.equal(whole, parts)
    assert whole.shape[0] == torch.unique(p).numel()


def test_auc_without_positives_is_one_half() -> None:
    m = AUCMetric()
    m.update(torch.rand(10), torch.zeros(10))
    assert float(m.compute()["auc-DefaultTask|lifetime_auc"]) == 0.5


def test_ne_matches_the_direct_formula() -> None:
    p, y = data(500, 2, ties=False)
    m = NEMetric()
    m.update(p[:200], y[:200])
    m.update(p[200:], y[200:])
    out = m.compute()
    assert abs(float(out["ne-DefaultTask|lifetime_ne"]) - reference_ne(p, y)) < 1e-9
    baseline = NEMetric()  # predicting the mean label everywhere scores NE 1
    baseline.update(torch.full((500,), float(y.double().mean()), dtype=torch.float64), y)
    assert abs(float(baseline.compute()["ne-DefaultTask|lifetime_ne"]) - 1.0) < 1e-12
    assert set(out) == {"ne-DefaultTask|lifetime_ne", "ne-DefaultTask|window_ne"}


def test_window_keeps_the_latest_updates() -> None:
    p, y = data(600, 3, ties=False)
    m = AUCMetric(window_size=250)
    for a in range(0, 600, 100):
        m.update(p[a : a + 100], y[a : a + 100])
    out = m.compute()
    assert abs(float(out["auc-DefaultTask|window_auc"]) - reference_auc(p[400:], y[400:])) < 1e-12
    assert abs(float(out["auc-DefaultTask|lifetime_auc"]) - reference_auc(p, y)) < 1e-12


def test_tasks_calibration_and_accuracy() -> None:
    p, y = data(400, 4, ties=False)
    cal = CalibrationMetric(tasks=["ctr", "cvr"])
    cal.update({"ctr": p, "cvr": p / 2}, {"ctr": y, "cvr": y})
    out = cal.compute()
    assert abs(float(out["calibration-ctr|lifetime_calibration"]) - float(p.sum() / y.sum())) < 1e-6
    assert (
        abs(float(out["calibration-cvr|window_calibration"]) - float(p.sum() / 2 / y.sum())) < 1e-6
    )
    acc = AccuracyMetric(threshold=0.4)
    acc.update(p, y)
    expect = float(((p >= 0.4).float() == y).double().mean())
    assert abs(float(acc.compute()["accuracy-DefaultTask|lifetime_accuracy"]) - expect) < 1e-12
    with pytest.raises(ValueError, match="lacks tasks"):
        cal.update({"ctr": p}, {"ctr": y})
    with pytest.raises(ValueError, match="one value per sample"):
        acc.update(p, y[:-1])


def test_throughput_lifetime_and_window() -> None:
    now = [0.0]
    m = ThroughputMetric(batch_size=10, window_seconds=5.0, clock=lambda: now[0])
    for _ in range(10):
        now[0] += 1.0
        m.update()
    out = m.compute()
    assert float(out["throughput-throughput|total_examples"]) == 100
    assert float(out["throughput-throughput|lifetime_throughput"]) == pytest.approx(10.0)
    # the window holds the updates at t = 5..10: 60 examples over 5 s
    assert float(out["throughput-throughput|window_throughput"]) == pytest.approx(12.0)
