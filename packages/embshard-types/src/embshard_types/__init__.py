"""embshard-types: the sharding vocabulary every embshard package speaks.

Depends on torch only; importing it loads no FBGEMM, ShardedTensor or DTensor and touches no
CUDA device.
"""

from __future__ import annotations

from embshard_types.awaitables import (
    Awaitable,
    DeviceToHostTensorAwaitable,
    GetItemLazyAwaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    NoWait,
)
from embshard_types.comm_codec import (
    NoOpQuantizedCommCodec,
    QCommCodecsRegistry,
    QuantizationContext,
    QuantizedCommCodec,
    QuantizedCommCodecs,
)
from embshard_types.configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from embshard_types.env import ShardingEnv, ShardingEnv2D, rank_device
from embshard_types.interfaces import ModuleSharder, ShardingPlanner, get_tensor_size_bytes
from embshard_types.kernel_params import (
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    KeyValueParams,
    MultiPassPrefetchConfig,
)
from embshard_types.parameter_sharding import ParameterSharding, ShardingBucketMetadata
from embshard_types.plan import (
    PLAN_FORMAT_VERSION,
    DMPCollectionConfig,
    EmbeddingModuleShardingPlan,
    ModuleShardingPlan,
    ObjectPoolShardingPlan,
    ShardingPlan,
    validate_plan_for_world,
)
from embshard_types.shard_spec import ShardSpec
from embshard_types.sharded_module import (
    Multistreamable,
    NullShardedModuleContext,
    ShardedModule,
    ShardedModuleContext,
)
from embshard_types.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from embshard_types.vocab import (
    CommOp,
    ComputeKernel,
    DataType,
    EmbeddingEvent,
    ObjectPoolShardingType,
    ParameterStorage,
    ParsableEnum,
    PipelineType,
    PoolingType,
    ShardingType,
)

__all__ = [
    "ParsableEnum",
    "ShardingType",
    "ComputeKernel",
    "EmbeddingEvent",
    "PipelineType",
    "ParameterStorage",
    "CommOp",
    "ObjectPoolShardingType",
    "PoolingType",
    "DataType",
    "BaseEmbeddingConfig",
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "ShardSpec",
    "BoundsCheckMode",
    "CacheAlgorithm",
    "CacheParams",
    "KeyValueParams",
    "MultiPassPrefetchConfig",
    "ParameterSharding",
    "ShardingBucketMetadata",
    "PLAN_FORMAT_VERSION",
    "DMPCollectionConfig",
    "EmbeddingModuleShardingPlan",
    "ModuleShardingPlan",
    "ObjectPoolShardingPlan",
    "ShardingPlan",
    "validate_plan_for_world",
    "Awaitable",
    "DeviceToHostTensorAwaitable",
    "GetItemLazyAwaitable",
    "LazyAwaitable",
    "LazyGetItemMixin",
    "LazyNoWait",
    "NoWait",
    "NoOpQuantizedCommCodec",
    "QCommCodecsRegistry",
    "QuantizationContext",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "ShardingEnv",
    "ShardingEnv2D",
    "rank_device",
    "ModuleSharder",
    "Multistreamable",
    "NullShardedModuleContext",
    "ShardedModule",
    "ShardedModuleContext",
    "ShardingPlanner",
    "get_tensor_size_bytes",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
]
