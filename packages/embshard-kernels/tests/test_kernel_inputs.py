"""Bad input raises a clear error naming table, feature and value, and changes nothing."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import bit_identical, one_group, random_kjt, snapshot, table

from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.dense import BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbeddingBag
from embshard_kernels.inputs import IdOutOfRangeError
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

ADAM = OptimizerSpec.from_name("adam", lr=0.1)
ADAGRAD = OptimizerSpec.from_name("rowwise_adagrad", lr=0.1)


def _config(kernel: str, spec: OptimizerSpec, weighted: bool = False):
    return one_group(
        table("big", 50, 8, ["f_big"], kernel=kernel, optimizer=spec, weighted=weighted),
        table(
            "small", 5, 4, ["f_small", "f_small2"], kernel=kernel, optimizer=spec, weighted=weighted
        ),
    )


KERNELS = {
    "fused-fbgemm": lambda: BatchedFusedEmbeddingBag(_config("fused", ADAGRAD)),
    "fused-torch": lambda: BatchedFusedEmbeddingBag(_config("fused", ADAM)),
    "dense": lambda: BatchedDenseEmbeddingBag(_config("dense", ADAGRAD)),
}


def _state(kernel) -> list[torch.Tensor]:
    tensors = list(kernel.split_embedding_weights())
    if hasattr(kernel, "fused_optimizer"):
        tensors += [t for s in kernel.emb_module.get_optimizer_state() for t in s.values()]
    return tensors


def _trained(name: str):
    """A kernel after one real step, so that optimizer state is non-zero."""
    kernel = KERNELS[name]()
    good = random_kjt([("f_big", 50), ("f_small", 5), ("f_small2", 5)], 4, seed=1)
    out = kernel(good)
    out.sum().backward()
    return kernel


def _batch(values: list[int], dtype: torch.dtype = torch.int64) -> KeyedJaggedTensor:
    # f_big: bags [v0, v1], [v2]; f_small: [v3], []; f_small2: [v4], [v5]
    return KeyedJaggedTensor(
        ["f_big", "f_small", "f_small2"],
        torch.tensor(values, dtype=dtype),
        lengths=torch.tensor([2, 1, 1, 0, 1, 1]),
    )


BAD_BATCHES = {
    "id too large for its table": (
        lambda: _batch([1, 2, 3, 4, 7, 0]),
        IdOutOfRangeError,
        ["f_small2", "'small'", "id 7", "[0, 5)"],
    ),
    "id fits another table only": (
        lambda: _batch([1, 2, 3, 40, 0, 0]),
        IdOutOfRangeError,
        ["f_small", "'small'", "id 40"],
    ),
    "negative id": (
        lambda: _batch([1, -3, 3, 4, 0, 0]),
        IdOutOfRangeError,
        ["f_big", "'big'", "id -3", "negative"],
    ),
    "id too large for the big table": (
        lambda: _batch([1, 2, 50, 4, 0, 0]),
        IdOutOfRangeError,
        ["f_big", "'big'", "id 50", "sample 1"],
    ),
    "float ids": (
        lambda: _batch([1, 2, 3, 4, 0, 0], torch.float32),
        TypeError,
        ["float32", "integer"],
    ),
    "missing feature": (
        lambda: KeyedJaggedTensor(
            ["f_big", "f_small"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0])
        ),
        ValueError,
        ["f_small2", "'small'", "missing"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
def test_bad_batch_is_refused_before_any_change(kernel_name: str, case: str) -> None:
    kernel = _trained(kernel_name)
    before = snapshot(_state(kernel))
    make, error, fragments = BAD_BATCHES[case]
    with pytest.raises(error) as info:
        kernel(make())
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert bit_identical(_state(kernel), before)


def test_out_of_range_error_is_both_index_and_value_error() -> None:
    assert issubclass(IdOutOfRangeError, IndexError)
    assert issubclass(IdOutOfRangeError, ValueError)


def test_weighted_tables_need_weights() -> None:
    kernel = BatchedFusedEmbeddingBag(_config("fused", ADAGRAD, weighted=True))
    with pytest.raises(ValueError, match="weighted but the input"):
        kernel(_batch([1, 2, 3, 4, 0, 0]))
    with pytest.raises(TypeError, match="floating point"):
        kernel(
            KeyedJaggedTensor(
                ["f_big", "f_small", "f_small2"],
                torch.tensor([1, 2, 3, 4, 0, 0]),
                weights=torch.ones(6, dtype=torch.int64),
                lengths=torch.tensor([2, 1, 1, 0, 1, 1]),
            )
        )


def test_features_out_of_order_are_refused_by_a_kernel() -> None:
    kernel = KERNELS["fused-fbgemm"]()
    kjt = KeyedJaggedTensor(
        ["f_small", "f_big", "f_small2"],
        torch.tensor([1, 2, 3, 4, 0, 0]),
        lengths=torch.tensor([2, 1, 1, 0, 1, 1]),
    )
    with pytest.raises(ValueError, match="permute"):
        kernel(kjt)


@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_width_not_a_multiple_of_four_names_table_and_width(kernel: str) -> None:
    config = one_group(table("odd", 10, 6, ["f"], kernel="fused", optimizer=ADAGRAD))
    with pytest.raises(ValueError, match=r"table 'odd'.*dimension 6.*multiple of 4"):
        BatchedFusedEmbeddingBag(config)
    # The dense kernel takes any width.
    dense = BatchedDenseEmbeddingBag(one_group(table("odd", 10, 6, ["f"], kernel="dense")))
    assert dense.split_embedding_weights()[0].shape == (10, 6)


@pytest.mark.parametrize("optimizer", [ADAGRAD, ADAM, None], ids=["fbgemm", "torch", "dense"])
def test_collection_refuses_bad_batches_before_any_change(optimizer: OptimizerSpec | None) -> None:
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name="big", num_embeddings=50, embedding_dim=8, feature_names=("f_big",)
            ),
            EmbeddingBagConfig(
                name="small",
                num_embeddings=5,
                embedding_dim=4,
                feature_names=("f_small", "f_small2"),
            ),
        ],
        optimizer=optimizer,
    )
    ebc(
        random_kjt([("f_big", 50), ("f_small", 5), ("f_small2", 5)], 4, seed=1)
    ).values().sum().backward()
    before = snapshot(_collection_state(ebc))
    for case in sorted(BAD_BATCHES):
        make, error, fragments = BAD_BATCHES[case]
        with pytest.raises(error) as info:
            ebc(make())
        for fragment in fragments:
            assert fragment in str(info.value), (case, fragment, str(info.value))
    assert bit_identical(_collection_state(ebc), before)


def _collection_state(ebc: EmbeddingBagCollection) -> list[torch.Tensor]:
    return [t for kernel in ebc.kernels() for t in _state(kernel)]


def test_empty_batch_is_fine() -> None:
    kernel = KERNELS["fused-fbgemm"]()
    empty = KeyedJaggedTensor(
        ["f_big", "f_small", "f_small2"],
        torch.zeros(0, dtype=torch.int64),
        lengths=torch.zeros(6, dtype=torch.int64),
    )
    out = kernel(empty)
    assert out.shape == (2, 16) and not out.any()
