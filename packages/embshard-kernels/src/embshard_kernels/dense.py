"""Dense batched kernels: table-batched lookups whose weights get ordinary autograd gradients.

The weights are one ``nn.Parameter``; each ``{table}.weight`` is a view of it whose ``.grad`` is
its region of the gradient. Pooled lookups use FBGEMM's dense TBE except with per-feature batch
sizes on the CPU (which it ignores); sequence lookups always run in torch (FBGEMM's CPU dense
TBE sum-pools them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from embshard_kernels._fbgemm import DenseTableBatchedEmbeddingBagsCodegen, PoolingMode
from embshard_kernels.base import BaseBatchedEmbedding
from embshard_kernels.fbgemm_mapping import (
    check_kernel_available,
    check_training_data_type,
    data_type_to_dtype,
    data_type_to_sparse_type,
    device_type,
    pooling_type_to_pooling_mode,
)
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_kernels.inputs import TBEInput, check_features, to_tbe_input
from embshard_kernels.lookup import CallLayout, pooled_lookup, sequence_lookup
from embshard_kernels.slices import table_slices
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, PoolingType


class _DenseKernel(BaseBatchedEmbedding):
    """The dense kernel's storage and checks; the public classes below differ in lookup."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | str | None,
        *,
        sequence: bool,
        init_weights: bool,
    ) -> None:
        super().__init__(config, device)
        for table in config.embedding_tables:
            kernel = check_kernel_available(table.compute_kernel, device, table=table.name)
            if kernel is not ComputeKernel.DENSE:
                raise ValueError(
                    f"table {table.name!r}: compute kernel {kernel.value!r} is not 'dense'; "
                    "build it with the matching kernel class"
                )
            if (table.pooling is PoolingType.NONE) != sequence:
                raise ValueError(
                    f"table {table.name!r}: pooling {table.pooling.value!r} does not fit "
                    f"{type(self).__name__}"
                )
            check_training_data_type(table.data_type, device, table=table.name)
        params = config.fused_params or FusedParams()
        on_cpu = device_type(device) != "cuda"
        module = DenseTableBatchedEmbeddingBagsCodegen(
            [(t.rows, t.cols) for t in config.embedding_tables],
            feature_table_map=config.feature_table_map(),
            weights_precision=data_type_to_sparse_type(config.data_type),
            pooling_mode=PoolingMode.SUM
            if sequence
            else pooling_type_to_pooling_mode(config.pooling),
            use_cpu=on_cpu,
            output_dtype=data_type_to_sparse_type(params.output_dtype),
        )
        self._set_emb_module(module)
        self._output_dtype = params.output_dtype
        offsets = [int(x) for x in module.weights_physical_offsets][: len(config.embedding_tables)]
        shapes = [(t.rows, t.cols) for t in config.embedding_tables]
        self._attach_tables(list(table_slices(module.weights, offsets, shapes)))
        self._offsets = offsets
        self._shapes = shapes
        self._on_cpu = on_cpu
        if init_weights:
            self.init_parameters()

    def autograd_tables(self) -> list[Tensor]:
        """Per table, a ``[rows, dim]`` view of the weight parameter that carries gradients."""
        weights = self._emb_module.weights
        return [
            weights[s : s + r * c].view(r, c)
            for s, (r, c) in zip(self._offsets, self._shapes, strict=True)
        ]

    def _input(self, features: KeyedJaggedTensor) -> TBEInput:
        check_features(features, self._layout)
        return to_tbe_input(features, weighted=self._config.is_weighted)


class BatchedDenseEmbeddingBag(_DenseKernel):
    """Pooled (SUM / MEAN) tables with autograd gradients (``init_weights``: draw the weights
    from the tables' init ranges)."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | str | None = None,
        *,
        init_weights: bool = True,
    ) -> None:
        super().__init__(config, device, sequence=False, init_weights=init_weights)

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        """Pooled ``[batch, sum of dims]`` (FBGEMM's flat layout when batch sizes vary)."""
        args = self._input(features)
        if args.batch_size_per_feature_per_rank is None or not self._on_cpu:
            out: Tensor = self._emb_module(
                args.indices,
                args.offsets,
                args.per_sample_weights,
                batch_size_per_feature_per_rank=args.batch_size_per_feature_per_rank,
            )
            return out
        # FBGEMM's CPU dense TBE ignores per-feature batch sizes: look up in torch.
        return pooled_lookup(
            self.autograd_tables(),
            self._config.feature_table_map(),
            args.indices,
            args.offsets,
            args.per_sample_weights,
            self._config.pooling,
            args.batch_size_per_feature_per_rank,
        ).to(data_type_to_dtype(self._output_dtype))


class BatchedDenseEmbedding(_DenseKernel):
    """Sequence tables (one row per id, one width) with autograd gradients; arguments as
    :class:`BatchedDenseEmbeddingBag`'s."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | str | None = None,
        *,
        init_weights: bool = True,
    ) -> None:
        super().__init__(config, device, sequence=True, init_weights=init_weights)

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        """``[ids, dim]``: one row per id, features in order."""
        args = self._input(features)
        layout = CallLayout.of(
            args.offsets,
            len(self._config.feature_table_map()),
            args.batch_size_per_feature_per_rank,
        )
        rows = sequence_lookup(
            self.autograd_tables(),
            self._config.feature_table_map(),
            args.indices,
            args.offsets,
            layout,
        )
        return rows.to(data_type_to_dtype(self._output_dtype))
