"""Gradient accumulation in the fused kernels: k = 4 micro-batches equal one step on their
concatenation (SGD bit for bit; RowWiseAdagrad and Adam within 1e-6), on FBGEMM's TBE and both
torch paths, pooled (uniform and variable batch) and sequence; bad uses raise before any change.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_testing import bit_identical, one_group, random_kjt, table
from torch import Tensor

from embshard_kernels.accumulate import defer_sparse_updates, pending_micro_batches
from embshard_kernels.call_concat import KernelCall, concat_calls
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.tbe import Backend, FbgemmFusedTBE
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_optim.specs import OptimizerSpec, OptimType
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import PoolingType

K = 4
SPECS = {
    "sgd": OptimizerSpec(OptimType.SGD, learning_rate=0.3),
    "rowwise_adagrad": OptimizerSpec(OptimType.ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3),
    "adam": OptimizerSpec(OptimType.ADAM, learning_rate=0.05, eps=1e-4, weight_decay=0.01),
}
FEATURES = [("a", 7), ("b", 7), ("c", 5)]


def _kernel(
    spec: OptimizerSpec, backend: Backend, pooling: PoolingType, *, fast: bool = True
) -> BatchedFusedEmbeddingBag | BatchedFusedEmbedding:
    width = 8 if pooling is PoolingType.NONE else 12  # sequence tables share one width
    config = one_group(
        table("t0", 7, 8, ["a", "b"], pooling=pooling, optimizer=spec),
        table("t1", 5, width, ["c"], pooling=pooling, optimizer=spec),
    )
    cls = BatchedFusedEmbedding if pooling is PoolingType.NONE else BatchedFusedEmbeddingBag
    kernel = cls(config, backend=backend, init_weights=False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for w in kernel.split_embedding_weights():
            w.copy_(torch.rand(w.shape, generator=g) - 0.5)
    tbe = kernel.emb_module
    if isinstance(tbe, TorchFusedTBE) and not fast:
        tbe.fast = None
    return kernel


def _join(kjts: Sequence[KeyedJaggedTensor], variable: bool) -> KeyedJaggedTensor:
    """The batch made of ``kjts`` one after the other (per feature, in order)."""
    keys = kjts[0].keys()
    values = [kjt[k].values() for k in keys for kjt in kjts]
    lengths = [kjt[k].lengths() for k in keys for kjt in kjts]
    per_rank = (
        [[b for kjt in kjts for b in kjt.stride_per_key_per_rank()[f]] for f in range(len(keys))]
        if variable
        else None
    )
    return KeyedJaggedTensor(
        keys, torch.cat(values), lengths=torch.cat(lengths), stride_per_key_per_rank=per_rank
    )


def _micro_batches(variable: bool) -> list[KeyedJaggedTensor]:
    sizes = [[3, 2, 4], [2, 3, 1], [4, 4, 2], [1, 2, 3]]
    return [
        random_kjt(FEATURES, 3, seed=10 + j, batch_sizes=sizes[j] if variable else None)
        for j in range(K)
    ]


def _grad_like(out: Tensor, seed: int) -> Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))


def _sequence_join(grads: Sequence[Tensor], kjts: Sequence[KeyedJaggedTensor]) -> Tensor:
    """Per feature, each micro-batch's rows of it, in the joined batch's order."""
    parts = []
    for f in range(len(FEATURES)):
        for grad, kjt in zip(grads, kjts, strict=True):
            lo, hi = kjt.offset_per_key()[f], kjt.offset_per_key()[f + 1]
            parts.append(grad[lo:hi])
    return torch.cat(parts)


def _state(kernel: BatchedFusedEmbeddingBag | BatchedFusedEmbedding) -> list[Tensor]:
    weights = [w.detach().clone() for w in kernel.split_embedding_weights()]
    states = [
        s.clone() for table in kernel.emb_module.get_optimizer_state() for s in table.values()
    ]
    return weights + states


CASES = [
    ("sgd", "torch", PoolingType.SUM, True, False),
    ("sgd", "torch", PoolingType.SUM, False, False),
    ("sgd", "torch", PoolingType.MEAN, True, True),
    ("sgd", "fbgemm", PoolingType.SUM, True, False),
    ("sgd", "torch", PoolingType.NONE, True, False),
    ("rowwise_adagrad", "torch", PoolingType.SUM, True, False),
    ("rowwise_adagrad", "torch", PoolingType.SUM, True, True),
    ("rowwise_adagrad", "fbgemm", PoolingType.SUM, True, False),
    ("rowwise_adagrad", "torch", PoolingType.NONE, True, False),
    ("adam", "torch", PoolingType.SUM, True, False),
    ("adam", "torch", PoolingType.SUM, True, True),
    ("adam", "torch", PoolingType.NONE, True, False),
]


@pytest.mark.parametrize(("optim", "backend", "pooling", "fast", "variable"), CASES)
def test_k_micro_batches_equal_one_step_on_their_concatenation(
    optim: str, backend: Backend, pooling: PoolingType, fast: bool, variable: bool
) -> None:
    spec = SPECS[optim]
    acc = _kernel(spec, backend, pooling, fast=fast)
    ref = _kernel(spec, backend, pooling, fast=fast)
    if backend == "fbgemm":
        assert isinstance(acc.emb_module, FbgemmFusedTBE)
    kjts = _micro_batches(variable)
    before = _state(acc)
    grads = []
    for j, kjt in enumerate(kjts):
        if j < K - 1:
            with defer_sparse_updates(acc):
                out = acc(kjt)
                grads.append(_grad_like(out, 100 + j))
                out.backward(grads[-1])
            assert acc.grad_accumulation.pending == j + 1
            assert bit_identical(_state(acc), before)  # nothing applied yet
        else:
            out = acc(kjt)
            grads.append(_grad_like(out, 100 + j))
            out.backward(grads[-1])
    assert acc.grad_accumulation.pending == 0
    joined = _join(kjts, variable)
    out = ref(joined)
    grad = _sequence_join(grads, kjts) if pooling is PoolingType.NONE else torch.cat(grads)
    out.backward(grad)
    if optim == "sgd":
        assert bit_identical(_state(acc), _state(ref))
    else:
        for a, r in zip(_state(acc), _state(ref), strict=True):
            torch.testing.assert_close(a, r, atol=1e-6, rtol=0)
    assert not bit_identical(_state(acc), before)


def test_the_next_window_starts_fresh() -> None:
    """Two windows of two micro-batches: two steps, each on its window's concatenation."""
    spec = SPECS["adam"]
    acc, ref = _kernel(spec, "torch", PoolingType.SUM), _kernel(spec, "torch", PoolingType.SUM)
    kjts = _micro_batches(False)
    grads = [torch.randn(3, 28, generator=torch.Generator().manual_seed(j)) for j in range(K)]
    for window in (0, 2):
        with defer_sparse_updates(acc):
            acc(kjts[window]).backward(grads[window])
        acc(kjts[window + 1]).backward(grads[window + 1])
        ref(_join(kjts[window : window + 2], False)).backward(torch.cat(grads[window : window + 2]))
    assert acc.emb_module.step == ref.emb_module.step == 2
    for a, r in zip(_state(acc), _state(ref), strict=True):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=0)


def test_collection_defers_every_kernel_and_refuses_a_mid_window_state_dict() -> None:
    spec = SPECS["sgd"]
    configs = [
        EmbeddingBagConfig(name="t0", num_embeddings=7, embedding_dim=8, feature_names=("a",)),
        EmbeddingBagConfig(
            name="t1",
            num_embeddings=5,
            embedding_dim=4,
            feature_names=("c",),
            pooling=PoolingType.MEAN,  # another kernel
        ),
    ]
    ebc = EmbeddingBagCollection(configs, optimizer=spec)
    kjt = random_kjt([("a", 7), ("c", 5)], 3, seed=3)
    with defer_sparse_updates(ebc) as accumulations:
        assert len(accumulations) == 2
        ebc(kjt).values().sum().backward()
        with torch.no_grad():  # an evaluation inside the window keeps nothing
            ebc(kjt)
    assert pending_micro_batches(ebc) == 1
    with pytest.raises(RuntimeError, match="not applied yet and would be lost"):
        ebc.state_dict()
    ebc(kjt).values().sum().backward()
    assert pending_micro_batches(ebc) == 0
    assert set(ebc.state_dict()) == {"embedding_bags.t0.weight", "embedding_bags.t1.weight"}


def test_per_sample_weights_that_need_a_gradient_are_refused_before_any_change() -> None:
    spec = SPECS["sgd"]
    config = one_group(table("t0", 7, 8, ["a"], weighted=True, optimizer=spec))
    kernel = BatchedFusedEmbeddingBag(config, backend="torch")
    kjt = random_kjt([("a", 7)], 3, weighted=True, seed=4)
    weights = kjt.weights().clone().requires_grad_(True)
    kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=weights, lengths=kjt.lengths())
    before = _state(kernel)
    with defer_sparse_updates(kernel), pytest.raises(ValueError, match="per-sample weights"):
        kernel(kjt)
    assert kernel.grad_accumulation.pending == 0
    assert bit_identical(_state(kernel), before)


def test_concat_calls_refuses_no_calls_and_mixed_weights() -> None:
    with pytest.raises(ValueError, match="at least one call"):
        concat_calls([], [4], sequence=False)
    call = KernelCall(torch.tensor([0]), torch.tensor([0, 1]), None, None, torch.zeros(1, 4))
    weighted = KernelCall(
        torch.tensor([0]), torch.tensor([0, 1]), torch.ones(1), None, torch.zeros(1, 4)
    )
    with pytest.raises(ValueError, match="per-sample weights"):
        concat_calls([call, weighted], [4], sequence=False)
