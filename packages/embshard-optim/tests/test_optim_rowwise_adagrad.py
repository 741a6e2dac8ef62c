"""``embshard_optim.RowWiseAdagrad`` against a plain-torch transcription of TorchRec's rule, and
its mapping to the fused ``ROWWISE_ADAGRAD`` when declared with ``apply_optimizer_in_backward``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from embshard_optim import (
    OptimizerSpec,
    OptimType,
    RowWiseAdagrad,
    WeightDecayMode,
    apply_optimizer_in_backward,
    in_backward_spec,
)


def _reference_steps(
    weight: Tensor,
    grads: list[Tensor],
    *,
    lr: float,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
) -> tuple[Tensor, Tensor]:
    """TorchRec's row-wise Adagrad written out with plain tensor ops (float64)."""
    w = weight.detach().double().clone()
    acc = torch.full((w.shape[0], 1), initial, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if maximize:
            g = -g
        g = g + weight_decay * w
        acc = acc + (g * g).mean(dim=1, keepdim=True)
        w = w - lr / (1 + (t - 1) * lr_decay) * g / (acc.sqrt() + eps)
    return w, acc


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.1},
        {"lr": 0.05, "weight_decay": 0.01},
        {"lr": 0.2, "lr_decay": 0.5, "eps": 1e-6},
        {"lr": 0.1, "initial_accumulator_value": 0.3, "maximize": True},
    ],
)
def test_matches_plain_torch_reference(kwargs: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = nn.Parameter(torch.randn(6, 5, generator=gen))
    grads = [torch.randn(6, 5, generator=gen) for _ in range(4)]
    grads[1][2] = 0.0  # a row without gradient in one step
    start = weight.detach().clone()
    opt = RowWiseAdagrad([weight], **kwargs)
    for g in grads:
        weight.grad = g.clone()
        opt.step()
    ref_kwargs = dict(kwargs)
    ref_kwargs["initial"] = ref_kwargs.pop("initial_accumulator_value", 0.0)
    expected_w, expected_acc = _reference_steps(start, grads, **ref_kwargs)
    torch.testing.assert_close(weight.detach().double(), expected_w, rtol=1e-5, atol=1e-6)
    state = opt.state[weight]
    assert state["sum"].shape == (6, 1)
    assert state["step"].item() == 4.0
    torch.testing.assert_close(state["sum"].double(), expected_acc, rtol=1e-5, atol=1e-7)


def test_trains_an_embedding_bag_and_round_trips_its_state() -> None:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 4, mode="sum")
    opt = RowWiseAdagrad(bag.parameters(), lr=0.5)
    ids, offsets = torch.tensor([1, 3, 3, 7]), torch.tensor([0, 2])
    before = bag.weight.detach().clone()
    bag(ids, offsets).sum().backward()
    opt.step()
    changed = (bag.weight.detach() != before).any(dim=1)
    assert changed.tolist() == [i in (1, 3, 7) for i in range(10)]

    again = RowWiseAdagrad([nn.Parameter(torch.zeros(10, 4))], lr=0.5)
    again.load_state_dict(opt.state_dict())
    (loaded,) = again.state.values()
    torch.testing.assert_close(loaded["sum"], opt.state[bag.weight]["sum"])


def test_refuses_bad_arguments_and_parameters() -> None:
    with pytest.raises(ValueError, match="lr must be >= 0"):
        RowWiseAdagrad([nn.Parameter(torch.zeros(2, 2))], lr=-1.0)
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 has shape \(3,\)"):
        RowWiseAdagrad([nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3))])
    weight = nn.Parameter(torch.zeros(4, 2))
    opt = RowWiseAdagrad([weight])
    weight.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()


def test_in_backward_maps_to_the_fused_rowwise_adagrad() -> None:
    table = nn.Parameter(torch.zeros(8, 4))
    apply_optimizer_in_backward(RowWiseAdagrad, [table], {"lr": 0.3, "weight_decay": 0.01})
    spec = in_backward_spec(table, "table t")
    assert spec == OptimizerSpec(
        OptimType.ROWWISE_ADAGRAD,
        learning_rate=0.3,
        eps=1e-10,
        weight_decay=0.01,
        weight_decay_mode=WeightDecayMode.L2,
    )
    with pytest.raises(ValueError, match="lr_decay"):
        other = nn.Parameter(torch.zeros(8, 4))
        apply_optimizer_in_backward(RowWiseAdagrad, [other], {"lr": 0.3, "lr_decay": 0.1})
        in_backward_spec(other, "table u")


def test_in_backward_steps_a_dense_table_like_the_optimizer() -> None:
    torch.manual_seed(1)
    bag = nn.EmbeddingBag(10, 4, mode="sum")
    twin = nn.EmbeddingBag(10, 4, mode="sum")
    twin.load_state_dict(bag.state_dict())
    apply_optimizer_in_backward(RowWiseAdagrad, bag.parameters(), {"lr": 0.2})
    opt = RowWiseAdagrad(twin.parameters(), lr=0.2)
    ids, offsets = torch.tensor([0, 4, 4, 9]), torch.tensor([0, 3])
    for _ in range(2):
        bag(ids, offsets).square().sum().backward()
        twin(ids, offsets).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert bag.weight.grad is None
    torch.testing.assert_close(bag.weight.detach(), twin.weight.detach())
