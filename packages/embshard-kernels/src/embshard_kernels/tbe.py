""" "Anything that looks like a fused TBE", and FBGEMM's training TBE behind that face.

``FusedTBE`` is the protocol the fused kernels compose: a module called with
``(indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)`` that applies its
optimizer inside the backward, and exposes its weights, optimizer state and learning rate.
:class:`FbgemmFusedTBE` wraps ``SplitTableBatchedEmbeddingBagsCodegen``;
``embshard_kernels.torch_fused.TorchFusedTBE`` implements the same protocol in plain torch for
optimizers FBGEMM cannot run on a device, and for RowWiseAdagrad on pooled CPU tables, where its
fast path (``embshard_kernels.fast_pooled``) beats FBGEMM's CPU backward.
:func:`build_fused_tbe` picks one.

Guarantees: optimizer state comes back keyed by embshard's names (``spec.state_names()``,
e.g. ``momentum1``), whatever FBGEMM calls it; the weight buffer returned by
:meth:`FusedTBE.weight_buffer` is the kernel's own storage (slices of it are live weights).
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from embshard_kernels._fbgemm import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from embshard_kernels.fast_pooled import fast_path_refusal
from embshard_kernels.fbgemm_mapping import (
    bounds_check_to_fbgemm,
    cache_algorithm_to_fbgemm,
    data_type_to_sparse_type,
    embedding_location,
    fbgemm_refusal,
    optimizer_kwargs,
    pooling_type_to_pooling_mode,
)
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_optim.specs import OptimizerSpec, OptimType

Backend = Literal["auto", "fbgemm", "torch"]

FASTER_THAN_FBGEMM = (OptimType.ROWWISE_ADAGRAD,)
"""Optimizers whose plain-torch fast path ``"auto"`` prefers to FBGEMM on the CPU.

Measured with one thread, contenders interleaved in one run: on benchmark K1 (4 x 100k x 64,
batch 2,048, 20 ids per bag) a RowWiseAdagrad step takes about half of FBGEMM's CPU TBE time; on
a W2-like group (26 tables up to 200k x 128, power-law ids) about as long or less. SGD is not
listed: FBGEMM's CPU SGD backward is fast already (on K1 the fast path's SGD step is ~1.5x
longer than FBGEMM's).
"""


@runtime_checkable
class FusedTBE(Protocol):
    """A table-batched embedding module whose backward applies its optimizer."""

    def __call__(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
    ) -> Tensor:
        """Pooled ``[batch, sum of dims]`` (flat when batch sizes vary) or ``[ids, dim]`` rows."""
        ...

    def split_embedding_weights(self) -> list[Tensor]:
        """Per table, its ``[rows, dim]`` weights (views of the kernel's storage)."""
        ...

    def get_optimizer_state(self) -> list[dict[str, Tensor]]:
        """Per table, its optimizer state keyed by ``spec.state_names()`` (live tensors)."""
        ...

    def set_learning_rate(self, lr: float) -> None: ...

    def get_learning_rate(self) -> float: ...

    def flush(self) -> None:
        """Write cached rows back to their backing storage."""
        ...

    def reset_cache_states(self) -> None:
        """Drop cached rows (after weights were loaded behind the cache's back)."""
        ...

    def weight_buffer(self) -> tuple[Tensor, list[int]]:
        """The flat weight storage and where each table starts in it."""
        ...

    def set_optimizer_step(self, step: int) -> None:
        """Set the step counter (Adam / LAMB bias correction)."""
        ...


class FbgemmFusedTBE(nn.Module):
    """FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` seen as a :class:`FusedTBE`.

    Args:
        config: the tables (widths must be multiples of 4).
        spec: the optimizer.
        params: output dtype, bounds-check mode and cache options.
        device: where the kernel runs (``None``: the CPU).
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        spec: OptimizerSpec,
        params: FusedParams,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else torch.device("cpu")
        compute = ComputeDevice.CUDA if dev.type == "cuda" else ComputeDevice.CPU
        location = embedding_location(config.compute_kernel, dev)
        specs = [(t.rows, t.cols, location, compute) for t in config.embedding_tables]
        extra: dict[str, object] = {}
        cache = params.cache_params
        if cache is not None and location is EmbeddingLocation.MANAGED_CACHING:
            if cache.load_factor is not None:
                extra["cache_load_factor"] = cache.load_factor
            if cache.algorithm is not None:
                extra["cache_algorithm"] = cache_algorithm_to_fbgemm(cache.algorithm)
            if cache.reserved_memory is not None:
                extra["cache_reserved_memory"] = cache.reserved_memory
            if cache.precision is not None:
                extra["cache_precision"] = data_type_to_sparse_type(cache.precision)
            if cache.prefetch_pipeline is not None:
                extra["prefetch_pipeline"] = cache.prefetch_pipeline
        extra.setdefault("cache_precision", data_type_to_sparse_type(config.data_type))
        self.module = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=specs,
            feature_table_map=config.feature_table_map(),
            pooling_mode=pooling_type_to_pooling_mode(config.pooling),
            weights_precision=data_type_to_sparse_type(config.data_type),
            output_dtype=data_type_to_sparse_type(params.output_dtype),
            bounds_check_mode=bounds_check_to_fbgemm(params.bounds_check_mode),
            device=dev,
            table_names=config.table_names(),
            **optimizer_kwargs(spec),
            **extra,
        )
        self._state_names = spec.state_names()
        self._location = location

    def forward(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
    ) -> Tensor:
        return self.module(
            indices,
            offsets,
            per_sample_weights=per_sample_weights,
            batch_size_per_feature_per_rank=batch_size_per_feature_per_rank,
        )

    def split_embedding_weights(self) -> list[Tensor]:
        return list(self.module.split_embedding_weights())

    def get_optimizer_state(self) -> list[dict[str, Tensor]]:
        per_table = self.module.get_optimizer_state()
        if not per_table:
            return [{} for _ in self.module.embedding_specs]
        return [dict(zip(self._state_names, states.values(), strict=True)) for states in per_table]

    def set_learning_rate(self, lr: float) -> None:
        self.module.set_learning_rate(lr)

    def get_learning_rate(self) -> float:
        return float(self.module.get_learning_rate())

    def flush(self) -> None:
        self.module.flush()

    def reset_cache_states(self) -> None:
        self.module.reset_cache_states()

    def set_optimizer_step(self, step: int) -> None:
        self.module.set_optimizer_step(step)

    def weight_buffer(self) -> tuple[Tensor, list[int]]:
        buffers = {
            EmbeddingLocation.HOST: "weights_host",
            EmbeddingLocation.DEVICE: "weights_dev",
        }
        buffer = getattr(self.module, buffers.get(self._location, "weights_uvm"))
        return buffer, [int(x) for x in self.module.weights_physical_offsets]


def build_fused_tbe(
    config: GroupedEmbeddingConfig,
    params: FusedParams,
    device: torch.device | str | None = None,
    *,
    backend: Backend = "auto",
) -> FusedTBE:
    """The fused TBE for ``config``: FBGEMM's or embshard's plain-torch one.

    ``"auto"`` takes the torch TBE where FBGEMM cannot run ``params.optimizer`` faithfully on
    ``device``, and where the torch TBE's fast path serves the group with an optimizer in
    :data:`FASTER_THAN_FBGEMM` (pooled fp32 tables on the CPU); FBGEMM's elsewhere.

    Args:
        config: the tables.
        params: optimizer and kernel options.
        device: where the kernel runs.
        backend: ``"auto"``, or force ``"fbgemm"`` / ``"torch"``.

    Raises:
        ValueError: ``backend="fbgemm"`` with an optimizer FBGEMM cannot run on ``device``.
    """
    from embshard_kernels.torch_fused import TorchFusedTBE

    spec = params.optimizer
    refusal = fbgemm_refusal(spec, device)
    if backend == "fbgemm" and refusal is not None:
        raise ValueError(
            f"backend='fbgemm' cannot serve tables {config.table_names()}: {refusal}; "
            "use backend='auto' (embshard's sparse update rules run it)"
        )
    faster = spec.optim_type in FASTER_THAN_FBGEMM and (
        fast_path_refusal(config, spec, device) is None
    )
    if backend == "torch" or (backend == "auto" and (refusal is not None or faster)):
        return TorchFusedTBE(config, params, device)
    return FbgemmFusedTBE(config, spec, params, device)
