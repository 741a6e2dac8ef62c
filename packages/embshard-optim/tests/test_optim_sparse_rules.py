"""Sparse update rules against dense references written from FBGEMM's formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from embshard_optim.sparse_rules import aggregate, rule_for
from embshard_optim.specs import OptimizerSpec, OptimType, WeightDecayMode

ROWS, DIM, STEPS = 24, 6, 4


def _reference(spec: OptimizerSpec, w: Tensor, s: dict[str, Tensor], g: Tensor, t: int):
    """One dense step on every row (callers keep only the touched ones)."""
    lr, eps, b1, b2, wd = spec.learning_rate, spec.eps, spec.beta1, spec.beta2, spec.weight_decay
    mode = spec.weight_decay_mode
    kind = spec.optim_type
    if kind is OptimType.SGD:
        return w - lr * g, {}
    if kind is OptimType.ADAGRAD:
        m = s["momentum1"] + g * g
        return w - lr * g / (m.sqrt() + eps), {"momentum1": m}
    if kind is OptimType.ROWWISE_ADAGRAD:
        g_eff = g + wd * w if mode is WeightDecayMode.L2 else g
        m = s["momentum1"] + (g_eff**2).sum(1) / w.shape[1]
        mult = lr / (m.sqrt() + eps)
        if mode is WeightDecayMode.L2:
            corr = 1 - mult * wd
        elif mode is WeightDecayMode.DECOUPLED:
            corr = torch.full_like(mult, 1 - lr * wd)
        else:
            corr = torch.ones_like(mult)
        new = corr[:, None] * w - mult[:, None] * g
        if spec.max_norm > 0:
            norm = new.norm(dim=1)
            factor = torch.where(norm > spec.max_norm, spec.max_norm / norm, torch.ones_like(norm))
            new = new * factor[:, None]
        return new, {"momentum1": m}
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    m1 = b1 * s["momentum1"] + (1 - b1) * g
    if kind in (OptimType.ADAM, OptimType.LAMB):
        m2 = b2 * s["momentum2"] + (1 - b2) * g * g
        u = (m1 / bc1) / ((m2 / bc2).sqrt() + eps)
    elif kind in (OptimType.PARTIAL_ROWWISE_ADAM, OptimType.PARTIAL_ROWWISE_LAMB):
        m2 = b2 * s["momentum2"] + (1 - b2) * (g * g).mean(1)
        u = (m1 / bc1) / ((m2 / bc2).sqrt() + eps)[:, None]
    if kind in (OptimType.ADAM, OptimType.PARTIAL_ROWWISE_ADAM):
        return w - lr * (u + wd * w), {"momentum1": m1, "momentum2": m2}
    if kind in (OptimType.LAMB, OptimType.PARTIAL_ROWWISE_LAMB):
        r = u + wd * w
        ratio = w.norm(dim=1) / r.norm(dim=1)
        return w - lr * ratio[:, None] * r, {"momentum1": m1, "momentum2": m2}
    assert kind is OptimType.LARS_SGD
    w_norm, g_norm = w.norm(dim=1), g.norm(dim=1)
    adj = lr * spec.eta * w_norm / (g_norm + wd * w_norm)
    m = spec.momentum * s["momentum1"] + adj[:, None] * (g + wd * w)
    return w - m, {"momentum1": m}


SPECS = [
    OptimizerSpec(OptimType.SGD, learning_rate=0.1),
    OptimizerSpec(OptimType.ADAGRAD, learning_rate=0.1),
    OptimizerSpec(OptimType.ROWWISE_ADAGRAD, learning_rate=0.1),
    OptimizerSpec(OptimType.ROWWISE_ADAGRAD, weight_decay=0.05, weight_decay_mode="l2"),
    OptimizerSpec(OptimType.ROWWISE_ADAGRAD, weight_decay=0.05, weight_decay_mode="decoupled"),
    OptimizerSpec(OptimType.ROWWISE_ADAGRAD, learning_rate=0.5, max_norm=0.4),
    OptimizerSpec(OptimType.ADAM, learning_rate=0.05),
    OptimizerSpec(OptimType.ADAM, learning_rate=0.05, weight_decay=0.1),
    OptimizerSpec(OptimType.PARTIAL_ROWWISE_ADAM, learning_rate=0.05, weight_decay=0.1),
    OptimizerSpec(OptimType.LAMB, learning_rate=0.05),
    OptimizerSpec(OptimType.LAMB, learning_rate=0.05, weight_decay=0.1, beta1=0.8),
    OptimizerSpec(OptimType.PARTIAL_ROWWISE_LAMB, learning_rate=0.05, weight_decay=0.1),
    OptimizerSpec(OptimType.LARS_SGD, learning_rate=0.5, eta=0.01),
    OptimizerSpec(OptimType.LARS_SGD, learning_rate=0.5, weight_decay=0.01, momentum=0.5),
]


def _spec_id(spec: OptimizerSpec) -> str:
    extra = f"-wd{spec.weight_decay_mode.value}" if spec.weight_decay else ""
    return f"{spec.optim_type.value}{extra}{'-maxnorm' if spec.max_norm else ''}"


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_rule_matches_dense_reference_on_touched_rows(spec: OptimizerSpec) -> None:
    gen = torch.Generator().manual_seed(0)
    rule = rule_for(spec)
    weight = torch.randn(ROWS, DIM, generator=gen)
    state = rule.init_state(ROWS, DIM)
    ref_w, ref_s = weight.clone(), {k: v.clone() for k, v in state.items()}
    never_touched = torch.arange(ROWS - 4, ROWS)  # these ids never appear
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, ROWS - 4, (30,), generator=gen)  # repeats, and gaps
        grads = torch.randn(30, DIM, generator=gen)
        before_w = weight.clone()
        before_s = {k: v.clone() for k, v in state.items()}
        rows, summed = aggregate(ids, grads)
        rule.apply(weight, state, rows, summed, step)

        dense_g = torch.zeros(ROWS, DIM).index_add_(0, ids, grads)
        touched = torch.zeros(ROWS, dtype=torch.bool)
        touched[ids] = True
        new_w, new_s = _reference(spec, ref_w, ref_s, dense_g, step)
        ref_w = torch.where(touched[:, None], new_w, ref_w)
        for k in ref_s:
            mask = touched if ref_s[k].dim() == 1 else touched[:, None]
            ref_s[k] = torch.where(mask, new_s[k], ref_s[k])

        torch.testing.assert_close(weight[touched], ref_w[touched], rtol=0, atol=1e-6)
        for k in state:
            torch.testing.assert_close(state[k][touched], ref_s[k][touched], rtol=0, atol=1e-6)
        # Untouched rows and their state: bit for bit.
        assert torch.equal(weight[~touched], before_w[~touched])
        for k in state:
            assert torch.equal(state[k][~touched], before_s[k][~touched])
    assert torch.equal(weight[never_touched], ref_w[never_touched])


@pytest.mark.parametrize("spec", SPECS[:3] + SPECS[6:7], ids=_spec_id)
def test_half_precision_weights_follow_float32_math(spec: OptimizerSpec) -> None:
    gen = torch.Generator().manual_seed(1)
    rule = rule_for(spec)
    w32 = torch.randn(ROWS, DIM, generator=gen).half().float()
    w16 = w32.half()
    s32, s16 = rule.init_state(ROWS, DIM), rule.init_state(ROWS, DIM)
    rows = torch.tensor([0, 3, 7])
    grad = torch.randn(3, DIM, generator=gen)
    rule.apply(w32, s32, rows, grad, 1)
    rule.apply(w16, s16, rows, grad.half(), 1)
    assert w16.dtype == torch.float16
    torch.testing.assert_close(w16.float(), w32, rtol=2e-3, atol=2e-3)


def test_empty_rows_change_nothing() -> None:
    rule = rule_for(OptimizerSpec(OptimType.ADAM))
    weight = torch.randn(5, 3)
    state = rule.init_state(5, 3)
    before = weight.clone()
    rule.apply(weight, state, torch.empty(0, dtype=torch.long), torch.empty(0, 3), 1)
    assert torch.equal(weight, before)
    assert all(torch.count_nonzero(v) == 0 for v in state.values())


def test_init_state_shapes_follow_the_spec() -> None:
    state = rule_for(OptimizerSpec(OptimType.PARTIAL_ROWWISE_ADAM)).init_state(7, 3)
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "momentum1": (7, 3),
        "momentum2": (7,),
    }
    assert rule_for(OptimizerSpec(OptimType.SGD)).init_state(7, 3) == {}
    with pytest.raises(ValueError, match="floating point"):
        rule_for(OptimizerSpec(OptimType.ADAGRAD)).init_state(7, 3, dtype=torch.int32)


def _setup() -> tuple:
    rule = rule_for(OptimizerSpec(OptimType.ROWWISE_ADAGRAD))
    weight = torch.randn(6, 4)
    return rule, weight, rule.init_state(6, 4)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"rows": torch.tensor([0, 6])}, IndexError, r"\[0, 6\).*0 to 6"),
        ({"rows": torch.tensor([-1, 0])}, IndexError, "row ids must lie"),
        ({"rows": torch.tensor([0.0])}, TypeError, "rows must be a 1-D int64"),
        ({"grad": torch.randn(2, 3)}, ValueError, r"grad must be .*\[2, 4\]"),
        ({"step": 0}, ValueError, "step must be an int >= 1"),
        ({"state": {}}, ValueError, r"missing \['momentum1'\]"),
        ({"state": {"momentum1": torch.zeros(6, 4)}}, ValueError, r"state 'momentum1'.*\[6\]"),
        ({"weight": torch.randn(6)}, ValueError, "weight must be a 2-D"),
    ],
)
def test_bad_arguments_are_refused_before_any_write(change: dict, error: type, match: str) -> None:
    rule, weight, state = _setup()
    args = {
        "weight": weight,
        "state": state,
        "rows": torch.tensor([0, 2]),
        "grad": torch.randn(2, 4),
        "step": 1,
    }
    args.update(change)
    before = weight.clone()
    with pytest.raises(error, match=match):
        rule.apply(args["weight"], args["state"], args["rows"], args["grad"], args["step"])
    assert torch.equal(weight, before)
    assert torch.count_nonzero(state["momentum1"]) == 0


def test_rule_for_refuses_non_specs() -> None:
    with pytest.raises(TypeError, match="OptimizerSpec"):
        rule_for("adam")  # type: ignore[arg-type]


def test_aggregate_sums_repeated_ids() -> None:
    ids = torch.tensor([5, 1, 5, 3, 1, 5])
    grads = torch.arange(12.0).reshape(6, 2)
    rows, summed = aggregate(ids, grads)
    assert rows.tolist() == [1, 3, 5]
    assert summed.tolist() == [[2 + 8, 3 + 9], [6, 7], [0 + 4 + 10, 1 + 5 + 11]]
    with pytest.raises(ValueError, match="grad_rows must be"):
        aggregate(ids, grads[:3])
    with pytest.raises(ValueError, match="1-D integer"):
        aggregate(ids.float(), grads)


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 9), min_size=0, max_size=40),
    dim=st.integers(1, 5),
)
def test_aggregate_equals_dense_scatter(ids: list[int], dim: int) -> None:
    id_tensor = torch.tensor(ids, dtype=torch.long)
    grads = torch.randn(len(ids), dim, dtype=torch.float64)
    rows, summed = aggregate(id_tensor, grads)
    dense = torch.zeros(10, dim, dtype=torch.float64).index_add_(0, id_tensor, grads)
    assert rows.tolist() == sorted(set(ids))
    torch.testing.assert_close(summed, dense[rows])


def test_parameters_are_updated_in_place_without_autograd() -> None:
    rule = rule_for(OptimizerSpec(OptimType.ROWWISE_ADAGRAD, weight_decay=0.1))
    weight = torch.nn.Parameter(torch.ones(4, 2))
    state = rule.init_state(4, 2)
    rule.apply(weight, state, torch.tensor([1]), torch.ones(1, 2), 1)
    assert weight[0].tolist() == [1.0, 1.0] and weight[1, 0] < 1.0
    assert weight.grad_fn is None
