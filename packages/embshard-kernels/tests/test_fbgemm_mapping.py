"""embshard's vocabulary maps onto FBGEMM's; unavailable kernels are refused with the options."""

from __future__ import annotations

import pytest

from embshard_kernels._fbgemm import (
    BoundsCheckMode,
    EmbeddingLocation,
    EmbOptimType,
    FbgemmWeightDecayMode,
    PoolingMode,
    SparseType,
)
from embshard_kernels.fbgemm_mapping import (
    available_kernels,
    bounds_check_to_fbgemm,
    check_kernel_available,
    check_training_data_type,
    data_type_to_sparse_type,
    embedding_location,
    fbgemm_refusal,
    optimizer_kwargs,
    pooling_type_to_pooling_mode,
)
from embshard_optim.specs import OptimizerSpec, OptimType
from embshard_types.vocab import ComputeKernel, DataType, PoolingType


def test_data_types_and_pooling() -> None:
    assert data_type_to_sparse_type(DataType.FP32) is SparseType.FP32
    assert data_type_to_sparse_type("int4") is SparseType.INT4
    assert {data_type_to_sparse_type(d) for d in DataType} >= {SparseType.INT2, SparseType.BF16}
    assert pooling_type_to_pooling_mode(PoolingType.MEAN) is PoolingMode.MEAN
    assert pooling_type_to_pooling_mode("none") is PoolingMode.NONE


def test_kernel_locations() -> None:
    assert embedding_location(ComputeKernel.FUSED, "cpu") is EmbeddingLocation.HOST
    assert embedding_location(ComputeKernel.FUSED, "cuda") is EmbeddingLocation.DEVICE
    assert embedding_location(ComputeKernel.FUSED_UVM, "cuda:1") is EmbeddingLocation.MANAGED
    assert (
        embedding_location(ComputeKernel.FUSED_UVM_CACHING, "cuda")
        is EmbeddingLocation.MANAGED_CACHING
    )


@pytest.mark.parametrize("kernel", ["fused_uvm", "fused_uvm_caching", "key_value"])
def test_cuda_only_kernels_are_refused_on_cpu_with_the_alternatives(kernel: str) -> None:
    with pytest.raises(ValueError) as info:
        check_kernel_available(kernel, "cpu", table="t7")
    message = str(info.value)
    assert f"'{kernel}'" in message and "table 't7'" in message
    assert "'dense', 'fused', 'quant'" in message and "CUDA" in message


def test_available_kernels() -> None:
    assert ComputeKernel.KEY_VALUE in available_kernels("cuda")
    assert ComputeKernel.KEY_VALUE not in available_kernels("cpu")
    assert check_kernel_available("default", "cpu") is ComputeKernel.FUSED


def test_training_data_types() -> None:
    check_training_data_type(DataType.FP16, "cpu")
    with pytest.raises(ValueError, match=r"bf16.*CPU"):
        check_training_data_type(DataType.BF16, "cpu", table="t")
    with pytest.raises(ValueError, match="inference-only"):
        check_training_data_type(DataType.INT8, "cpu", table="t")


def test_fbgemm_refusals_on_cpu() -> None:
    assert fbgemm_refusal(OptimizerSpec(OptimType.ROWWISE_ADAGRAD), "cpu") is None
    assert fbgemm_refusal(OptimizerSpec(OptimType.SGD), None) is None
    assert "ADAM" in (fbgemm_refusal(OptimizerSpec(OptimType.ADAM), "cpu") or "")
    assert "weight_decay" in (
        fbgemm_refusal(OptimizerSpec(OptimType.ROWWISE_ADAGRAD, weight_decay=0.1), "cpu") or ""
    )
    assert fbgemm_refusal(OptimizerSpec(OptimType.LAMB), "cuda") is None


def test_optimizer_kwargs() -> None:
    spec = OptimizerSpec.from_name(
        "rowwise_adagrad", lr=0.2, eps=1e-3, weight_decay=0.1, weight_decay_mode="decoupled"
    )
    kwargs = optimizer_kwargs(spec)
    assert kwargs["optimizer"] is EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert kwargs["learning_rate"] == 0.2 and kwargs["eps"] == 1e-3
    assert kwargs["weight_decay_mode"] is FbgemmWeightDecayMode.DECOUPLE


def test_bounds_check_modes() -> None:
    assert bounds_check_to_fbgemm("fatal") is BoundsCheckMode.FATAL
    assert bounds_check_to_fbgemm(BoundsCheckMode.WARNING) is BoundsCheckMode.WARNING
