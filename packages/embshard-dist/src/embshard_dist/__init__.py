"""embshard-dist: sharded embedding collections, DistributedModelParallel, the planner and the
``embshard`` command.

Layered top to bottom: ``cli`` -> ``checkpoint`` (``data``, ``metrics``, ``models`` and
``train_pipeline`` beside it) -> ``dmp`` -> ``planner`` -> ``sharded`` (sharded collections with
their sharders) -> ``strategies`` (one module per sharding strategy) -> ``comm``. A sharded step flows input dist -> lookup -> output
dist. Importing is cheap: the public names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embshard_dist.comm.local import get_local_rank, get_local_size
    from embshard_dist.comm.qcomms import (
        CommsPrecision,
        QCommsConfig,
        get_qcomm_codecs,
        get_qcomm_codecs_registry,
    )
    from embshard_dist.comm.timeouts import CollectiveError
    from embshard_dist.dmp.collection import DMPCollection
    from embshard_dist.dmp.dense import DataParallelWrapper, DefaultDataParallelWrapper
    from embshard_dist.dmp.model_parallel import (
        DistributedModelParallel,
        get_module,
        get_unsharded_module_names,
        get_unwrapped_module,
    )
    from embshard_dist.planner.constraints import ParameterConstraints
    from embshard_dist.planner.planner import EmbeddingShardingPlanner
    from embshard_dist.planner.topology import Topology
    from embshard_dist.sharded.embedding import (
        EmbeddingCollectionSharder,
        ShardedEmbeddingCollection,
    )
    from embshard_dist.sharded.embedding_bag import (
        EmbeddingBagCollectionSharder,
        ShardedEmbeddingBagCollection,
    )
    from embshard_dist.sharded.plan_helpers import (
        apply_to_all,
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        get_default_sharders,
        get_module_to_default_sharders,
        grid_shard,
        row_wise,
        table_column_wise,
        table_row_wise,
        table_wise,
    )
    from embshard_dist.sharded.quant_embedding_bag import (
        QuantEmbeddingBagCollectionSharder,
        ShardedQuantEmbeddingBagCollection,
    )

_LAZY: dict[str, str] = {
    "CollectiveError": "embshard_dist.comm.timeouts",
    "CommsPrecision": "embshard_dist.comm.qcomms",
    "DMPCollection": "embshard_dist.dmp.collection",
    "DistributedModelParallel": "embshard_dist.dmp.model_parallel",
    "EmbeddingCollectionSharder": "embshard_dist.sharded.embedding",
    "EmbeddingBagCollectionSharder": "embshard_dist.sharded.embedding_bag",
    "EmbeddingShardingPlanner": "embshard_dist.planner.planner",
    "ParameterConstraints": "embshard_dist.planner.constraints",
    "QCommsConfig": "embshard_dist.comm.qcomms",
    "QuantEmbeddingBagCollectionSharder": "embshard_dist.sharded.quant_embedding_bag",
    "ShardedQuantEmbeddingBagCollection": "embshard_dist.sharded.quant_embedding_bag",
    "ShardedEmbeddingBagCollection": "embshard_dist.sharded.embedding_bag",
    "ShardedEmbeddingCollection": "embshard_dist.sharded.embedding",
    "Topology": "embshard_dist.planner.topology",
    "get_qcomm_codecs": "embshard_dist.comm.qcomms",
    "get_qcomm_codecs_registry": "embshard_dist.comm.qcomms",
    "DataParallelWrapper": "embshard_dist.dmp.dense",
    "DefaultDataParallelWrapper": "embshard_dist.dmp.dense",
    "apply_to_all": "embshard_dist.sharded.plan_helpers",
    "column_wise": "embshard_dist.sharded.plan_helpers",
    "construct_module_sharding_plan": "embshard_dist.sharded.plan_helpers",
    "data_parallel": "embshard_dist.sharded.plan_helpers",
    "get_default_sharders": "embshard_dist.sharded.plan_helpers",
    "get_local_rank": "embshard_dist.comm.local",
    "get_local_size": "embshard_dist.comm.local",
    "get_module": "embshard_dist.dmp.model_parallel",
    "get_module_to_default_sharders": "embshard_dist.sharded.plan_helpers",
    "get_unsharded_module_names": "embshard_dist.dmp.model_parallel",
    "get_unwrapped_module": "embshard_dist.dmp.model_parallel",
    "grid_shard": "embshard_dist.sharded.plan_helpers",
    "row_wise": "embshard_dist.sharded.plan_helpers",
    "table_column_wise": "embshard_dist.sharded.plan_helpers",
    "table_row_wise": "embshard_dist.sharded.plan_helpers",
    "table_wise": "embshard_dist.sharded.plan_helpers",
}

__all__ = [
    "CollectiveError",
    "CommsPrecision",
    "DMPCollection",
    "DistributedModelParallel",
    "EmbeddingCollectionSharder",
    "EmbeddingBagCollectionSharder",
    "EmbeddingShardingPlanner",
    "ParameterConstraints",
    "QCommsConfig",
    "QuantEmbeddingBagCollectionSharder",
    "ShardedQuantEmbeddingBagCollection",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "Topology",
    "get_qcomm_codecs",
    "get_qcomm_codecs_registry",
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "apply_to_all",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_default_sharders",
    "get_local_rank",
    "get_local_size",
    "get_module",
    "get_module_to_default_sharders",
    "get_unsharded_module_names",
    "get_unwrapped_module",
    "grid_shard",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'embshard_dist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
