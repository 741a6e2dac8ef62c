"""KeyedOptimizer, KeyedOptimizerWrapper and CombinedOptimizer: state dicts by name."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from embshard_optim.combined import CombinedOptimizer
from embshard_optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def _train(opt: KeyedOptimizer, model: nn.Module, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()


def _adam(model: nn.Module) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(
        dict(model.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.01)
    )


def _round_trip(obj: object) -> dict:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_state_dict_is_keyed_by_name() -> None:
    model = _model()
    opt = _adam(model)
    _train(opt, model, 2)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(sd["state"]["0.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert sd["param_groups"][0]["params"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sd["param_groups"][0]["lr"] == 0.01
    # Tensors are the optimizer's own, not copies.
    p = model[0].weight
    assert sd["state"]["0.weight"]["exp_avg"] is opt.state[p]["exp_avg"]


def test_round_trip_into_a_fresh_optimizer_continues_identically() -> None:
    model_a = _model()
    opt_a = _adam(model_a)
    _train(opt_a, model_a, 3)
    saved = _round_trip(opt_a.state_dict())
    opt_a.param_groups[0]["lr"] = 0.01  # unchanged, for clarity

    model_b = _model()
    model_b.load_state_dict(model_a.state_dict())
    opt_b = _adam(model_b)
    opt_b.param_groups[0]["lr"] = 0.5  # loading restores 0.01
    opt_b.init_state()
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 0.01

    _train(opt_a, model_a, 2, seed=7)
    _train(opt_b, model_b, 2, seed=7)
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)


def test_init_state_materialises_zero_state_without_touching_parameters() -> None:
    model = _model()
    opt = KeyedOptimizerWrapper(
        dict(model.named_parameters()),
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
    )
    before = [p.detach().clone() for p in model.parameters()]
    model[0].weight.grad = torch.ones_like(model[0].weight)
    opt.init_state()
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert model[0].weight.grad is not None and bool((model[0].weight.grad == 1).all())
    assert model[2].bias.grad is None
    state = opt.state[model[0].weight]
    assert float(state["step"]) == 0.0 and torch.count_nonzero(state["exp_avg"]) == 0
    # A fresh optimizer's first step and one after init_state() agree.
    fresh_model = _model()
    fresh = KeyedOptimizerWrapper(
        dict(fresh_model.named_parameters()),
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
    )
    model[0].weight.grad = None
    _train(opt, model, 1)
    _train(fresh, fresh_model, 1)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_init_state_makes_sparse_gradients_where_asked() -> None:
    emb = nn.Embedding(5, 2, sparse=True)
    opt = KeyedOptimizerWrapper({"emb": emb.weight}, lambda ps: torch.optim.SparseAdam(ps))
    opt.init_state({"emb"})
    assert sorted(opt.state[emb.weight]) == ["exp_avg", "exp_avg_sq", "step"]
    with pytest.raises(ValueError, match=r"unknown sparse parameters \['nope'\]"):
        opt.init_state({"nope"})


def _trained_pair() -> tuple[KeyedOptimizerWrapper, dict]:
    model = _model()
    opt = _adam(model)
    _train(opt, model, 1)
    fresh = _adam(_model())
    fresh.init_state()
    return fresh, _round_trip(opt.state_dict())


def _expect_refusal(opt: KeyedOptimizer, sd: dict, match: str) -> None:
    snapshot = _round_trip(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for key, state in snapshot["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after["state"][key][name]), "state changed on refusal"
    assert after["param_groups"] == snapshot["param_groups"]


def test_missing_parameter_is_refused() -> None:
    opt, sd = _trained_pair()
    del sd["state"]["2.bias"]
    _expect_refusal(opt, sd, r"state is missing parameters \['2.bias'\]")


def test_unexpected_parameter_is_refused() -> None:
    opt, sd = _trained_pair()
    sd["state"]["9.weight"] = {"step": torch.tensor(1.0)}
    _expect_refusal(opt, sd, r"unexpected parameters \['9.weight'\]")


def test_missing_and_extra_state_keys_are_refused() -> None:
    opt, sd = _trained_pair()
    del sd["state"]["0.weight"]["exp_avg"]
    sd["state"]["0.bias"]["momentum_buffer"] = torch.zeros(3)
    sd["param_groups"][0]["lr"] = 123.0
    _expect_refusal(opt, sd, r"(?s)'0.bias'.*unexpected keys \['momentum_buffer'\].*missing keys")


def test_misshaped_state_is_refused() -> None:
    opt, sd = _trained_pair()
    sd["state"]["0.weight"]["exp_avg"] = torch.zeros(4, 3)
    _expect_refusal(
        opt, sd, r"state\['0.weight'\]\['exp_avg'\]: shape \[4, 3\] does not match \[3, 4\]"
    )


def test_wrong_kind_of_value_is_refused() -> None:
    opt, sd = _trained_pair()
    sd["state"]["0.weight"]["exp_avg"] = [1, 2]
    _expect_refusal(opt, sd, "expected a Tensor, got list")


def test_param_group_problems_are_refused() -> None:
    opt, sd = _trained_pair()
    sd["param_groups"][0]["params"] = ["0.weight"]
    _expect_refusal(opt, sd, "no saved group holds parameters")
    opt, sd = _trained_pair()
    del sd["param_groups"][0]["betas"]
    _expect_refusal(opt, sd, r"missing hyperparameters \['betas'\]")
    opt, sd = _trained_pair()
    del sd["param_groups"]
    _expect_refusal(opt, sd, "no 'param_groups'")
    opt.save_param_groups(False)
    opt.load_state_dict(sd)  # accepted once groups are not required


def test_loading_before_init_state_names_the_fix() -> None:
    model = _model()
    opt = _adam(model)
    _train(opt, model, 1)
    fresh = _adam(_model())
    with pytest.raises(ValueError, match="have no optimizer state yet; call init_state"):
        fresh.load_state_dict(opt.state_dict())


def test_construction_refuses_inconsistent_input() -> None:
    a = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="registered under two names"):
        KeyedOptimizerWrapper({"a": a, "b": a}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="state entries belong to tensors"):
        KeyedOptimizer({"a": a}, {torch.zeros(1): {}}, [{"params": [a]}])
    with pytest.raises(ValueError, match="param group 0 holds 1 tensors"):
        KeyedOptimizer({"a": a}, {}, [{"params": [torch.zeros(1)]}])
    with pytest.raises(NotImplementedError, match="KeyedOptimizerWrapper"):
        KeyedOptimizer({"a": a}, {}, [{"params": [a]}]).step()
    with pytest.raises(TypeError, match="CombinedOptimizer"):
        KeyedOptimizer({"a": a}, {}, [{"params": [a]}]).add_param_group({"params": []})


def test_lr_schedulers_drive_keyed_optimizers() -> None:
    model = _model()
    opt = KeyedOptimizerWrapper.from_class(dict(model.named_parameters()), torch.optim.SGD, lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(opt, model, 1)
    scheduler.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.5


# -- CombinedOptimizer ---------------------------------------------------------------------


def _combined(seed: int = 0) -> tuple[CombinedOptimizer, nn.Module, nn.Module]:
    dense, other = _model(seed), _model(seed + 10)
    combined = CombinedOptimizer(
        [
            ("dense", _adam(dense)),
            KeyedOptimizerWrapper.from_class(
                {f"other.{k}": v for k, v in other.named_parameters()}, torch.optim.Adagrad, lr=0.1
            ),
        ]
    )
    return combined, dense, other


def _train_both(combined: CombinedOptimizer, dense: nn.Module, other: nn.Module) -> None:
    gen = torch.Generator().manual_seed(3)
    combined.zero_grad()
    x = torch.randn(8, 4, generator=gen)
    (dense(x).pow(2).mean() + other(x).abs().mean()).backward()
    combined.step()


def test_combined_names_and_round_trip() -> None:
    combined, dense, other = _combined()
    _train_both(combined, dense, other)
    sd = _round_trip(combined.state_dict())
    assert sorted(sd["state"]) == sorted(
        [f"dense.{k}" for k, _ in dense.named_parameters()]
        + [f"other.{k}" for k, _ in other.named_parameters()]
    )
    assert [g["params"][0] for g in sd["param_groups"]] == ["dense.0.bias", "other.0.bias"]

    fresh, fresh_dense, fresh_other = _combined()
    fresh_dense.load_state_dict(dense.state_dict())
    fresh_other.load_state_dict(other.state_dict())
    fresh.init_state()
    fresh.load_state_dict(sd)
    _train_both(combined, dense, other)
    _train_both(fresh, fresh_dense, fresh_other)
    for a, b in zip(
        [*dense.parameters(), *other.parameters()],
        [*fresh_dense.parameters(), *fresh_other.parameters()],
        strict=True,
    ):
        assert torch.equal(a, b)


def test_combined_param_groups_are_the_childrens() -> None:
    combined, _, _ = _combined()
    combined.param_groups[0]["lr"] = 0.25
    child = combined.optimizers[0][1]
    assert child.param_groups[0]["lr"] == 0.25


def test_combined_refuses_duplicate_names_and_bad_children() -> None:
    a = torch.zeros(2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    one = KeyedOptimizerWrapper.from_class({"x": a}, torch.optim.SGD, lr=0.1)
    two = KeyedOptimizerWrapper.from_class({"x": b}, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="parameter name 'x' is used twice"):
        CombinedOptimizer([one, two])
    with pytest.raises(TypeError, match="KeyedOptimizerWrapper"):
        CombinedOptimizer([("p", torch.optim.SGD([a], lr=0.1))])  # type: ignore[list-item]
    assert sorted(CombinedOptimizer([("p", one), ("q", two)]).params) == ["p.x", "q.x"]


def test_combined_refusal_changes_nothing() -> None:
    combined, dense, other = _combined()
    _train_both(combined, dense, other)
    sd = _round_trip(combined.state_dict())
    sd["state"]["other.2.weight"]["sum"] = torch.zeros(7)
    _expect_refusal(combined, sd, r"state\['other.2.weight'\]\['sum'\]: shape \[7\]")
