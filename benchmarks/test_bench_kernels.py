"""Kernel lookups on K1 (``nox -s bench``): every embshard kernel that runs on the CPU.

Each kernel class of ``embshard_kernels`` is built directly from a ``GroupedEmbeddingConfig`` of
K1's 4 tables (100,000 x 64), loaded with K1's initial weights and fed K1's ids (20 per bag,
batch 2,048) as one KeyedJaggedTensor, so the figures exclude the collections' routing:

- fused, pooled (``BatchedFusedEmbeddingBag``, RowWiseAdagrad in the backward): the CPU default
  (``backend="auto"``: embshard's fast pooled path) and ``backend="fbgemm"`` (FBGEMM's TBE);
  forward, and forward + backward + update;
- fused, sequence (``BatchedFusedEmbedding``, pooling NONE, one row per id): the same;
- dense (``BatchedDenseEmbeddingBag`` / ``BatchedDenseEmbedding``): forward, and forward +
  backward + ``torch.optim.SGD`` step over the tables' parameters;
- quantized inference (``QuantBatchedEmbeddingBag`` INT8 / INT4 / FP16, and the sequence
  ``QuantBatchedEmbedding`` INT8): forward (they are not trainable);
- key-value (``KeyValueEmbeddingBag``, FBGEMM's SSD TBE): CUDA only, skipped elsewhere.

The collection over the fused kernel (``EmbeddingBagCollection``, default path) is in
``test_bench_k1.py``; ratios between contenders come from ``k1_ratios.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

pytest.importorskip("pytest_benchmark", reason="benchmarks need pytest-benchmark (nox -s bench)")

import torch
from workloads import K1

from embshard_kernels.dense import BatchedDenseEmbedding, BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig
from embshard_kernels.quant import QuantBatchedEmbedding, QuantBatchedEmbeddingBag
from embshard_optim.specs import OptimizerSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, DataType, PoolingType

_W = K1()
STEP_ROUNDS, STEP_WARMUP = 8, 2
FORWARD_ROUNDS, FORWARD_WARMUP = 15, 3


@functools.cache
def _k1() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """K1's weights, ids and pooled output gradient, drawn once per session (never mutated)."""
    return _W.tensors()


@functools.cache
def _features() -> KeyedJaggedTensor:
    _, ids, _ = _k1()
    lengths = torch.full((_W.num_tables * _W.batch,), _W.ids_per_bag, dtype=torch.long)
    return KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(_W.num_tables)], values=ids.reshape(-1), lengths=lengths
    )


def _config(
    kernel: ComputeKernel,
    *,
    pooling: PoolingType = PoolingType.SUM,
    data_type: DataType = DataType.FP32,
    fused: bool = False,
) -> GroupedEmbeddingConfig:
    params = (
        FusedParams(optimizer=OptimizerSpec.from_name("rowwise_adagrad", lr=_W.lr, eps=_W.eps))
        if fused
        else None
    )
    tables = tuple(
        ShardedTableConfig(
            name=f"t{t}",
            num_embeddings=_W.rows,
            embedding_dim=_W.dim,
            feature_names=(f"f{t}",),
            data_type=data_type,
            pooling=pooling,
            compute_kernel=kernel,
            fused_params=params,
        )
        for t in range(_W.num_tables)
    )
    return GroupedEmbeddingConfig(
        data_type=data_type,
        pooling=pooling,
        is_weighted=False,
        compute_kernel=kernel,
        embedding_tables=tables,
        fused_params=params,
    )


def _load(kernel: torch.nn.Module) -> torch.nn.Module:
    weights, _, _ = _k1()
    with torch.no_grad():
        for dst, src in zip(kernel.split_embedding_weights(), weights, strict=True):  # type: ignore[operator]
            dst.copy_(src)
    return kernel


def _output_grad(sequence: bool) -> torch.Tensor:
    _, _, pooled = _k1()
    if not sequence:
        return pooled
    gen = torch.Generator().manual_seed(_W.seed + 1)
    return torch.randn(_W.num_tables * _W.batch * _W.ids_per_bag, _W.dim, generator=gen)


def _trainable(name: str) -> torch.nn.Module:
    sequence = name.endswith("_sequence")
    pooling = PoolingType.NONE if sequence else PoolingType.SUM
    if name.startswith("fused"):
        cls = BatchedFusedEmbedding if sequence else BatchedFusedEmbeddingBag
        backend = "fbgemm" if "_fbgemm" in name else "auto"
        config = _config(ComputeKernel.FUSED, pooling=pooling, fused=True)
        return _load(cls(config, backend=backend, init_weights=False))
    dense_cls = BatchedDenseEmbedding if sequence else BatchedDenseEmbeddingBag
    return _load(dense_cls(_config(ComputeKernel.DENSE, pooling=pooling), init_weights=False))


def _step(name: str, kernel: torch.nn.Module) -> Callable[[], None]:
    features = _features()
    grad = _output_grad(name.endswith("_sequence"))
    if name.startswith("fused"):

        def fused_step() -> None:
            kernel(features).backward(grad)

        return fused_step
    opt = torch.optim.SGD(kernel.parameters(), lr=_W.lr)

    def dense_step() -> None:
        opt.zero_grad(set_to_none=True)
        kernel(features).backward(grad)
        opt.step()

    return dense_step


TRAINABLE = [
    "fused_auto_pooled",
    "fused_fbgemm_pooled",
    "fused_auto_sequence",
    "dense_pooled",
    "dense_sequence",
]


@pytest.mark.parametrize("kernel", TRAINABLE)
def test_kernel_step(benchmark, kernel: str) -> None:  # type: ignore[no-untyped-def]
    """Forward + backward + optimizer update (fused: in the backward; dense: SGD step)."""
    step = _step(kernel, _trainable(kernel))
    benchmark.pedantic(step, rounds=STEP_ROUNDS, warmup_rounds=STEP_WARMUP, iterations=1)


FRESH_OUTPUT_NOTE = (
    "one row per id: a fresh 42 MB output every round, whose page faults come and go with the "
    "allocator's state (6 ms or 22 ms on the 2-core reference machine)"
)
"""Why a sequence forward is reported but not gated (``bench_gate.py`` reads ``extra_info``)."""


def _mark_fresh_output(benchmark, sequence: bool) -> None:  # type: ignore[no-untyped-def]
    if sequence:
        benchmark.extra_info["gate"] = "report only"
        benchmark.extra_info["why"] = FRESH_OUTPUT_NOTE


@pytest.mark.parametrize("kernel", TRAINABLE)
def test_kernel_forward(benchmark, kernel: str) -> None:  # type: ignore[no-untyped-def]
    module = _trainable(kernel)
    features = _features()

    def forward() -> None:
        with torch.no_grad():
            module(features)

    _mark_fresh_output(benchmark, kernel.endswith("_sequence"))
    benchmark.pedantic(forward, rounds=FORWARD_ROUNDS, warmup_rounds=FORWARD_WARMUP, iterations=1)


QUANT = {
    "int8_pooled": (DataType.INT8, False),
    "int4_pooled": (DataType.INT4, False),
    "fp16_pooled": (DataType.FP16, False),
    "int8_sequence": (DataType.INT8, True),
}


@pytest.mark.parametrize("kernel", list(QUANT))
def test_quant_forward(benchmark, kernel: str) -> None:  # type: ignore[no-untyped-def]
    """Quantized inference lookups, tables quantized from K1's float weights."""
    data_type, sequence = QUANT[kernel]
    config = _config(
        ComputeKernel.QUANT,
        pooling=PoolingType.NONE if sequence else PoolingType.SUM,
        data_type=data_type,
    )
    module = (QuantBatchedEmbedding if sequence else QuantBatchedEmbeddingBag)(config)
    module.load_float_weights(_k1()[0])
    features = _features()

    def forward() -> None:
        with torch.no_grad():
            module(features)

    _mark_fresh_output(benchmark, sequence)
    benchmark.pedantic(forward, rounds=FORWARD_ROUNDS, warmup_rounds=FORWARD_WARMUP, iterations=1)


def test_key_value_forward(benchmark) -> None:  # type: ignore[no-untyped-def]
    """FBGEMM's SSD key-value TBE: CUDA only (embshard refuses it elsewhere)."""
    if not torch.cuda.is_available():
        pytest.skip(
            "key-value kernel (KeyValueEmbeddingBag, FBGEMM's SSD TBE) runs only on CUDA; "
            "this machine has no CUDA device"
        )
    try:
        from embshard_kernels.key_value import KeyValueEmbeddingBag
    except ImportError as error:
        pytest.skip(f"key-value kernel unavailable: {error}")
    device = torch.device("cuda")
    config = _config(ComputeKernel.KEY_VALUE, fused=True)
    module = KeyValueEmbeddingBag(config, device=device)
    features = _features().to(device)

    def forward() -> None:
        with torch.no_grad():
            module(features)
        torch.cuda.synchronize(device)

    benchmark.pedantic(forward, rounds=FORWARD_ROUNDS, warmup_rounds=FORWARD_WARMUP, iterations=1)
