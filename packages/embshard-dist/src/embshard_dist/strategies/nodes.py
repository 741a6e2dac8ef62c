"""Node topology of a sharding group (rank ``r`` is local rank ``r % L`` of node ``r // L``) and
the process groups inside and across nodes.

Node size: explicit setting, else ``LOCAL_WORLD_SIZE``, else one node. Every process creates
every group in the same order (torch numbers groups per process), each once; bad node sizes
raise ``ValueError``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from embshard_dist.comm.collectives import all_gather_ints
from embshard_types.env import ShardingEnv, ShardingEnv2D

__all__ = [
    "LOCAL_WORLD_SIZE_ENV",
    "NodeGroups",
    "NodeTopology",
    "env_local_world_size",
    "node_groups",
    "resolve_local_world_size",
    "subgroup",
]

LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"


def _check_size(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def resolve_local_world_size(world_size: int, explicit: int | None = None) -> int:
    """Ranks per node for a sharding group (``explicit``, else ``LOCAL_WORLD_SIZE``, else all).

    Raises:
        ValueError: the node size is not a positive int or does not divide ``world_size``.
    """
    _check_size(world_size, "world_size")
    source = "local_world_size"
    if explicit is None:
        raw = os.environ.get(LOCAL_WORLD_SIZE_ENV, "").strip()
        if not raw:
            return world_size
        source = f"environment variable {LOCAL_WORLD_SIZE_ENV}={raw!r}"
        try:
            explicit = int(raw)
        except ValueError:
            raise ValueError(
                f"{source} is not a number of ranks per node; unset it or pass "
                "local_world_size to the sharder"
            ) from None
    size = _check_size(explicit, source)
    if world_size % size:
        raise ValueError(
            f"{source}: {size} ranks per node do not divide the {world_size} ranks of the "
            "sharding group; pass local_world_size (ranks per node) to the sharder, e.g. "
            "EmbeddingBagCollectionSharder(local_world_size=...)"
        )
    return size


def env_local_world_size(env: ShardingEnv, explicit: int | None = None) -> int | None:
    """The explicit node size for sharding over ``env`` (``None``: read ``LOCAL_WORLD_SIZE``).

    A 2-D environment ignores ``LOCAL_WORLD_SIZE``: its ``node_group_size`` counts, else one node.
    """
    if explicit is not None:
        return explicit
    if isinstance(env, ShardingEnv2D):
        return env.node_group_size or env.world_size
    return None


@dataclass(frozen=True)
class NodeTopology:
    """A sharding group cut into nodes of ``local_world_size`` consecutive ranks."""

    world_size: int
    local_world_size: int
    rank: int

    def __post_init__(self) -> None:
        resolve_local_world_size(self.world_size, self.local_world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of size {self.world_size}")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def node_ranks(self, node: int) -> list[int]:
        lws = self.local_world_size
        return list(range(node * lws, (node + 1) * lws))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """The ranks at position ``local_rank`` of every node, node by node."""
        return [n * self.local_world_size + local_rank for n in range(self.num_nodes)]


@dataclass(frozen=True)
class NodeGroups:
    """One rank's node group (``None`` with one rank per node) and its cross-node peers' group
    (``None`` with one node)."""

    intra: Any
    cross: Any


def _members(pg: Any) -> tuple[int, ...]:
    group = pg if pg is not None else dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


@dataclass
class _GroupCache:
    """Groups made by :func:`subgroup` and the mirrors found by :func:`_mirrors`, valid while
    ``world`` is the default process group (a new ``init_process_group`` starts afresh)."""

    world: Any = None
    mirrors: dict[tuple[int, ...], list[tuple[int, ...]]] = field(default_factory=dict)
    subgroups: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = field(default_factory=dict)


_CACHE = _GroupCache()


def _cache() -> _GroupCache:
    """The caches of the current default process group (emptied when it changed)."""
    global _CACHE
    world = dist.group.WORLD
    if _CACHE.world is not world:
        _CACHE = _GroupCache(world)
    return _CACHE


def _mirrors(pg: Any) -> list[tuple[int, ...]]:
    """Every sharding group of the job that mirrors ``pg`` (``pg`` among them), sorted (2-D)."""
    members = _members(pg)
    world = dist.get_world_size()
    if len(members) == world:
        return [members]
    cached = _cache().mirrors
    if members not in cached:
        sizes = [row[0] for row in all_gather_ints([len(members)], name="node_groups.sizes")]
        if len(set(sizes)) > 1:
            raise ValueError(
                f"sharding groups of different sizes {sizes} (per global rank); a sharding "
                "group smaller than the job needs every process to shard over a group of the "
                "same size (a 2-D layout, see ShardingEnv2D)"
            )
        rows = all_gather_ints(list(members), name="node_groups.members")
        groups = sorted({tuple(row) for row in rows})
        covered = sorted(r for g in groups for r in g)
        if covered != list(range(world)):
            raise ValueError(
                f"the sharding groups {groups} do not partition the job's {world} ranks; give "
                "every process one sharding group of the same size"
            )
        cached[members] = groups
    return cached[members]


def subgroup(pg: Any, ranks: Sequence[int]) -> Any:
    """The process group of ``ranks`` (ranks of ``pg``), created by every process and cached
    for as long as the default process group lives.

    Raises:
        ValueError: ``ranks`` repeat a rank or fall outside ``pg``.
    """
    members = _members(pg)
    wanted = tuple(int(r) for r in ranks)
    if len(set(wanted)) != len(wanted) or any(not 0 <= r < len(members) for r in wanted):
        raise ValueError(
            f"subgroup: ranks {list(wanted)} must be distinct ranks of a group of "
            f"{len(members)} ranks"
        )
    if sorted(wanted) == list(range(len(members))):
        return pg if pg is not None else dist.group.WORLD
    key = (members, tuple(sorted(wanted)))
    cached = _cache().subgroups
    if key not in cached:
        mine: Any = None
        for mirror in _mirrors(pg):
            group = dist.new_group(ranks=sorted(mirror[r] for r in wanted))
            if mirror == members:
                mine = group
        cached[key] = mine
    return cached[key]


def node_groups(pg: Any, topology: NodeTopology) -> NodeGroups:
    """This rank's intra-node and cross-node groups; every process calls it at the same point.

    Raises:
        ValueError: the sharding group's ranks are not in increasing global order.
    """
    members = _members(pg)
    if list(members) != sorted(members):
        raise ValueError(
            f"node-aware sharding needs a sharding group whose ranks are in increasing global "
            f"order, got {list(members)}"
        )
    lws, nodes = topology.local_world_size, topology.num_nodes
    intra_groups = [subgroup(pg, topology.node_ranks(n)) for n in range(nodes)] if lws > 1 else []
    cross_groups = [subgroup(pg, topology.peer_ranks(lr)) for lr in range(lws)] if nodes > 1 else []
    return NodeGroups(
        intra=intra_groups[topology.node] if intra_groups else None,
        cross=cross_groups[topology.local_rank] if cross_groups else None,
    )
