"""Quantized inference kernels: row-wise INT8 / INT4 / INT2 (and FP16 / FP32) tables.

``QuantBatchedEmbeddingBag`` / ``QuantBatchedEmbedding`` wrap FBGEMM's IntNBit TBE, built from a
trained float kernel by ``from_float`` (FBGEMM's quantizer); each element is within half a
quantization step (plus fp16 rounding) of its float value, recorded in ``quantization_error``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Self

import torch
from torch import Tensor, nn

from embshard_kernels._fbgemm import (
    EmbeddingLocation,
    IntNBitTableBatchedEmbeddingBagsCodegen,
    SparseType,
    rounded_row_size_in_bytes,
)
from embshard_kernels.base import BaseBatchedEmbedding
from embshard_kernels.dense import traced_bounds_check
from embshard_kernels.fbgemm_mapping import (
    bounds_check_to_fbgemm,
    check_kernel_available,
    data_type_to_sparse_type,
    pooling_type_to_pooling_mode,
)
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_kernels.inputs import check_features, to_tbe_input
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, DataType, PoolingType

QUANT_TYPES = (DataType.INT8, DataType.INT4, DataType.INT2, DataType.FP16, DataType.FP32)


class QuantTableWeight(nn.Module):
    """One quantized table: packed rows in ``weight``, fp16 scale/bias in ``weight_qscaleshift``."""

    weight: Tensor
    weight_qscaleshift: Tensor | None

    def __init__(self, weight: Tensor, qscaleshift: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_qscaleshift", qscaleshift)


class _QuantKernel(BaseBatchedEmbedding):
    _SEQUENCE = False

    def __init__(
        self, config: GroupedEmbeddingConfig, device: torch.device | str | None = None
    ) -> None:
        super().__init__(config, device)
        for table in config.embedding_tables:
            where = f"table {table.name!r}"
            kernel = check_kernel_available(table.compute_kernel, device, table=table.name)
            if kernel is not ComputeKernel.QUANT:
                raise ValueError(f"{where}: compute kernel {kernel.value!r} is not 'quant'")
            if table.data_type not in QUANT_TYPES:
                raise ValueError(
                    f"{where}: data type {table.data_type.value!r} cannot be served by the "
                    f"quantized kernel; use one of {[d.value for d in QUANT_TYPES]}"
                )
            if table.data_type.is_quantized and (table.cols * table.data_type.bits) % 16:
                raise ValueError(
                    f"{where}: {table.cols} columns of {table.data_type.value} pack into an odd "
                    f"number of bytes, which FBGEMM's quantizer refuses; use a width that is a "
                    f"multiple of {16 // table.data_type.bits}"
                )
            if (table.pooling is PoolingType.NONE) != self._SEQUENCE:
                raise ValueError(
                    f"{where}: pooling {table.pooling.value!r} does not fit {type(self).__name__}"
                )
        params = config.fused_params or FusedParams()
        module = IntNBitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (
                    t.name,
                    t.rows,
                    t.cols,
                    data_type_to_sparse_type(t.data_type),
                    EmbeddingLocation.HOST
                    if self.device.type != "cuda"
                    else EmbeddingLocation.DEVICE,
                )
                for t in config.embedding_tables
            ],
            feature_table_map=config.feature_table_map(),
            pooling_mode=pooling_type_to_pooling_mode(config.pooling),
            device=self.device,
            output_dtype=data_type_to_sparse_type(params.output_dtype),
            indices_dtype=torch.int64,
            # embshard checks ids before every eager lookup; the traced one checks its own
            bounds_check_mode=bounds_check_to_fbgemm(params.bounds_check_mode),
        )
        module.initialize_weights()
        self._set_emb_module(module)
        for table, (weight, qscaleshift) in zip(
            config.embedding_tables,
            module.split_embedding_weights(split_scale_shifts=True),
            strict=True,
        ):
            self.add_module(table.name, QuantTableWeight(weight, qscaleshift))
        self.quantization_error: dict[str, float] = {}

    def split_embedding_weights(self) -> list[Tensor]:
        """Per table, its packed uint8 rows (live views)."""
        return [self.table_weight(t.name).weight for t in self._config.embedding_tables]

    def table_weight(self, name: str) -> QuantTableWeight:  # type: ignore[override]
        module = self._modules.get(name)
        if not isinstance(module, QuantTableWeight):
            raise KeyError(f"no table {name!r}; the tables are {self._config.table_names()}")
        return module

    def init_parameters(self, generator: torch.Generator | None = None) -> None:
        """Quantized tables are not trained: fill them with ``load_float_weights``."""
        raise TypeError(
            f"{type(self).__name__} holds quantized inference tables; fill them from trained "
            "float weights with load_float_weights() or build it with from_float()"
        )

    def load_float_weights(self, weights: Sequence[Tensor]) -> dict[str, float]:
        """Quantize float ``[rows, cols]`` weights (one per table, config order) into the kernel.

        Returns:
            Per table, the largest absolute error of the dequantized weights (also kept in
            ``quantization_error``).

        Raises:
            ValueError: the number or shape of the weights does not match the tables.
        """
        tables = self._config.embedding_tables
        if len(weights) != len(tables):
            raise ValueError(
                f"got {len(weights)} weights for the {len(tables)} tables {self._config.table_names()}"
            )
        for table, weight in zip(tables, weights, strict=True):
            if tuple(weight.shape) != (table.rows, table.cols):
                raise ValueError(
                    f"table {table.name!r}: float weight {list(weight.shape)} does not match "
                    f"[{table.rows}, {table.cols}]"
                )
        errors = {}
        with torch.no_grad():
            for table, weight in zip(tables, weights, strict=True):
                holder = self.table_weight(table.name)
                _quantize_into(weight.detach().float(), table.data_type, holder)
                restored = self._dequantize(table.name)
                errors[table.name] = (
                    float((restored - weight.float().to(restored.device)).abs().max())
                    if weight.numel()
                    else 0.0
                )
        self.quantization_error = errors
        return dict(errors)

    def load_packed(self, name: str, packed: Tensor, scale_shift: Tensor | None) -> None:
        """Copy already quantized rows (see :func:`quantize_rows`) into table ``name``.

        Raises:
            KeyError: no such table.
            ValueError: shapes that do not match the table's packed rows.
        """
        holder = self.table_weight(name)
        expected = tuple(holder.weight.shape)
        if tuple(packed.shape) != expected or packed.dtype != torch.uint8:
            raise ValueError(
                f"table {name!r}: packed rows {list(packed.shape)} of {packed.dtype} do not match "
                f"the table's {list(expected)} of torch.uint8; quantize with the same data type"
            )
        held = holder.weight_qscaleshift
        if (held is None) != (scale_shift is None) or (
            held is not None
            and scale_shift is not None
            and tuple(scale_shift.shape) != tuple(held.shape)
        ):
            raise ValueError(
                f"table {name!r}: the scale/bias given "
                f"({None if scale_shift is None else list(scale_shift.shape)}) does not match "
                f"the table's ({None if held is None else list(held.shape)})"
            )
        with torch.no_grad():
            holder.weight.copy_(packed)
            if held is not None and scale_shift is not None:
                held.copy_(scale_shift)

    def _dequantize(self, name: str) -> Tensor:
        table = next(t for t in self._config.embedding_tables if t.name == name)
        holder = self.table_weight(name)
        if not table.data_type.is_quantized:
            return holder.weight.view(
                torch.float16 if table.data_type is DataType.FP16 else torch.float32
            ).float()
        assert holder.weight_qscaleshift is not None  # quantized tables have one
        fused = torch.cat([holder.weight, holder.weight_qscaleshift], dim=1)
        restored: Tensor = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(
            fused, table.data_type.bits
        )
        return restored[:, : table.cols]

    def full_rows(self) -> list[Tensor]:
        """Per table, its rows as the kernel stores them, ``[rows, stored_row_bytes]`` uint8
        (scale and bias, packed values, padding): live views. :func:`pool_packed_rows` pools
        rows in this form exactly as this kernel does."""
        return [rows for rows, _, _ in self._emb_module.split_embedding_weights_with_scale_bias(0)]

    def dequantized_weights(self) -> list[Tensor]:
        """Per table, its weights as float32 (copies), for inspection and error reports."""
        return [self._dequantize(t.name) for t in self._config.embedding_tables]

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        """Pooled ``[batch, sum of dims]`` or sequence ``[ids, dim]`` lookups."""
        if not torch.compiler.is_compiling():
            check_features(features, self._layout)
            args = to_tbe_input(features, weighted=self._config.is_weighted)
            out: Tensor = self._emb_module(args.indices, args.offsets, args.per_sample_weights)
            return out
        args = to_tbe_input(features, weighted=self._config.is_weighted)
        return _traced_lookup(self._emb_module, args.indices, args.offsets, args.per_sample_weights)

    @classmethod
    def from_float(
        cls, module: BaseBatchedEmbedding, data_type: DataType | str = DataType.INT8
    ) -> Self:
        """Quantize a trained float kernel (fused or dense) of the same tables.

        ``data_type``: ``int8``, ``int4``, ``int2``, ``fp16`` or ``fp32``.
        """
        quant = cls(quant_config(module.config, data_type), module.device)
        quant.load_float_weights(module.split_embedding_weights())
        return quant


def _traced_lookup(
    tbe: IntNBitTableBatchedEmbeddingBagsCodegen,
    indices: Tensor,
    offsets: Tensor,
    weights: Tensor | None,
) -> Tensor:
    """FBGEMM's IntNBit forward as a traceable graph: a FATAL bounds check, then the lookup op.

    The module's own forward pops a cache queue (a TorchScript object dynamo cannot trace);
    embshard's quantized tables are never cached or pruned, so that step is empty here.
    """
    traced_bounds_check(tbe.rows_per_table, indices, offsets, weights)
    lookup: Tensor = torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
        dev_weights=tbe.weights_host if tbe.host_size > 0 else tbe.weights_dev,
        uvm_weights=tbe.weights_uvm,
        weights_placements=tbe.weights_placements,
        weights_offsets=tbe.weights_offsets,
        weights_tys=tbe.weights_tys,
        D_offsets=tbe.D_offsets,
        total_D=tbe.total_D,
        max_int2_D=tbe.max_int2_D,
        max_int4_D=tbe.max_int4_D,
        max_int8_D=tbe.max_int8_D,
        max_float16_D=tbe.max_float16_D,
        max_float32_D=tbe.max_float32_D,
        indices=indices,
        offsets=offsets,
        pooling_mode=int(tbe.pooling_mode),
        indice_weights=weights,
        output_dtype=tbe.output_dtype,
        lxu_cache_weights=tbe.lxu_cache_weights,
        lxu_cache_locations=indices.new_empty(0, dtype=torch.int32),
        row_alignment=tbe.row_alignment,
        max_float8_D=tbe.max_float8_D,
        fp8_exponent_bits=tbe.fp8_exponent_bits,
        fp8_exponent_bias=tbe.fp8_exponent_bias,
    )
    return lookup


def _row_alignment(device: torch.device) -> int:
    return 1 if device.type == "cpu" else 16  # FBGEMM's default for its IntNBit kernel


def stored_row_bytes(dim: int, data_type: DataType | str, device: torch.device | str) -> int:
    """Bytes of one row of ``dim`` values of ``data_type`` as the quantized kernel stores it."""
    dt = DataType.parse(data_type, what="quantized data type")
    return int(
        rounded_row_size_in_bytes(
            dim, data_type_to_sparse_type(dt), _row_alignment(torch.device(device))
        )
    )


def pool_packed_rows(
    rows: Tensor,
    starts: Sequence[int],
    dims: Sequence[int],
    data_type: DataType | str,
    indices: Tensor,
    offsets: Tensor,
    pooling: PoolingType,
    weights: Tensor | None = None,
) -> Tensor:
    """Pool bags over stored rows (see :meth:`_QuantKernel.full_rows`) with FBGEMM's kernel.

    Args:
        rows: flat uint8, one block of stored rows per table, starting at ``starts``.
        dims: per table, its embedding dimension (all tables of ``data_type``).
        indices / offsets: as a TBE takes them (row numbers within each table's block;
            ``tables x batch`` bags).
        pooling: ``sum`` or ``mean``.

    Returns:
        ``[batch, sum of dims]`` float32: what the kernel holding those rows would return.
    """
    ty = data_type_to_sparse_type(DataType.parse(data_type, what="quantized data type"))
    device = rows.device
    location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
    count = len(dims)
    dim_offsets = [0]
    for d in dims:
        dim_offsets.append(dim_offsets[-1] + d)

    def widest(kind: SparseType) -> int:
        return max(dims) if ty.value == kind.value and dims else 0

    pooled: Tensor = torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
        dev_weights=rows,  # host rows on the CPU, device rows on CUDA
        uvm_weights=rows.new_empty(0),
        weights_placements=torch.full((count,), location.value, dtype=torch.int32, device=device),
        weights_offsets=torch.tensor(list(starts), dtype=torch.int64, device=device),
        weights_tys=torch.full((count,), ty.as_int(), dtype=torch.uint8, device=device),
        D_offsets=torch.tensor(dim_offsets, dtype=torch.int32, device=device),
        total_D=dim_offsets[-1],
        max_int2_D=widest(SparseType.INT2),
        max_int4_D=widest(SparseType.INT4),
        max_int8_D=widest(SparseType.INT8),
        max_float16_D=widest(SparseType.FP16),
        max_float32_D=widest(SparseType.FP32),
        indices=indices.long(),
        offsets=offsets.long(),
        pooling_mode=int(pooling_type_to_pooling_mode(pooling)),
        indice_weights=weights,
        output_dtype=SparseType.FP32.as_int(),
        lxu_cache_weights=rows.new_empty(0, 0),
        lxu_cache_locations=indices.new_empty(0, dtype=torch.int32),
        row_alignment=_row_alignment(device),
        max_float8_D=0,
        fp8_exponent_bits=-1,
        fp8_exponent_bias=-1,
    )
    return pooled


def quant_config(
    config: GroupedEmbeddingConfig, data_type: DataType | str
) -> GroupedEmbeddingConfig:
    """``config``'s tables on the quantized kernel with ``data_type``."""
    dt = DataType.parse(data_type, what="quantized data type")
    tables = tuple(
        replace(t, data_type=dt, compute_kernel=ComputeKernel.QUANT)
        for t in config.embedding_tables
    )
    return replace(
        config, data_type=dt, compute_kernel=ComputeKernel.QUANT, embedding_tables=tables
    )


def quantize_rows(weight: Tensor, data_type: DataType | str) -> tuple[Tensor, Tensor | None]:
    """Float ``[rows, cols]`` weights as FBGEMM's quantized kernel stores them.

    Returns:
        ``(packed, scale_shift)``: the packed uint8 rows and, for INT8 / INT4 / INT2, each
        row's fp16 scale and bias as ``[rows, 4]`` uint8 (``None`` for FP16 / FP32, whose rows
        are the values' bytes).

    Raises:
        ValueError: a data type the quantized kernel does not serve, or a width that packs into
            an odd number of bytes.
    """
    dt = DataType.parse(data_type, what="quantized data type")
    if dt not in QUANT_TYPES:
        raise ValueError(
            f"{dt.value!r} is not a quantized table type; use one of {[d.value for d in QUANT_TYPES]}"
        )
    cols = weight.shape[1]
    if dt.is_quantized and (cols * dt.bits) % 16:
        raise ValueError(
            f"{cols} columns of {dt.value} pack into an odd number of bytes, which FBGEMM's "
            f"quantizer refuses; use a width that is a multiple of {16 // dt.bits}"
        )
    weight = weight.detach().float()
    if not dt.is_quantized:
        dtype = torch.float16 if dt is DataType.FP16 else torch.float32
        return weight.to(dtype).contiguous().view(torch.uint8), None
    packed = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(weight, dt.bits)
    return packed[:, :-4].contiguous(), packed[:, -4:].contiguous()


def _quantize_into(weight: Tensor, data_type: DataType, holder: QuantTableWeight) -> None:
    packed, scale_shift = quantize_rows(weight, data_type)
    holder.weight.copy_(packed.view(holder.weight.shape))
    if scale_shift is not None:
        assert holder.weight_qscaleshift is not None
        holder.weight_qscaleshift.copy_(scale_shift)


class QuantBatchedEmbeddingBag(_QuantKernel):
    """Pooled (SUM / MEAN) quantized inference tables.

    ``config``: compute kernel ``quant``; ``device`` ``None`` is the CPU.
    """

    _SEQUENCE = False


class QuantBatchedEmbedding(_QuantKernel):
    """Sequence (one row per id) quantized inference tables.

    Args: as :class:`QuantBatchedEmbeddingBag`, for tables with pooling NONE.
    """

    _SEQUENCE = True
