"""The sharding vocabulary every embshard package speaks.

Each member's ``value`` is TorchRec's lower-case string for the same concept; ``parse`` accepts
a member or that string and raises a ``ValueError`` listing the valid choices otherwise.
"""

from __future__ import annotations

from enum import Enum, unique
from typing import Self


class ParsableEnum(Enum):
    """An enum whose members can be parsed from their value with a helpful error."""

    @classmethod
    def parse(cls, value: Self | str, *, what: str = "") -> Self:
        """Return the member for ``value``: a member or its (case-insensitive) string value.

        Args:
            what: where the value came from, for the error message (e.g. "table 't1'").
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            lowered = value.lower()
            for member in cls:
                if member.value == lowered or member.name.lower() == lowered:
                    return member
        valid = ", ".join(repr(m.value) for m in cls)
        where = f" for {what}" if what else ""
        raise ValueError(f"unknown {cls.__name__} {value!r}{where}; expected one of {valid}")

    def __str__(self) -> str:
        return str(self.value)


@unique
class ShardingType(ParsableEnum):
    """How one table is split across ranks."""

    DATA_PARALLEL = "data_parallel"
    """Every rank holds the whole table; gradients are combined across ranks."""
    TABLE_WISE = "table_wise"
    """The whole table lives on one rank."""
    COLUMN_WISE = "column_wise"
    """The embedding dimension is split; each column block is placed like its own table."""
    ROW_WISE = "row_wise"
    """Rows are split into contiguous blocks, one per rank."""
    TABLE_ROW_WISE = "table_row_wise"
    """Row-wise within one node, table-wise across nodes."""
    TABLE_COLUMN_WISE = "table_column_wise"
    """Column-wise within one node, table-wise across nodes."""
    GRID_SHARD = "grid_shard"
    """Column blocks, each of them placed table-row-wise."""


@unique
class ComputeKernel(ParsableEnum):
    """Which kernel looks a table's rows up."""

    DEFAULT = "default"
    DENSE = "dense"
    """Table-batched lookup with autograd gradients (for data-parallel tables)."""
    FUSED = "fused"
    """Table-batched lookup with the optimizer applied inside the backward pass."""
    FUSED_UVM = "fused_uvm"
    """Fused, with the weights in host memory mapped into the GPU (CUDA only)."""
    FUSED_UVM_CACHING = "fused_uvm_caching"
    """Fused, host-memory weights behind a GPU cache of hot rows (CUDA only)."""
    KEY_VALUE = "key_value"
    """Fused, with the table in an SSD-backed key-value store (CUDA only)."""
    QUANT = "quant"
    """Row-wise quantized inference lookup."""


@unique
class EmbeddingEvent(ParsableEnum):
    """Stages of a sharded embedding forward, used to annotate traces."""

    KJT_SPLITS_DIST = "splits_dist"
    KJT_TENSORS_DIST = "tensors_dist"
    LOOKUP = "lookup"
    OUTPUT_DIST = "output_dist"
    OUTPUT_DIST_WAIT = "output_dist_wait"


@unique
class PipelineType(ParsableEnum):
    """Training pipelines a sharded model can run under."""

    NONE = "none"
    TRAIN_BASE = "train_base"
    TRAIN_SPARSE_DIST = "train_sparse_dist"
    TRAIN_PREFETCH_SPARSE_DIST = "train_prefetch_sparse_dist"


@unique
class ParameterStorage(ParsableEnum):
    """Physical memory a planner can place parameters in."""

    HBM = "hbm"
    """Accelerator memory."""
    DDR = "ddr"
    """Host memory."""


@unique
class CommOp(ParsableEnum):
    """Collectives whose payload may be compressed by a quantized comm codec."""

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"


@unique
class ObjectPoolShardingType(ParsableEnum):
    """How an object pool (a keyed store of tensors) is sharded."""

    ROW_WISE = "row_wise"
    REPLICATED_ROW_WISE = "replicated_row_wise"


@unique
class PoolingType(ParsableEnum):
    """How the rows of one bag are combined."""

    SUM = "sum"
    MEAN = "mean"
    NONE = "none"
    """No pooling: one row per id (sequence embeddings)."""


@unique
class DataType(ParsableEnum):
    """Storage type of a table's weights."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"

    @property
    def bits(self) -> int:
        """Bits per stored element."""
        return _BITS[self]

    @property
    def is_quantized(self) -> bool:
        """Whether the type is an integer (row-wise quantized) type."""
        return self in (DataType.INT8, DataType.INT4, DataType.INT2)


_BITS = {
    DataType.FP32: 32,
    DataType.FP16: 16,
    DataType.BF16: 16,
    DataType.INT8: 8,
    DataType.INT4: 4,
    DataType.INT2: 2,
}
