"""FBGEMM's CPU backward as the writer of the fast path's summed rows.

``FbgemmRowUpdate`` applies SGD and RowWiseAdagrad to distinct touched rows exactly as
embshard-optim's rules do (within FBGEMM's rounding), touches no other row, and a torch TBE
forced for its hooks uses it where FBGEMM is the faster path (``EMBSHARD_FUSED_PATH``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_same_rows, one_group, table

from embshard_kernels.fbgemm_rows import FbgemmRowUpdate, row_update_refusal
from embshard_kernels.fused import BatchedFusedEmbeddingBag
from embshard_kernels.path_probe import ENV_VAR
from embshard_optim.sparse_rules.adagrad import rowwise_adagrad_update
from embshard_optim.sparse_rules.sgd import sgd_update
from embshard_optim.specs import OptimizerSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

SPECS = {
    "sgd": OptimizerSpec.from_name("sgd", lr=0.3),
    "rowwise_adagrad": OptimizerSpec.from_name("rowwise_adagrad", lr=0.3, eps=1e-3),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_rows_update_as_the_rules_do(name: str) -> None:
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 12, generator=gen)
    momentum = torch.rand(50, generator=gen)
    expected_weight, expected_momentum = weight.clone(), momentum.clone()
    update = FbgemmRowUpdate(spec)
    for step in range(1, 4):
        rows = torch.randperm(50, generator=gen)[:17].sort().values
        grads = torch.randn(17, 12, generator=gen)
        update.apply(spec, weight, momentum, rows, grads.clone())
        rule = sgd_update if name == "sgd" else rowwise_adagrad_update
        rule(spec, expected_weight, {"momentum1": expected_momentum}, rows, grads, step)
    torch.testing.assert_close(weight, expected_weight, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(momentum, expected_momentum, atol=1e-6, rtol=1e-6)
    update.apply(spec, weight, momentum, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 12))
    torch.testing.assert_close(weight, expected_weight, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_repeated_rows_are_summed_in_the_order_given(name: str) -> None:
    # Blocks of rows (two ranks' sorted rows, the shorter one padded with zero gradients on row
    # 0) update bit for bit as their per-row sums, added block by block from zero, do; an
    # untouched row that only got padding stays as it was.
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 8, generator=gen)
    momentum = torch.rand(40, generator=gen)
    summed_weight, summed_momentum = weight.clone(), momentum.clone()
    update = FbgemmRowUpdate(spec)
    for _ in range(3):
        blocks = [torch.randperm(39, generator=gen)[:n].add(1).sort().values for n in (11, 7)]
        grads = [torch.randn(b.numel(), 8, generator=gen) for b in blocks]
        rows = torch.cat([blocks[0], blocks[1], torch.zeros(4, dtype=torch.int64)])
        entries = torch.cat([grads[0], grads[1], torch.zeros(4, 8)])
        update.apply(spec, weight, momentum, rows, entries)
        distinct = torch.cat(blocks).unique()
        sums = torch.zeros(distinct.numel(), 8)
        for block, grad in zip(blocks, grads, strict=True):
            at = torch.searchsorted(distinct, block)
            sums[at] = sums[at] + grad  # one block at a time: rank order
        update.apply(spec, summed_weight, summed_momentum, distinct, sums)
        assert torch.equal(weight, summed_weight)
        assert torch.equal(momentum, summed_momentum)
    assert torch.equal(weight[0], summed_weight[0])


def test_what_it_refuses() -> None:
    weight = torch.zeros(4, 4)
    adam = OptimizerSpec.from_name("adam", lr=0.1)
    assert "no ADAM" in (row_update_refusal(adam, weight) or "")
    decayed = OptimizerSpec.from_name("rowwise_adagrad", lr=0.1, weight_decay=0.1)
    assert "weight decay" in (row_update_refusal(decayed, weight) or "")
    assert "float32 CPU" in (row_update_refusal(SPECS["sgd"], weight.double()) or "")
    with pytest.raises(ValueError, match="no ADAM"):
        FbgemmRowUpdate(adam)


@pytest.mark.parametrize("path", ["fbgemm", "torch"])
def test_forced_torch_tbe_writes_rows_with_fbgemm_where_it_is_faster(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, path)
    spec = SPECS["rowwise_adagrad"]
    config = one_group(table("a", 9, 8, optimizer=spec), table("b", 6, 8, optimizer=spec))
    hooked = BatchedFusedEmbeddingBag(config, backend="torch")
    assert (hooked.emb_module.fast.row_update is not None) is (path == "fbgemm")
    monkeypatch.setenv(ENV_VAR, "torch")
    plain = BatchedFusedEmbeddingBag(config, backend="torch")
    assert plain.emb_module.fast.row_update is None
    with torch.no_grad():
        for a, b in zip(
            hooked.split_embedding_weights(), plain.split_embedding_weights(), strict=True
        ):
            b.copy_(a)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        lengths = torch.randint(0, 4, (8,), generator=gen)
        ids = torch.cat(
            [
                torch.randint(0, 9, (int(lengths[:4].sum()),), generator=gen),
                torch.randint(0, 6, (int(lengths[4:].sum()),), generator=gen),
            ]
        )
        kjt = KeyedJaggedTensor(["a", "b"], ids, lengths=lengths)
        grad = torch.randn(4, 16, generator=gen)
        for kernel in (hooked, plain):
            (kernel(kjt) * grad).sum().backward()
    assert_same_rows(hooked, plain)
