"""The kernels behind a collection: one batched kernel per table group, and the input routing.

Input whose keys are the groups' features in order is split into per-group views, else permuted
once. A missing feature raises before any kernel runs; building consumes no random numbers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embshard_kernels.base import BaseBatchedEmbedding
from embshard_kernels.dense import BatchedDenseEmbedding, BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig, group_tables
from embshard_kernels.key_value import KeyValueEmbedding, KeyValueEmbeddingBag
from embshard_kernels.tbe import Backend
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, PoolingType

_FUSED = (ComputeKernel.FUSED, ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)


def build_kernel(
    config: GroupedEmbeddingConfig,
    device: torch.device | str | None,
    *,
    backend: Backend = "auto",
    init_weights: bool = True,
) -> BaseBatchedEmbedding:
    """The training kernel for one group (fused, dense or key-value; pooled or sequence).

    Raises:
        ValueError: the group's kernel is not a training kernel (``quant``: build it with
            ``QuantBatchedEmbeddingBag.from_float``) or cannot run on ``device``.
    """
    sequence = config.pooling is PoolingType.NONE
    kernel = (
        ComputeKernel.FUSED
        if config.compute_kernel is ComputeKernel.DEFAULT
        else config.compute_kernel
    )
    if kernel in _FUSED:
        cls = BatchedFusedEmbedding if sequence else BatchedFusedEmbeddingBag
        return cls(config, device=device, backend=backend, init_weights=init_weights)
    if kernel is ComputeKernel.DENSE:
        dense = BatchedDenseEmbedding if sequence else BatchedDenseEmbeddingBag
        return dense(config, device, init_weights=init_weights)
    if kernel is ComputeKernel.KEY_VALUE:
        kv = KeyValueEmbedding if sequence else KeyValueEmbeddingBag
        return kv(config, device=device)
    raise ValueError(
        f"tables {config.table_names()}: compute kernel {kernel.value!r} is for inference; train "
        "with 'fused' or 'dense' and quantize the trained kernel with "
        "QuantBatchedEmbeddingBag.from_float / QuantBatchedEmbedding.from_float"
    )


class GroupedKernels:
    """A collection's tables grouped into kernels (see the module docstring).

    ``backend``: the fused kernels' (see ``choose_fused_path``).
    """

    def __init__(self, tables: list[ShardedTableConfig], *, backend: Backend = "auto") -> None:
        self.tables = tables
        self.groups = group_tables(tables)
        self.backend: Backend = backend
        self.kernels: list[BaseBatchedEmbedding] = []
        self.device: torch.device | None = None
        self._feature_table = {f: t.name for t in tables for f in t.feature_names}
        self._order = [f for g in self.groups for f in g.feature_names()]
        self._sizes = [g.num_features() for g in self.groups]
        self._routes: dict[tuple[str, ...], list[int] | None] = {}

    def build(
        self, device: torch.device, values: dict[str, Tensor] | None = None
    ) -> dict[str, Any]:
        """Build the kernels on ``device``; return ``{table: holder module}``.

        ``values``: weights to copy in, by table (``None``: uninitialised, see
        ``init_parameters``).
        """
        with torch.random.fork_rng(devices=[]):
            self.kernels = [
                build_kernel(g, device, backend=self.backend, init_weights=False)
                for g in self.groups
            ]
        self.device = device
        holders = {
            t.name: kernel.table_weight(t.name)
            for kernel, g in zip(self.kernels, self.groups, strict=True)
            for t in g.embedding_tables
        }
        if values is not None:
            with torch.no_grad():
                for name, value in values.items():
                    holders[name].weight.copy_(value)
        return {t.name: holders[t.name] for t in self.tables}

    def feature_order(self) -> list[str]:
        """The features in the order the kernels take (and pool) them, group by group."""
        return list(self._order)

    def drop(self) -> None:
        """Forget the kernels (the collection moved to the meta device)."""
        self.kernels = []
        self.device = None

    def route(self, features: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        """Per kernel, its features as a KeyedJaggedTensor (views when the keys line up)."""
        keys = tuple(features.keys())
        if keys not in self._routes:
            if len(self._routes) >= 64:  # inputs with ever-changing key orders: stay bounded
                self._routes.clear()
            self._routes[keys] = self._plan(list(keys))
        permutation = self._routes[keys]
        if permutation is not None:
            features = features.permute(permutation)
        return features.split(self._sizes)

    def _plan(self, keys: list[str]) -> list[int] | None:
        if keys == self._order:
            return None
        position = {k: i for i, k in enumerate(keys)}
        for feature in self._order:
            if feature not in position:
                raise ValueError(
                    f"feature {feature!r} (table {self._feature_table[feature]!r}) is missing "
                    f"from the input; the input has features {keys}"
                )
        return [position[f] for f in self._order]
