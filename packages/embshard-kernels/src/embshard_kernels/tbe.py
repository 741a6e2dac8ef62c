"""The fused TBE protocol, FBGEMM's training TBE behind it, and the choice of fused path.

``FusedTBE`` is what the fused kernels compose: a lookup whose backward applies the optimizer.
:class:`FbgemmFusedTBE` wraps ``SplitTableBatchedEmbeddingBagsCodegen``; ``TorchFusedTBE`` is
the plain-torch one. :func:`choose_fused_path` picks the path, :func:`build_fused_tbe` builds it.
Optimizer state comes back keyed by ``spec.state_names()``, whatever FBGEMM calls it.
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
from embshard_kernels.path_probe import (
    FusedPath,
    ProbeResult,
    TrainingTBE,
    fused_path_override,
    probe_fused_path,
)
from embshard_optim.specs import OptimizerSpec, OptimType

Backend = Literal["auto", "fbgemm", "torch"]

__all__ = [
    "Backend",
    "FbgemmFusedTBE",
    "FusedPath",
    "FusedTBE",
    "build_cpu_tbe",
    "build_fused_tbe",
    "choose_fused_path",
    "measured_fused_path",
]


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

    ``config``'s widths must be multiples of 4; ``device`` ``None`` is the CPU.
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


def choose_fused_path(
    config: GroupedEmbeddingConfig,
    spec: OptimizerSpec,
    device: torch.device | str | None,
    backend: Backend = "auto",
) -> FusedPath:
    """The path that runs ``spec`` for ``config`` on ``device``.

    Correctness first: a forced ``backend`` is obeyed (callers force ``"torch"`` for the hooks
    only ``TorchFusedTBE`` has), and ``"auto"`` never picks FBGEMM where it cannot run ``spec``
    faithfully. Only where both FBGEMM and the fast pooled path serve the group is speed the
    rule: ``EMBSHARD_FUSED_PATH`` (``fbgemm`` / ``torch``) decides if set, else the faster on
    this machine (:func:`~embshard_kernels.path_probe.probe_fused_path`, once per process).

    Raises:
        ValueError: ``backend="fbgemm"`` with an optimizer FBGEMM cannot run on ``device``, or
            ``EMBSHARD_FUSED_PATH`` set to an unknown value.
    """
    fbgemm_cannot = fbgemm_refusal(spec, device)
    fast_fits = fast_path_refusal(config, spec, device) is None
    torch_path = FusedPath.TORCH_FAST if fast_fits else FusedPath.TORCH
    if backend == "fbgemm" and fbgemm_cannot is not None:  # forced, but FBGEMM cannot
        raise ValueError(
            f"backend='fbgemm' cannot serve tables {config.table_names()}: {fbgemm_cannot}; "
            "use backend='auto' (embshard's sparse update rules run it)"
        )
    if backend == "fbgemm":  # forced
        return FusedPath.FBGEMM
    if backend == "torch":  # forced: the fast path wherever it fits
        return torch_path
    if fbgemm_cannot is not None:  # FBGEMM cannot run the optimizer faithfully here
        return torch_path
    if not fast_fits:  # FBGEMM serves it; the general torch path would only be slower
        return FusedPath.FBGEMM
    override = fused_path_override()
    if override is not None:  # both fit: the user's choice
        return override
    return measured_fused_path(spec.optim_type).chosen  # both fit: the faster here


def measured_fused_path(optim_type: OptimType) -> ProbeResult:
    """This process's measurement of FBGEMM against the fast pooled path for ``optim_type``
    (SGD or RowWiseAdagrad), taken on the first call and cached."""
    return probe_fused_path(optim_type, build_cpu_tbe)


def build_cpu_tbe(
    config: GroupedEmbeddingConfig, params: FusedParams, path: FusedPath
) -> TrainingTBE:
    """The CPU TBE of ``path`` for ``config``, built as the probe times it."""
    from embshard_kernels.torch_fused import TorchFusedTBE

    if path is FusedPath.FBGEMM:
        return FbgemmFusedTBE(config, params.optimizer, params)
    return TorchFusedTBE(config, params, fast=path is FusedPath.TORCH_FAST)


def build_fused_tbe(
    config: GroupedEmbeddingConfig,
    params: FusedParams,
    device: torch.device | str | None = None,
    *,
    backend: Backend = "auto",
) -> FusedTBE:
    """The fused TBE of :func:`choose_fused_path` for ``config``.

    Args:
        backend: ``"auto"``, or force ``"fbgemm"`` / ``"torch"``.

    Raises:
        ValueError: ``backend="fbgemm"`` with an optimizer FBGEMM cannot run on ``device``.
    """
    from embshard_kernels.torch_fused import TorchFusedTBE

    path = choose_fused_path(config, params.optimizer, device, backend)
    if path is FusedPath.FBGEMM:
        return FbgemmFusedTBE(config, params.optimizer, params, device)
    fast = path is FusedPath.TORCH_FAST
    # a torch TBE forced for its hooks (data-parallel rows, column shards' row statistics):
    # FBGEMM's row loop writes the summed rows where its kernels are the faster ones here
    rows = (
        fast
        and backend != "auto"
        and choose_fused_path(config, params.optimizer, device) is FusedPath.FBGEMM
    )
    return TorchFusedTBE(config, params, device, fast=fast, fbgemm_rows=rows)
