"""AUC, NE, calibration, accuracy and throughput on 2 and 3 ranks equal the single-process values
of the concatenated predictions, lifetime and windowed, on every rank.

Ranks get unequal batch sizes (one update is empty), sample weights, tied scores, and rank 1 no
positive labels. References: scikit-learn's ``roc_auc_score`` (with ``sample_weight``) for AUC,
the direct formulas for NE, calibration and accuracy. The ranks exchange fixed-size sums only;
a metric given a subgroup reduces over that subgroup alone.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device

from embshard_dist.metrics import (
    AccuracyMetric,
    AUCMetric,
    CalibrationMetric,
    NEMetric,
    RecMetric,
    ThroughputMetric,
)

SIZES = {2: [(37, 5, 16), (11, 30)], 3: [(50, 13), (7, 0, 20), (29, 3, 3, 8)]}  # rank, update
WINDOW = 50  # samples over the ranks: each rank keeps its latest ceil(50 / world) samples
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rank_data(world: int, rank: int, ties: bool = True) -> list[Batch]:
    g = torch.Generator().manual_seed(100 * world + rank)
    out = []
    for n in SIZES[world][rank]:
        p = torch.rand(n, generator=g)
        if ties:
            p = (p * 30).round() / 31 + 0.01  # ties within and across ranks
        y = (torch.rand(n, generator=g) < p).float()
        if rank == 1:
            y = torch.zeros(n)  # a rank with no positive labels
        out.append((p, y, torch.rand(n, generator=g) * 2 + 0.1))
    return out


def windowed(batches: list[Batch], local_window: int) -> list[Batch]:
    """The latest batches with at most ``local_window`` samples, and always the latest one."""
    kept: list[Batch] = []
    for b in reversed(batches):
        if kept and sum(len(k[0]) for k in kept) + len(b[0]) > local_window:
            break
        kept.insert(0, b)
    return kept


def concat(batches: list[Batch]) -> Batch:
    return (
        torch.cat([b[0] for b in batches]).double(),
        torch.cat([b[1] for b in batches]).double(),
        torch.cat([b[2] for b in batches]).double(),
    )


def reference(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    from sklearn.metrics import roc_auc_score  # here: the ranks need not pay its import

    pos, neg = float((w * y).sum()), float((w * (1 - y)).sum())
    q = pos / (pos + neg)
    ce = float((-w * (y * torch.log2(p) + (1 - y) * torch.log2(1 - p))).sum())
    right = ((p >= 0.5).double() == y).double()
    return {
        "auc": float(roc_auc_score(y.numpy(), p.numpy(), sample_weight=w.numpy())),
        "ne": ce / (-pos * math.log2(q) - neg * math.log2(1 - q)),
        "calibration": float((w * p).sum() / (w * y).sum()),
        "accuracy": float((w * right).sum() / w.sum()),
    }


def make_metrics(group: dist.ProcessGroup | None = None) -> list[RecMetric]:
    return [
        m(window_size=WINDOW, group=group)
        for m in (AUCMetric, NEMetric, CalibrationMetric, AccuracyMetric)
    ]


def _values(metrics: list[RecMetric], batches: list[Batch]) -> dict[str, float]:
    device = test_device()
    for p, y, w in batches:
        for m in metrics:
            m.update(p.to(device), y.to(device), w.to(device))
    return {k: float(v) for m in metrics for k, v in m.compute().items()}


def _on_rank(world: int, ties: bool) -> dict[str, float]:
    rank = dist.get_rank()
    out = _values(make_metrics(), rank_data(world, rank, ties))
    now = [0.0]
    throughput = ThroughputMetric(batch_size=1, window_seconds=2.5, clock=lambda: now[0])
    for p, _, _ in rank_data(world, rank, ties):
        now[0] += 1.0
        throughput.update(len(p))
    out.update({k: float(v) for k, v in throughput.compute().items()})
    return out


def _on_subgroup(world: int) -> dict[str, float]:
    members = [0, world - 1]
    group = dist.new_group(members)  # every rank joins new_group; only members compute
    if dist.get_rank() not in members:
        return {}
    return _values(make_metrics(group), rank_data(world, dist.get_rank()))


def _check(got: dict[str, float], ranks: list[int], world: int, ties: bool = True) -> None:
    data = {r: rank_data(world, r, ties) for r in ranks}
    local_window = math.ceil(WINDOW / len(ranks))
    expect = {
        "lifetime": reference(*concat([b for r in ranks for b in data[r]])),
        "window": reference(*concat([b for r in ranks for b in windowed(data[r], local_window)])),
    }
    for prefix, values in expect.items():
        for name, value in values.items():
            key = f"{name}-DefaultTask|{prefix}_{name}"
            assert abs(got[key] - value) < 1e-6, (key, got[key], value)


@pytest.mark.parametrize("world", [2, 3])
def test_metrics_across_ranks_equal_the_concatenated_values(world: int) -> None:
    results = run_on_ranks(world, _on_rank, world, True)
    assert all(r == results[0] for r in results)  # every rank gets the same values
    got = results[0]
    _check(got, list(range(world)), world)
    sizes = [sum(SIZES[world][r]) for r in range(world)]
    assert got["throughput-throughput|total_examples"] == sum(sizes)
    # rank r's lifetime rate: its examples over the seconds to its latest update
    rates = [s / len(SIZES[world][r]) for r, s in enumerate(sizes)]
    assert got["throughput-throughput|lifetime_throughput"] == pytest.approx(sum(rates))
    window = [  # the updates in the last 2.5 s before the latest, over 2.5 s (or less if younger)
        sum(SIZES[world][r][-3:]) / min(2.5, len(SIZES[world][r])) for r in range(world)
    ]
    assert got["throughput-throughput|window_throughput"] == pytest.approx(sum(window))


def test_continuous_scores_across_ranks_equal_one_process() -> None:
    """Scores without ties: the ranks' AUC is the one-process metric's on the concatenation."""
    world = 3
    got = run_on_ranks(world, _on_rank, world, False)[0]
    whole = concat([b for r in range(world) for b in rank_data(world, r, ties=False)])
    single = _values(make_metrics(), [whole])
    for name in ("auc", "ne", "calibration", "accuracy"):
        key = f"{name}-DefaultTask|lifetime_{name}"
        assert abs(got[key] - single[key]) < 1e-12, key


def test_a_subgroup_reduces_over_its_members_only() -> None:
    world = 3
    results = run_on_ranks(world, _on_subgroup, world)
    assert results[1] == {} and results[0] == results[2]
    _check(results[0], [0, world - 1], world)


def _compute_twice_one_rank_idle() -> list[dict[str, float]]:
    """Compute, then only rank 1 updates, then compute again on both ranks."""
    device, rank = test_device(), dist.get_rank()
    metrics = make_metrics()
    throughput = ThroughputMetric(batch_size=4)
    data = rank_data(2, rank)
    out = []
    for p, y, w in data[:1] if rank == 0 else data[:2]:
        for m in metrics:
            m.update(p.to(device), y.to(device), w.to(device))
        throughput.update()
        if len(out) == 0:  # the first compute: both ranks have one update
            out.append({k: float(v) for m in metrics for k, v in m.compute().items()})
            out[-1].update({k: float(v) for k, v in throughput.compute().items()})
    # Rank 0 has nothing new since the first compute; it must still join the second reduction.
    out.append({k: float(v) for m in metrics for k, v in m.compute().items()})
    out[-1].update({k: float(v) for k, v in throughput.compute().items()})
    return out


def test_a_rank_without_new_samples_still_joins_compute() -> None:
    """torchmetrics caches a result until the next update; a cached compute on an idle rank
    would leave the other rank alone in the all-reduce (a hang until the timeout)."""
    results = run_on_ranks(2, _compute_twice_one_rank_idle)
    assert results[0] == results[1]  # every rank gets the same values, both times
    first, second = results[0]
    assert first != second  # the second compute includes rank 1's new batch
    data = {0: rank_data(2, 0)[:1], 1: rank_data(2, 1)[:2]}
    expect = reference(*concat(data[0] + data[1]))
    for name, value in expect.items():
        assert abs(second[f"{name}-DefaultTask|lifetime_{name}"] - value) < 1e-6, name
    assert second["throughput-throughput|total_examples"] == 12  # 1 + 2 updates of 4
