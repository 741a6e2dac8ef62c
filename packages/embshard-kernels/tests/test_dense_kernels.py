"""Dense kernels: ordinary autograd gradients equal those of F.embedding_bag / F.embedding."""

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
from embshard_types.vocab import PoolingType


@pytest.mark.parametrize("pooling,weighted", [("sum", True), ("mean", False)])
@pytest.mark.parametrize("variable_batch", [False, True])
def test_dense_bag_gradients(pooling: str, weighted: bool, variable_batch: bool) -> None:
    config = one_group(
        table("t1", 12, 8, ["f1", "f2"], kernel="dense", pooling=pooling, weighted=weighted),
        table("t2", 7, 6, ["f3"], kernel="dense", pooling=pooling, weighted=weighted),
    )
    kernel = BatchedDenseEmbeddingBag(config)
    kjt = random_kjt(
        [("f1", 12), ("f2", 12), ("f3", 7)],
        4,
        weighted=weighted,
        seed=5,
        batch_sizes=[3, 4, 2] if variable_batch else None,
    )
    out = kernel(kjt)
    grad_out = torch.randn(out.shape)
    out.backward(grad_out)

    tables = [w.detach().clone().requires_grad_(True) for w in kernel.split_embedding_weights()]
    ref = reference_pooled(
        kjt,
        feature_weights(config, tables),
        PoolingType.parse(pooling),
        weighted=weighted,
        flat=variable_batch,
    )
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    (ref * grad_out).sum().backward()
    for w, r in zip(kernel.split_embedding_weights(), tables, strict=True):
        torch.testing.assert_close(w.grad, r.grad, rtol=1e-6, atol=1e-6)


def test_dense_sequence_rows_and_gradients() -> None:
    config = one_group(
        table("s1", 9, 4, ["a", "b"], kernel="dense", pooling="none"),
        table("s2", 5, 4, ["c"], kernel="dense", pooling="none"),
    )
    kernel = BatchedDenseEmbedding(config)
    kjt = random_kjt([("a", 9), ("b", 9), ("c", 5)], 3, seed=8)
    out = kernel(kjt)
    assert out.shape == (kjt.values().numel(), 4)  # one row per id, not sum-pooled
    grad_out = torch.randn(out.shape)
    out.backward(grad_out)
    tables = [w.detach().clone().requires_grad_(True) for w in kernel.split_embedding_weights()]
    ref = reference_sequence(kjt, feature_weights(config, tables))
    torch.testing.assert_close(out, ref)
    (ref * grad_out).sum().backward()
    for w, r in zip(kernel.split_embedding_weights(), tables, strict=True):
        torch.testing.assert_close(w.grad, r.grad)
