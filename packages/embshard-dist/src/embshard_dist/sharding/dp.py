"""Data-parallel sharding: every rank holds every table whole and looks up its own batch.

Flow: the input dist only selects the features (no communication); the lookup runs embshard's
torch fused kernels; the output dist divides the gradient by the world size (no
communication either).

Math: in the backward each rank sums the gradient of each row its batch touched, the ranks
exchange those rows (:func:`~embshard_dist.comm.collectives.sparse_all_reduce`: the sorted
union of the rows, each row's gradients added in rank order, so every rank gets the same bits;
a small block of rows is summed whole by one all-reduce instead, still the same bits on every
rank),
and every rank applies the same sparse update rule to the same rows. The replicas stay
bit-identical and equal the unsharded module stepped with ``L = (1/N) * sum_i L_i`` (up to the
order of the gradient sums). Unlike TorchRec, data-parallel tables are trained by the chosen
fused optimizer, and whole tables are never all-reduced: only the touched rows travel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.collectives import dense_row_all_reduce, sparse_all_reduce
from embshard_dist.sharding._lookup import GroupedBagLookup, kernel_feature_order
from embshard_dist.sharding.base import (
    BagTable,
    FeatureSelector,
    ShardingOptions,
    ShardingStepContext,
    scale_grad,
    shard_config,
)
from embshard_kernels.workspace import Workspace
from embshard_optim.sharded_state import StateFormat
from embshard_types.awaitables import Awaitable, NoWait
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ShardingType


class DpInputDist(nn.Module):
    """Selects the data-parallel features of the caller's batch (no communication).

    Args:
        features: the features, in the lookup's order.
        feature_tables: feature -> table, for messages.
        is_weighted: keep the per-id weights.
    """

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
    """Divides the gradient by the world size (the 1/N rule); no communication.

    Args:
        world_size: N.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self._world = world_size

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[Tensor]:
        return NoWait(scale_grad(embeddings, self._world))


DENSE_EXCHANGE_BYTES = 4 << 20
"""Blocks of rows whose whole float32 gradient (plus a marker column) fits in this many bytes
are summed with one dense all-reduce; larger ones exchange their touched rows only."""


class _RowExchange:
    """A torch TBE's ``grad_exchange`` hook: sum the touched rows' gradients over the ranks.

    Small blocks (:data:`DENSE_EXCHANGE_BYTES`) take one dense all-reduce
    (:func:`~embshard_dist.comm.collectives.dense_row_all_reduce`), others the touched rows'
    exchange (:func:`~embshard_dist.comm.collectives.sparse_all_reduce`); every rank chooses
    alike, from the block's shape alone.
    """

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self._pg = pg
        # one per block of rows: a kernel may hold every block's sums before applying them
        self._workspaces: dict[str, Workspace] = {}

    def __call__(
        self, label: str, rows: Tensor, grads: Tensor, num_rows: int
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
        return sparse_all_reduce(rows, grads, group=self._pg, name=name, workspace=workspace)


class DpSharding:
    """Data-parallel sharding of ``tables`` (replicated whole on every rank).

    Args:
        tables: the data-parallel tables, in the collection's order.
        options: where to run and how to build kernels.
    """

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
        """Features in output order (the kernels' order)."""
        return kernel_feature_order(self._local)

    def embedding_dims(self) -> list[int]:
        return [self._by_feature[f].config.embedding_dim for f in self.feature_names()]

    def shard_specs(self) -> None:
        """None: every rank holds every table whole."""
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
