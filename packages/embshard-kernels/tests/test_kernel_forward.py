"""Every kernel's forward equals torch.nn.functional.embedding_bag / embedding on its weights."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import (
    feature_weights,
    one_group,
    random_kjt,
    reference_pooled,
    reference_sequence,
    table,
)

from embshard_kernels.dense import BatchedDenseEmbedding, BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.quant import QuantBatchedEmbedding, QuantBatchedEmbeddingBag
from embshard_kernels.tbe import FbgemmFusedTBE
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_optim.specs import OptimizerSpec
from embshard_types.vocab import PoolingType

ADAGRAD = OptimizerSpec.from_name("rowwise_adagrad", lr=0.1)


def _pooled_tables(pooling: str, kernel: str, weighted: bool):
    return one_group(
        table(
            "t1",
            13,
            8,
            ["f1", "f2"],
            pooling=pooling,
            kernel=kernel,
            weighted=weighted,
            optimizer=ADAGRAD,
        ),
        table(
            "t2", 7, 4, ["f3"], pooling=pooling, kernel=kernel, weighted=weighted, optimizer=ADAGRAD
        ),
        table(
            "t3",
            5,
            12,
            ["f4"],
            pooling=pooling,
            kernel=kernel,
            weighted=weighted,
            optimizer=ADAGRAD,
        ),
    )


def _batch(config, weighted: bool, seed: int = 0, batch_sizes=None):
    rows = {f: t.rows for t in config.embedding_tables for f in t.feature_names}
    return random_kjt(
        [(f, rows[f]) for f in config.feature_names()],
        5,
        weighted=weighted,
        seed=seed,
        batch_sizes=batch_sizes,
    )


POOLED_CASES = [("sum", False), ("sum", True), ("mean", False)]


@pytest.mark.parametrize("pooling,weighted", POOLED_CASES)
@pytest.mark.parametrize("backend", ["fbgemm", "torch"])
def test_fused_bag_matches_embedding_bag(pooling: str, weighted: bool, backend: str) -> None:
    config = _pooled_tables(pooling, "fused", weighted)
    kernel = BatchedFusedEmbeddingBag(config, backend=backend)  # type: ignore[arg-type]
    expected_type = FbgemmFusedTBE if backend == "fbgemm" else TorchFusedTBE
    assert isinstance(kernel.emb_module, expected_type)
    kjt = _batch(config, weighted)
    out = kernel(kjt)
    ref = reference_pooled(
        kjt,
        feature_weights(config, kernel.split_embedding_weights()),
        PoolingType.parse(pooling),
        weighted=weighted,
    )
    assert out.shape == (5, 8 + 8 + 4 + 12)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pooling,weighted", POOLED_CASES)
def test_dense_bag_matches_embedding_bag(pooling: str, weighted: bool) -> None:
    config = _pooled_tables(pooling, "dense", weighted)
    kernel = BatchedDenseEmbeddingBag(config)
    kjt = _batch(config, weighted)
    ref = reference_pooled(
        kjt,
        feature_weights(config, kernel.split_embedding_weights()),
        PoolingType.parse(pooling),
        weighted=weighted,
    )
    torch.testing.assert_close(kernel(kjt), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pooling,weighted", POOLED_CASES)
def test_quant_fp32_bag_matches_embedding_bag(pooling: str, weighted: bool) -> None:
    trained = BatchedFusedEmbeddingBag(_pooled_tables(pooling, "fused", weighted))
    quant = QuantBatchedEmbeddingBag.from_float(trained, "fp32")
    assert quant.quantization_error == {"t1": 0.0, "t2": 0.0, "t3": 0.0}
    kjt = _batch(trained.config, weighted)
    ref = reference_pooled(
        kjt,
        feature_weights(trained.config, trained.split_embedding_weights()),
        PoolingType.parse(pooling),
        weighted=weighted,
    )
    torch.testing.assert_close(quant(kjt), ref, rtol=1e-6, atol=1e-6)


def _sequence_tables(kernel: str):
    return one_group(
        table("s1", 11, 8, ["f1", "f2"], pooling="none", kernel=kernel, optimizer=ADAGRAD),
        table("s2", 6, 8, ["f3"], pooling="none", kernel=kernel, optimizer=ADAGRAD),
    )


@pytest.mark.parametrize(
    "build",
    [
        lambda: BatchedFusedEmbedding(_sequence_tables("fused"), backend="fbgemm"),
        lambda: BatchedFusedEmbedding(_sequence_tables("fused"), backend="torch"),
        lambda: BatchedDenseEmbedding(_sequence_tables("dense")),
        lambda: QuantBatchedEmbedding.from_float(
            BatchedFusedEmbedding(_sequence_tables("fused")), "fp32"
        ),
    ],
    ids=["fused-fbgemm", "fused-torch", "dense", "quant-fp32"],
)
def test_sequence_kernels_return_one_row_per_id(build) -> None:
    kernel = build()
    config = kernel.config
    kjt = _batch(config, weighted=False)
    weights = kernel.split_embedding_weights()
    if isinstance(kernel, QuantBatchedEmbedding):
        weights = kernel.dequantized_weights()
    out = kernel(kjt)
    assert out.shape == (kjt.values().numel(), 8)
    torch.testing.assert_close(out, reference_sequence(kjt, feature_weights(config, weights)))


@pytest.mark.parametrize("backend", ["fbgemm", "torch"])
def test_variable_batch_per_feature(backend: str) -> None:
    config = _pooled_tables("sum", "fused", False)
    kernel = BatchedFusedEmbeddingBag(config, backend=backend)  # type: ignore[arg-type]
    kjt = _batch(config, weighted=False, batch_sizes=[2, 5, 1, 3])
    assert kjt.variable_stride_per_key()
    ref = reference_pooled(
        kjt, feature_weights(config, kernel.split_embedding_weights()), PoolingType.SUM, flat=True
    )
    torch.testing.assert_close(kernel(kjt), ref, rtol=1e-6, atol=1e-6)


def test_variable_batch_layout_is_rank_major_like_fbgemm() -> None:
    """Two ranks' batch sizes per feature: the torch kernel lays rows out as FBGEMM does."""
    config = _pooled_tables("sum", "fused", False)
    fbgemm = BatchedFusedEmbeddingBag(config, backend="fbgemm")
    plain = BatchedFusedEmbeddingBag(config, backend="torch")
    plain.load_state_dict(fbgemm.state_dict())
    kjt = _batch(config, weighted=False, batch_sizes=[3, 4, 2, 3])
    per_rank = [[1, 2], [3, 1], [0, 2], [2, 1]]
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    two_ranks = KeyedJaggedTensor(
        kjt.keys(), kjt.values(), lengths=kjt.lengths(), stride_per_key_per_rank=per_rank
    )
    torch.testing.assert_close(plain(two_ranks), fbgemm(two_ranks), rtol=1e-6, atol=1e-6)


def test_dense_variable_batch_uses_real_batch_sizes() -> None:
    """FBGEMM's CPU dense TBE ignores per-feature batch sizes; the dense kernel does not."""
    config = _pooled_tables("mean", "dense", False)
    kernel = BatchedDenseEmbeddingBag(config)
    kjt = _batch(config, weighted=False, batch_sizes=[2, 5, 1, 3])
    ref = reference_pooled(
        kjt, feature_weights(config, kernel.split_embedding_weights()), PoolingType.MEAN, flat=True
    )
    torch.testing.assert_close(kernel(kjt), ref, rtol=1e-6, atol=1e-6)


def test_output_dtype_fp16_is_passed_through() -> None:
    from dataclasses import replace

    from embshard_kernels.fused_params import FusedParams

    params = FusedParams(optimizer=ADAGRAD, output_dtype="fp16")
    tables = [
        replace(t, fused_params=params)
        for t in _pooled_tables("sum", "fused", False).embedding_tables
    ]
    kernel = BatchedFusedEmbeddingBag(one_group(*tables))
    kjt = _batch(kernel.config, weighted=False)
    out = kernel(kjt)
    assert out.dtype == torch.float16
    ref = reference_pooled(
        kjt, feature_weights(kernel.config, kernel.split_embedding_weights()), PoolingType.SUM
    )
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
