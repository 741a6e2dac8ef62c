"""A small DLRM trained on 2 gloo processes (1 thread each): ``TrainPipelineSparseDist`` against
the plain loop, per sharding type, one job.

Run as ``python -m benchmarks.asv_bench.pipeline_job --out FILE`` from the repository root (the
asv benchmarks in ``bench_pipeline`` do so once per commit, in a fresh interpreter, so asv's own
process never forks ranks). Per sharding type it starts one fresh group of ranks, forked from
this process once it has imported torch and embshard (as ``w1_job`` does); each rank builds two identical ``DistributedModelParallel(DLRMTrain(DLRM(...)))`` models (RowWiseAdagrad
fused in backward, Adagrad on the dense part) and times, in alternating rounds, ``STEPS`` steps
of the plain loop ``zero_grad; loss, _ = model(batch); loss.backward(); step`` on one and
``STEPS`` ``pipeline.progress`` calls on the other, after ``WARMUP`` warm-up steps of each. A
round's figure is its wall time over its steps (no barrier between steps: the pipeline's next
input dist stays in flight across them), the slowest rank's; the job keeps each loop's best
round. It writes, as JSON::

    {"<sharding>": {"plain": ms per step, "pipelined": ms per step, "wall_s": ...}
     or {"error": "why it could not run"} or {"missing": "no train pipeline: why"}, ...,
     "embshard_dist_from": the folder embshard_dist was imported from}

The model: ``TABLES`` tables of ``ROWS`` x ``DIM`` (one feature each, 1-``MAX_IDS`` uniform ids
per bag), 13 dense features, dense arch [64, DIM], over arch [64, 1], ``BATCH`` samples per rank.
Nothing is imported from embshard at module level: asv imports every module of ``asv_bench``
while discovering benchmarks, whatever the commit installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHARDINGS = ("table_wise", "row_wise")
LOOPS = ("plain", "pipelined")
WORLD_SIZE = 2
TABLES = 8
ROWS = 20_000
DIM = 32
MAX_IDS = 20
NUM_DENSE = 13
BATCH = 256
NUM_BATCHES = 8


@dataclass(frozen=True)
class Batch:
    """TorchRec's batch fields, as ``DLRMTrain`` reads them."""

    dense_features: Any
    sparse_features: Any
    labels: Any


def _batches(rank: int) -> list[Batch]:
    """``NUM_BATCHES`` fixed batches of this rank (different on every rank)."""
    import torch

    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    keys = [f"f{t}" for t in range(TABLES)]
    out = []
    for i in range(NUM_BATCHES):
        g = torch.Generator().manual_seed(1000 * i + rank)
        lengths = torch.randint(1, MAX_IDS + 1, (TABLES * BATCH,), generator=g)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        out.append(
            Batch(
                torch.randn(BATCH, NUM_DENSE, generator=g),
                KeyedJaggedTensor(keys, ids, lengths=lengths),
                torch.randint(0, 2, (BATCH,), generator=g).float(),
            )
        )
    return out


def _model(sharding: str) -> Any:
    """The DLRM on this rank, sharded by ``sharding`` (table-wise: tables alternate ranks)."""
    import torch

    from embshard_dist.dmp.model_parallel import DistributedModelParallel
    from embshard_dist.models.dlrm import DLRM, DLRMTrain
    from embshard_kernels.collections import EmbeddingBagCollection
    from embshard_optim.specs import OptimizerSpec
    from embshard_types.configs import EmbeddingBagConfig
    from embshard_types.parameter_sharding import ParameterSharding
    from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
    from embshard_types.vocab import ComputeKernel, ShardingType

    spec = OptimizerSpec.from_name("rowwise_adagrad", lr=0.01, eps=1e-8)
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=(f"f{t}",)
        )
        for t in range(TABLES)
    ]
    kind = ShardingType(sharding)
    per_table = {
        t.name: ParameterSharding(
            kind,
            ComputeKernel.FUSED,
            ranks=(i % WORLD_SIZE,) if kind == ShardingType.TABLE_WISE else None,
        )
        for i, t in enumerate(tables)
    }
    plan = ShardingPlan(
        {"model.sparse_arch.embedding_bag_collection": EmbeddingModuleShardingPlan(per_table)}
    )
    torch.manual_seed(0)
    dlrm = DLRM(
        EmbeddingBagCollection(tables, optimizer=spec),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[64, DIM],
        over_arch_layer_sizes=[64, 1],
    )
    return DistributedModelParallel(
        DLRMTrain(dlrm), plan=plan, optimizer=spec, device=torch.device("cpu")
    )


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _run_rank(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    """One spawned rank: both loops on ``job["sharding"]``; rank 0 writes the figures."""
    import itertools

    import torch
    import torch.distributed as dist

    from benchmarks.compare.common import join_group
    from embshard_dist.train_pipeline import TrainPipelineSparseDist

    join_group(rank, world, port, threads=1)
    batches = _batches(rank)
    plain, piped = _model(job["sharding"]), _model(job["sharding"])
    optimizer = plain.optimizer()
    pipeline: Any = TrainPipelineSparseDist(piped, piped.optimizer(), torch.device("cpu"))
    feed = itertools.cycle(batches)
    cursor = itertools.count()

    def plain_steps(n: int) -> None:
        for _ in range(n):
            optimizer.zero_grad()
            loss, _ = plain(batches[next(cursor) % len(batches)])
            loss.backward()
            optimizer.step()

    def piped_steps(n: int) -> None:
        for _ in range(n):
            pipeline.progress(feed)

    loops = {"plain": plain_steps, "pipelined": piped_steps}
    best = {name: float("inf") for name in loops}
    for run in loops.values():
        run(job["warmup"])
    for r in range(job["rounds"]):
        for name in LOOPS if r % 2 == 0 else LOOPS[::-1]:
            dist.barrier()
            start = time.perf_counter()
            loops[name](job["steps"])
            ms = _slowest(time.perf_counter() - start) * 1e3 / job["steps"]
            best[name] = min(best[name], ms)
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(best))
    dist.barrier()
    dist.destroy_process_group()


def run_sharding(sharding: str, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """Both loops on fresh ranks for ``sharding``: ms per step of each."""
    import torch.multiprocessing as mp

    from benchmarks.compare.common import free_port

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="embshard-asv-pipeline-") as tmp:
        out = Path(tmp, "rank0.json")
        job = {"sharding": sharding, "steps": steps, "warmup": warmup, "rounds": rounds}
        job["out"] = str(out)
        mp.start_processes(
            _run_rank, args=(WORLD_SIZE, free_port(), job), nprocs=WORLD_SIZE, start_method="fork"
        )
        figures: dict[str, Any] = json.loads(out.read_text())
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--shardings", nargs="+", default=list(SHARDINGS), choices=SHARDINGS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and loop")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per loop")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (best kept)")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts: forked ranks must find no pool
    import torch

    import benchmarks.compare.common  # noqa: F401  (imported once, before the ranks fork)
    from benchmarks.asv_bench.origin import package_dir
    from benchmarks.asv_bench.w1_job import ORIGIN

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    try:
        import embshard_dist.models.dlrm
        import embshard_dist.train_pipeline  # noqa: F401
    except ImportError as e:  # the commit predates the pipeline: nothing to time
        results = {s: {"missing": f"{type(e).__name__}: {e}"} for s in args.shardings}
        Path(args.out).write_text(json.dumps({**results, ORIGIN: package_dir()}, indent=1))
        return 0
    for sharding in args.shardings:
        try:
            results[sharding] = run_sharding(sharding, args.steps, args.warmup, args.rounds)
        except Exception as e:  # one sharding failing must not hide the others' figures
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            results[sharding] = {"error": f"pipeline {sharding} failed: {type(e).__name__}: {last}"}
        print(f"pipeline {sharding}: {results[sharding]}", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps({**results, ORIGIN: package_dir()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
