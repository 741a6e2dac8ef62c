"""How ``choose_fused_path`` picks between FBGEMM and the fast pooled path.

Correctness rules (a forced backend, what FBGEMM cannot run faithfully, what the fast path cannot
serve) always win; between the two faithful paths the override, else the per-process probe,
decides. The probe's decision rule is checked with a path slowed on purpose, so it is exact on a
loaded machine; the real probe is checked for what it must do whatever the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from kernel_testing import one_group, table
from torch import Tensor

from embshard_kernels.fused import BatchedFusedEmbeddingBag
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_kernels.path_probe import (
    ENV_VAR,
    MARGIN,
    Build,
    FusedPath,
    ProbeShape,
    TrainingTBE,
    cached_probes,
    clear_probe_cache,
    faster_path,
    probe_fused_path,
)
from embshard_kernels.tbe import (
    FbgemmFusedTBE,
    build_cpu_tbe,
    choose_fused_path,
    measured_fused_path,
)
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_optim.specs import OptimizerSpec, OptimType

ROWWISE = OptimizerSpec.from_name("rowwise_adagrad", lr=0.1)
SMALL = ProbeShape(rows=64, batch=16, ids_per_bag=4, warmup=1, steps=3)
SLOW = 0.05
"""Seconds a slowed path sleeps per step: far above a small step, even on a loaded host."""


@pytest.fixture(autouse=True)
def _fresh_probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_VAR, raising=False)
    clear_probe_cache()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no thread contention on a loaded host: steps of ~1 ms
    yield
    torch.set_num_threads(threads)
    clear_probe_cache()


def _config(spec: OptimizerSpec = ROWWISE, **kwargs: object) -> GroupedEmbeddingConfig:
    tables = [
        table("a", 7, 8, ["f1", "f2"], optimizer=spec),
        table("b", 5, 8, ["f3"], optimizer=spec),
    ]
    return one_group(*[replace(t, **kwargs) for t in tables])  # type: ignore[arg-type]


def _slowed(path: FusedPath, seconds: float, builds: list[FusedPath] | None = None) -> Build:
    """A probe builder whose ``path`` sleeps ``seconds`` per step (``builds`` logs each build)."""

    def build(config: GroupedEmbeddingConfig, params: FusedParams, which: FusedPath) -> TrainingTBE:
        if builds is not None:
            builds.append(which)
        tbe = build_cpu_tbe(config, params, which)
        if which is not path:
            return tbe

        def slow(indices: Tensor, offsets: Tensor) -> Tensor:
            time.sleep(seconds)
            return tbe(indices, offsets)

        return slow

    return build


def _settle(winner: FusedPath) -> None:
    """Cache a RowWiseAdagrad probe that ``winner`` won by far (the other path slowed)."""
    loser = FusedPath.FBGEMM if winner is FusedPath.TORCH_FAST else FusedPath.TORCH_FAST
    result = probe_fused_path(OptimType.ROWWISE_ADAGRAD, _slowed(loser, SLOW), SMALL)
    assert result.chosen is winner


@pytest.mark.parametrize("winner", [FusedPath.FBGEMM, FusedPath.TORCH_FAST])
def test_the_probe_picks_the_faster_path(winner: FusedPath) -> None:
    loser = FusedPath.FBGEMM if winner is FusedPath.TORCH_FAST else FusedPath.TORCH_FAST
    result = probe_fused_path(OptimType.ROWWISE_ADAGRAD, _slowed(loser, SLOW), SMALL)
    assert result.chosen is winner
    fast, slow = (
        (result.fbgemm_s, result.torch_fast_s)
        if winner is FusedPath.FBGEMM
        else (result.torch_fast_s, result.fbgemm_s)
    )
    assert slow >= SLOW and fast < slow
    assert choose_fused_path(_config(), ROWWISE, None) is winner


def test_an_inconclusive_probe_falls_back_to_fbgemm() -> None:
    def both_slow(
        config: GroupedEmbeddingConfig, params: FusedParams, which: FusedPath
    ) -> TrainingTBE:
        tbe = build_cpu_tbe(config, params, FusedPath.TORCH_FAST)  # the same kernel twice

        def slow(indices: Tensor, offsets: Tensor) -> Tensor:
            time.sleep(SLOW)
            return tbe(indices, offsets)

        return slow

    result = probe_fused_path(OptimType.SGD, both_slow, SMALL)
    assert result.chosen is FusedPath.FBGEMM


def test_the_fast_path_must_win_by_its_fastest_and_its_median_step() -> None:
    fbgemm = [3.0, 3.0, 3.0]
    assert faster_path(fbgemm, [1.0, 1.0, 1.0]) is FusedPath.TORCH_FAST
    assert faster_path(fbgemm, [3.0 / MARGIN] * 3) is FusedPath.TORCH_FAST  # the margin itself
    assert faster_path(fbgemm, [2.9, 2.9, 2.9]) is FusedPath.FBGEMM  # within the margin
    assert faster_path(fbgemm, [1.0, 2.9, 2.9]) is FusedPath.FBGEMM  # the median says no
    assert faster_path([1.0, 3.0, 3.0], [1.0, 1.0, 1.0]) is FusedPath.FBGEMM  # the fastest says no
    assert faster_path([1.0, 1.0, 1.0], [3.0, 3.0, 3.0]) is FusedPath.FBGEMM


def test_the_probe_runs_once_per_optimizer_and_is_cached() -> None:
    builds: list[FusedPath] = []
    first = probe_fused_path(OptimType.ROWWISE_ADAGRAD, _slowed(FusedPath.FBGEMM, 0.0, builds))
    again = probe_fused_path(OptimType.ROWWISE_ADAGRAD, _slowed(FusedPath.FBGEMM, 0.0, builds))
    assert again is first and builds == [FusedPath.FBGEMM, FusedPath.TORCH_FAST]
    for _ in range(3):  # kernels built after the probe reuse its answer
        choose_fused_path(_config(), ROWWISE, None)
    assert len(builds) == 2
    probe_fused_path(OptimType.SGD, _slowed(FusedPath.FBGEMM, 0.0, builds))
    assert len(builds) == 4  # another optimizer: its own probe


def test_auto_builds_the_kernel_the_real_probe_chose() -> None:
    kernel = BatchedFusedEmbeddingBag(_config())
    result = measured_fused_path(OptimType.ROWWISE_ADAGRAD)
    assert probe_fused_path(OptimType.ROWWISE_ADAGRAD, build_cpu_tbe) is result
    assert result.threads == torch.get_num_threads()
    assert result.fbgemm_s > 0 and result.torch_fast_s > 0
    assert len(result.fbgemm_steps) == len(result.torch_fast_steps) == ProbeShape().steps
    assert result.chosen is faster_path(result.fbgemm_steps, result.torch_fast_steps)
    if result.chosen is FusedPath.FBGEMM:
        assert isinstance(kernel.emb_module, FbgemmFusedTBE)
    else:
        assert isinstance(kernel.emb_module, TorchFusedTBE) and kernel.emb_module.fast is not None


def test_the_probe_leaves_random_state_and_grad_mode_alone() -> None:
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    with torch.no_grad():
        path = choose_fused_path(_config(), ROWWISE, None)  # probes, inside no_grad
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.rand(4), want)
    assert path in (FusedPath.FBGEMM, FusedPath.TORCH_FAST)
    clear_probe_cache()
    with torch.inference_mode():  # a kernel built for serving: the probe still trains
        assert choose_fused_path(_config(), ROWWISE, None) in (FusedPath.FBGEMM, path)
        assert torch.is_inference_mode_enabled()


@pytest.mark.parametrize(
    "value,want",
    [
        ("fbgemm", FusedPath.FBGEMM),
        ("torch", FusedPath.TORCH_FAST),
        ("TORCH", FusedPath.TORCH_FAST),
    ],
)
def test_the_environment_overrides_the_probe(
    monkeypatch: pytest.MonkeyPatch, value: str, want: FusedPath
) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    assert choose_fused_path(_config(), ROWWISE, None) is want
    assert not cached_probes()  # nothing was measured
    # a backend passed in code wins over the environment
    assert choose_fused_path(_config(), ROWWISE, None, "fbgemm") is FusedPath.FBGEMM
    assert choose_fused_path(_config(), ROWWISE, None, "torch") is FusedPath.TORCH_FAST


def test_auto_in_the_environment_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "auto")
    _settle(FusedPath.TORCH_FAST)
    assert choose_fused_path(_config(), ROWWISE, None) is FusedPath.TORCH_FAST


def test_an_unknown_override_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=rf"{ENV_VAR}='cuda'.*'auto'.*'fbgemm'.*'torch'"):
        choose_fused_path(_config(), ROWWISE, None)


@pytest.mark.parametrize("winner", [FusedPath.FBGEMM, FusedPath.TORCH_FAST])
@pytest.mark.parametrize("override", [None, "fbgemm", "torch"])
def test_correctness_rules_win_over_probe_and_override(
    monkeypatch: pytest.MonkeyPatch, winner: FusedPath, override: str | None
) -> None:
    _settle(winner)
    if override is not None:
        monkeypatch.setenv(ENV_VAR, override)
    # hooks (grad_exchange, row_reductions) need the torch TBE: callers force it
    assert choose_fused_path(_config(), ROWWISE, None, "torch") is FusedPath.TORCH_FAST
    assert choose_fused_path(_config(), ROWWISE, None, "fbgemm") is FusedPath.FBGEMM
    # FBGEMM's CPU TBE cannot run these faithfully: the torch general path
    adam = OptimizerSpec.from_name("adam", lr=0.1)
    assert choose_fused_path(_config(adam), adam, None) is FusedPath.TORCH
    decayed = replace(ROWWISE, weight_decay=0.1)
    assert choose_fused_path(_config(decayed), decayed, None) is FusedPath.TORCH
    # the fast path cannot serve these: FBGEMM, or the general torch path where forced
    half = _config(data_type="fp16")
    sequence = one_group(table("s", 4, 8, pooling="none", optimizer=ROWWISE))
    for config in (half, sequence):
        assert choose_fused_path(config, ROWWISE, None) is FusedPath.FBGEMM
        assert choose_fused_path(config, ROWWISE, None, "torch") is FusedPath.TORCH
    # the fast path runs on the CPU only
    assert choose_fused_path(_config(), ROWWISE, "meta") is FusedPath.FBGEMM
    with pytest.raises(ValueError, match="backend='fbgemm' cannot serve tables"):
        choose_fused_path(_config(adam), adam, None, "fbgemm")
