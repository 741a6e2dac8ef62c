"""OptimizerSpec: construction from torch.optim classes and names, validation, state layout."""

from __future__ import annotations

import pytest
import torch

from embshard_optim.specs import OptimizerSpec, OptimType, WeightDecayMode


def test_from_torch_takes_the_class_defaults() -> None:
    adam = OptimizerSpec.from_torch(torch.optim.Adam)
    assert adam == OptimizerSpec(OptimType.ADAM, learning_rate=1e-3, eps=1e-8)
    adagrad = OptimizerSpec.from_torch(torch.optim.Adagrad, lr=0.05)
    assert (adagrad.optim_type, adagrad.learning_rate, adagrad.eps) == (
        OptimType.ADAGRAD,
        0.05,
        1e-10,
    )
    sgd = OptimizerSpec.from_torch(torch.optim.SGD, lr=0.2, foreach=True)
    assert (sgd.optim_type, sgd.learning_rate) == (OptimType.SGD, 0.2)


def test_from_torch_maps_adamw_to_decoupled_decay() -> None:
    spec = OptimizerSpec.from_torch(torch.optim.AdamW, lr=0.01, betas=(0.8, 0.99))
    assert spec.optim_type is OptimType.ADAM
    assert (spec.beta1, spec.beta2, spec.weight_decay) == (0.8, 0.99, 0.01)
    assert spec.weight_decay_mode is WeightDecayMode.DECOUPLED
    coupled = OptimizerSpec.from_torch(
        torch.optim.Adam, weight_decay=0.1, decoupled_weight_decay=True
    )
    assert coupled.weight_decay_mode is WeightDecayMode.DECOUPLED


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (torch.optim.SGD, {"momentum": 0.9}, "momentum=0.9 has no fused"),
        (torch.optim.SGD, {"weight_decay": 0.1}, "FBGEMM's SGD has no weight decay"),
        (torch.optim.Adam, {"weight_decay": 0.1}, "use torch.optim.AdamW"),
        (torch.optim.Adam, {"amsgrad": True}, "amsgrad"),
        (torch.optim.Adagrad, {"lr_decay": 0.1}, "lr_decay"),
        (torch.optim.Adagrad, {"maximize": True}, "negate the loss"),
        (torch.optim.RMSprop, {}, "unknown optimizer name 'RMSprop'"),
    ],
)
def test_from_torch_refuses_what_has_no_fused_equivalent(
    cls: type, kwargs: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        OptimizerSpec.from_torch(cls, **kwargs)


def test_from_torch_looks_other_classes_up_by_name() -> None:
    class RowWiseAdagrad(torch.optim.Optimizer):  # the shape of TorchRec's class
        def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10):  # type: ignore[no-untyped-def]
            super().__init__(params, {})

    spec = OptimizerSpec.from_torch(RowWiseAdagrad, lr=0.1, weight_decay=0.01)
    assert spec.optim_type is OptimType.ROWWISE_ADAGRAD
    assert (spec.learning_rate, spec.eps, spec.weight_decay) == (0.1, 1e-10, 0.01)
    assert spec.weight_decay_mode is WeightDecayMode.L2  # the optimizer's own mode


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("sgd", OptimType.SGD),
        ("EXACT_SGD", OptimType.SGD),
        ("exact_rowwise_adagrad", OptimType.ROWWISE_ADAGRAD),
        ("RowWiseAdagrad", OptimType.ROWWISE_ADAGRAD),
        ("partial-rowwise-adam", OptimType.PARTIAL_ROWWISE_ADAM),
        ("PartialRowWiseLAMB", OptimType.PARTIAL_ROWWISE_LAMB),
        ("LarsSGD", OptimType.LARS_SGD),
        (OptimType.LAMB, OptimType.LAMB),
    ],
)
def test_from_name(name: str | OptimType, kind: OptimType) -> None:
    assert OptimizerSpec.from_name(name, lr=0.3).optim_type is kind


def test_from_name_kwargs() -> None:
    spec = OptimizerSpec.from_name("adamw", learning_rate=0.1, betas=(0.5, 0.6), weight_decay=0.2)
    assert (spec.learning_rate, spec.beta1, spec.beta2) == (0.1, 0.5, 0.6)
    assert spec.weight_decay_mode is WeightDecayMode.DECOUPLED
    with pytest.raises(ValueError, match="given twice"):
        OptimizerSpec.from_name("adam", lr=0.1, learning_rate=0.2)
    with pytest.raises(ValueError, match="unknown optimizer argument 'nesterov'"):
        OptimizerSpec.from_name("adam", nesterov=True)
    with pytest.raises(ValueError, match="betas must be a pair"):
        OptimizerSpec.from_name("adam", betas=0.9)
    with pytest.raises(ValueError, match="unknown optimizer name 'adamax'"):
        OptimizerSpec.from_name("adamax")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optim_type": "sgd", "weight_decay": 0.1}, "applies no weight decay"),
        ({"optim_type": "adagrad", "weight_decay": 0.1}, "applies no weight decay"),
        (
            {"optim_type": "adam", "weight_decay": 0.1, "weight_decay_mode": "l2"},
            "supports DECOUPLED",
        ),
        ({"optim_type": "adam", "max_norm": 1.0}, "max_norm is implemented only"),
        ({"optim_type": "adam", "beta1": 1.0}, r"beta1 must be finite and in \[0.0, 1.0\)"),
        ({"optim_type": "sgd", "learning_rate": -1.0}, "learning_rate must be finite"),
        ({"optim_type": "sgd", "learning_rate": float("nan")}, "learning_rate must be finite"),
        ({"optim_type": "rmsprop"}, "unknown OptimType 'rmsprop'"),
        ({"optim_type": "adam", "weight_decay_mode": "cowclip"}, "unknown WeightDecayMode"),
    ],
)
def test_invalid_specs_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OptimizerSpec(**kwargs)


def test_weight_decay_mode_defaults_to_the_optimizers_own() -> None:
    assert (
        OptimizerSpec("rowwise_adagrad", weight_decay=0.1).weight_decay_mode is WeightDecayMode.L2
    )
    assert OptimizerSpec("lars_sgd", weight_decay=0.1).weight_decay_mode is WeightDecayMode.L2
    assert OptimizerSpec("lamb", weight_decay=0.1).weight_decay_mode is WeightDecayMode.DECOUPLED
    assert OptimizerSpec("adam").weight_decay_mode is WeightDecayMode.NONE


def test_specs_are_frozen_and_hashable() -> None:
    spec = OptimizerSpec("adam", learning_rate=1)
    assert isinstance(spec.learning_rate, float)
    assert {spec: 1}[OptimizerSpec(OptimType.ADAM, learning_rate=1.0)] == 1
    with pytest.raises(AttributeError):
        spec.learning_rate = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kind", "states"),
    [
        (OptimType.SGD, {}),
        (OptimType.ADAGRAD, {"momentum1": False}),
        (OptimType.ROWWISE_ADAGRAD, {"momentum1": True}),
        (OptimType.ADAM, {"momentum1": False, "momentum2": False}),
        (OptimType.PARTIAL_ROWWISE_ADAM, {"momentum1": False, "momentum2": True}),
        (OptimType.LAMB, {"momentum1": False, "momentum2": False}),
        (OptimType.PARTIAL_ROWWISE_LAMB, {"momentum1": False, "momentum2": True}),
        (OptimType.LARS_SGD, {"momentum1": False}),
    ],
)
def test_state_names_and_rowwise_flags(kind: OptimType, states: dict[str, bool]) -> None:
    spec = OptimizerSpec(kind)
    assert spec.state_names() == tuple(states)
    assert {name: spec.state_is_rowwise(name) for name in spec.state_names()} == states
    with pytest.raises(ValueError, match="has no optimizer state 'momentum3'"):
        spec.state_is_rowwise("momentum3")


@pytest.mark.parametrize("field", ["eta", "max_norm", "momentum", "learning_rate"])
def test_a_non_number_names_the_field_and_the_optimizer(field: str) -> None:
    with pytest.raises(TypeError, match=rf"OptimizerSpec\(LARS_SGD\): {field} must be a number, got 'fast'"):  # fmt: skip
        OptimizerSpec.from_name("lars_sgd", **{field: "fast"})
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False, got 'no'"):
        OptimizerSpec("sgd", stochastic_rounding="no")  # type: ignore[arg-type]
