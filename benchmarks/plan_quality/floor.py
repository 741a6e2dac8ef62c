"""The compute floor of a workload: its lookups and updates with no communication at all.

Whatever the plan, the ranks together look up every id of the global batch and update every row
it touches; the slowest rank does at least ``1 / world`` of that work. Two measurements of that
work, each with unsharded embshard ``EmbeddingBagCollection``s (fused RowWiseAdagrad, the
harness's learning rate) stepped on the global batch (``world * batch_per_rank`` samples, drawn
exactly as the ranks draw theirs) with the harness's loss:

* :func:`compute_floor`: all tables in the calling process; ``floor_ms`` is that step divided
  by ``world`` (the machine otherwise idle);
* :func:`contended_floor`: ``world`` processes at once, each stepping ``1 / world`` of the tables
  (every ``world``-th table, largest first) after a barrier, as the ranks of a table-wise plan
  compute, without sending anything; ``floor_ms`` is the slowest process's median. On a host
  whose ranks share cores' caches and memory bandwidth this is the floor a plan really meets.

A plan's step time minus the floor is what its communication and its sharding cost: the only
part a plan can change.

Guarantees: the same workload, world size and seed time the same tensors; nothing is kept after
a call returns.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.compare.common import load_global_weights
from benchmarks.compare.workloads import Workload
from benchmarks.plan_quality.measure import kjt_of
from benchmarks.plan_quality.tables import embedding_bag_configs, optimizer_spec


def _stepper(workload: Workload, world: int, tables: list[int]) -> Callable[[int], None]:
    """Step ``i`` of the collection of ``tables`` on global batch ``i % 4``."""
    from embshard_kernels.collections import EmbeddingBagCollection

    samples = world * workload.batch_per_rank
    whole = replace(workload, batch_per_rank=samples)
    kjts = [kjt_of(b).permute(tables) for b in whole.batches(0, 1, 4)]
    configs = embedding_bag_configs(workload)
    ebc = EmbeddingBagCollection([configs[i] for i in tables], optimizer=optimizer_spec())
    prefix, suffix = "embedding_bags.", ".weight"
    load_global_weights(
        ebc.state_dict(),
        workload,
        lambda key: key[len(prefix) : -len(suffix)] if key.endswith(suffix) else None,
    )
    gen = torch.Generator().manual_seed(workload.seed + 7)
    loss_weights = torch.randn(samples, sum(workload.tables[i].dim for i in tables), generator=gen)

    def step(i: int) -> None:
        ((ebc(kjts[i % len(kjts)]).values() * loss_weights).sum() / samples).backward()

    return step


def _median_ms(
    step: Callable[[int], None], steps: int, warmup: int, before: Callable[[], Any] | None = None
) -> float:
    times = []
    for i in range(warmup + steps):
        if before is not None:
            before()
        start = time.perf_counter()
        step(i)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def compute_floor(
    workload: Workload, world: int, steps: int = 10, warmup: int = 3, threads: int = 1
) -> dict[str, Any]:
    """``{"global_step_ms", "floor_ms", "world"}``: the median step of the whole global batch in
    this process (``threads`` torch threads, as one rank has) and its share per rank."""
    torch.set_num_threads(threads)
    step = _median_ms(_stepper(workload, world, list(range(len(workload.tables)))), steps, warmup)
    return {"global_step_ms": step, "floor_ms": step / world, "world": world}


def split_tables(workload: Workload, world: int) -> list[list[int]]:
    """Per process, its tables: every ``world``-th table by rows, largest first."""
    order = sorted(range(len(workload.tables)), key=lambda i: (-workload.tables[i].rows, i))
    return [sorted(order[r::world]) for r in range(world)]


def _contended_rank(
    rank: int, world: int, port: int, name: str, seed: int, steps: int, warmup: int, out: str
) -> None:
    import torch.distributed as dist

    from benchmarks.compare.common import join_group
    from benchmarks.compare.workloads import get

    join_group(rank, world, port, threads=1)
    try:
        workload = get(name, seed)
        step = _stepper(workload, world, split_tables(workload, world)[rank])
        ms = _median_ms(step, steps, warmup, before=dist.barrier)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"ms": ms}))
    finally:
        dist.destroy_process_group()


def contended_floor(workload: Workload, world: int, steps: int = 10, warmup: int = 3) -> dict:
    """``{"rank_ms", "floor_ms", "world"}``: ``world`` processes (1 thread each) stepping their
    share of the tables at the same time, with no communication (see the module docstring)."""
    import torch.multiprocessing as mp

    from benchmarks.compare.common import free_port

    with tempfile.TemporaryDirectory(prefix="embshard-floor-") as tmp:
        mp.spawn(
            _contended_rank,
            args=(world, free_port(), workload.name, workload.seed, steps, warmup, tmp),
            nprocs=world,
            join=True,
        )
        rank_ms = [json.loads(Path(tmp, f"rank{r}.json").read_text())["ms"] for r in range(world)]
    return {"rank_ms": rank_ms, "floor_ms": max(rank_ms), "world": world}
