"""Joining replicas' pooled calls into the global batch's call, and a fused TBE applying it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import bit_identical, one_group, table
from torch import Tensor

from embshard_kernels.call_gather import PooledCall, RunIds, join_calls
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_optim.specs import OptimizerSpec

FEATURE_ROWS = (7, 7, 5)  # f0 and f1 read table "a", f2 reads "b"
WIDTH = 4


def _call(batch: int, seed: int, weighted: bool) -> PooledCall:
    """A random call of ``batch`` samples over the three features (some bags empty)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURE_ROWS) * batch,), generator=g)
    per_feature = lengths.view(len(FEATURE_ROWS), batch).sum(1).tolist()
    ids = torch.cat(
        [
            torch.randint(0, r, (n,), generator=g)
            for r, n in zip(FEATURE_ROWS, per_feature, strict=True)
        ]
    )
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    weights = torch.rand(ids.shape, generator=g) + 0.5 if weighted else None
    grad = torch.randn(batch, len(FEATURE_ROWS) * WIDTH, generator=g)
    return PooledCall(ids, offsets, weights, grad)


def _pooled(call: PooledCall, tables: Sequence[Tensor]) -> Tensor:
    """``[batch, features * WIDTH]``: each feature's bags summed from its table."""
    features = len(FEATURE_ROWS)
    batch = (call.offsets.numel() - 1) // features
    out = []
    for f, t in enumerate((0, 0, 1)):
        lo = call.offsets[f * batch : (f + 1) * batch + 1]
        ids = call.indices[int(lo[0]) : int(lo[-1])]
        w = None if call.per_sample_weights is None else call.per_sample_weights[lo[0] : lo[-1]]
        out.append(
            F.embedding_bag(
                ids,
                tables[t],
                lo - lo[0],
                mode="sum",
                per_sample_weights=w,
                include_last_offset=True,
            )
        )
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("weighted", [False, True])
def test_joined_call_pools_each_calls_samples_in_turn(weighted: bool) -> None:
    calls = [_call(3, 1, weighted), _call(0, 2, weighted), _call(4, 3, weighted)]
    joined = join_calls(calls, len(FEATURE_ROWS))
    tables = [torch.randn(7, WIDTH), torch.randn(5, WIDTH)]
    assert torch.equal(_pooled(joined, tables), torch.cat([_pooled(c, tables) for c in calls]))
    assert torch.equal(joined.grad_output, torch.cat([c.grad_output for c in calls]))
    assert joined.indices.numel() == sum(c.indices.numel() for c in calls)


def test_a_call_without_weights_joins_weighted_ones_with_ones() -> None:
    joined = join_calls([_call(2, 1, True), _call(2, 2, False)], len(FEATURE_ROWS))
    assert joined.per_sample_weights is not None
    tables = [torch.randn(7, WIDTH), torch.randn(5, WIDTH)]
    unweighted = _call(2, 2, False)
    assert torch.equal(_pooled(joined, tables)[2:], _pooled(unweighted, tables))


def test_joining_names_the_call_that_does_not_fit() -> None:
    good, bad = _call(2, 1, False), _call(2, 2, False)
    with pytest.raises(ValueError, match="call 1: 5 bags cannot be split evenly over 3"):
        join_calls([good, bad._replace(offsets=bad.offsets[:-1])], len(FEATURE_ROWS))
    with pytest.raises(ValueError, match=r"call 1: expected a \[2, dims\] gradient"):
        join_calls([good, bad._replace(grad_output=bad.grad_output[:1])], len(FEATURE_ROWS))


def _tbe(spec: OptimizerSpec, fbgemm_rows: bool = True) -> TorchFusedTBE:
    config = one_group(
        table("a", 7, WIDTH, ["f0", "f1"], optimizer=spec),
        table("b", 5, WIDTH, ["f2"], optimizer=spec),
    )
    tbe = TorchFusedTBE(config, FusedParams(spec), fbgemm_rows=fbgemm_rows)
    assert tbe.fast is not None and (tbe.fast.row_update is not None) == fbgemm_rows
    with torch.no_grad():
        tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
    return tbe


@pytest.mark.parametrize("path", ["fbgemm", "torch"])
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_gathered_call_updates_as_the_global_batch(path: str, name: str, weighted: bool) -> None:
    # The hook hands back this call joined with another replica's: the update (FBGEMM's row
    # loop or the torch rules) is the one of the global batch, bit for bit, and no row is
    # exchanged.
    spec = OptimizerSpec.from_name(name, lr=0.2, eps=1e-3)
    replica, reference = _tbe(spec, path == "fbgemm"), _tbe(spec, path == "fbgemm")
    seen: list[list[RunIds]] = []
    for step in range(3):
        mine, other = _call(3, 10 + step, weighted), _call(2, 20 + step, weighted)

        def gather(
            call: PooledCall, features: int, runs: Sequence[RunIds], other: PooledCall = other
        ) -> PooledCall:
            seen.append(list(runs))
            return join_calls([call, other], features)

        replica.call_gather = gather
        replica.grad_exchange = lambda *args: pytest.fail("rows were exchanged")  # type: ignore[assignment,misc]
        out = replica(mine.indices, mine.offsets, mine.per_sample_weights)
        (out * mine.grad_output).sum().backward()
        both = join_calls([mine, other], len(FEATURE_ROWS))
        out = reference(both.indices, both.offsets, both.per_sample_weights)
        (out * both.grad_output).sum().backward()
    assert bit_identical(replica.tables(), reference.tables())
    assert all(
        torch.equal(a[k], b[k])
        for a, b in zip(replica.get_optimizer_state(), reference.get_optimizer_state(), strict=True)
        for k in a
    )
    # one run (both tables are WIDTH wide): its ids in this call, rows and width
    assert [r.rows for r in seen[0]] == [12] and [r.width for r in seen[0]] == [WIDTH]


def test_a_declined_call_exchanges_rows() -> None:
    spec = OptimizerSpec.from_name("sgd", lr=0.2)
    tbe = _tbe(spec)
    exchanged: list[str] = []

    def exchange(label: str, rows: Tensor, grads: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
        exchanged.append(label)
        return rows, grads

    tbe.call_gather = lambda call, features, runs: None
    tbe.grad_exchange = exchange
    call = _call(3, 1, False)
    (tbe(call.indices, call.offsets) * call.grad_output).sum().backward()
    assert exchanged == ["a+b"]
