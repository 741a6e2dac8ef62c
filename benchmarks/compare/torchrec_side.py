"""TorchRec 1.8.0's side: its DistributedModelParallel over an EmbeddingBagCollection.

What is done to make TorchRec run the harness's step, and why:

* the collection is built on ``meta`` and the plan is handed to ``DistributedModelParallel``;
  TorchRec does not copy weights from a CPU model, so the workload's initial weights are written
  into its sharded state dict afterwards (``common.load_global_weights``);
* the plan is built with ``torchrec.distributed.sharding_plan`` helpers (``data_parallel``,
  ``table_wise(rank=)``, ``row_wise()``, ``column_wise(ranks=)``, ``table_row_wise(host_index=)``);
  grid sharding is written by hand from the neutral plan (``grid_shard`` cuts columns in blocks
  of at least 128, whatever the number of hosts); each table's shards are then checked against
  the neutral plan, and every sharded table gets the ``fused`` kernel (the helpers pick ``dense`` for tables
  without an in-backward optimizer attribute);
* the optimizer is FBGEMM's EXACT_ROWWISE_ADAGRAD fused in the backward, through the sharder's
  ``fused_params``;
* data-parallel tables use TorchRec's dense kernel, whose gradients DDP all-reduces (averages);
  TorchRec never updates them on its own, so a dense ``torchrec.optim.RowWiseAdagrad`` with the
  same learning rate and eps (the same per-row rule as FBGEMM's) is stepped after the backward;
* TorchRec returns table-wise outputs with their keys reordered: outputs are compared by key and
  the loss weights are laid out in TorchRec's own key order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.compare.common import (
    EPS,
    LEARNING_RATE,
    Root,
    check_tables,
    load_global_weights,
    loss_weights_in_order,
    same_plan,
)
from benchmarks.compare.plans import Plan, Shard, TablePlan
from benchmarks.compare.workloads import Batch, Workload

MODULE = "ebc"


def _torchrec_plan(plan: Plan, ebc: nn.Module, sharder: Any, world: int, local: int) -> Any:
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ParameterSharding

    generators = {}
    for table, tp in plan.items():
        kind = tp.sharding_type
        if kind == "data_parallel":
            generators[table] = sp.data_parallel()
        elif kind == "table_wise":
            generators[table] = sp.table_wise(rank=tp.ranks[0], compute_kernel="fused")
        elif kind == "row_wise":
            generators[table] = sp.row_wise(compute_kernel="fused")
        elif kind == "column_wise":
            generators[table] = sp.column_wise(ranks=list(tp.ranks), compute_kernel="fused")
        elif kind == "table_row_wise":
            generators[table] = sp.table_row_wise(host_index=tp.ranks[0] // local)
        elif kind == "grid_shard":
            generators[table] = sp.data_parallel()  # placeholder, replaced below
        else:
            raise ValueError(f"table {table!r}: no TorchRec plan for {kind!r}")
    module_plan = sp.construct_module_sharding_plan(
        ebc, generators, sharder=sharder, local_size=local, world_size=world, device_type="cpu"
    )
    for table, tp in plan.items():
        if tp.sharding_type == "grid_shard":
            assert tp.shards is not None
            spec = EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=[s.row_offset, s.col_offset],
                        shard_sizes=[s.rows, s.cols],
                        placement=f"rank:{s.rank}/cpu",
                    )
                    for s in tp.shards
                ]
            )
            module_plan[table] = ParameterSharding(
                sharding_type="grid_shard",
                compute_kernel="fused",
                ranks=list(tp.ranks),
                sharding_spec=spec,
            )
        elif tp.sharding_type != "data_parallel":
            module_plan[table].compute_kernel = "fused"
        same_plan("TorchRec", table, tp, _neutral(module_plan[table]))
    return module_plan


def _neutral(ps: Any) -> TablePlan:
    shards = None
    if ps.sharding_spec is not None:
        shards = tuple(
            Shard(
                m.placement.rank(),
                m.shard_offsets[0],
                m.shard_offsets[1],
                m.shard_sizes[0],
                m.shard_sizes[1],
            )
            for m in ps.sharding_spec.shards
        )
    return TablePlan(ps.sharding_type, tuple(ps.ranks or ()), shards)


class TorchRecSide:
    """TorchRec's sharded collection on this rank, with the harness's step.

    Args:
        workload: the tables and their initial weights.
        plan: the neutral plan to translate.
        loss_weights: this rank's loss weights by feature.
        world_size: ranks in the default process group.
        local_size: ranks per host.
    """

    name = "torchrec"

    def __init__(
        self,
        workload: Workload,
        plan: Plan,
        loss_weights: dict[str, Tensor],
        world_size: int,
        local_size: int,
    ) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingPlan
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        check_tables(plan, workload)
        tables = [
            EmbeddingBagConfig(
                name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[t.feature]
            )
            for t in workload.tables
        ]
        root = Root(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
        sharder = EmbeddingBagCollectionSharder(
            fused_params={
                "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "learning_rate": LEARNING_RATE,
                "eps": EPS,
            }
        )
        module_plan = _torchrec_plan(plan, root.ebc, sharder, world_size, local_size)
        self.model = DistributedModelParallel(
            root,
            device=torch.device("cpu"),
            plan=ShardingPlan({MODULE: module_plan}),
            sharders=[sharder],
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
            raise RuntimeError(f"TorchRec: initial weights reached tables {sorted(written)} only")
        dense = dict(in_backward_optimizer_filter(self.model.named_parameters()))
        dp_tables = {name for name, tp in plan.items() if tp.sharding_type == "data_parallel"}
        dense_tables = {k.split(".")[-2] for k in dense}
        if dense_tables != dp_tables:
            raise RuntimeError(
                f"TorchRec: parameters outside the fused optimizer {sorted(dense)} do not match "
                f"the data-parallel tables {sorted(dp_tables)}"
            )
        self.dense_optimizer = (
            RowWiseAdagrad(list(dense.values()), lr=LEARNING_RATE, eps=EPS) if dense else None
        )
        self._loss_weights = loss_weights
        self._arranged: Tensor | None = None
        self._kjts: dict[int, tuple[Batch, Any]] = {}

    def _kjt(self, batch: Batch) -> Any:
        """The batch as this library's KeyedJaggedTensor, built once (outside the timed step)."""
        entry = self._kjts.get(id(batch))  # the batch is kept in the entry, so its id stays
        if entry is None:
            from torchrec import KeyedJaggedTensor

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

    def _dense_step(self) -> None:
        if self.dense_optimizer is not None:
            self.dense_optimizer.step()
            self.dense_optimizer.zero_grad(set_to_none=True)

    def step(self, batch: Batch) -> None:
        self._loss(self.model(self._kjt(batch)), batch).backward()
        self._dense_step()

    def profile(self, batch: Batch) -> tuple[dict[str, float], dict[str, float]]:
        from benchmarks.compare.profile import profile_step

        def loss_of(kt: Any) -> Tensor:
            return self._loss(kt, batch)

        return profile_step(self.model, self._kjt(batch), loss_of, self._dense_step)
