"""Kernels refuse KJTs whose layout could make FBGEMM read or write out of bounds.

The plain constructor does not read tensor data, so a negative length or lengths that do not add
up to the values reach ``forward``; each kernel must raise before its TBE runs and change nothing
(a negative length used to corrupt the heap inside FBGEMM's sequence kernel).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import bit_identical, one_group, snapshot, table

from embshard_kernels.dense import BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_optim.specs import OptimizerSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

ADAGRAD = OptimizerSpec.from_name("rowwise_adagrad", lr=0.1)


def _pooled(kernel: str):
    return one_group(table("t", 20, 8, ["f", "g"], kernel=kernel, optimizer=ADAGRAD))


KERNELS = {
    "fused": lambda: BatchedFusedEmbeddingBag(_pooled("fused")),
    "dense": lambda: BatchedDenseEmbeddingBag(_pooled("dense")),
    "fused-sequence": lambda: BatchedFusedEmbedding(
        one_group(table("t", 20, 8, ["f", "g"], kernel="fused", optimizer=ADAGRAD, pooling="none"))
    ),
}

V = torch.tensor([1, 2, 3, 4, 5, 6])
BAD = {
    "negative length": (dict(lengths=torch.tensor([3, -1, 2, 2])), "is negative"),
    "lengths sum to less": (dict(lengths=torch.tensor([1, 1, 1, 1])), "values not in any bag"),
    "lengths sum to more": (dict(lengths=torch.tensor([3, 3, 3, 3])), "too few values"),
    "offsets not from 0": (dict(offsets=torch.tensor([1, 2, 3, 4, 6])), "start at 0"),
    "decreasing offsets": (dict(offsets=torch.tensor([0, 3, 2, 4, 6])), "decrease"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_broken_layout_is_refused_before_the_kernel(name: str, case: str) -> None:
    kernel = KERNELS[name]()
    before = snapshot(list(kernel.split_embedding_weights()))
    layout, fragment = BAD[case]
    with pytest.raises(ValueError, match=fragment):
        kernel(KeyedJaggedTensor(["f", "g"], V, **layout))
    assert bit_identical(list(kernel.split_embedding_weights()), before)


def test_nan_weights_are_refused_by_a_weighted_kernel() -> None:
    kernel = BatchedFusedEmbeddingBag(
        one_group(table("t", 20, 8, ["f"], kernel="fused", optimizer=ADAGRAD, weighted=True))
    )
    kjt = KeyedJaggedTensor(
        ["f"],
        torch.tensor([1, 2]),
        weights=torch.tensor([1.0, float("nan")]),
        lengths=torch.tensor([2]),
    )
    with pytest.raises(
        ValueError, match=r"feature 'f' \(table 't'\), sample 0: weights\[1\] is nan"
    ):
        kernel(kjt)
