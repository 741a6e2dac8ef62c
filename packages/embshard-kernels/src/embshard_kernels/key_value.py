"""Key-value kernels: tables in FBGEMM's SSD-backed store behind a device cache (CUDA only).

``KeyValueEmbeddingBag`` / ``KeyValueEmbedding`` wrap ``SSDTableBatchedEmbeddingBags`` (row-wise
Adagrad in the backward). Elsewhere than CUDA construction raises, saying what to use instead; as
in TorchRec the weights are not in the state dict and the optimizer exposes only the learning rate.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from embshard_kernels._fbgemm import EmbeddingLocation
from embshard_kernels.base import BaseBatchedEmbedding
from embshard_kernels.fbgemm_mapping import (
    data_type_to_sparse_type,
    device_type,
    optimizer_kwargs,
    pooling_type_to_pooling_mode,
)
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_kernels.inputs import check_features, to_tbe_input
from embshard_optim.fused import FusedOptimizer
from embshard_optim.specs import OptimType
from embshard_types.kernel_params import KeyValueParams
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import PoolingType

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_ASSOCIATIVITY = 32  # rows per cache set in FBGEMM's SSD TBE


def check_key_value_device(device: torch.device | str | None, tables: list[str]) -> None:
    """Raise ``ValueError`` unless ``device`` is a CUDA device."""
    if device_type(device) != "cuda":
        raise ValueError(
            f"compute kernel 'key_value' (tables {tables}) uses FBGEMM's SSD TBE, which runs "
            f"only on CUDA, not on {device_type(device)}; on the CPU use compute kernel 'fused' "
            "(weights in host memory, any optimizer) or 'dense'"
        )


class KeyValueFusedOptimizer(FusedOptimizer):
    """The learning rate of a key-value kernel (its state stays in the store)."""

    def __init__(self, set_learning_rate: Callable[[float], None], learning_rate: float) -> None:
        self._set_learning_rate = set_learning_rate
        super().__init__({}, {}, [{"params": [], "lr": learning_rate}])

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self._set_learning_rate(float(self.param_groups[0]["lr"]))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._set_learning_rate(float(self.param_groups[0]["lr"]))


class _KeyValueKernel(BaseBatchedEmbedding):
    _SEQUENCE: ClassVar[bool] = False

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        *,
        key_value_params: KeyValueParams | None = None,
    ) -> None:
        check_key_value_device(device, config.table_names())
        super().__init__(config, device)
        from fbgemm_gpu.tbe.ssd import SSDTableBatchedEmbeddingBags

        if (config.pooling is PoolingType.NONE) != self._SEQUENCE:
            raise ValueError(
                f"tables {config.table_names()}: pooling {config.pooling.value!r} does not fit "
                f"{type(self).__name__}"
            )
        params = config.fused_params or FusedParams()
        spec = params.optimizer
        if spec.optim_type is not OptimType.ROWWISE_ADAGRAD:
            raise ValueError(
                f"tables {config.table_names()}: FBGEMM's SSD TBE trains with ROWWISE_ADAGRAD "
                f"only, got {spec.optim_type.name}; use compute kernel 'fused' for other optimizers"
            )
        kv = key_value_params or KeyValueParams()
        load_factor = (params.cache_params.load_factor if params.cache_params else None) or 0.2
        rows = sum(t.rows for t in config.embedding_tables)
        tables = config.embedding_tables
        kwargs: dict[str, Any] = {
            "ssd_storage_directory": kv.ssd_storage_directory or tempfile.mkdtemp(),
            "ssd_uniform_init_lower": sum(t.weight_init_min for t in tables) / len(tables),
            "ssd_uniform_init_upper": sum(t.weight_init_max for t in tables) / len(tables),
        }
        if kv.ssd_rocksdb_shards is not None:
            kwargs["ssd_rocksdb_shards"] = kv.ssd_rocksdb_shards
        if kv.l2_cache_size is not None:
            kwargs["l2_cache_size"] = kv.l2_cache_size
        self._set_emb_module(
            SSDTableBatchedEmbeddingBags(
                embedding_specs=[(t.rows, t.cols) for t in tables],
                feature_table_map=config.feature_table_map(),
                cache_sets=max(1, int(load_factor * rows / _ASSOCIATIVITY)),
                ssd_cache_location=EmbeddingLocation.DEVICE,
                pooling_mode=pooling_type_to_pooling_mode(config.pooling),
                weights_precision=data_type_to_sparse_type(config.data_type),
                output_dtype=data_type_to_sparse_type(params.output_dtype),
                **{k: v for k, v in optimizer_kwargs(spec).items() if k != "optimizer"},
                **kwargs,
            ).to(self.device)
        )
        self._optim = KeyValueFusedOptimizer(self._emb_module.set_learning_rate, spec.learning_rate)

    @property
    def fused_optimizer(self) -> KeyValueFusedOptimizer:
        return self._optim

    def split_embedding_weights(self) -> list[Tensor]:
        """The store's weights are not materialised: FBGEMM's own accessors per table."""
        return list(self._emb_module.split_embedding_weights())

    def init_parameters(self, generator: torch.Generator | None = None) -> None:
        """The store initialises rows on first use (uniform in the tables' mean init range)."""

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        check_features(features, self._layout)
        args = to_tbe_input(features, weighted=self._config.is_weighted)
        out: Tensor = self._emb_module(args.indices, args.offsets, args.per_sample_weights)
        return out

    def purge(self) -> None:
        """Drop cached rows (after the store was written behind the cache)."""
        self._emb_module.lxu_cache_weights.zero_()
        self._emb_module.lxu_cache_state.fill_(-1)


class KeyValueEmbeddingBag(_KeyValueKernel):
    """Pooled tables in FBGEMM's SSD key-value store (CUDA only).

    Args:
        config: compute kernel ``key_value``, ROWWISE_ADAGRAD.
        key_value_params: store options (directory, RocksDB shards, L2 cache size).

    Raises:
        ValueError: not on CUDA (use compute kernel ``fused``), or an optimizer other than
            ROWWISE_ADAGRAD.
    """

    _SEQUENCE = False


class KeyValueEmbedding(_KeyValueKernel):
    """Sequence tables in FBGEMM's SSD key-value store (CUDA only).

    Args: as :class:`KeyValueEmbeddingBag`, for tables with pooling NONE.
    """

    _SEQUENCE = True
