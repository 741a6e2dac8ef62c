"""Metrics on one process against references: scikit-learn's ``roc_auc_score`` for AUC (ties
and sample weights), direct formulas for NE, calibration, accuracy and throughput."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from sklearn.metrics import roc_auc_score
from torchmetrics import Metric

from embshard_dist.metrics import (
    AccuracyMetric,
    AUCMetric,
    CalibrationMetric,
    NEMetric,
    ThroughputMetric,
)
from embshard_dist.metrics.auc import auc_tie_bound, histogram_rows
from embshard_dist.metrics.reduce import all_reduce_states


def sk_auc(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> float:
    weights = None if w is None else w.double().numpy()
    return float(roc_auc_score(y.numpy(), p.double().numpy(), sample_weight=weights))


def reference_ne(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> float:
    ws = [1.0] * len(p) if w is None else w.double().tolist()
    ce = sum(
        wi * (-yi * math.log2(pi) - (1 - yi) * math.log2(1 - pi))
        for pi, yi, wi in zip(p.double().tolist(), y.tolist(), ws, strict=True)
    )
    pos = sum(wi * yi for yi, wi in zip(y.tolist(), ws, strict=True))
    neg = sum(ws) - pos
    q = pos / (pos + neg)
    return ce / (-pos * math.log2(q) - neg * math.log2(1 - q))


def data(n: int, seed: int, ties: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g)
    if ties:
        p = (p * 20).round() / 21 + 0.01  # many tied scores
    y = (torch.rand(n, generator=g) < p).float()
    w = torch.rand(n, generator=g) + 0.5
    return p, y, w


def test_metrics_are_torchmetrics_metrics() -> None:
    for m in (AUCMetric(), NEMetric(), CalibrationMetric(), AccuracyMetric()):
        for comp in m.computations:
            assert isinstance(comp, Metric)
            assert set(comp.metric_state) == {"lifetime", "window"}  # two fixed-size tables
            assert comp.dist_sync_fn is all_reduce_states  # summed, never gathered
    throughput = ThroughputMetric(batch_size=1)
    assert isinstance(throughput, Metric) and throughput.dist_sync_fn is all_reduce_states


def test_auc_equals_roc_auc_score_with_ties_and_weights() -> None:
    p, y, w = data(700, 0)
    m = AUCMetric()
    for a, b in ((0, 100), (100, 101), (101, 700)):
        m.update(p[a:b], y[a:b], w[a:b])
    out = m.compute()
    assert abs(float(out["auc-DefaultTask|lifetime_auc"]) - sk_auc(p, y, w)) < 1e-12
    table = m.computation("DefaultTask").lifetime
    assert float(auc_tie_bound(table)) > 0  # tied positives and negatives share cells ...
    grid = (torch.rand(500, generator=torch.Generator().manual_seed(5)) * 1024).floor() / 1024
    exact = AUCMetric(num_bins=1024)  # ... and predictions on the grid are exact, whatever ties
    exact.update(grid, y[:500], w[:500])
    got = float(exact.compute()["auc-DefaultTask|lifetime_auc"])
    assert abs(got - sk_auc(grid, y[:500], w[:500])) < 1e-12


def test_auc_of_continuous_scores_is_within_the_tie_bound() -> None:
    p, y, w = data(4000, 1, ties=False)
    for num_bins in (64, 1 << 16):
        m = AUCMetric(num_bins=num_bins)
        m.update(p, y, w)
        got = float(m.compute()["auc-DefaultTask|lifetime_auc"])
        bound = float(auc_tie_bound(m.computation("DefaultTask").lifetime))
        assert abs(got - sk_auc(p, y, w)) <= bound + 1e-12
    assert bound < 1e-4  # 2^16 cells: the bound is small for 4000 scores


def test_histogram_rows_add_up() -> None:
    p, y, w = data(300, 2)
    table = torch.zeros(65, 2, dtype=torch.float64)
    for a, b in ((0, 120), (120, 300)):
        rows, values = histogram_rows(p[a:b].double(), y[a:b].double(), w[a:b].double(), 64)
        table.index_add_(0, rows, values)
    rows, values = histogram_rows(p.double(), y.double(), w.double(), 64)
    whole = torch.zeros(65, 2, dtype=torch.float64).index_add_(0, rows, values)
    torch.testing.assert_close(table, whole, rtol=0, atol=1e-12)
    assert rows.numel() == torch.unique((p.double() * 64).floor()).numel()


def test_auc_without_positives_is_one_half() -> None:
    m = AUCMetric()
    m.update(torch.rand(10), torch.zeros(10))
    assert float(m.compute()["auc-DefaultTask|lifetime_auc"]) == 0.5


def test_ne_matches_the_direct_formula() -> None:
    p, y, w = data(500, 2, ties=False)
    m = NEMetric()
    m.update(p[:200], y[:200], w[:200])
    m.update(p[200:], y[200:], w[200:])
    out = m.compute()
    assert abs(float(out["ne-DefaultTask|lifetime_ne"]) - reference_ne(p, y, w)) < 1e-9
    baseline = NEMetric()  # predicting the mean label everywhere scores NE 1
    baseline.update(torch.full((500,), float(y.double().mean()), dtype=torch.float64), y)
    assert abs(float(baseline.compute()["ne-DefaultTask|lifetime_ne"]) - 1.0) < 1e-12
    assert set(out) == {"ne-DefaultTask|lifetime_ne", "ne-DefaultTask|window_ne"}


def test_window_keeps_the_latest_updates() -> None:
    p, y, w = data(600, 3, ties=False)
    auc, ne = AUCMetric(window_size=250), NEMetric(window_size=250)
    for a in range(0, 600, 100):
        auc.update(p[a : a + 100], y[a : a + 100])
        ne.update(p[a : a + 100], y[a : a + 100], w[a : a + 100])
    out = {**auc.compute(), **ne.compute()}
    assert abs(float(out["auc-DefaultTask|window_auc"]) - sk_auc(p[400:], y[400:])) < 1e-12
    assert abs(float(out["auc-DefaultTask|lifetime_auc"]) - sk_auc(p, y)) < 1e-12
    window_ne = reference_ne(p[400:], y[400:], w[400:])
    assert abs(float(out["ne-DefaultTask|window_ne"]) - window_ne) < 1e-9
    big = NEMetric(window_size=10)  # a batch larger than the window: the window is that batch
    big.update(p[:100], y[:100])
    big.update(p[100:300], y[100:300])
    got = float(big.compute()["ne-DefaultTask|window_ne"])
    assert abs(got - reference_ne(p[100:300], y[100:300])) < 1e-9
    big.reset()
    big.update(p[:50], y[:50])
    assert (
        abs(float(big.compute()["ne-DefaultTask|window_ne"]) - reference_ne(p[:50], y[:50])) < 1e-9
    )


def test_tasks_calibration_and_accuracy() -> None:
    p, y, w = data(400, 4, ties=False)
    cal = CalibrationMetric(tasks=["ctr", "cvr.v2"])
    cal.update({"ctr": p, "cvr.v2": p / 2}, {"ctr": y, "cvr.v2": y}, {"ctr": w, "cvr.v2": w})
    out = cal.compute()
    wd = w.double()
    expect = float((wd * p.double()).sum() / (wd * y.double()).sum())
    assert abs(float(out["calibration-ctr|lifetime_calibration"]) - expect) < 1e-9
    assert abs(float(out["calibration-cvr.v2|window_calibration"]) - expect / 2) < 1e-9
    acc = AccuracyMetric(threshold=0.4)
    acc.update(p, y, w)
    right = ((p >= 0.4).float() == y).double()
    expect = float((w.double() * right).sum() / w.double().sum())
    assert abs(float(acc.compute()["accuracy-DefaultTask|lifetime_accuracy"]) - expect) < 1e-12


def test_bad_batches_change_nothing() -> None:
    p, y, _ = data(40, 5)
    cal = CalibrationMetric(tasks=["ctr", "cvr"])
    cal.update({"ctr": p, "cvr": p}, {"ctr": y, "cvr": y})
    before = {k: float(v) for k, v in cal.compute().items()}
    bad_p = p.clone()
    bad_p[3] = 1.5
    cases = [
        (({"ctr": p}, {"ctr": y}), "lacks tasks"),
        ((p, y), "one tensor but the metric has tasks"),
        (({"ctr": p, "cvr": p[:-1]}, {"ctr": y, "cvr": y}), "one value per sample"),
        (({"ctr": p, "cvr": bad_p}, {"ctr": y, "cvr": y}), r"calibration-cvr: predictions"),
        (({"ctr": p, "cvr": p}, {"ctr": y, "cvr": y * 2}), r"calibration-cvr: labels"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            cal.update(*args)
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        cal.update({"ctr": p, "cvr": p}, {"ctr": y, "cvr": y}, {"ctr": -p, "cvr": p})
    with pytest.raises(ValueError, match=r"NaN or inf"):
        NEMetric().update(torch.full((3,), float("nan")), torch.zeros(3))
    assert {k: float(v) for k, v in cal.compute().items()} == before
    with pytest.raises(TypeError, match="call update"):
        cal.computation("ctr")(p, y)


def test_throughput_lifetime_and_window() -> None:
    now = [0.0]
    m = ThroughputMetric(batch_size=10, window_seconds=5.0, clock=lambda: now[0])
    for _ in range(10):
        now[0] += 1.0
        m.update()
    now[0] += 50.0  # idle time after the last step does not count
    out = m.compute()
    assert float(out["throughput-throughput|total_examples"]) == 100
    assert float(out["throughput-throughput|lifetime_throughput"]) == pytest.approx(10.0)
    # the window holds the steps ending in (5, 10]: 50 examples over 5 s
    assert float(out["throughput-throughput|window_throughput"]) == pytest.approx(10.0)
    now[0] += 1.0
    m.update(70)  # one step after a long pause: the window holds that step alone
    assert float(m.compute()["throughput-throughput|window_throughput"]) == pytest.approx(14.0)
    with pytest.raises(ValueError, match="num_examples must be >= 0"):
        m.update(-1)


def test_import_embshard_dist_does_not_import_torchmetrics() -> None:
    code = "import sys, embshard_dist; assert 'torchmetrics' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
