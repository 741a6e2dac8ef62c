"""Execute several embshard plans of one workload in the same processes, interleaved.

Every rank (spawned gloo processes, ``threads`` torch threads each):

1. builds one embshard ``DistributedModelParallel`` per plan over the workload's tables (an
   ``EmbeddingBagCollection`` on ``meta``, RowWiseAdagrad fused in the backward, lr 0.01), then
   writes the workload's initial weights into every model's shards (each table drawn once);
2. checks the first batch's forward outputs of every plan against the first plan's (the largest
   absolute difference over the ranks; above ``tolerance`` nothing is timed);
3. times ``warmup + steps`` rounds; in each round every plan does one step (forward, backward
   with the fused update, the harness's loss), each started after a barrier; the order rotates
   and reverses from round to round so no plan always follows the same one;
4. writes its step times and the check to ``out_dir/rank{r}.json``.

The figure of a plan is its slowest rank's median step (``summarize``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.compare.common import (
    Root,
    free_port,
    join_group,
    load_global_weights,
    loss_weights_in_order,
)
from benchmarks.compare.workloads import Batch, get
from benchmarks.plan_quality.tables import MODULE, embedding_bag_configs, optimizer_spec


@dataclass(frozen=True)
class MeasureJob:
    """What every rank does: the plans (label -> embshard plan JSON) of one workload."""

    workload: str
    plans: tuple[tuple[str, str], ...]
    steps: int = 10
    warmup: int = 3
    threads: int = 1
    num_batches: int = 4
    tolerance: float = 1e-5
    seed: int = 0
    out_dir: str = ""


class PlanRunner:
    """One plan's sharded model on this rank, with the harness's step."""

    def __init__(self, label: str, plan: Any, workload: Any, loss_weights: Any) -> None:
        from embshard_dist.dmp.model_parallel import DistributedModelParallel
        from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
        from embshard_kernels.collections import EmbeddingBagCollection

        spec = optimizer_spec()
        root = Root(
            EmbeddingBagCollection(embedding_bag_configs(workload), device="meta", optimizer=spec)
        )
        self.label = label
        self.model = DistributedModelParallel(
            root,
            device=torch.device("cpu"),
            plan=plan,
            sharders=[EmbeddingBagCollectionSharder(optimizer=spec)],
            optimizer=spec,
        )
        self._loss_weights = loss_weights
        self._arranged: torch.Tensor | None = None

    def weights(self) -> dict[str, Any]:
        """Table name -> its weight in this model's state dict (shards or a replica)."""
        prefix, suffix = f"{MODULE}.embedding_bags.", ".weight"
        return {
            k[len(prefix) : -len(suffix)]: v
            for k, v in self.model.state_dict().items()
            if k.startswith(prefix) and k.endswith(suffix)
        }

    def forward(self, kjt: Any) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {k: v.clone() for k, v in self.model(kjt).to_dict().items()}

    def step(self, kjt: Any, batch_size: int) -> None:
        kt = self.model(kjt)
        if self._arranged is None:
            self._arranged = loss_weights_in_order(self._loss_weights, kt.keys())
        ((kt.values() * self._arranged).sum() / batch_size).backward()


def _load_weights(runners: list[PlanRunner], workload: Any) -> None:
    """Every runner's shards from the workload's initial weights (each table drawn once)."""
    states = {
        f"{i}/{table}": value for i, r in enumerate(runners) for table, value in r.weights().items()
    }
    load_global_weights(states, workload, lambda key: key.split("/", 1)[1])


def _all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def kjt_of(batch: Batch) -> Any:
    """``batch`` as an embshard ``KeyedJaggedTensor``."""
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(batch.keys), values=batch.values, lengths=batch.lengths)


def run_rank(rank: int, world: int, port: int, job: MeasureJob) -> None:
    """Entry point of one spawned rank."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    join_group(rank, world, port, job.threads)
    result: dict[str, Any] = {"rank": rank}
    try:
        from embshard_types.plan import ShardingPlan

        workload = get(job.workload, job.seed)
        batches = workload.batches(rank, world, job.num_batches)
        kjts = [kjt_of(b) for b in batches]
        loss_weights = workload.loss_weights(rank)
        runners = [
            PlanRunner(label, ShardingPlan.from_json(text), workload, loss_weights)
            for label, text in job.plans
        ]
        _load_weights(runners, workload)
        first = runners[0].forward(kjts[0])
        diffs = {}
        for r in runners[1:]:
            out = r.forward(kjts[0])
            diffs[r.label] = _all_max(max(float((first[k] - out[k]).abs().max()) for k in first))
        result["check_max_abs_diff"] = diffs
        if any(d > job.tolerance for d in diffs.values()):
            result["error"] = f"forward outputs differ: {diffs} > {job.tolerance}"
            return
        times: dict[str, list[float]] = {r.label: [] for r in runners}
        n = len(runners)
        for i in range(job.warmup + job.steps):
            order = runners[i % n :] + runners[: i % n]
            if (i // n) % 2:
                order = order[::-1]
            b = i % len(batches)
            for r in order:
                dist.barrier()
                start = time.perf_counter()
                r.step(kjts[b], batches[b].batch_size)
                if i >= job.warmup:
                    times[r.label].append((time.perf_counter() - start) * 1e3)
        result["step_ms"] = times
    finally:
        Path(job.out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def measure(job: MeasureJob, world: int) -> list[dict[str, Any]]:
    """Run ``job`` on ``world`` fresh processes; each rank's result (an ``error`` key if any)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="embshard-plan-quality-") as tmp:
        job = replace(job, out_dir=tmp)
        error = None
        try:
            mp.spawn(run_rank, args=(world, free_port(), job), nprocs=world, join=True)
        except Exception as e:
            lines = str(e).strip().splitlines()
            error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        ranks: list[dict[str, Any]] = []
        for rank in range(world):
            p = Path(tmp, f"rank{rank}.json")
            ranks.append(json.loads(p.read_text()) if p.exists() else {"rank": rank})
    if error:
        for found in ranks:
            found.setdefault("error", error)
    return ranks


def summarize(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Label -> ``{"ms": slowest rank's median, "rank_ms": every rank's median}``."""
    out: dict[str, dict[str, Any]] = {}
    labels = ranks[0].get("step_ms", {})
    for label in labels:
        medians = [statistics.median(r["step_ms"][label]) for r in ranks]
        out[label] = {"ms": max(medians), "rank_ms": medians}
    return out
