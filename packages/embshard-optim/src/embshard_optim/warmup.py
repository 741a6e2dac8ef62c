"""Learning-rate warm-up and decay schedules applied through a keyed optimizer.

:class:`WarmupOptimizer` sets each param group's learning rate to ``lr * multiplier(i)`` after
every step, following stages (see :class:`WarmupPolicy` for the formulas); after the last stage
the multiplier is 1. The step counter lives in the optimizer state, so it is checkpointed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import unique

import torch

from embshard_optim.keyed import KeyedOptimizer, OptimizerWrapper
from embshard_types.vocab import ParsableEnum


@unique
class WarmupPolicy(ParsableEnum):
    """The shape of one warm-up stage (TorchRec's ``WarmupPolicy``): its multiplier at step ``i``,
    with ``v`` the stage's ``value``, times its ``lr_scale``."""

    NONE = "none"
    """``1``."""
    LINEAR = "linear"
    """``v + (1 - v) * i / max_iters`` (from ``v`` up to 1)."""
    CONSTANT = "constant"
    """``v``."""
    POLY = "poly"
    """``max(0, 1 - i / decay_iters) ** v`` (``decay_iters`` defaults to ``max_iters``)."""
    STEP = "step"
    """``v ** (i // decay_iters)`` (``decay_iters`` defaults to 1)."""
    INVSQRT = "inv_sqrt"
    """``1 / sqrt(max(i, 1))``."""
    COSINE_ANNEALING_WARM_RESTARTS = "cosine_annealing_warm_restarts"
    """``v + (1 - v) * (1 + cos(pi * (i % sgdr_period) / sgdr_period)) / 2``."""


@dataclass(frozen=True)
class WarmupStage:
    """One stage of a schedule, in force while ``i <= max_iters`` (formulas: ``WarmupPolicy``).

    Args:
        policy: the stage's shape.
        max_iters: the last step (counted from the start) this stage is in force for.
        value: the policy's parameter (start factor, constant, power, step factor, floor).
        lr_scale: a factor on the stage's multiplier.
        decay_iters: ``POLY``'s horizon and ``STEP``'s step length (``<= 0``: the default).
        sgdr_period: the cosine schedule's period.
    """

    policy: WarmupPolicy = WarmupPolicy.LINEAR
    max_iters: int = 1
    value: float = 1.0
    lr_scale: float = 1.0
    decay_iters: int = -1
    sgdr_period: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", WarmupPolicy.parse(self.policy, what="WarmupStage"))
        if self.max_iters <= 0:
            raise ValueError(f"warm-up stage {self}: max_iters must be positive")
        if self.sgdr_period <= 0:
            raise ValueError(f"warm-up stage {self}: sgdr_period must be positive")

    def multiplier(self, iteration: int) -> float:
        """The learning-rate multiplier of this stage after ``iteration`` steps."""
        i, v, policy = iteration, self.value, self.policy
        decay = self.decay_iters
        if decay <= 0:
            decay = 1 if policy is WarmupPolicy.STEP else self.max_iters
        if policy is WarmupPolicy.LINEAR:
            factor = v + (1.0 - v) * i / self.max_iters
        elif policy is WarmupPolicy.CONSTANT:
            factor = v
        elif policy is WarmupPolicy.POLY:
            factor = max(0.0, 1.0 - i / decay) ** v
        elif policy is WarmupPolicy.STEP:
            factor = v ** (i // decay)
        elif policy is WarmupPolicy.INVSQRT:
            factor = 1.0 / math.sqrt(max(i, 1))
        elif policy is WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS:
            phase = (i % self.sgdr_period) / self.sgdr_period
            factor = v + (1.0 - v) * 0.5 * (1.0 + math.cos(math.pi * phase))
        else:
            factor = 1.0
        return factor * self.lr_scale


def _check_stages(stages: Sequence[WarmupStage]) -> list[WarmupStage]:
    previous = 0
    for stage in stages:
        if stage.max_iters <= previous:
            raise ValueError(
                f"warm-up stage {stage} ends at step {stage.max_iters}, not after the previous "
                f"stage's {previous}; max_iters counts from the start and must grow"
            )
        previous = stage.max_iters
    return [*stages, WarmupStage(WarmupPolicy.NONE, max_iters=1 << 62)]


class WarmupOptimizer(OptimizerWrapper):
    """Wraps a keyed optimizer and schedules its learning rate.

    Args:
        optimizer: the optimizer whose param groups get the learning rate.
        stages: the schedule (see :class:`WarmupStage`).
        lr: the base learning rate the multipliers apply to.
        lr_param: the param-group key to set.
        param_name: the name under which the schedule's state is saved.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        stages: Sequence[WarmupStage],
        lr: float = 0.1,
        lr_param: str = "lr",
        param_name: str = "__warmup",
    ) -> None:
        self._stages = _check_stages(stages)
        self._lr = lr
        self._lr_param = lr_param
        self._holder = torch.empty(0)
        self._counter = torch.zeros(2, dtype=torch.long)  # (iteration, stage)
        super().__init__(
            optimizer, {param_name: self._holder}, {self._holder: {"warmup": self._counter}}
        )
        self._set_lr()

    @property
    def iteration(self) -> int:
        """Steps taken so far."""
        return int(self._counter[0])

    def current_lr(self) -> float:
        """The learning rate the schedule gives now."""
        iteration, stage = (int(x) for x in self._counter.tolist())
        return self._lr * self._stages[stage].multiplier(iteration)

    def _set_lr(self) -> None:
        lr = self.current_lr()
        for group in self.param_groups:
            group[self._lr_param] = lr

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the wrapped optimizer, then advance the schedule by one step."""
        result = super().step(closure)
        iteration, stage = (int(x) for x in self._counter.tolist())
        iteration += 1
        if iteration > self._stages[stage].max_iters and stage + 1 < len(self._stages):
            stage += 1
        self._counter.copy_(torch.tensor([iteration, stage]))
        self._set_lr()
        return result

    def post_load_state_dict(self) -> None:
        """Re-derive the learning rate from the loaded step counter."""
        super().post_load_state_dict()
        self._set_lr()
