"""The interfaces sharded modules, sharders and planners implement.

``ShardedModule`` is a model-parallel module whose inputs and outputs are data-parallel: its
``forward`` runs ``input_dist`` (data-parallel -> model-parallel), ``compute`` on the local shards
and ``output_dist`` (model-parallel -> data-parallel), returning a ``LazyAwaitable``.
``ModuleSharder`` turns one kind of module into its sharded form and tells a planner what it
supports; ``ShardingPlanner`` produces the ``ShardingPlan``. ``CacheStatistics`` describes how
cacheable a table's accesses are.

Guarantees: abstract methods stay abstract (instantiating an incomplete subclass raises
``TypeError``); the default behaviours follow TorchRec's (data-parallel sharding type, the
``default`` kernel, storage counted in HBM on accelerators and DDR on the CPU).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar, runtime_checkable

import torch
from torch import nn

from embshard_types.awaitables import Awaitable, LazyAwaitable
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.vocab import ComputeKernel, ParameterStorage, ShardingType

if TYPE_CHECKING:
    from embshard_types.env import ShardingEnv
    from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan

__all__ = [
    "CacheStatistics",
    "ModuleSharder",
    "Multistreamable",
    "NullShardedModuleContext",
    "NullShardingContext",
    "ShardedModule",
    "ShardedModuleContext",
    "ShardingPlanner",
    "get_tensor_size_bytes",
]


@runtime_checkable
class Multistreamable(Protocol):
    """Anything that can tell the caching allocator it is used on another stream."""

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor held as in use on ``stream``."""
        ...


ShardedModuleContext = Multistreamable
"""What a sharded module carries from ``input_dist`` to ``output_dist`` within one step."""


class NullShardedModuleContext:
    """A module context that holds nothing (for modules that need no per-step state)."""

    __slots__ = ()

    def record_stream(self, stream: torch.Stream | None) -> None:
        return None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(
            f"NullShardedModuleContext holds no state (tried to set {key!r}); give the module "
            "a context class with that field"
        )


class NullShardingContext:
    """A sharding context that holds nothing."""

    def record_stream(self, stream: torch.Stream | None) -> None:
        return None


class CacheStatistics(abc.ABC):
    """How well a table's accesses can be cached, for planning a cache's size."""

    @property
    @abc.abstractmethod
    def expected_lookups(self) -> float:
        """Expected number of distinct ids looked up per training step (global batch)."""

    @abc.abstractmethod
    def expected_miss_rate(self, clf: float) -> float:
        """Expected miss rate for a cache holding the fraction ``clf`` of the table.

        Args:
            clf: cache load factor in ``[0, 1]``; 0 gives 1.0 (all misses), 1 gives 0.0.
        """

    @property
    @abc.abstractmethod
    def cacheability(self) -> float:
        """Size-independent difficulty of caching: 0 very cacheable, 1 hardly cacheable."""


_PACKED_BITS = {torch.quint4x2: 4, torch.quint2x4: 2}


def get_tensor_size_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor's elements occupy.

    Sub-byte packed dtypes are counted packed, as torch stores them: ``torch.quint4x2`` holds
    two 4-bit values per byte and ``torch.quint2x4`` four 2-bit values, so a tensor of ``n``
    elements takes ``ceil(n / 2)`` and ``ceil(n / 4)`` bytes. Every other dtype counts
    ``numel * element_size`` (``torch.uint4``/``int4``... shell dtypes take a byte per element;
    a ``uint8`` tensor that already holds packed rows is counted by its bytes).

    Args:
        t: the tensor.
    """
    bits = _PACKED_BITS.get(t.dtype)
    if bits is not None:
        return (t.numel() * bits + 7) // 8
    return t.numel() * t.element_size()


CompIn = TypeVar("CompIn")
DistOut = TypeVar("DistOut")
Out = TypeVar("Out")
ShrdCtx = TypeVar("ShrdCtx", bound=Multistreamable)
M = TypeVar("M", bound=nn.Module)


class ShardedModule(abc.ABC, nn.Module, Generic[CompIn, DistOut, Out, ShrdCtx]):
    """A model-parallel module with data-parallel inputs and outputs.

    ``forward(*input)`` = ``input_dist`` -> wait -> ``compute_and_output_dist``.

    Args:
        qcomm_codecs_registry: codecs per ``CommOp`` value for the module's collectives.
    """

    def __init__(self, qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None) -> None:
        super().__init__()
        self._qcomm_codecs_registry: dict[str, QuantizedCommCodecs] = (
            {} if qcomm_codecs_registry is None else dict(qcomm_codecs_registry)
        )

    @abc.abstractmethod
    def create_context(self) -> ShrdCtx:
        """A fresh context for one step."""

    @property
    def qcomm_codecs_registry(self) -> dict[str, QuantizedCommCodecs]:
        """The codecs per ``CommOp`` value (empty: no compression)."""
        return self._qcomm_codecs_registry

    @abc.abstractmethod
    def input_dist(self, ctx: ShrdCtx, *input: Any, **kwargs: Any) -> Awaitable[Awaitable[CompIn]]:
        """Start sending data-parallel inputs to the ranks that hold the shards.

        The outer awaitable waits for the splits (sizes), the inner one for the values.
        """

    @abc.abstractmethod
    def compute(self, ctx: ShrdCtx, dist_input: CompIn) -> DistOut:
        """Look up the local shards for the distributed input."""

    @abc.abstractmethod
    def output_dist(self, ctx: ShrdCtx, output: DistOut) -> LazyAwaitable[Out]:
        """Start sending model-parallel outputs back to their data-parallel owners."""

    def compute_and_output_dist(self, ctx: ShrdCtx, input: CompIn) -> LazyAwaitable[Out]:
        """``compute`` then ``output_dist``; override to start each output's collective as soon
        as its part of the compute ends."""
        return self.output_dist(ctx, self.compute(ctx, input))

    def forward(self, *input: Any, **kwargs: Any) -> LazyAwaitable[Out]:
        """Run input dist, compute and output dist.

        Args:
            *input: the data-parallel input.
            **kwargs: keyword arguments for ``input_dist``.

        Returns:
            The output, still being distributed.
        """
        ctx = self.create_context()
        dist_input = self.input_dist(ctx, *input, **kwargs).wait().wait()
        return self.compute_and_output_dist(ctx, dist_input)

    def prefetch(
        self,
        dist_input: CompIn,
        forward_stream: torch.Stream | None = None,
        ctx: ShrdCtx | None = None,
    ) -> None:
        """Bring the rows ``dist_input`` will look up into a cache ahead of ``compute``.

        The default does nothing (no cache).
        """
        return None

    def write_dist(self, ctx: ShrdCtx, *input: Any, **kwargs: Any) -> Awaitable[Awaitable[CompIn]]:
        """Start sending rows to write to the ranks that hold them (key-value tables)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support writes (only a sharded module that "
            "implements write_dist and update does); to set rows of its tables, load them with "
            "load_state_dict"
        )

    def update(self, ctx: ShrdCtx, dist_input: CompIn) -> None:
        """Write the distributed rows into the local shards."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support updates (only a sharded module that "
            "implements write_dist and update does); to set rows of its tables, load them with "
            "load_state_dict"
        )

    def write(self, *input: Any, **kwargs: Any) -> None:
        """Run write dist and update: store the given rows in their shards.

        Args:
            *input: the data-parallel rows to write.
            **kwargs: keyword arguments for ``write_dist``.
        """
        ctx = self.create_context()
        dist_input = self.write_dist(ctx, *input, **kwargs).wait().wait()
        self.update(ctx, dist_input)

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Names of the parameters this module holds (its local shards).

        Args:
            prefix: prepended to every name.
        """
        for name, _ in self.named_parameters(prefix):
            yield name

    def copy(self, device: torch.device) -> Self:
        """Sharded modules place their own shards: moving a model to a device keeps them as is."""
        return self

    @property
    @abc.abstractmethod
    def unsharded_module_type(self) -> type[nn.Module]:
        """The type of module this one shards (used to find the sharder when resharding)."""


_STORAGE_OF_DEVICE = {
    "cuda": ParameterStorage.HBM,
    "mtia": ParameterStorage.HBM,
    "cpu": ParameterStorage.DDR,
}


class ModuleSharder(abc.ABC, Generic[M]):
    """Shards one kind of module and tells a planner which sharding options it supports.

    Args:
        qcomm_codecs_registry: codecs per ``CommOp`` value handed to the sharded modules.
    """

    def __init__(self, qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None) -> None:
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @abc.abstractmethod
    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedModule[Any, Any, Any, Any]:
        """Build the sharded module, allocating the shards the plan puts on this rank.

        Args:
            module: the module to shard.
            params: the sharding of each of its tables.
            env: the ranks and process group to shard over.
            device: the compute device.
            module_fqn: the module's fully qualified name (for trace annotations).
        """

    @property
    @abc.abstractmethod
    def module_type(self) -> type[M]:
        """The type of module this sharder shards."""

    @property
    def qcomm_codecs_registry(self) -> dict[str, QuantizedCommCodecs] | None:
        """The codecs per ``CommOp`` value, if any."""
        return self._qcomm_codecs_registry

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        """The parameters of ``module`` that can be sharded (default: all of them)."""
        return dict(module.named_parameters())

    def sharding_types(self, compute_device_type: str) -> list[ShardingType]:
        """Sharding types supported on ``compute_device_type`` (default: data-parallel only)."""
        return [ShardingType.DATA_PARALLEL]

    def compute_kernels(
        self, sharding_type: ShardingType | str, compute_device_type: str
    ) -> list[ComputeKernel]:
        """Kernels supported for ``sharding_type`` on ``compute_device_type`` (default: DEFAULT)."""
        return [ComputeKernel.DEFAULT]

    def storage_usage(
        self,
        tensor: torch.Tensor,
        compute_device_type: str,
        compute_kernel: ComputeKernel | str,
    ) -> dict[ParameterStorage, int]:
        """Memory ``tensor`` takes when computed on ``compute_device_type`` with ``compute_kernel``.

        The default puts the whole tensor in the device's own memory: HBM for ``cuda`` and
        ``mtia``, DDR for ``cpu``.

        Raises:
            ValueError: an unknown device type or compute kernel.
        """
        ComputeKernel.parse(compute_kernel, what="storage_usage")
        storage = _STORAGE_OF_DEVICE.get(compute_device_type)
        if storage is None:
            raise ValueError(
                f"unknown compute device type {compute_device_type!r}; expected one of "
                f"{sorted(_STORAGE_OF_DEVICE)}"
            )
        return {storage: get_tensor_size_bytes(tensor)}


class ShardingPlanner(abc.ABC):
    """Decides how every shardable module of a model is sharded."""

    @abc.abstractmethod
    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """Plan the sharding of ``module`` with ``sharders`` on this process.

        Args:
            module: the model.
            sharders: one sharder per kind of shardable module.
        """

    @abc.abstractmethod
    def collective_plan(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> ShardingPlan:
        """Plan on rank 0 and broadcast the plan, so that every rank uses the same one.

        Args:
            module: the model.
            sharders: one sharder per kind of shardable module.
        """
