"""embshard-kernels: embshard's wrappers over FBGEMM's table-batched embedding kernels.

The only embshard package that imports ``fbgemm_gpu``; a missing or mismatched FBGEMM raises an
``ImportError`` with the install command.
"""

from __future__ import annotations

from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_kernels.dense import BatchedDenseEmbedding, BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouped_kernels import GroupedKernels
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig
from embshard_kernels.key_value import (
    KeyValueEmbedding,
    KeyValueEmbeddingBag,
    KeyValueFusedOptimizer,
)
from embshard_kernels.quant import QuantBatchedEmbedding, QuantBatchedEmbeddingBag, QuantTableWeight
from embshard_kernels.quantize import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    quantize_embeddings,
)
from embshard_kernels.slices import TableBatchedEmbeddingSlice, TableWeight

__all__ = [
    "FusedParams",
    "ShardedTableConfig",
    "GroupedEmbeddingConfig",
    "TableBatchedEmbeddingSlice",
    "TableWeight",
    "BatchedFusedEmbeddingBag",
    "BatchedFusedEmbedding",
    "BatchedDenseEmbeddingBag",
    "BatchedDenseEmbedding",
    "QuantTableWeight",
    "QuantBatchedEmbeddingBag",
    "QuantBatchedEmbedding",
    "KeyValueFusedOptimizer",
    "KeyValueEmbeddingBag",
    "KeyValueEmbedding",
    "GroupedKernels",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "quantize_embeddings",
]
