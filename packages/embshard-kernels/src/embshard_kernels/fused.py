"""Fused batched kernels: one TBE per table group, the optimizer applied inside the backward.

``BatchedFusedEmbeddingBag`` (pooled) and ``BatchedFusedEmbedding`` (sequence) run the TBE that
:func:`~embshard_kernels.tbe.build_fused_tbe` picks; ``fused_optimizer`` exposes its state. The
config is checked at construction and every batch before the TBE runs, so a bad batch changes
neither weights nor optimizer state.

Under ``torch.compile`` FBGEMM's fused CPU op cannot be traced (it has no fake kernel, in the
forward nor in the backward that updates the weights), so a traced training forward breaks its
graph there. A traced forward without gradients on the CPU looks up fp32 pooled tables with
FBGEMM's dense op on the same weights (the same CPU kernel: the same outputs), and bounds-checks
the ids in the graph instead of calling ``check_features``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from embshard_kernels.accumulate import ATTR as _ACCUMULATION_ATTR
from embshard_kernels.accumulate import GradAccumulation
from embshard_kernels.base import BaseBatchedEmbedding
from embshard_kernels.dense import register_dense_lookup_fake, traced_bounds_check
from embshard_kernels.fbgemm_mapping import (
    check_kernel_available,
    check_training_data_type,
    device_type,
)
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig
from embshard_kernels.inputs import TBEInput, check_features, to_tbe_input
from embshard_kernels.slices import table_slices
from embshard_kernels.tbe import Backend, FbgemmFusedTBE, build_fused_tbe
from embshard_optim.embedding_fused import EmbeddingFusedOptimizer, TableShardInfo
from embshard_optim.sharded_state import StateFormat
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, DataType, PoolingType

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def check_fused_config(
    config: GroupedEmbeddingConfig, device: torch.device | str | None, *, sequence: bool
) -> None:
    """Raise ``ValueError`` unless a fused kernel on ``device`` can serve ``config``."""
    kind = "sequence (pooling 'none')" if sequence else "pooled (pooling 'sum' or 'mean')"
    cls = "BatchedFusedEmbedding" if sequence else "BatchedFusedEmbeddingBag"
    for table in config.embedding_tables:
        where = f"table {table.name!r}"
        kernel = check_kernel_available(table.compute_kernel, device, table=table.name)
        if kernel in (ComputeKernel.DENSE, ComputeKernel.QUANT, ComputeKernel.KEY_VALUE):
            raise ValueError(
                f"{where}: compute kernel {kernel.value!r} is not a fused kernel; use "
                "BatchedDenseEmbedding(Bag), QuantBatchedEmbedding(Bag) or KeyValueEmbedding(Bag)"
            )
        if (table.pooling is PoolingType.NONE) != sequence:
            raise ValueError(
                f"{where}: {cls} serves {kind} tables, got pooling {table.pooling.value!r}"
            )
        check_training_data_type(table.data_type, device, table=table.name)
        if table.cols % 4:
            raise ValueError(
                f"{where}: embedding dimension {table.cols} (local columns) is not a multiple of "
                "4, which FBGEMM's fused kernel needs; use a multiple of 4, or compute kernel "
                "'dense'"
            )
    params = config.fused_params or FusedParams()
    allowed = (
        (DataType.FP32, DataType.FP16)
        if device_type(device) != "cuda"
        else (DataType.FP32, DataType.FP16, DataType.BF16)
    )
    if params.output_dtype not in allowed:
        raise ValueError(
            f"tables {config.table_names()}: output dtype {params.output_dtype.value!r} is not "
            f"supported on {device_type(device)}; use one of {[d.value for d in allowed]}"
        )


def shard_infos(config: GroupedEmbeddingConfig) -> list[TableShardInfo]:
    """What embshard-optim's fused optimizer needs to know of each table shard."""
    return [_shard_info(t) for t in config.embedding_tables]


def _shard_info(table: ShardedTableConfig) -> TableShardInfo:
    assert table.local_metadata is not None
    return TableShardInfo(
        name=table.name,
        num_embeddings=table.num_embeddings,
        embedding_dim=table.embedding_dim,
        local_shard=table.local_metadata,
        all_shards=table.global_metadata,
    )


def default_state_format(config: GroupedEmbeddingConfig, pg: ProcessGroup | None) -> StateFormat:
    """Plain tensors for whole tables outside a process group, else ``ShardedTensor``."""
    whole = all(len(t.global_metadata) == 1 for t in config.embedding_tables)
    return StateFormat.TENSOR if pg is None and whole else StateFormat.SHARDED_TENSOR


class _FusedKernel(BaseBatchedEmbedding):
    """The fused kernel; the public classes below fix whether it pools."""

    _SEQUENCE: ClassVar[bool] = False
    _rows_per_feature: Tensor

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        *,
        backend: Backend = "auto",
        state_format: StateFormat | str | None = None,
        init_weights: bool = True,
    ) -> None:
        super().__init__(config, device)
        check_fused_config(config, device, sequence=self._SEQUENCE)
        params = config.fused_params or FusedParams()
        tbe = build_fused_tbe(config, params, self.device, backend=backend)
        self._set_emb_module(tbe)
        self._traced_inference = (
            isinstance(tbe, FbgemmFusedTBE)
            and not self._SEQUENCE
            and tbe.module.weights_host.numel() > 0
            and tbe.module.weights_host.dtype == torch.float32
        )
        if self._traced_inference:
            register_dense_lookup_fake()
            rows = [t.rows for t in config.embedding_tables]
            self.register_buffer(
                "_rows_per_feature",
                torch.tensor([rows[t] for t in config.feature_table_map()], dtype=torch.int64),
                persistent=False,
            )
        buffer, offsets = tbe.weight_buffer()
        slices = table_slices(buffer, offsets, [(t.rows, t.cols) for t in config.embedding_tables])
        self._attach_tables(list(slices))
        if init_weights:
            self.init_parameters()
        fmt = (
            StateFormat.parse(state_format)
            if state_format is not None
            else (default_state_format(config, pg))
        )
        infos = shard_infos(config)
        lr = tbe.get_learning_rate()
        self._accumulation = GradAccumulation(
            tbe, config.embedding_dims(), sequence=self._SEQUENCE, tables=config.table_names()
        )
        self._optim = EmbeddingFusedOptimizer(tbe, infos, learning_rate=lr, pg=pg, state_format=fmt)
        for table, weight in zip(config.embedding_tables, slices, strict=True):
            weight._in_backward_optimizers = [  # type: ignore[attr-defined]
                EmbeddingFusedOptimizer(
                    tbe,
                    infos,
                    learning_rate=lr,
                    pg=pg,
                    state_format=fmt,
                    create_for_table=table.name,
                    param_weight_for_table=weight,
                )
            ]
            setattr(weight, _ACCUMULATION_ATTR, self._accumulation)

    @property
    def fused_optimizer(self) -> EmbeddingFusedOptimizer:
        """The optimizer applied in the backward (its ``step()`` only pushes the learning rate)."""
        return self._optim

    @property
    def grad_accumulation(self) -> GradAccumulation:
        """This kernel's gradient accumulation (see :mod:`embshard_kernels.accumulate`)."""
        return self._accumulation

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        """Look up ``features`` (exactly the group's features, in order).

        Pooled: ``[batch, sum of dims]`` (flat when batch sizes vary); sequence: ``[ids, dim]``.
        Bad input raises (see ``check_features``) before anything changes. Inside
        ``defer_sparse_updates`` the backward keeps the gradient instead of updating.
        """
        # data-dependent checks: traced graphs skip them
        if self.check_inputs and not torch.compiler.is_compiling():
            check_features(features, self._layout)
        args = to_tbe_input(features, weighted=self._config.is_weighted)
        if self._accumulation.engaged():
            return self._accumulation.lookup(args)
        if self._traced_without_grad(args):
            return self._dense_lookup(args)
        out: Tensor = self._emb_module(*args)
        return out

    def _traced_without_grad(self, args: TBEInput) -> bool:
        """Whether this call is traced, without gradients, on a path the dense op can serve."""
        if not self._traced_inference or args.batch_size_per_feature_per_rank is not None:
            return False
        return torch.compiler.is_compiling() and not torch.is_grad_enabled()

    def _dense_lookup(self, args: TBEInput) -> Tensor:
        """The fused TBE's pooled lookup by FBGEMM's (traceable) dense op, without gradients."""
        if self.check_inputs:
            traced_bounds_check(
                self._rows_per_feature, args.indices, args.offsets, args.per_sample_weights
            )
        tbe = self._emb_module
        assert isinstance(tbe, FbgemmFusedTBE)
        m = tbe.module
        out: Tensor = torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
            m.weights_host,
            m.weights_offsets,
            m.D_offsets,
            m.total_D,
            m.max_D,
            m.hash_size_cumsum,
            m.total_hash_size_bits,
            args.indices,
            args.offsets,
            int(m.pooling_mode),
            args.per_sample_weights,
            None,
            m.output_dtype,
        )
        return out


class BatchedFusedEmbeddingBag(_FusedKernel):
    """Pooled (SUM / MEAN) tables with the optimizer fused into the backward.

    Args:
        config: pooling SUM or MEAN, widths multiples of 4.
        pg: the process group the tables' shard placements refer to.
        backend: ``"auto"``, ``"fbgemm"`` or ``"torch"`` (see ``choose_fused_path``).
        state_format: how ``fused_optimizer`` exposes weights and state (default: plain tensors
            for whole tables without ``pg``, ``ShardedTensor`` otherwise).
        init_weights: draw the weights from the tables' init ranges.
    """

    _SEQUENCE = False


class BatchedFusedEmbedding(_FusedKernel):
    """Sequence tables (one row per id) with the optimizer fused into the backward.

    Args: as :class:`BatchedFusedEmbeddingBag`, for tables with pooling NONE (one width).
    """

    _SEQUENCE = True
