"""The lookup half of a strategy: this rank's shards in grouped kernels, KJT in, pooled rows out.

Guarantees: the kernels are grouped by :func:`~embshard_kernels.grouping.group_tables`, so
:func:`kernel_feature_order` (computable on any rank for any rank's shards, without building a
kernel) is the exact key order the lookup takes; input dists send features in that order, so
the lookup only splits its input (views, no permutation). A rank without shards returns an
empty ``[batch, 0]`` tensor that still takes part in autograd, so that the output dist's
backward collective runs on every rank. A group holding an empty shard (a row-wise table with
fewer rows than ranks) runs on embshard's torch TBE: FBGEMM's CPU TBE (fbgemm-gpu-cpu 1.8.0)
mishandles a table of 0 rows followed by a table of another width (wrong updates of the next
table, or a crash).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from embshard_dist.sharding.base import ShardingOptions
from embshard_kernels.base import BaseBatchedEmbedding
from embshard_kernels.dense import BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbeddingBag
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig, group_tables
from embshard_kernels.tbe import Backend
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_optim.keyed import KeyedOptimizer
from embshard_optim.sharded_state import StateFormat
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel

_FUSED = (ComputeKernel.FUSED, ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)


def _groups(
    tables: Sequence[ShardedTableConfig], one_table_per_kernel: bool
) -> list[GroupedEmbeddingConfig]:
    if one_table_per_kernel:
        return [group for table in tables for group in group_tables([table])]
    return group_tables(tables)


def kernel_feature_order(
    tables: Sequence[ShardedTableConfig], *, one_table_per_kernel: bool = False
) -> list[str]:
    """The features of ``tables`` in the order their grouped kernels take them."""
    return [f for g in _groups(tables, one_table_per_kernel) for f in g.feature_names()]


def build_bag_kernel(
    group: GroupedEmbeddingConfig,
    options: ShardingOptions,
    *,
    backend: Backend = "auto",
    state_format: StateFormat | None = None,
) -> BaseBatchedEmbedding:
    """The training kernel of one group of shards (weights left uninitialised).

    Raises:
        ValueError: the group's kernel is not a training kernel this package shards.
    """
    kernel = group.compute_kernel
    if kernel is ComputeKernel.DEFAULT:
        kernel = ComputeKernel.FUSED
    if kernel in _FUSED:
        return BatchedFusedEmbeddingBag(
            group,
            options.pg,
            options.device,
            backend=backend,
            state_format=state_format or options.state_format,
            init_weights=False,
        )
    if kernel is ComputeKernel.DENSE:
        return BatchedDenseEmbeddingBag(group, options.device, init_weights=False)
    raise ValueError(
        f"tables {group.table_names()}: compute kernel {kernel.value!r} cannot be sharded for "
        "training; use 'fused' or 'dense'"
    )


class GroupedBagLookup(nn.Module):
    """Pooled lookups of this rank's shards (see the module docstring).

    Args:
        tables: this rank's shards, in the strategy's order.
        options: how to build the kernels.
        backend: fused kernels' backend (``"torch"`` where the update needs embshard's rules).
        state_format: override ``options.state_format`` (data-parallel tables: plain tensors).
        one_table_per_kernel: give every table its own kernel (so that kernels' backward
            passes, which run in reverse order of their forwards, handle tables in reverse
            table order; column-wise row reductions rely on it).
    """

    def __init__(
        self,
        tables: Sequence[ShardedTableConfig],
        options: ShardingOptions,
        *,
        backend: Backend = "auto",
        state_format: StateFormat | None = None,
        one_table_per_kernel: bool = False,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        groups = _groups(self.tables, one_table_per_kernel)
        self.kernels = nn.ModuleList(
            build_bag_kernel(
                g,
                options,
                backend="torch" if any(t.rows == 0 for t in g.embedding_tables) else backend,
                state_format=state_format,
            )
            for g in groups
        )
        self._groups = groups
        self._sizes = [g.num_features() for g in groups]
        self._order = [f for g in groups for f in g.feature_names()]
        self._device = options.device

    def feature_names(self) -> list[str]:
        """The features the lookup takes, in order."""
        return list(self._order)

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        """``[batch, sum of local widths]``, column blocks in ``feature_names()`` order."""
        if not self.kernels:
            return torch.zeros(
                features.stride(), 0, device=self._device, requires_grad=torch.is_grad_enabled()
            )
        parts = features.split(self._sizes) if len(self._sizes) > 1 else [features]
        outputs = [kernel(part) for kernel, part in zip(self.kernels, parts, strict=True)]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def local_weights(self) -> dict[str, tuple[nn.Parameter, ShardSpec]]:
        """Table -> its local shard's weight (a live view) and the shard's spec."""
        out: dict[str, tuple[nn.Parameter, ShardSpec]] = {}
        for kernel, group in zip(self.kernels, self._groups, strict=True):
            assert isinstance(kernel, BaseBatchedEmbedding)
            for table in group.embedding_tables:
                assert table.local_metadata is not None
                out[table.name] = (kernel.table_weight(table.name).weight, table.local_metadata)
        return out

    def torch_tbes(self) -> list[tuple[GroupedEmbeddingConfig, TorchFusedTBE]]:
        """Per kernel built on embshard's torch TBE (``backend="torch"``): its group and TBE,
        whose update hooks a strategy may set."""
        out = []
        for kernel, group in zip(self.kernels, self._groups, strict=True):
            tbe = getattr(kernel, "emb_module", None)
            if isinstance(tbe, TorchFusedTBE):
                out.append((group, tbe))
        return out

    def fused_optimizers(self) -> list[KeyedOptimizer]:
        """The fused optimizers of the kernels that have one."""
        return [k.fused_optimizer for k in self.kernels if isinstance(k, BatchedFusedEmbeddingBag)]
