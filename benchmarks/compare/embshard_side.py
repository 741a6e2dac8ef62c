"""embshard's side: ``embshard_dist.dmp.model_parallel.DistributedModelParallel`` over an
``embshard_kernels`` EmbeddingBagCollection, built the same way as TorchRec's side.

* the collection is built on ``meta`` with ``OptimizerSpec(ROWWISE_ADAGRAD, lr, eps)`` (FBGEMM's
  EXACT_ROWWISE_ADAGRAD fused in the backward) and handed to ``DistributedModelParallel`` with
  a plan of ``ParameterSharding`` entries whose shards come from
  ``embshard_dist.strategies.layout.shard_specs``; each table's shards are checked against the
  harness's neutral plan;
* the initial weights are written into its sharded state dict after sharding, exactly as on
  TorchRec's side (so neither side holds an unsharded copy of the model);
* data-parallel tables need nothing more: embshard trains them in the backward with the same
  optimizer (touched rows exchanged, not whole tables).

:func:`missing` says which sharding types embshard cannot run on the CPU yet, so the driver
can skip them with a note instead of failing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from benchmarks.compare.common import (
    EPS,
    LEARNING_RATE,
    Root,
    Unsupported,
    check_tables,
    load_global_weights,
    loss_weights_in_order,
    same_plan,
)
from benchmarks.compare.plans import Plan, Shard, TablePlan
from benchmarks.compare.workloads import Batch, Workload

MODULE = "ebc"


def _sharder(local_size: int | None = None) -> Any:
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(optimizer=_spec(), local_world_size=local_size)


def _spec() -> Any:
    from embshard_optim.specs import OptimizerSpec, OptimType

    return OptimizerSpec(OptimType.ROWWISE_ADAGRAD, learning_rate=LEARNING_RATE, eps=EPS)


def missing(sharding_types: set[str]) -> str | None:
    """What embshard lacks to run tables of these sharding types on the CPU (``None``: nothing)."""
    try:
        import embshard_dist.dmp.model_parallel  # noqa: F401

        sharder = _sharder()
    except ImportError as e:
        return f"embshard_dist cannot build a DistributedModelParallel yet ({e})"
    offered = {str(t) for t in sharder.sharding_types("cpu")}
    lacking = sorted(sharding_types - offered)
    if lacking:
        return (
            f"EmbeddingBagCollectionSharder does not offer {', '.join(lacking)} on the CPU "
            f"(it offers {', '.join(sorted(offered))})"
        )
    return None


def _embshard_plan(plan: Plan, workload: Workload, world: int, local: int, sharder: Any) -> Any:
    from embshard_dist.strategies.layout import shard_specs
    from embshard_types.parameter_sharding import ParameterSharding
    from embshard_types.plan import EmbeddingModuleShardingPlan
    from embshard_types.vocab import ComputeKernel, ShardingType

    tables = {t.name: t for t in workload.tables}
    out = {}
    for name, tp in plan.items():
        kind = ShardingType.parse(tp.sharding_type)
        kernels = list(sharder.compute_kernels(kind, "cpu"))
        kernel = ComputeKernel.FUSED if ComputeKernel.FUSED in kernels else kernels[0]
        t = tables[name]
        if kind is ShardingType.DATA_PARALLEL:
            ranks: list[int] = list(range(world))
            specs = None
        else:
            if kind is ShardingType.GRID_SHARD:
                ranks = [s.rank for s in tp.shards or ()]
            else:
                ranks = list(tp.ranks)
            specs = shard_specs(
                kind, t.rows, t.dim, ranks, "cpu", local_world_size=local, table_name=name
            )
        ps = ParameterSharding(
            sharding_type=kind,
            compute_kernel=kernel,
            ranks=tuple(ranks),
            shards=tuple(specs) if specs is not None else None,
        )
        same_plan("embshard", name, tp, _neutral(ps))
        out[name] = ps
    return EmbeddingModuleShardingPlan(out)


def _neutral(ps: Any) -> TablePlan:
    kind = str(ps.sharding_type)
    shards = None
    if ps.shards is not None:
        shards = tuple(
            Shard(r, s.offsets[0], s.offsets[1], s.sizes[0], s.sizes[1])
            for r, s in zip(ps.ranks, ps.shards, strict=True)
        )
    ranks = () if kind == "data_parallel" else tuple(ps.ranks)
    return TablePlan(kind, ranks, shards)


class EmbshardSide:
    """embshard's sharded collection on this rank, with the harness's step.

    Args:
        workload: the tables and their initial weights.
        plan: the neutral plan to translate.
        loss_weights: this rank's loss weights by feature.
        world_size: ranks in the default process group.
        local_size: ranks per node.
    """

    name = "embshard"

    def __init__(
        self,
        workload: Workload,
        plan: Plan,
        loss_weights: dict[str, Tensor],
        world_size: int,
        local_size: int,
    ) -> None:
        check_tables(plan, workload)
        why = missing({tp.sharding_type for tp in plan.values()})
        if why is not None:
            raise Unsupported(why)
        from embshard_dist.dmp.model_parallel import DistributedModelParallel
        from embshard_kernels.collections import EmbeddingBagCollection
        from embshard_types.configs import EmbeddingBagConfig
        from embshard_types.plan import ShardingPlan

        tables = [
            EmbeddingBagConfig(
                name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=(t.feature,)
            )
            for t in workload.tables
        ]
        spec = _spec()
        sharder = _sharder(local_size)
        root = Root(EmbeddingBagCollection(tables, device="meta", optimizer=spec))
        module_plan = _embshard_plan(plan, workload, world_size, local_size, sharder)
        self.model = DistributedModelParallel(
            root,
            device=torch.device("cpu"),
            plan=ShardingPlan({MODULE: module_plan}),
            sharders=[sharder],
            optimizer=spec,
        )
        prefix = f"{MODULE}.embedding_bags."
        written = load_global_weights(
            self.model.state_dict(),
            workload,
            lambda k: (
                k[len(prefix) : -len(".weight")]
                if k.startswith(prefix) and k.endswith(".weight")
                else None
            ),
        )
        if written != set(plan):
            raise RuntimeError(f"embshard: initial weights reached tables {sorted(written)} only")
        self._loss_weights = loss_weights
        self._arranged: Tensor | None = None
        self._kjts: dict[int, tuple[Batch, Any]] = {}

    def _kjt(self, batch: Batch) -> Any:
        """The batch as this library's KeyedJaggedTensor, built once (outside the timed step)."""
        entry = self._kjts.get(id(batch))  # the batch is kept in the entry, so its id stays
        if entry is None:
            from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

            kjt = KeyedJaggedTensor(
                keys=list(batch.keys), values=batch.values, lengths=batch.lengths
            )
            entry = self._kjts[id(batch)] = (batch, kjt)
        return entry[1]

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        with torch.no_grad():
            out = self.model(self._kjt(batch))
            return {k: v.detach().clone() for k, v in out.to_dict().items()}

    def _loss(self, kt: Any, batch: Batch) -> Tensor:
        if self._arranged is None:
            self._arranged = loss_weights_in_order(self._loss_weights, kt.keys())
        loss: Tensor = (kt.values() * self._arranged).sum() / batch.batch_size
        return loss

    def step(self, batch: Batch) -> None:
        self._loss(self.model(self._kjt(batch)), batch).backward()

    def profile(self, batch: Batch) -> tuple[dict[str, float], dict[str, float]]:
        from benchmarks.compare.profile import profile_step

        return profile_step(self.model, self._kjt(batch), lambda kt: self._loss(kt, batch))
