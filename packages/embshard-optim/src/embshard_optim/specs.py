"""What a user asked of an embedding optimizer, in one typed, validated description.

``OptimizerSpec`` is the currency between the user, the sparse update rules and the kernels:
frozen, hashable, validated, and it refuses settings FBGEMM would silently ignore. Weight decay
follows FBGEMM's kernels (see :class:`WeightDecayMode`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from enum import unique
from typing import Any

from embshard_types.vocab import ParsableEnum


@unique
class OptimType(ParsableEnum):
    """The embedding optimizers embshard runs (FBGEMM's ``EmbOptimType`` members of the same name)."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_rowwise_adam"
    LAMB = "lamb"
    PARTIAL_ROWWISE_LAMB = "partial_rowwise_lamb"
    LARS_SGD = "lars_sgd"


@unique
class WeightDecayMode(ParsableEnum):
    """How weight decay enters the update (FBGEMM's ``WeightDecayMode``).

    As in FBGEMM's kernels: RowWiseAdagrad takes ``L2`` or ``DECOUPLED``; Adam always decouples
    (AdamW); LAMB adds decay to the update before the trust ratio; LARS-SGD to the gradient.
    ``NONE`` with ``weight_decay > 0`` means the optimizer's own mode.
    """

    NONE = "none"
    L2 = "l2"
    """Added to the gradient: ``g + weight_decay * w``."""
    DECOUPLED = "decoupled"
    """Applied to the weights apart from the gradient statistics (AdamW-style)."""


# Optimizer state per type: (name, row-wise?) in the order the kernel keeps them.
_STATE: dict[OptimType, tuple[tuple[str, bool], ...]] = {
    OptimType.SGD: (),
    OptimType.ADAGRAD: (("momentum1", False),),
    OptimType.ROWWISE_ADAGRAD: (("momentum1", True),),
    OptimType.ADAM: (("momentum1", False), ("momentum2", False)),
    OptimType.PARTIAL_ROWWISE_ADAM: (("momentum1", False), ("momentum2", True)),
    OptimType.LAMB: (("momentum1", False), ("momentum2", False)),
    OptimType.PARTIAL_ROWWISE_LAMB: (("momentum1", False), ("momentum2", True)),
    OptimType.LARS_SGD: (("momentum1", False),),
}

# The weight-decay modes each optimizer's kernel implements; the first is its default.
_DECAY_MODES: dict[OptimType, tuple[WeightDecayMode, ...]] = {
    OptimType.SGD: (),
    OptimType.ADAGRAD: (),
    OptimType.ROWWISE_ADAGRAD: (WeightDecayMode.L2, WeightDecayMode.DECOUPLED),
    OptimType.ADAM: (WeightDecayMode.DECOUPLED,),
    OptimType.PARTIAL_ROWWISE_ADAM: (WeightDecayMode.DECOUPLED,),
    OptimType.LAMB: (WeightDecayMode.DECOUPLED,),
    OptimType.PARTIAL_ROWWISE_LAMB: (WeightDecayMode.DECOUPLED,),
    OptimType.LARS_SGD: (WeightDecayMode.L2,),
}

_NAMES: dict[str, tuple[OptimType, WeightDecayMode | None]] = {
    "sgd": (OptimType.SGD, None),
    "exactsgd": (OptimType.SGD, None),
    "adagrad": (OptimType.ADAGRAD, None),
    "exactadagrad": (OptimType.ADAGRAD, None),
    "rowwiseadagrad": (OptimType.ROWWISE_ADAGRAD, None),
    "exactrowwiseadagrad": (OptimType.ROWWISE_ADAGRAD, None),
    "adam": (OptimType.ADAM, None),
    "adamw": (OptimType.ADAM, WeightDecayMode.DECOUPLED),
    "partialrowwiseadam": (OptimType.PARTIAL_ROWWISE_ADAM, None),
    "lamb": (OptimType.LAMB, None),
    "partialrowwiselamb": (OptimType.PARTIAL_ROWWISE_LAMB, None),
    "larssgd": (OptimType.LARS_SGD, None),
    "lars": (OptimType.LARS_SGD, None),
}

_SPEC_FIELDS = (
    "learning_rate",
    "eps",
    "beta1",
    "beta2",
    "weight_decay",
    "weight_decay_mode",
    "momentum",
    "eta",
    "max_norm",
    "stochastic_rounding",
)
# The float fields; each must be given as a number (an int or a float, not a bool or a string).
_NUMBER_FIELDS = (
    "learning_rate",
    "eps",
    "beta1",
    "beta2",
    "weight_decay",
    "momentum",
    "eta",
    "max_norm",
)
# torch.optim arguments that only choose an implementation; they do not change the math.
_IMPLEMENTATION_KNOBS = frozenset({"foreach", "capturable", "differentiable", "fused"})


@dataclass(frozen=True)
class OptimizerSpec:
    """One embedding optimizer and its hyperparameters.

    Args:
        optim_type: an ``OptimType`` or its name.
        eps: added to the denominator of Adagrad / Adam / LAMB updates.
        beta1, beta2: moment decays (Adam, LAMB families).
        weight_decay, weight_decay_mode: see :class:`WeightDecayMode`.
        momentum, eta: LARS-SGD's momentum and trust coefficient.
        max_norm: RowWiseAdagrad only: rows longer than it after the update are scaled back
            to it (0 disables).
        stochastic_rounding: round FP16 weights stochastically in the kernel.

    Raises:
        ValueError: a number out of range, or a setting the optimizer's kernel ignores.
    """

    optim_type: OptimType
    learning_rate: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecayMode = WeightDecayMode.NONE
    momentum: float = 0.9
    eta: float = 0.001
    max_norm: float = 0.0
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        kind = OptimType.parse(self.optim_type, what="OptimizerSpec.optim_type")
        object.__setattr__(self, "optim_type", kind)
        where = f"OptimizerSpec({kind.name})"
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{where}: {name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        _check_range(where, "learning_rate", self.learning_rate, low=0.0)
        _check_range(where, "eps", self.eps, low=0.0)
        _check_range(where, "weight_decay", self.weight_decay, low=0.0)
        _check_range(where, "max_norm", self.max_norm, low=0.0)
        _check_range(where, "eta", self.eta, low=0.0)
        for name in ("beta1", "beta2", "momentum"):
            _check_range(where, name, getattr(self, name), low=0.0, below=1.0)
        if not isinstance(self.stochastic_rounding, bool | int):
            raise TypeError(
                f"{where}: stochastic_rounding must be True or False, got "
                f"{self.stochastic_rounding!r}"
            )
        object.__setattr__(self, "stochastic_rounding", bool(self.stochastic_rounding))

        mode = WeightDecayMode.parse(self.weight_decay_mode, what=f"{where}.weight_decay_mode")
        supported = _DECAY_MODES[kind]
        if self.weight_decay > 0.0:
            if not supported:
                raise ValueError(
                    f"{where}: FBGEMM's {kind.name} applies no weight decay, so "
                    f"weight_decay={self.weight_decay} would be ignored; set weight_decay=0 or "
                    "use ROWWISE_ADAGRAD (L2 or DECOUPLED) or ADAM with decoupled decay"
                )
            if mode is WeightDecayMode.NONE:
                mode = supported[0]
            elif mode not in supported:
                names = ", ".join(m.name for m in supported)
                raise ValueError(
                    f"{where}: weight_decay_mode {mode.name} is not what FBGEMM's {kind.name} "
                    f"kernel implements; it supports {names}"
                )
        object.__setattr__(self, "weight_decay_mode", mode)
        if self.max_norm > 0.0 and kind is not OptimType.ROWWISE_ADAGRAD:
            raise ValueError(
                f"{where}: max_norm is implemented only for ROWWISE_ADAGRAD; set max_norm=0"
            )

    # -- state ------------------------------------------------------------------------------

    def state_names(self) -> tuple[str, ...]:
        """Names of the optimizer state tensors, in the kernel's order (e.g. ``("momentum1",)``)."""
        return tuple(name for name, _ in _STATE[self.optim_type])

    def state_is_rowwise(self, name: str) -> bool:
        """Whether state ``name`` holds one value per row (else per element); ``ValueError`` for
        a name not in :meth:`state_names`."""
        for state_name, rowwise in _STATE[self.optim_type]:
            if state_name == name:
                return rowwise
        raise ValueError(
            f"{self.optim_type.name} has no optimizer state {name!r}; "
            f"its states are {list(self.state_names())}"
        )

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_name(cls, name: str | OptimType, **kwargs: Any) -> OptimizerSpec:
        """Build a spec from an optimizer name and hyperparameters.

        Args:
            name: an ``OptimType`` or its name, e.g. ``"rowwise_adagrad"`` or ``"adamw"`` (case,
                ``_``, ``-``, spaces and FBGEMM's ``exact_`` prefix are ignored).
            **kwargs: spec fields or their ``torch.optim`` spellings (``lr``, ``betas``).

        Raises:
            ValueError: unknown name, unknown or conflicting keyword, or an invalid value.
        """
        if isinstance(name, OptimType):
            kind, mode = name, None
        else:
            key = "".join(ch for ch in str(name).lower() if ch not in "_- ")
            if key not in _NAMES:
                valid = sorted({k.value for k in OptimType} | {"adamw"})
                raise ValueError(f"unknown optimizer name {name!r}; expected one of {valid}")
            kind, mode = _NAMES[key]
        fields = _translate_kwargs(kwargs, what=f"optimizer {name!r}")
        if mode is not None:
            fields.setdefault("weight_decay_mode", mode)
        return cls(kind, **fields)

    @classmethod
    def from_torch(cls, optim_cls: type, **kwargs: Any) -> OptimizerSpec:
        """Build a spec from a ``torch.optim`` class and the keyword arguments it would take.

        Left-out arguments take the class's defaults. Classes other than ``torch.optim``'s SGD,
        Adagrad, Adam and AdamW are looked up by name (TorchRec's ``RowWiseAdagrad``, ``LAMB``...).

        Raises:
            ValueError: the class or an argument has no fused equivalent.
        """
        import torch

        where = f"{optim_cls.__name__}"
        merged = {**_signature_defaults(optim_cls), **kwargs}
        for knob in _IMPLEMENTATION_KNOBS:
            merged.pop(knob, None)
        if merged.pop("maximize", False):
            raise ValueError(f"{where}: maximize=True has no fused equivalent; negate the loss")
        mode: WeightDecayMode | None = None
        if optim_cls is torch.optim.SGD:
            kind = OptimType.SGD
            _require(merged, where, momentum=0.0, dampening=0.0, nesterov=False)
            _require(merged, where, weight_decay=0.0, hint="FBGEMM's SGD has no weight decay")
        elif optim_cls is torch.optim.Adagrad:
            kind = OptimType.ADAGRAD
            _require(merged, where, lr_decay=0.0, initial_accumulator_value=0.0)
            _require(merged, where, weight_decay=0.0, hint="FBGEMM's Adagrad has no weight decay")
        elif optim_cls is torch.optim.Adam or optim_cls is torch.optim.AdamW:
            kind = OptimType.ADAM
            _require(merged, where, amsgrad=False)
            decoupled = bool(merged.pop("decoupled_weight_decay", False))
            if optim_cls is torch.optim.AdamW or decoupled:
                mode = WeightDecayMode.DECOUPLED
            else:
                _require(
                    merged,
                    where,
                    weight_decay=0.0,
                    hint="FBGEMM's Adam decays weights decoupled; use torch.optim.AdamW",
                )
        else:
            # Not a torch.optim class: look it up by name, refusing arguments it cannot honour.
            _require(merged, where, lr_decay=0.0, initial_accumulator_value=0.0, amsgrad=False)
            return cls.from_name(optim_cls.__name__, **merged)
        fields = _translate_kwargs(merged, what=where)
        if mode is not None:
            fields.setdefault("weight_decay_mode", mode)
        return cls(kind, **fields)


def _check_range(
    where: str, name: str, value: float, *, low: float, below: float | None = None
) -> None:
    if not math.isfinite(value) or value < low or (below is not None and value >= below):
        bound = f"in [{low}, {below})" if below is not None else f">= {low}"
        raise ValueError(f"{where}: {name} must be finite and {bound}, got {value}")


def _signature_defaults(optim_cls: type) -> dict[str, Any]:
    """The keyword defaults of ``optim_cls.__init__`` (empty when it cannot be inspected)."""
    try:
        params = inspect.signature(optim_cls.__init__).parameters  # type: ignore[misc]
    except (TypeError, ValueError):
        return {}
    return {
        n: p.default
        for n, p in params.items()
        if n not in ("self", "params") and p.default is not inspect.Parameter.empty
    }


def _require(merged: dict[str, Any], where: str, *, hint: str = "", **required: Any) -> None:
    """Pop ``required`` keys from ``merged``, refusing values other than the required ones."""
    for key, expected in required.items():
        value = merged.pop(key, expected)
        if value != expected:
            extra = f" ({hint})" if hint else ""
            raise ValueError(
                f"{where}: {key}={value!r} has no fused embedding equivalent{extra}; "
                f"use {key}={expected!r}"
            )


def _translate_kwargs(kwargs: dict[str, Any], *, what: str) -> dict[str, Any]:
    """Map ``torch.optim`` spellings (``lr``, ``betas``) to spec fields; refuse unknown keys."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "lr":
            targets = {"learning_rate": value}
        elif key == "betas":
            try:
                beta1, beta2 = value
            except (TypeError, ValueError):
                raise ValueError(
                    f"{what}: betas must be a pair (beta1, beta2), got {value!r}"
                ) from None
            targets = {"beta1": beta1, "beta2": beta2}
        elif key in _SPEC_FIELDS:
            targets = {key: value}
        else:
            valid = ", ".join(("lr", "betas", *_SPEC_FIELDS))
            raise ValueError(f"{what}: unknown optimizer argument {key!r}; expected one of {valid}")
        for field_name, field_value in targets.items():
            if field_name in out:
                raise ValueError(
                    f"{what}: {field_name} is given twice (e.g. as lr and learning_rate)"
                )
            out[field_name] = field_value
    return out
