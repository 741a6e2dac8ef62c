"""Quantized inference kernels built from a trained float kernel, with bounded, reported error."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import feature_weights, one_group, random_kjt, reference_pooled, table

from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.quant import QuantBatchedEmbedding, QuantBatchedEmbeddingBag
from embshard_optim.specs import OptimizerSpec
from embshard_types.vocab import DataType, PoolingType

SGD = OptimizerSpec.from_name("sgd", lr=0.5)
BITS = {"int8": 8, "int4": 4, "int2": 2}


def _trained_bag() -> BatchedFusedEmbeddingBag:
    config = one_group(
        table("t1", 40, 16, ["f1", "f2"], optimizer=SGD), table("t2", 30, 32, ["f3"], optimizer=SGD)
    )
    kernel = BatchedFusedEmbeddingBag(config)
    for step in range(3):
        kernel(random_kjt([("f1", 40), ("f2", 40), ("f3", 30)], 8, seed=step)).sum().backward()
    return kernel


def _step_bound(weight: torch.Tensor, bits: int) -> float:
    """Half the largest row's quantization step, plus slack for fp16 scale and bias."""
    span = (weight.max(dim=1).values - weight.min(dim=1).values).max().item()
    return span / (2**bits - 1) / 2 * 1.01 + 1e-3 * weight.abs().max().item()


@pytest.mark.parametrize("data_type", ["int8", "int4", "int2", "fp16"])
def test_quantized_bag_error_is_reported_and_bounded(data_type: str) -> None:
    trained = _trained_bag()
    quant = QuantBatchedEmbeddingBag.from_float(trained, data_type)
    floats = trained.split_embedding_weights()
    restored = quant.dequantized_weights()
    for t, (w, r) in enumerate(zip(floats, restored, strict=True)):
        name = trained.config.embedding_tables[t].name
        actual = (r - w).abs().max().item()
        assert quant.quantization_error[name] == pytest.approx(actual)
        bound = (
            _step_bound(w, BITS[data_type]) if data_type in BITS else 1e-3 * w.abs().max().item()
        )
        assert 0.0 < actual <= bound, (name, actual, bound)

    kjt = random_kjt([("f1", 40), ("f2", 40), ("f3", 30)], 6, seed=9)
    out = quant(kjt)
    assert out.dtype == torch.float32 and out.shape == (6, 16 + 16 + 32)
    # Pooled error: at most (bag length) x (largest element error) per column.
    ref = reference_pooled(kjt, feature_weights(trained.config, floats), PoolingType.SUM)
    longest = max(int(kjt.lengths().max()), 1)
    assert (out - ref).abs().max().item() <= longest * max(quant.quantization_error.values()) + 1e-5
    # Exactly the float lookup of the dequantized weights.
    exact = reference_pooled(kjt, feature_weights(trained.config, restored), PoolingType.SUM)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


def test_quantized_state_dict_and_reload() -> None:
    trained = _trained_bag()
    quant = QuantBatchedEmbeddingBag.from_float(trained, DataType.INT4)
    state = quant.state_dict()
    assert sorted(state) == [
        "t1.weight",
        "t1.weight_qscaleshift",
        "t2.weight",
        "t2.weight_qscaleshift",
    ]
    assert state["t1.weight"].dtype == torch.uint8 and state["t1.weight"].shape == (40, 8)
    other = QuantBatchedEmbeddingBag.from_float(_trained_bag(), DataType.INT4)
    other.load_state_dict({k: v.clone() for k, v in state.items()})
    kjt = random_kjt([("f1", 40), ("f2", 40), ("f3", 30)], 4, seed=1)
    assert torch.equal(other(kjt), quant(kjt))


def test_quantized_sequence_kernel() -> None:
    config = one_group(table("s", 20, 16, ["a", "b"], pooling="none", optimizer=SGD))
    trained = BatchedFusedEmbedding(config)
    quant = QuantBatchedEmbedding.from_float(trained, "int8")
    kjt = random_kjt([("a", 20), ("b", 20)], 5, seed=2)
    out = quant(kjt)
    ref = torch.cat([trained.split_embedding_weights()[0][kjt[k].values()] for k in ("a", "b")])
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= quant.quantization_error["s"] + 1e-6


def test_quantized_kernel_refuses_unpackable_width_and_training() -> None:
    odd = one_group(table("t", 10, 6, kernel="quant", data_type="int4"))
    with pytest.raises(ValueError, match="multiple of 4"):
        QuantBatchedEmbeddingBag(odd)
    quant = QuantBatchedEmbeddingBag(one_group(table("t", 10, 8, kernel="quant", data_type="int8")))
    with pytest.raises(TypeError, match="from_float"):
        quant.init_parameters()
    with pytest.raises(ValueError, match=r"does not match \[10, 8\]"):
        quant.load_float_weights([torch.zeros(10, 4)])
