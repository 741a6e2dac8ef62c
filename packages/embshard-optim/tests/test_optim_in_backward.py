"""apply_optimizer_in_backward marks parameters as torch does; the marks map to fused specs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from embshard_optim import (
    OptimType,
    apply_optimizer_in_backward,
    in_backward_optimizer,
    in_backward_optimizer_filter,
    in_backward_spec,
)


class RowWiseAdagrad(torch.optim.Optimizer):
    """Stands for TorchRec's class of that name: looked up by name, never stepped here."""

    def __init__(self, params: object, lr: float = 0.01, eps: float = 1e-10) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})  # type: ignore[arg-type]


def test_steps_in_backward_and_records_class_and_kwargs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    sparse, dense = model[0], model[1]
    apply_optimizer_in_backward(torch.optim.SGD, sparse.parameters(), {"lr": 0.1})
    before = sparse.weight.detach().clone()
    x = torch.randn(4, 3)
    reference = nn.Linear(3, 2)
    reference.load_state_dict(sparse.state_dict())
    expected_grad = torch.autograd.grad(dense(reference(x)).sum(), reference.weight)[0]
    dense(sparse(x)).sum().backward()
    assert sparse.weight.grad is None
    torch.testing.assert_close(sparse.weight.detach(), before - 0.1 * expected_grad)
    assert dense.weight.grad is not None
    assert in_backward_optimizer(sparse.weight) == (torch.optim.SGD, {"lr": 0.1})
    assert in_backward_optimizer(dense.weight) is None
    names = [n for n, _ in in_backward_optimizer_filter(model.named_parameters())]
    assert names == ["1.weight", "1.bias"]
    marked = [n for n, _ in in_backward_optimizer_filter(model.named_parameters(), include=True)]
    assert marked == ["0.weight", "0.bias"]


def test_specs_of_fusable_classes() -> None:
    a, b, c = (nn.Parameter(torch.zeros(2, 4)) for _ in range(3))
    apply_optimizer_in_backward(torch.optim.Adagrad, [a], {"lr": 0.5})
    apply_optimizer_in_backward(RowWiseAdagrad, [b], {"lr": 0.2})
    apply_optimizer_in_backward(torch.optim.AdamW, [c], {"lr": 0.3, "weight_decay": 0.1})
    spec_a, spec_b, spec_c = (in_backward_spec(p) for p in (a, b, c))
    assert spec_a is not None and spec_a.optim_type is OptimType.ADAGRAD
    assert (spec_a.learning_rate, spec_a.eps) == (0.5, 1e-10)
    assert spec_b is not None and spec_b.optim_type is OptimType.ROWWISE_ADAGRAD
    assert spec_b.learning_rate == 0.2
    assert spec_c is not None and spec_c.optim_type is OptimType.ADAM
    assert spec_c.weight_decay == 0.1
    assert in_backward_spec(nn.Parameter(torch.zeros(1))) is None


def test_unfusable_declarations_are_refused_with_the_class_and_place() -> None:
    p = nn.Parameter(torch.zeros(2, 4))
    apply_optimizer_in_backward(torch.optim.RMSprop, [p], {"lr": 0.5})
    with pytest.raises(ValueError, match=r"table 't0': .*torch\.optim\.rmsprop\.RMSprop.*Use one"):
        in_backward_spec(p, where="table 't0'")
    q = nn.Parameter(torch.zeros(2, 4))
    apply_optimizer_in_backward(torch.optim.SGD, [q], {"lr": 0.5, "momentum": 0.9})
    with pytest.raises(ValueError, match=r"momentum=0\.9 has no fused embedding equivalent"):
        in_backward_spec(q)
    twice = nn.Parameter(torch.zeros(2, 4))
    apply_optimizer_in_backward(torch.optim.SGD, [twice], {"lr": 0.5})
    apply_optimizer_in_backward(torch.optim.Adagrad, [twice], {"lr": 0.5})
    with pytest.raises(ValueError, match=r"called 2 times on it \(\['SGD', 'Adagrad'\]\)"):
        in_backward_spec(twice)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer subclass"):
        apply_optimizer_in_backward(dict, [nn.Parameter(torch.zeros(1))], {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"parameter 0 must be an nn\.Parameter"):
        apply_optimizer_in_backward(torch.optim.SGD, [torch.zeros(1)], {"lr": 0.1})  # type: ignore[list-item]
    fused = nn.Parameter(torch.zeros(2))
    fused._in_backward_optimizers = []  # type: ignore[attr-defined]  # as fused kernels mark theirs
    with pytest.raises(ValueError, match="already has a fused optimizer"):
        apply_optimizer_in_backward(torch.optim.SGD, [fused], {"lr": 0.1})
