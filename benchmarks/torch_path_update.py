"""The torch path's fused step on one rank's shards of W1 / W2 (single process, no collectives).

Builds, per scenario, the ``TorchFusedTBE`` a rank of the sharded plan holds, feeds it that
rank's share of the workload's ids and times forward + backward (in which the update runs) in
this thread's CPU time, which a loaded host's waits for a core do not inflate;
FBGEMM's CPU TBE on the same shard is timed beside it where it can run the same math (no row
sums). The collectives of the sharded step are replaced by local stand-ins that do the same
arithmetic on one rank: a column shard's row sum adds its partial sums twice (two equal column
blocks), a data-parallel exchange returns the rows as they are.

Scenarios (2 ranks): ``W1-cw`` 4 x [100,000, 32] with the global batch; ``W1-grid`` 4 x
[50,000, 64] with half the ids (one node: the row-wise layout); ``W1-dp`` 4 x [100,000, 64]
with the local batch; the same for W2 (26 tables of 128, the capped Criteo sizes).

Usage::

    python benchmarks/torch_path_update.py [--scenarios W1-cw W2-grid] [--rounds 15] [--fbgemm]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compare.workloads import Workload, get

SCENARIOS = ("W1-cw", "W1-grid", "W1-dp", "W2-cw", "W2-grid", "W2-dp")


def _shard_ids(
    w: Workload, kind: str
) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor, int]:
    """(rows per table, width, indices, offsets, batch) of rank 0's shard in ``kind``."""
    world = 2
    if kind == "dp":
        batches = w.batches(0, world, 1)
    else:  # cw / grid: the global batch (both ranks' samples) reaches rank 0
        batches = [w.batches(r, world, 1)[0] for r in range(world)]
    b = w.batch_per_rank
    feats = len(w.tables)
    per_feature_lengths: list[list[torch.Tensor]] = [[] for _ in range(feats)]
    per_feature_ids: list[list[torch.Tensor]] = [[] for _ in range(feats)]
    for batch in batches:
        lengths = batch.lengths.view(feats, b)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.sum(1).cumsum(0)])
        for f in range(feats):
            per_feature_lengths[f].append(lengths[f])
            per_feature_ids[f].append(batch.values[int(starts[f]) : int(starts[f + 1])])
    rows = [t.rows for t in w.tables]
    width = w.tables[0].dim
    lengths_all, ids_all = [], []
    for f in range(feats):
        lengths = torch.cat(per_feature_lengths[f])
        ids = torch.cat(per_feature_ids[f])
        if kind == "grid":  # rank 0 holds the first ceil(rows / 2) rows: keep its ids only
            block = -(-rows[f] // world)
            keep = ids < block
            bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            lengths = torch.bincount(bag[keep], minlength=lengths.numel())
            ids = ids[keep]
        lengths_all.append(lengths)
        ids_all.append(ids)
    if kind == "grid":
        rows = [-(-r // world) for r in rows]
    if kind == "cw":
        width //= world
    lengths = torch.cat(lengths_all)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return rows, [width] * feats, torch.cat(ids_all), offsets, lengths_all[0].numel()


def build(scenario: str, backend: str) -> Callable[[], None]:
    """One step (forward + backward with the update) of ``scenario`` on ``backend``."""
    from embshard_kernels.fused_params import FusedParams
    from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig
    from embshard_kernels.tbe import FbgemmFusedTBE
    from embshard_kernels.torch_fused import TorchFusedTBE
    from embshard_optim.sparse_rules.base import RowReduction
    from embshard_optim.specs import OptimizerSpec
    from embshard_types.vocab import ComputeKernel, DataType, PoolingType

    name, kind = scenario.split("-")
    w = get(name)
    rows, widths, indices, offsets, batch = _shard_ids(w, kind)
    tables = tuple(
        ShardedTableConfig(
            name=f"t{i}",
            num_embeddings=r,
            embedding_dim=c,
            feature_names=(f"f{i}",),
        )
        for i, (r, c) in enumerate(zip(rows, widths, strict=True))
    )
    config = GroupedEmbeddingConfig(
        DataType.FP32, PoolingType.SUM, False, ComputeKernel.FUSED, tables, None
    )
    spec = OptimizerSpec.from_name("rowwise_adagrad", lr=0.01, eps=1e-8)
    params = FusedParams(optimizer=spec)
    if backend == "fbgemm":
        tbe: torch.nn.Module = FbgemmFusedTBE(config, spec, params)
    else:
        torch_tbe = TorchFusedTBE(config, params, fast=True)
        if kind == "cw":

            def row_sum(partial: torch.Tensor) -> torch.Tensor:
                return partial + partial

            torch_tbe.row_reductions = [RowReduction(row_sum, w.tables[0].dim) for _ in tables]
        if kind == "dp":
            torch_tbe.grad_exchange = lambda label, r, g, n: (r, g)
        tbe = torch_tbe
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t in tbe.split_embedding_weights():
            t.uniform_(-0.01, 0.01, generator=gen)
    grad = torch.randn(batch, sum(widths), generator=gen)

    def step() -> None:
        tbe(indices, offsets).backward(grad)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--fbgemm", action="store_true", help="also time FBGEMM's CPU TBE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for scenario in args.scenarios:
        backends = ["torch"] + (["fbgemm"] if args.fbgemm and not scenario.endswith("cw") else [])
        for backend in backends:
            step = build(scenario, backend)
            for _ in range(args.warmup):
                step()
            times = []
            for _ in range(args.rounds):
                start = time.thread_time()
                step()
                times.append(time.thread_time() - start)
            print(
                f"{scenario:8s} {backend:6s} median {statistics.median(times) * 1e3:7.2f} ms  "
                f"min {min(times) * 1e3:7.2f} ms"
            )


if __name__ == "__main__":
    main()
