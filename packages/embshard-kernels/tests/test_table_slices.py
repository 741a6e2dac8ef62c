"""Per-table slices are live, copy-free views of the fused weight buffer."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_testing import one_group, random_kjt, table
from torch import nn

from embshard_kernels.dense import BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbeddingBag
from embshard_kernels.slices import TableBatchedEmbeddingSlice
from embshard_optim.specs import OptimizerSpec


def test_slice_aliases_the_buffer_both_ways() -> None:
    buffer = nn.Parameter(torch.arange(20.0))
    s = TableBatchedEmbeddingSlice(buffer, 4, 10, 3, 2)
    assert s.shape == (3, 2) and s.data_ptr() == buffer.data_ptr() + 4 * 4
    with torch.no_grad():
        buffer[4] = 100.0
        s[2, 1] = -1.0
    assert s[0, 0] == 100.0 and buffer[9] == -1.0
    assert isinstance(s, nn.Parameter) and s.is_leaf and s.grad_fn is None


def test_slice_gradient_is_the_buffer_region() -> None:
    buffer = nn.Parameter(torch.zeros(10))
    s = TableBatchedEmbeddingSlice(buffer, 2, 8, 3, 2)
    assert s.grad is None
    (buffer * torch.arange(10.0)).sum().backward()
    assert s.grad is not None
    assert torch.equal(s.grad, torch.arange(2.0, 8.0).view(3, 2))
    s.grad = None
    assert buffer.grad is None


def test_slice_checks_its_region() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        TableBatchedEmbeddingSlice(torch.zeros(5), 2, 8, 3, 2)
    with pytest.raises(ValueError, match="not 2 x 2"):
        TableBatchedEmbeddingSlice(torch.zeros(10), 2, 8, 2, 2)


def test_deepcopy_keeps_the_aliasing_within_the_copy() -> None:
    buffer = nn.Parameter(torch.arange(8.0))
    module = nn.Module()
    module.a = TableBatchedEmbeddingSlice(buffer, 0, 4, 2, 2)
    module.b = TableBatchedEmbeddingSlice(buffer, 4, 8, 2, 2)
    clone = copy.deepcopy(module)
    assert clone.a.original_tensor is clone.b.original_tensor
    assert clone.a.original_tensor is not buffer
    with torch.no_grad():
        clone.b.original_tensor[5] = 42.0
    assert clone.b[0, 1] == 42.0 and buffer[5] == 5.0


def test_kernel_parameters_are_live_views_of_the_fbgemm_buffer() -> None:
    config = one_group(
        table("t1", 10, 8, optimizer=OptimizerSpec.from_name("sgd", lr=1.0)),
        table("t2", 6, 4, optimizer=OptimizerSpec.from_name("sgd", lr=1.0)),
    )
    kernel = BatchedFusedEmbeddingBag(config)
    params = dict(kernel.named_parameters_by_table())
    assert list(params) == ["t1", "t2"]
    buffer, offsets = kernel.emb_module.weight_buffer()
    assert params["t2"].data_ptr() == buffer.data_ptr() + offsets[1] * 4
    state = kernel.state_dict()
    assert list(state) == ["t1.weight", "t2.weight"]
    assert state["t1.weight"].data_ptr() == params["t1"].data_ptr()
    before = params["t1"].detach().clone()
    kernel(random_kjt([("t1", 10), ("t2", 6)], 3, seed=4)).sum().backward()  # SGD in backward
    assert not torch.equal(before, params["t1"])  # the slice saw the update without a copy
    assert [n for n, _ in kernel.named_parameters()] == ["t1.weight", "t2.weight"]
    # only the per-feature row counts a traced lookup bounds-checks with (not in state_dict)
    assert list(dict(kernel.named_buffers())) in ([], ["_rows_per_feature"])


def test_dense_slices_get_the_flat_gradient_and_train_with_torch_optimizers() -> None:
    config = one_group(table("t1", 10, 8, kernel="dense"), table("t2", 6, 4, kernel="dense"))
    kernel = BatchedDenseEmbeddingBag(config)
    optimizer = torch.optim.SGD(kernel.parameters(), lr=0.5)
    kjt = random_kjt([("t1", 10), ("t2", 6)], 3, seed=2)
    before = [w.detach().clone() for w in kernel.split_embedding_weights()]
    kernel(kjt).sum().backward()
    grads = [w.grad for w in kernel.split_embedding_weights()]
    assert all(g is not None for g in grads)
    optimizer.step()
    for b, w, g in zip(before, kernel.split_embedding_weights(), grads, strict=True):
        torch.testing.assert_close(w.detach(), b - 0.5 * g)
    optimizer.zero_grad()
    assert kernel.emb_module.weights.grad is None
