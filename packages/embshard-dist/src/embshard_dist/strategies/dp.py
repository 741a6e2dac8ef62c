"""Data-parallel sharding: every rank holds every table whole and looks up its own batch.

In the backward the ranks sum the touched rows' gradients in rank order and apply the chosen
fused optimizer to them, so the replicas stay bit-identical; whole tables never travel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.collectives import (
    dense_row_all_reduce,
    sparse_all_gather,
    sparse_all_reduce,
)
from embshard_dist.strategies.base import (
    BagTable,
    FeatureSelector,
    ShardingStepContext,
    scale_grad,
    shard_config,
)
from embshard_dist.strategies.lookup import GroupedBagLookup, kernel_feature_order
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.sequence import DpSequenceOutputDist, PooledSequenceSharding
from embshard_kernels.workspace import Workspace
from embshard_optim.sharded_state import StateFormat
from embshard_types.awaitables import Awaitable, NoWait
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ShardingType


class DpInputDist(nn.Module):
    """Selects the data-parallel features of the caller's batch (no communication)."""

    def __init__(
        self, features: Sequence[str], feature_tables: dict[str, str], *, is_weighted: bool
    ) -> None:
        super().__init__()
        self._select = FeatureSelector(features, feature_tables, is_weighted=is_weighted)

    def forward(
        self, features: KeyedJaggedTensor, ctx: ShardingStepContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        selected = self._select(features)
        ctx.batch_size_per_rank = None
        return NoWait(NoWait(selected))


class DpOutputDist(nn.Module):
    """Divides the gradient by the world size (the 1/N rule); no communication."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self._world = world_size

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[Tensor]:
        return NoWait(scale_grad(embeddings, self._world))


DENSE_EXCHANGE_BYTES = 4 << 20
"""Blocks whose float32 gradient fits in this many bytes take one dense all-reduce."""


class _RowExchange:
    """A torch TBE's ``grad_exchange`` hook: sums the touched rows' gradients over the ranks.

    Every rank picks dense or sparse exchange alike, from the block's shape alone. Where the
    kernel sums repeated rows itself (:meth:`unsummed`: FBGEMM's row loop, which adds a row's
    entries in the order given), the sparse exchange hands it every rank's rows in rank order
    unsummed (their blocks zero-padded as they travelled): the same sums, without a second
    sort and sum here.
    """

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self._pg = pg
        # One per block: a kernel may hold every block's sums before applying them.
        self._workspaces: dict[str, Workspace] = {}

    def __call__(
        self, label: str, rows: Tensor, grads: Tensor, num_rows: int
    ) -> tuple[Tensor, Tensor]:
        """Distinct rows, each with its gradients summed over the ranks in rank order."""
        return self._exchange(label, rows, grads, num_rows, summed=True)

    def unsummed(
        self, label: str, rows: Tensor, grads: Tensor, num_rows: int
    ) -> tuple[Tensor, Tensor]:
        """Every rank's rows in rank order, a row repeating once per rank that touched it (a
        small block's dense exchange still sums them)."""
        return self._exchange(label, rows, grads, num_rows, summed=False)

    def _exchange(
        self, label: str, rows: Tensor, grads: Tensor, num_rows: int, *, summed: bool
    ) -> tuple[Tensor, Tensor]:
        workspace = self._workspaces.get(label)
        if workspace is None:
            workspace = self._workspaces[label] = Workspace()
        name = f"data_parallel_grads.{label}"
        dense_bytes = num_rows * (grads.shape[1] + 1) * grads.element_size()
        if grads.dtype == torch.float32 and dense_bytes <= DENSE_EXCHANGE_BYTES:
            return dense_row_all_reduce(
                rows, grads, num_rows, group=self._pg, name=name, workspace=workspace
            )
        if not summed:
            return sparse_all_gather(
                rows, grads, group=self._pg, name=name, workspace=workspace, zero_padding=True
            )
        return sparse_all_reduce(rows, grads, group=self._pg, name=name, workspace=workspace)


class DpSharding:
    """Data-parallel sharding of ``tables`` (replicated whole on every rank)."""

    sharding_type = ShardingType.DATA_PARALLEL

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        self._tables = list(tables)
        self._options = options
        device = options.device.type
        self._local = []
        for table in self._tables:
            cfg = table.config
            spec = ShardSpec.on(
                options.rank, device, (0, 0), (cfg.num_embeddings, cfg.embedding_dim)
            )
            self._local.append(shard_config(table, spec, options, all_specs=(spec,)))
        self._by_feature = {f: t for t in self._tables for f in t.config.feature_names}

    def feature_names(self) -> list[str]:
        return kernel_feature_order(self._local)

    def embedding_dims(self) -> list[int]:
        return [self._by_feature[f].config.embedding_dim for f in self.feature_names()]

    def shard_specs(self) -> None:
        return None

    def create_input_dist(self) -> nn.Module:
        return DpInputDist(
            self.feature_names(),
            {f: t.name for f, t in self._by_feature.items()},
            is_weighted=self._options.is_weighted,
        )

    def create_lookup(self) -> GroupedBagLookup:
        lookup = GroupedBagLookup(
            self._local, self._options, backend="torch", state_format=StateFormat.TENSOR
        )
        for _, tbe in lookup.torch_tbes():
            tbe.grad_exchange = _RowExchange(self._options.pg)
        return lookup

    def create_output_dist(self) -> nn.Module:
        return DpOutputDist(self._options.world_size)


class DpSequenceSharding(PooledSequenceSharding[DpSharding]):
    """Data-parallel sharding of sequence ``tables`` (replicated whole on every rank)."""

    sharding_type = ShardingType.DATA_PARALLEL

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        super().__init__(DpSharding(tables, options), options, _output_dist)


def _output_dist(pooled: DpSharding, options: ShardingOptions) -> nn.Module:

    return DpSequenceOutputDist(pooled.feature_names(), pooled.embedding_dims(), options.world_size)
