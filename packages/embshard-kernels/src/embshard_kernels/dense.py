"""Dense batched kernels: table-batched lookups whose weights get ordinary autograd gradients.

The weights are one ``nn.Parameter``; each ``{table}.weight`` is a view of it whose ``.grad`` is
its region of the gradient. Pooled lookups use FBGEMM's dense TBE except with per-feature batch
sizes on the CPU (which it ignores); sequence lookups always run in torch (FBGEMM's CPU dense
TBE sum-pools them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from embshard_kernels._fbgemm import (
    BoundsCheckMode,
    DenseTableBatchedEmbeddingBagsCodegen,
    PoolingMode,
)
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

_OUTPUT_DTYPES = {0: torch.float32, 1: torch.float16, 5: torch.bfloat16}
_FAKE_REGISTERED: list[bool] = []


def register_dense_lookup_fake() -> None:
    """Give FBGEMM's dense TBE op a fake (shape-only) implementation, once.

    ``torch.export`` and ``torch.compile`` trace with fake tensors; FBGEMM registers none for
    ``fbgemm::dense_embedding_codegen_lookup_function``, so without this the dense kernels cannot
    be exported. The exported graph then calls FBGEMM's own op, which gives the eager outputs.
    """
    if _FAKE_REGISTERED:
        return
    _FAKE_REGISTERED.append(True)

    @torch.library.register_fake("fbgemm::dense_embedding_codegen_lookup_function")
    def _dense_lookup_fake(
        dev_weights: Tensor,
        weights_offsets: Tensor,
        D_offsets: Tensor,
        total_D: int,
        max_D: int,
        hash_size_cumsum: Tensor,
        total_hash_size_bits: int,
        indices: Tensor,
        offsets: Tensor,
        pooling_mode: int,
        indice_weights: Tensor | None,
        feature_requires_grad: Tensor | None,
        output_dtype: int = 0,
        B_offsets: Tensor | None = None,
        vbe_output_offsets_feature_rank: Tensor | None = None,
        vbe_B_offsets_rank_per_feature: Tensor | None = None,
        max_B: int = -1,
        max_B_feature_rank: int = -1,
        vbe_output_size: int = -1,
        mixed_D: bool = True,
    ) -> Tensor:
        dtype = _OUTPUT_DTYPES.get(output_dtype)
        if dtype is None:
            raise ValueError(
                f"dense TBE output dtype code {output_dtype} is not float32, float16 or bfloat16"
            )
        if B_offsets is not None:
            return dev_weights.new_empty(vbe_output_size, dtype=dtype)
        num_features = D_offsets.shape[0] - 1
        batch = (offsets.shape[0] - 1) // num_features
        return dev_weights.new_empty(batch, total_D, dtype=dtype)


def traced_bounds_check(
    rows_per_feature: Tensor, indices: Tensor, offsets: Tensor, weights: Tensor | None
) -> None:
    """In a traced graph (torch.export / torch.compile), fail on an id outside its table.

    Eager calls run ``check_features`` instead, whose data-dependent checks cannot be traced;
    this keeps exported programs from reading out of bounds (FBGEMM's FATAL bounds check).
    """
    warning = torch.zeros(1, dtype=torch.int64, device=indices.device)
    torch.ops.fbgemm.bounds_check_indices(
        rows_per_feature, indices, offsets, BoundsCheckMode.FATAL.value, warning, weights
    )


class _DenseKernel(BaseBatchedEmbedding):
    """The dense kernel's storage and checks; the public classes below differ in lookup."""

    _rows_per_feature: Tensor

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | str | None,
        *,
        sequence: bool,
        init_weights: bool,
    ) -> None:
        super().__init__(config, device)
        register_dense_lookup_fake()
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
        self.register_buffer(
            "_rows_per_feature",
            torch.tensor(
                [config.embedding_tables[t].rows for t in config.feature_table_map()],
                dtype=torch.int64,
                device=self.device,
            ),
            persistent=False,
        )
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
        if not torch.compiler.is_compiling():
            if self.check_inputs:
                check_features(features, self._layout)
            return to_tbe_input(features, weighted=self._config.is_weighted)
        args = to_tbe_input(features, weighted=self._config.is_weighted)
        traced_bounds_check(
            self._rows_per_feature, args.indices, args.offsets, args.per_sample_weights
        )
        return args


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
        if torch.compiler.is_compiling() and torch.is_grad_enabled():
            # FBGEMM's dense op has no autograd that AOTAutograd sees (its backward would be
            # silently dropped): a traced training graph pools in torch instead.
            return self._torch_pooled(features, args)
        if args.batch_size_per_feature_per_rank is None or not self._on_cpu:
            out: Tensor = self._emb_module(
                args.indices,
                args.offsets,
                args.per_sample_weights,
                batch_size_per_feature_per_rank=args.batch_size_per_feature_per_rank,
            )
            return out
        # FBGEMM's CPU dense TBE ignores per-feature batch sizes: look up in torch.
        return self._torch_pooled(features, args)

    def _torch_pooled(self, features: KeyedJaggedTensor, args: TBEInput) -> Tensor:
        return pooled_lookup(
            self.autograd_tables(),
            self._config.feature_table_map(),
            args.indices,
            args.offsets,
            args.per_sample_weights,
            self._config.pooling,
            args.batch_size_per_feature_per_rank,
            layout=_layout(features, args),
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
        layout = _layout(features, args)
        rows = sequence_lookup(
            self.autograd_tables(),
            self._config.feature_table_map(),
            args.indices,
            args.offsets,
            layout,
        )
        return rows.to(data_type_to_dtype(self._output_dtype))


def _layout(features: KeyedJaggedTensor, args: TBEInput) -> CallLayout:
    """The call's layout from the per-key sizes the KeyedJaggedTensor knows (cached after one
    device read), so torch.compile / torch.export trace nothing data-dependent."""
    return CallLayout(
        features.lengths_offset_per_key(),
        features.offset_per_key(),
        args.batch_size_per_feature_per_rank,
    )
