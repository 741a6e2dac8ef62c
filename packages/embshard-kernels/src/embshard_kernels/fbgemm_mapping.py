"""embshard's vocabulary -> FBGEMM's enums and constructor arguments, and what runs where.

Every mapping is total over embshard's enums (errors name the table and the alternatives);
:func:`fbgemm_refusal` says why FBGEMM's TBE cannot run a spec faithfully on a device, so callers
route it to the plain-torch rules instead.
"""

from __future__ import annotations

from typing import Any

import torch

from embshard_kernels._fbgemm import (
    BoundsCheckMode,
    CacheAlgorithm,
    EmbeddingLocation,
    EmbOptimType,
    FbgemmWeightDecayMode,
    PoolingMode,
    SparseType,
)
from embshard_optim.specs import OptimizerSpec, OptimType, WeightDecayMode
from embshard_types.kernel_params import BoundsCheckMode as EsBoundsCheckMode
from embshard_types.kernel_params import CacheAlgorithm as EsCacheAlgorithm
from embshard_types.vocab import ComputeKernel, DataType, PoolingType

_SPARSE_TYPES: dict[DataType, SparseType] = {
    DataType.FP32: SparseType.FP32,
    DataType.FP16: SparseType.FP16,
    DataType.BF16: SparseType.BF16,
    DataType.INT8: SparseType.INT8,
    DataType.INT4: SparseType.INT4,
    DataType.INT2: SparseType.INT2,
}

_POOLING_MODES: dict[PoolingType, PoolingMode] = {
    PoolingType.SUM: PoolingMode.SUM,
    PoolingType.MEAN: PoolingMode.MEAN,
    PoolingType.NONE: PoolingMode.NONE,
}

_OPTIM_TYPES: dict[OptimType, EmbOptimType] = {
    OptimType.SGD: EmbOptimType.EXACT_SGD,
    OptimType.ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
    OptimType.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    OptimType.ADAM: EmbOptimType.ADAM,
    OptimType.PARTIAL_ROWWISE_ADAM: EmbOptimType.PARTIAL_ROWWISE_ADAM,
    OptimType.LAMB: EmbOptimType.LAMB,
    OptimType.PARTIAL_ROWWISE_LAMB: EmbOptimType.PARTIAL_ROWWISE_LAMB,
    OptimType.LARS_SGD: EmbOptimType.LARS_SGD,
}

_DECAY_MODES: dict[WeightDecayMode, FbgemmWeightDecayMode] = {
    WeightDecayMode.NONE: FbgemmWeightDecayMode.NONE,
    WeightDecayMode.L2: FbgemmWeightDecayMode.L2,
    WeightDecayMode.DECOUPLED: FbgemmWeightDecayMode.DECOUPLE,
}

CPU_OPTIMIZERS: frozenset[OptimType] = frozenset(
    {OptimType.SGD, OptimType.ADAGRAD, OptimType.ROWWISE_ADAGRAD}
)
"""Optimizers FBGEMM's CPU TBE constructs (Adam, LAMB, LARS fail there at construction)."""

_KERNELS_BY_DEVICE: dict[str, tuple[ComputeKernel, ...]] = {
    "cpu": (ComputeKernel.DENSE, ComputeKernel.FUSED, ComputeKernel.QUANT),
    "cuda": (
        ComputeKernel.DENSE,
        ComputeKernel.FUSED,
        ComputeKernel.FUSED_UVM,
        ComputeKernel.FUSED_UVM_CACHING,
        ComputeKernel.KEY_VALUE,
        ComputeKernel.QUANT,
    ),
}

_TRAINING_DTYPES_CPU = (DataType.FP32, DataType.FP16)


def _where(table: str | None) -> str:
    return f" (table {table!r})" if table else ""


def data_type_to_sparse_type(data_type: DataType | str, *, table: str | None = None) -> SparseType:
    """FBGEMM's ``SparseType`` for a table's storage type."""
    return _SPARSE_TYPES[DataType.parse(data_type, what=f"data type{_where(table)}")]


def data_type_to_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype of a float storage type (quantized types have none)."""
    dtypes = {
        DataType.FP32: torch.float32,
        DataType.FP16: torch.float16,
        DataType.BF16: torch.bfloat16,
    }
    if data_type not in dtypes:
        raise ValueError(f"data type {data_type.value!r} has no float dtype; it is quantized")
    return dtypes[data_type]


def pooling_type_to_pooling_mode(pooling: PoolingType | str) -> PoolingMode:
    """FBGEMM's ``PoolingMode`` for a pooling type (``NONE`` means one row per id)."""
    return _POOLING_MODES[PoolingType.parse(pooling, what="pooling")]


def optim_type_to_fbgemm(optim_type: OptimType) -> EmbOptimType:
    """FBGEMM's ``EmbOptimType`` for an embshard optimizer (the exact, deduplicating variants)."""
    return _OPTIM_TYPES[optim_type]


def bounds_check_to_fbgemm(mode: EsBoundsCheckMode | BoundsCheckMode | str) -> BoundsCheckMode:
    """FBGEMM's ``BoundsCheckMode`` for embshard's (or FBGEMM's own) mode, matched by name."""
    if isinstance(mode, BoundsCheckMode):
        return mode
    return BoundsCheckMode[EsBoundsCheckMode.parse(mode, what="bounds check mode").name]


def cache_algorithm_to_fbgemm(algorithm: EsCacheAlgorithm | str) -> CacheAlgorithm:
    """FBGEMM's ``CacheAlgorithm`` for embshard's, matched by name."""
    return CacheAlgorithm[EsCacheAlgorithm.parse(algorithm, what="cache algorithm").name]


def device_type(device: torch.device | str | None) -> str:
    """``"cpu"`` / ``"cuda"`` / ``"meta"`` for a device (``None`` means the CPU)."""
    return torch.device(device).type if device is not None else "cpu"


def available_kernels(device: torch.device | str | None) -> tuple[ComputeKernel, ...]:
    """The compute kernels embshard can run on ``device``."""
    return _KERNELS_BY_DEVICE.get(device_type(device), _KERNELS_BY_DEVICE["cpu"])


def resolve_kernel(kernel: ComputeKernel | str, *, table: str | None = None) -> ComputeKernel:
    """Parse a kernel; ``DEFAULT`` means ``FUSED`` (the optimizer runs inside the backward)."""
    parsed = ComputeKernel.parse(kernel, what=f"compute kernel{_where(table)}")
    return ComputeKernel.FUSED if parsed is ComputeKernel.DEFAULT else parsed


def check_kernel_available(
    kernel: ComputeKernel | str, device: torch.device | str | None, *, table: str | None = None
) -> ComputeKernel:
    """Return the resolved kernel, or raise when ``device`` cannot run it.

    Raises:
        ValueError: names the kernel, the table, the device and the kernels it can run.
    """
    resolved = resolve_kernel(kernel, table=table)
    dev = device_type(device)
    allowed = available_kernels(device)
    if resolved not in allowed:
        names = ", ".join(repr(k.value) for k in allowed)
        extra = (
            f"; {resolved.value!r} needs CUDA (with the fbgemm-gpu build)" if dev != "cuda" else ""
        )
        raise ValueError(
            f"compute kernel {resolved.value!r}{_where(table)} is not available on {dev}: "
            f"kernels available on {dev} are {names}{extra}"
        )
    return resolved


def check_training_data_type(
    data_type: DataType, device: torch.device | str | None, *, table: str | None = None
) -> None:
    """Refuse a storage type the training kernels cannot keep on ``device``.

    Raises:
        ValueError: quantized types (train in FP32/FP16 and quantize for inference with
            ``QuantBatchedEmbeddingBag.from_float``) or BF16 on the CPU.
    """
    if data_type.is_quantized:
        raise ValueError(
            f"data type {data_type.value!r}{_where(table)} is inference-only: train in fp32 or "
            "fp16 and build the quantized kernel from the trained module (compute kernel 'quant')"
        )
    if device_type(device) == "cpu" and data_type not in _TRAINING_DTYPES_CPU:
        raise ValueError(
            f"data type {data_type.value!r}{_where(table)} is not supported by FBGEMM's CPU "
            "training kernels; use 'fp32' or 'fp16'"
        )


def embedding_location(
    kernel: ComputeKernel, device: torch.device | str | None
) -> EmbeddingLocation:
    """Where FBGEMM keeps a table's rows for ``kernel`` on ``device``."""
    if device_type(device) != "cuda":
        return EmbeddingLocation.HOST
    return {
        ComputeKernel.FUSED_UVM: EmbeddingLocation.MANAGED,
        ComputeKernel.FUSED_UVM_CACHING: EmbeddingLocation.MANAGED_CACHING,
    }.get(kernel, EmbeddingLocation.DEVICE)


def fbgemm_refusal(spec: OptimizerSpec, device: torch.device | str | None) -> str | None:
    """Why FBGEMM's training TBE cannot run ``spec`` faithfully on ``device``, or ``None``.

    On the CPU FBGEMM constructs only SGD, Adagrad and RowWiseAdagrad, and its CPU kernels
    ignore ``weight_decay`` and ``max_norm`` (fbgemm-gpu-cpu 1.8.0), so those are refused too.
    """
    if device_type(device) == "cuda":
        return None
    kind = spec.optim_type
    if kind not in CPU_OPTIMIZERS:
        return f"FBGEMM's CPU TBE has no {kind.name}"
    if spec.weight_decay > 0.0:
        return f"FBGEMM's CPU TBE ignores weight_decay for {kind.name}"
    if spec.max_norm > 0.0:
        return f"FBGEMM's CPU TBE ignores max_norm for {kind.name}"
    return None


def optimizer_kwargs(spec: OptimizerSpec) -> dict[str, Any]:
    """``SplitTableBatchedEmbeddingBagsCodegen`` keyword arguments for ``spec``."""
    return {
        "optimizer": optim_type_to_fbgemm(spec.optim_type),
        "learning_rate": spec.learning_rate,
        "eps": spec.eps,
        "beta1": spec.beta1,
        "beta2": spec.beta2,
        "weight_decay": spec.weight_decay,
        "weight_decay_mode": _DECAY_MODES[spec.weight_decay_mode],
        "momentum": spec.momentum,
        "eta": spec.eta,
        "max_norm": spec.max_norm,
        "stochastic_rounding": spec.stochastic_rounding,
    }
