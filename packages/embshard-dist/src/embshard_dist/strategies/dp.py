"""Data-parallel sharding: every rank holds every table whole and looks up its own batch.

In the backward every rank applies the chosen fused optimizer to the same summed gradients, so
the replicas stay bit-identical; whole tables never travel. On the fast pooled path the ranks
gather every rank's call (ids, offsets, weights, the output's gradient) where it is the smaller
message, and each applies the global batch's update (:class:`_CallGather`); elsewhere they
exchange the touched rows' summed gradients (:class:`_RowExchange`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm._dtypes import dtype_code, dtype_name
from embshard_dist.comm.collectives import (
    all_gather_ints,
    dense_row_all_reduce,
    sparse_all_gather,
    sparse_all_reduce,
)
from embshard_dist.comm.gather import start_all_gather
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
from embshard_kernels.call_gather import PooledCall, RunIds, join_calls
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


CALL_GATHER_RATIO = 1.0
"""The call is gathered where its bytes are below this many times the row exchange's."""


class _CallGather:
    """A torch TBE's ``call_gather`` hook: every rank's pooled call, where it is smaller.

    Each rank first shares its call's sizes (one small all-gather); then, on every rank alike,
    the call is gathered when every rank offered one and its padded blocks are fewer bytes
    than the row exchange would send (at most one row per id, or a small block's dense
    all-reduce); else ``None``.
    """

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self._pg = pg
        self._workspace = Workspace()

    def __call__(
        self, call: PooledCall | None, num_features: int, runs: Sequence[RunIds]
    ) -> PooledCall | None:
        name = "data_parallel_call"
        sizes = [0] * 7
        if call is not None:
            grad = call.grad_output
            sizes = [
                call.offsets.numel() - 1,
                call.indices.numel(),
                int(call.per_sample_weights is not None),
                dtype_code(call.indices.dtype),
                dtype_code(call.offsets.dtype),
                dtype_code(grad.dtype),
                grad.shape[1],
            ]
        meta = all_gather_ints(
            [int(call is not None), *sizes, *(r.ids for r in runs)],
            group=self._pg,
            name=f"{name}.sizes",
        )
        if call is None or not all(m[0] for m in meta):  # some rank cannot join its call
            return None
        meta = [m[1:] for m in meta]
        if any(m[5:7] != meta[0][5:7] for m in meta):
            raise ValueError(
                f"{name}: ranks disagree on the output gradient's dtype or width: "
                + ", ".join(f"rank {r}: {dtype_name(m[5])} x {m[6]}" for r, m in enumerate(meta))
            )
        world = len(meta)
        bags, ids = max(m[0] for m in meta), max(m[1] for m in meta)
        weighted = any(m[2] for m in meta)
        same_indices = all(m[3:5] == meta[0][3:5] for m in meta)
        index_size = call.indices.element_size() if same_indices else 8
        call_bytes = world * (
            bags // num_features * grad.shape[1] * grad.element_size()
            + ids * (index_size + (4 if weighted else 0))
            + (bags + 1) * index_size
        )
        if call_bytes >= CALL_GATHER_RATIO * _row_exchange_bytes(meta, runs):
            return None
        indices, offsets = call.indices, call.offsets
        if not same_indices:
            indices, offsets = indices.long(), offsets.long()
        weights = call.per_sample_weights
        if weighted and weights is None:
            weights = torch.ones(indices.numel(), device=indices.device)
        batch = bags // num_features
        blocks = {
            "indices": (_padded(indices, ids), ids),
            "offsets": (_padded(offsets, bags + 1), bags + 1),
            "grad": (_padded(grad, batch), batch),
        }
        if weights is not None:
            blocks["weights"] = (_padded(weights.float(), ids), ids)
        gathered, pending = {}, []
        for key, (local, size) in blocks.items():
            out = self._workspace.take(
                key, (world * size, *local.shape[1:]), local.dtype, local.device
            )
            gathered[key] = out
            pending.append(start_all_gather(f"{name}.{key}", out, local, group=self._pg))
        for work in pending:
            work.wait()
        calls = []
        for r, m in enumerate(meta):
            n_bags, n_ids = m[0], m[1]
            calls.append(
                PooledCall(
                    gathered["indices"][r * ids : r * ids + n_ids],
                    gathered["offsets"][r * (bags + 1) : r * (bags + 1) + n_bags + 1],
                    gathered["weights"][r * ids : r * ids + n_ids] if weights is not None else None,
                    gathered["grad"][r * batch : r * batch + n_bags // num_features],
                )
            )
        return join_calls(calls, num_features)


def _row_exchange_bytes(meta: list[list[int]], runs: Sequence[RunIds]) -> int:
    """What :class:`_RowExchange` would send per rank at most: per run, a small block's dense
    all-reduce, else every rank's block of (at most one row per id) padded to the largest."""
    world, total = len(meta), 0
    for i, run in enumerate(runs):
        dense = run.rows * (run.width + 1) * 4
        if dense <= DENSE_EXCHANGE_BYTES:
            total += dense
        else:
            rows = max(min(m[7 + i], run.rows) for m in meta)
            total += world * rows * (run.width * 4 + 8)
    return total


def _padded(tensor: Tensor, size: int) -> Tensor:
    """``tensor`` with zeros appended along its first dimension up to ``size``."""
    if tensor.shape[0] == size:
        return tensor.contiguous()
    pad = tensor.new_zeros((size - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad])


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
            tbe.call_gather = _CallGather(self._options.pg)
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
