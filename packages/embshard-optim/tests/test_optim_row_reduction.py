"""Sparse rules on column shards with a RowReduction: each shard gets the full-row update.

Two threads play two column shards of one table; their ``row_sum`` meets at a barrier, adds
the partial sums in shard order, and returns the same bits to both. Every optimizer must then
leave each shard's columns (and its copy of any row-wise state) equal to the update of the
whole table; without the reduction, row-wise optimizers would differ.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_optim_sparse_rules import SPECS, _spec_id
from torch import Tensor

from embshard_optim.sparse_rules import rule_for
from embshard_optim.sparse_rules.base import RowReduction, SparseRule
from embshard_optim.specs import OptimizerSpec, OptimType

ROWS, DIM, SPLIT, STEPS = 10, 8, 4, 3


class _TwoShardSum:
    """``row_sum`` for two threads: gather both partial sums, add them in shard order."""

    def __init__(self) -> None:
        self._parts: list[Tensor | None] = [None, None]
        self._barrier = threading.Barrier(2)

    def for_shard(self, shard: int) -> RowReduction:
        def row_sum(partial: Tensor) -> Tensor:
            self._parts[shard] = partial.clone()
            self._barrier.wait()
            first, second = self._parts
            assert first is not None and second is not None
            total = first + second
            self._barrier.wait()  # both read before the next call overwrites
            return total

        return RowReduction(row_sum, full_dim=DIM)


def _columns(state: dict[str, Tensor], spec: OptimizerSpec, cols: slice) -> dict[str, Tensor]:
    return {
        name: value.clone() if spec.state_is_rowwise(name) else value[:, cols].clone()
        for name, value in state.items()
    }


def _apply_on_shards(
    rule: SparseRule,
    shards: list[tuple[Tensor, dict[str, Tensor]]],
    halves: list[slice],
    rows: Tensor,
    grad: Tensor,
    step: int,
    summer: _TwoShardSum,
) -> None:
    """Apply ``rule`` to both shards at once, one thread each (their row sums meet)."""
    errors: list[BaseException] = []

    def run(shard: int) -> None:
        try:
            w, s = shards[shard]
            g = grad[:, halves[shard]].contiguous()
            rule.apply(w, s, rows, g, step, reduction=summer.for_shard(shard))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_column_shards_with_a_reduction_follow_the_whole_table(spec: OptimizerSpec) -> None:
    gen = torch.Generator().manual_seed(1)
    rule = rule_for(spec)
    weight = torch.randn(ROWS, DIM, generator=gen)
    state = rule.init_state(ROWS, DIM)
    halves = [slice(0, SPLIT), slice(SPLIT, DIM)]
    shards = [(weight[:, c].clone(), _columns(state, spec, c)) for c in halves]
    summer = _TwoShardSum()
    for step in range(1, STEPS + 1):
        rows = torch.unique(torch.randint(0, ROWS, (6,), generator=gen))
        grad = torch.randn(rows.numel(), DIM, generator=gen)
        rule.apply(weight, state, rows, grad, step)
        _apply_on_shards(rule, shards, halves, rows, grad, step, summer)
    for (w, s), cols in zip(shards, halves, strict=True):
        torch.testing.assert_close(w, weight[:, cols], atol=1e-6, rtol=1e-6)
        for name, value in _columns(state, spec, cols).items():
            torch.testing.assert_close(s[name], value, atol=1e-6, rtol=1e-6)


def test_without_a_reduction_row_wise_statistics_stay_per_shard() -> None:
    spec = OptimizerSpec(OptimType.ROWWISE_ADAGRAD, learning_rate=0.1)
    rule = rule_for(spec)
    weight, rows = torch.ones(2, DIM), torch.tensor([0])
    grad = torch.arange(DIM, dtype=torch.float32).view(1, DIM)
    whole = rule.init_state(2, DIM)
    rule.apply(weight.clone(), whole, rows, grad, 1)
    left = rule.init_state(2, SPLIT)
    rule.apply(weight[:, :SPLIT].clone(), left, rows, grad[:, :SPLIT].contiguous(), 1)
    assert not torch.allclose(left["momentum1"], whole["momentum1"])


def test_reduction_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="full_dim must be positive"):
        RowReduction(lambda t: t, full_dim=0)
    with pytest.raises(TypeError, match="callable"):
        RowReduction("sum", full_dim=4)  # type: ignore[arg-type]
    rule = rule_for(OptimizerSpec(OptimType.ROWWISE_ADAGRAD))
    with pytest.raises(ValueError, match="narrower than the shard's 8 columns"):
        rule.apply(
            torch.zeros(2, 8),
            rule.init_state(2, 8),
            torch.tensor([0]),
            torch.ones(1, 8),
            1,
            reduction=RowReduction(lambda t: t, full_dim=4),
        )
