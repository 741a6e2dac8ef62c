"""WarmupOptimizer: each schedule against its formula, checkpointing of the schedule state."""

from __future__ import annotations

import math

import pytest
import torch
from _optim_helpers import FakeKernel

from embshard_optim.combined import CombinedOptimizer
from embshard_optim.embedding_fused import EmbeddingFusedOptimizer, TableShardInfo
from embshard_optim.keyed import KeyedOptimizerWrapper
from embshard_optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

BASE_LR = 0.5


def _sgd() -> KeyedOptimizerWrapper:
    p = torch.nn.Parameter(torch.zeros(2))
    return KeyedOptimizerWrapper.from_class({"p": p}, torch.optim.SGD, lr=1.0)


def _lrs(stages: list[WarmupStage], steps: int) -> list[float]:
    """The learning rate in force before each of ``steps`` steps (i = 0, 1, ...)."""
    opt = WarmupOptimizer(_sgd(), stages, lr=BASE_LR)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
    return seen


@pytest.mark.parametrize(
    ("stage", "formula"),
    [
        (WarmupStage(WarmupPolicy.LINEAR, max_iters=10, value=0.2), lambda i: 0.2 + 0.8 * i / 10),
        (WarmupStage(WarmupPolicy.CONSTANT, max_iters=10, value=0.3), lambda i: 0.3),
        (
            WarmupStage(WarmupPolicy.POLY, max_iters=10, value=2.0, decay_iters=8),
            lambda i: max(0.0, 1 - i / 8) ** 2,
        ),
        (WarmupStage(WarmupPolicy.POLY, max_iters=10, value=0.5), lambda i: (1 - i / 10) ** 0.5),
        (
            WarmupStage(WarmupPolicy.STEP, max_iters=10, value=0.5, decay_iters=3),
            lambda i: 0.5 ** (i // 3),
        ),
        (WarmupStage(WarmupPolicy.STEP, max_iters=10, value=0.9), lambda i: 0.9**i),
        (WarmupStage(WarmupPolicy.INVSQRT, max_iters=10), lambda i: 1 / math.sqrt(max(i, 1))),
        (
            WarmupStage(
                WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, max_iters=10, value=0.1, sgdr_period=4
            ),
            lambda i: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i % 4) / 4)),
        ),
        (WarmupStage(WarmupPolicy.NONE, max_iters=10, lr_scale=0.25), lambda i: 0.25),
        (
            WarmupStage(WarmupPolicy.LINEAR, max_iters=10, value=0.0, lr_scale=2.0),
            lambda i: 2.0 * i / 10,
        ),
    ],
    ids=lambda x: getattr(getattr(x, "policy", None), "value", ""),
)
def test_schedule_follows_its_formula(stage: WarmupStage, formula) -> None:  # type: ignore[no-untyped-def]
    seen = _lrs([stage], 14)
    expected = [BASE_LR * formula(i) for i in range(11)] + [BASE_LR] * 3  # then multiplier 1
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_stages_follow_each_other() -> None:
    stages = [
        WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.0),
        WarmupStage(WarmupPolicy.STEP, max_iters=8, value=0.5, decay_iters=2),
    ]
    expected = [i / 4 for i in range(5)] + [0.5 ** (i // 2) for i in range(5, 9)] + [1.0]
    assert _lrs(stages, 10) == pytest.approx([BASE_LR * m for m in expected])


def test_stage_validation() -> None:
    with pytest.raises(ValueError, match="must grow"):
        WarmupOptimizer(_sgd(), [WarmupStage(max_iters=5), WarmupStage(max_iters=5)])
    with pytest.raises(ValueError, match="max_iters must be positive"):
        WarmupStage(max_iters=0)
    with pytest.raises(ValueError, match="unknown WarmupPolicy 'sideways'"):
        WarmupStage("sideways")  # type: ignore[arg-type]


def test_schedule_state_is_checkpointed() -> None:
    stages = [WarmupStage(WarmupPolicy.LINEAR, max_iters=10, value=0.0)]
    opt = WarmupOptimizer(_sgd(), stages, lr=BASE_LR)
    for _ in range(3):
        opt.step()
    saved = opt.state_dict()
    assert saved["state"]["__warmup"]["warmup"].tolist() == [3, 0]

    fresh = WarmupOptimizer(_sgd(), stages, lr=BASE_LR)
    fresh.init_state()
    assert fresh.param_groups[0]["lr"] == 0.0
    fresh.load_state_dict(saved)
    assert fresh.iteration == 3
    assert fresh.param_groups[0]["lr"] == pytest.approx(BASE_LR * 0.3)


def test_fused_optimizer_gets_the_scheduled_rate() -> None:
    kernel = FakeKernel([torch.zeros(3, 2)], [{"momentum1": torch.zeros(3)}])
    fused = EmbeddingFusedOptimizer(
        kernel, [TableShardInfo.whole("t", 3, 2)], learning_rate=0.1, state_format="tensor"
    )
    opt = WarmupOptimizer(
        CombinedOptimizer([("sparse", fused)]),
        [WarmupStage(WarmupPolicy.CONSTANT, max_iters=2, value=0.5)],
        lr=0.2,
    )
    opt.zero_grad()
    assert kernel.learning_rates[-1] == pytest.approx(0.1)
    opt.step()  # pushes 0.1, then schedules step 1
    opt.zero_grad()
    assert kernel.learning_rates[-1] == pytest.approx(0.1)
    opt.step()
    opt.step()  # past the last stage: the base rate
    opt.zero_grad()
    assert kernel.learning_rates[-1] == pytest.approx(0.2)
