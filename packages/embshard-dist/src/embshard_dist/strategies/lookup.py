"""The lookup half of a strategy: this rank's shards in grouped kernels, KJT in, rows out.

:func:`kernel_feature_order` is exactly the key order the lookup takes, so it only splits its
input. A rank without shards returns an empty ``[batch, 0]`` tensor that still joins autograd,
so the output dist's backward collective runs on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor, nn

from embshard_dist.strategies.options import ShardingOptions
from embshard_kernels.base import BaseBatchedEmbedding
from embshard_kernels.dense import BatchedDenseEmbedding, BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig, group_tables
from embshard_kernels.lookup import arrange_pooled, split_pooled
from embshard_kernels.quant import QuantBatchedEmbeddingBag
from embshard_kernels.tbe import Backend
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_optim.keyed import KeyedOptimizer
from embshard_optim.sharded_state import StateFormat
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, PoolingType

_FUSED = (ComputeKernel.FUSED, ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)


KernelKey = Callable[[ShardedTableConfig], Hashable]
"""Tables with different keys never share a kernel."""

GroupBackend = Backend | Callable[[GroupedEmbeddingConfig], Backend]
"""A fused backend for every group, or a group's own (e.g. ``"torch"`` only where it needs hooks)."""


def _groups(
    tables: Sequence[ShardedTableConfig],
    one_table_per_kernel: bool,
    kernel_key: KernelKey | None = None,
) -> list[GroupedEmbeddingConfig]:
    if one_table_per_kernel:
        return [group for table in tables for group in group_tables([table])]
    if kernel_key is None:
        return group_tables(tables)
    buckets: dict[Hashable, list[ShardedTableConfig]] = {}
    for table in tables:
        buckets.setdefault(kernel_key(table), []).append(table)
    position = {id(t): i for i, t in enumerate(tables)}
    groups = [g for members in buckets.values() for g in group_tables(members)]
    # Kernels in order of their first table: the same relative order on every rank.
    return sorted(groups, key=lambda g: position[id(g.embedding_tables[0])])


def _group_backend(group: GroupedEmbeddingConfig, backend: GroupBackend) -> Backend:
    """``group``'s fused backend: ``backend``'s choice, but the torch TBE for a group with an empty
    shard (FBGEMM's CPU TBE mishandles 0 rows)."""
    if any(t.rows == 0 for t in group.embedding_tables):
        return "torch"
    return backend(group) if callable(backend) else backend


def kernel_feature_order(
    tables: Sequence[ShardedTableConfig],
    *,
    one_table_per_kernel: bool = False,
    kernel_key: KernelKey | None = None,
) -> list[str]:
    """The features of ``tables`` in the order their grouped kernels take them."""
    return [f for g in _groups(tables, one_table_per_kernel, kernel_key) for f in g.feature_names()]


def build_bag_kernel(
    group: GroupedEmbeddingConfig,
    options: ShardingOptions,
    *,
    backend: Backend = "auto",
    state_format: StateFormat | None = None,
) -> BaseBatchedEmbedding:
    """The kernel of one group of shards (weights left uninitialised).

    Training kernels (fused, dense); ``quant`` (pooled) for sharded inference.

    Raises:
        ValueError: the group's kernel is not a training kernel this package shards.
    """
    kernel = group.compute_kernel
    if kernel is ComputeKernel.DEFAULT:
        kernel = ComputeKernel.FUSED
    sequence = group.pooling is PoolingType.NONE
    if kernel in _FUSED:
        fused = BatchedFusedEmbedding if sequence else BatchedFusedEmbeddingBag
        return fused(
            group,
            options.pg,
            options.device,
            backend=backend,
            state_format=state_format or options.state_format,
            init_weights=False,
        )
    if kernel is ComputeKernel.DENSE:
        dense = BatchedDenseEmbedding if sequence else BatchedDenseEmbeddingBag
        return dense(group, options.device, init_weights=False)
    if kernel is ComputeKernel.QUANT and not sequence:
        # Inference only (sharded quantized collections); filled from the packed tables.
        return QuantBatchedEmbeddingBag(group, options.device)
    raise ValueError(
        f"tables {group.table_names()}: compute kernel {kernel.value!r} cannot be sharded for "
        "training; use 'fused' or 'dense'"
    )


class GroupedBagLookup(nn.Module):
    """Lookups of this rank's shards in grouped kernels.

    Args:
        backend: fused kernels' backend (``"torch"`` where the update needs embshard's rules),
            or a function giving each group its own.
        one_table_per_kernel: give every table its own kernel (backward in reverse table order).
        kernel_key: tables of different keys get different kernels, ordered by first table.
    """

    def __init__(
        self,
        tables: Sequence[ShardedTableConfig],
        options: ShardingOptions,
        *,
        backend: GroupBackend = "auto",
        state_format: StateFormat | None = None,
        one_table_per_kernel: bool = False,
        kernel_key: KernelKey | None = None,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        groups = _groups(self.tables, one_table_per_kernel, kernel_key)
        self.kernels = nn.ModuleList(
            build_bag_kernel(
                g,
                options,
                backend=_group_backend(g, backend),
                state_format=state_format,
            )
            for g in groups
        )
        self._groups = groups
        self._sizes = [g.num_features() for g in groups]
        self._order = [f for g in groups for f in g.feature_names()]
        self._device = options.device

    def feature_names(self) -> list[str]:
        return list(self._order)

    def trust_inputs(self) -> None:
        """Stop the kernels checking each batch: the owning collection checks every caller's batch
        at its boundary, and what reaches the kernels is routed from those by embshard's code."""
        for kernel in self.kernels:
            assert isinstance(kernel, BaseBatchedEmbedding)
            kernel.check_inputs = False

    def prepare_backward(self) -> None:
        """Let the kernels prepare their backward while the output dist's collective runs."""
        for kernel in self.kernels:
            prepare = getattr(getattr(kernel, "emb_module", None), "prepare_backward", None)
            if prepare is not None:
                prepare()

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        """``[batch, sum of local widths]`` in ``feature_names()`` order (sequence: flat rows).

        Variable batch sizes give FBGEMM's flat layout (rank by rank, then feature by feature).
        """
        if not self.kernels:
            return torch.zeros(
                features.stride(), 0, device=self._device, requires_grad=torch.is_grad_enabled()
            )
        parts = features.split(self._sizes) if len(self._sizes) > 1 else [features]
        outputs = [kernel(part) for kernel, part in zip(self.kernels, parts, strict=True)]
        if self._groups[0].pooling is PoolingType.NONE:
            return torch.cat([out.reshape(-1) for out in outputs])
        if len(outputs) == 1:
            return outputs[0]
        if not features.variable_stride_per_key():
            return torch.cat(outputs, dim=1)
        blocks = [
            block
            for out, group, part in zip(outputs, self._groups, parts, strict=True)
            for block in split_pooled(out, group.embedding_dims(), part.stride_per_key_per_rank())
        ]
        return arrange_pooled(blocks, features.stride_per_key_per_rank())

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
        """Each torch-TBE kernel's group and TBE, whose update hooks a strategy may set."""
        out = []
        for kernel, group in zip(self.kernels, self._groups, strict=True):
            tbe = getattr(kernel, "emb_module", None)
            if isinstance(tbe, TorchFusedTBE):
                out.append((group, tbe))
        return out

    def fused_optimizers(self) -> list[KeyedOptimizer]:
        fused = (BatchedFusedEmbeddingBag, BatchedFusedEmbedding)
        return [k.fused_optimizer for k in self.kernels if isinstance(k, fused)]
