"""Interfaces: ShardedModule's composed forward, ModuleSharder defaults, planners, contexts and
tensor sizes (packed 4-bit / 2-bit types included)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from embshard_types.awaitables import Awaitable, LazyAwaitable, LazyNoWait, NoWait
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import (
    ModuleSharder,
    Multistreamable,
    NullShardedModuleContext,
    ShardedModule,
    ShardingPlanner,
    get_tensor_size_bytes,
)
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.vocab import ComputeKernel, ParameterStorage, ShardingType

# --- tensor sizes -------------------------------------------------------------------------------


def _quantized(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.rand(n), 0.1, 0, dtype)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tensor_size_of_packed_sub_byte_types_matches_torch_storage() -> None:
    for n, dtype, expected in [
        (8, torch.quint4x2, 4),
        (7, torch.quint4x2, 4),
        (8, torch.quint2x4, 2),
        (6, torch.quint2x4, 2),
    ]:
        t = _quantized(n, dtype)
        assert get_tensor_size_bytes(t) == expected == t.untyped_storage().nbytes()


def test_tensor_size_of_ordinary_types() -> None:
    assert get_tensor_size_bytes(torch.zeros(3, 4)) == 48
    assert get_tensor_size_bytes(torch.zeros(3, 4, dtype=torch.float16)) == 24
    assert get_tensor_size_bytes(torch.zeros(10, dtype=torch.uint8)) == 10
    assert get_tensor_size_bytes(torch.empty(4, dtype=torch.uint4)) == 4  # one byte per element
    assert get_tensor_size_bytes(torch.zeros(0, 8)) == 0


# --- contexts -----------------------------------------------------------------------------------


def test_null_contexts() -> None:
    stream = torch.Stream("cpu") if hasattr(torch, "Stream") else None
    ctx = NullShardedModuleContext()
    assert isinstance(ctx, Multistreamable)
    ctx.record_stream(stream)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="holds no state \\(tried to set 'x'\\)"):
        ctx.x = 1


# --- ShardedModule ------------------------------------------------------------------------------


class _Ctx:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def record_stream(self, stream: torch.Stream) -> None:
        pass


class ScaledSharded(ShardedModule[torch.Tensor, torch.Tensor, torch.Tensor, _Ctx]):
    """A toy "sharded" module: doubles its input in input_dist, scales in compute,
    adds one in output_dist, recording the order of the steps in its context."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = nn.Parameter(torch.tensor(3.0))
        self.contexts: list[_Ctx] = []

    def create_context(self) -> _Ctx:
        ctx = _Ctx()
        self.contexts.append(ctx)
        return ctx

    def input_dist(
        self, ctx: _Ctx, *input: Any, **kwargs: Any
    ) -> Awaitable[Awaitable[torch.Tensor]]:
        ctx.calls.append("input_dist")
        (x,) = input
        return NoWait(NoWait(x * kwargs.get("factor", 2)))

    def compute(self, ctx: _Ctx, dist_input: torch.Tensor) -> torch.Tensor:
        ctx.calls.append("compute")
        return dist_input * self.scale

    def output_dist(self, ctx: _Ctx, output: torch.Tensor) -> LazyAwaitable[torch.Tensor]:
        ctx.calls.append("output_dist")
        return LazyNoWait(output + 1)

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return nn.Linear


def test_forward_composes_input_dist_compute_output_dist() -> None:
    module = ScaledSharded()
    out = module(torch.tensor([1.0, 2.0]))
    assert isinstance(out, LazyAwaitable)
    torch.testing.assert_close(out.wait(), torch.tensor([7.0, 13.0]))  # (x*2)*3+1
    assert module.contexts[0].calls == ["input_dist", "compute", "output_dist"]
    out = module(torch.tensor([1.0]), factor=10)
    torch.testing.assert_close(out + 0, torch.tensor([31.0]))
    assert len(module.contexts) == 2  # a fresh context per step


def test_gradients_flow_through_the_lazy_output() -> None:
    module = ScaledSharded()
    loss = (module(torch.tensor([1.0, 2.0])) * 1).sum()
    loss.backward()
    assert module.scale.grad is not None
    torch.testing.assert_close(module.scale.grad, torch.tensor(6.0))


def test_sharded_module_defaults() -> None:
    module = ScaledSharded()
    assert module.qcomm_codecs_registry == {}
    codecs = {"pooled_embeddings_all_to_all": QuantizedCommCodecs()}
    assert ScaledSharded(qcomm_codecs_registry=codecs).qcomm_codecs_registry == codecs
    assert list(module.sharded_parameter_names()) == ["scale"]
    assert list(module.sharded_parameter_names("ebc")) == ["ebc.scale"]
    assert module.copy(torch.device("cpu")) is module
    assert module.unsharded_module_type is nn.Linear


def test_incomplete_sharded_module_cannot_be_built() -> None:
    class Incomplete(ShardedModule[Any, Any, Any, Any]):
        def create_context(self) -> Any:
            return NullShardedModuleContext()

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()  # type: ignore[abstract]


# --- ModuleSharder / ShardingPlanner ------------------------------------------------------------


class LinearSharder(ModuleSharder[nn.Linear]):
    def shard(
        self,
        module: nn.Linear,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedModule[Any, Any, Any, Any]:
        assert env.world_size >= 1 and "weight" in params
        return ScaledSharded(qcomm_codecs_registry=self.qcomm_codecs_registry)

    @property
    def module_type(self) -> type[nn.Linear]:
        return nn.Linear


def test_module_sharder_defaults() -> None:
    sharder = LinearSharder()
    assert sharder.qcomm_codecs_registry is None
    assert sharder.module_type is nn.Linear
    assert sharder.sharding_types("cuda") == [ShardingType.DATA_PARALLEL]
    assert sharder.compute_kernels(ShardingType.DATA_PARALLEL, "cuda") == [ComputeKernel.DEFAULT]
    linear = nn.Linear(4, 2)
    assert set(sharder.shardable_parameters(linear)) == {"weight", "bias"}
    w = linear.weight
    assert sharder.storage_usage(w, "cuda", ComputeKernel.FUSED) == {ParameterStorage.HBM: 32}
    assert sharder.storage_usage(w, "mtia", "dense") == {ParameterStorage.HBM: 32}
    assert sharder.storage_usage(w, "cpu", "default") == {ParameterStorage.DDR: 32}


def test_storage_usage_rejects_unknown_device_and_kernel() -> None:
    w = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="unknown compute device type 'tpu'"):
        LinearSharder().storage_usage(w, "tpu", "default")
    with pytest.raises(ValueError, match="unknown ComputeKernel 'turbo'"):
        LinearSharder().storage_usage(w, "cpu", "turbo")


def test_sharder_shards_with_a_plan_and_env() -> None:
    ps = ParameterSharding(ShardingType.DATA_PARALLEL, ComputeKernel.DENSE, ranks=(0, 1))
    sharded = LinearSharder().shard(
        nn.Linear(2, 2), EmbeddingModuleShardingPlan({"weight": ps}), ShardingEnv.from_local(2, 0)
    )
    assert isinstance(sharded, ShardedModule)


class FixedPlanner(ShardingPlanner):
    def __init__(self, plan: ShardingPlan) -> None:
        self._plan = plan

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        return self._plan

    def collective_plan(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> ShardingPlan:
        return self.plan(module, sharders)


def test_planner_interface() -> None:
    plan = ShardingPlan({"linear": {"weight": ParameterSharding("data_parallel", "dense")}})  # type: ignore[arg-type]
    planner = FixedPlanner(plan)
    assert planner.collective_plan(nn.Linear(1, 1), []) is plan
    with pytest.raises(TypeError, match="abstract"):
        ShardingPlanner()  # type: ignore[abstract]
