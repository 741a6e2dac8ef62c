"""embshard-dist: sharded embedding collections, their collectives, DistributedModelParallel,
the planner and the ``embshard`` command.

A sharded step flows input dist -> lookup -> output dist: ``embshard_dist.sharding`` holds one
module per strategy (``dp``, ``tw``, ``rw``, ``cw``), ``embshard_dist.comm`` the collectives
they are built from, ``embshard_dist.sharded`` the sharded collections that compose them.

Importing this package is cheap and side-effect free: the public names below are loaded on first
use (FBGEMM and torch.distributed's sharded tensors are imported only then).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embshard_dist.comm.qcomms import (
        CommsPrecision,
        QCommsConfig,
        get_qcomm_codecs,
        get_qcomm_codecs_registry,
    )
    from embshard_dist.comm.timeouts import CollectiveError
    from embshard_dist.dmp.collection import DMPCollection
    from embshard_dist.model_parallel import DistributedModelParallel
    from embshard_dist.planner.constraints import ParameterConstraints
    from embshard_dist.planner.planner import EmbeddingShardingPlanner
    from embshard_dist.planner.simple import SimplePlanner
    from embshard_dist.planner.topology import Topology
    from embshard_dist.sharded.embedding import ShardedEmbeddingCollection
    from embshard_dist.sharded.embedding_bag import ShardedEmbeddingBagCollection
    from embshard_dist.sharders.embedding import EmbeddingCollectionSharder
    from embshard_dist.sharders.embedding_bag import EmbeddingBagCollectionSharder

_LAZY: dict[str, str] = {
    "CollectiveError": "embshard_dist.comm.timeouts",
    "CommsPrecision": "embshard_dist.comm.qcomms",
    "DMPCollection": "embshard_dist.dmp.collection",
    "DistributedModelParallel": "embshard_dist.model_parallel",
    "EmbeddingCollectionSharder": "embshard_dist.sharders.embedding",
    "EmbeddingBagCollectionSharder": "embshard_dist.sharders.embedding_bag",
    "EmbeddingShardingPlanner": "embshard_dist.planner.planner",
    "ParameterConstraints": "embshard_dist.planner.constraints",
    "QCommsConfig": "embshard_dist.comm.qcomms",
    "ShardedEmbeddingBagCollection": "embshard_dist.sharded.embedding_bag",
    "ShardedEmbeddingCollection": "embshard_dist.sharded.embedding",
    "SimplePlanner": "embshard_dist.planner.simple",
    "Topology": "embshard_dist.planner.topology",
    "get_qcomm_codecs": "embshard_dist.comm.qcomms",
    "get_qcomm_codecs_registry": "embshard_dist.comm.qcomms",
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
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "SimplePlanner",
    "Topology",
    "get_qcomm_codecs",
    "get_qcomm_codecs_registry",
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
