"""DMPCollection: a model sharded over a group of ranks, that group replicated (2-D parallelism).

Each sharding group holds a full copy of the tables sharded by a plan for its ranks; the dense
rest is data-parallel over all ranks, and the copies are averaged over replica groups every
``sync_interval`` steps. :func:`create_2d_env` creates every group on every process in one order;
bad sizes raise ``ValueError`` before any group is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from embshard_dist.dmp.dense import DataParallelWrapper, DenseOptimizerFactory
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.dmp.replicas import ReplicaSync
from embshard_optim.specs import OptimizerSpec
from embshard_types.env import ShardingEnv2D
from embshard_types.interfaces import ModuleSharder
from embshard_types.plan import ShardingPlan

__all__ = ["DMPCollection", "create_2d_env", "sharding_group_ranks"]


def sharding_group_ranks(
    world_size: int, sharding_group_size: int, *, use_inter_host_allreduce: bool = False
) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of every sharding group and every replica group.

    Args:
        use_inter_host_allreduce: contiguous sharding groups (default: strided, so replicas of
            a shard are neighbours and the sync stays inside a host).

    Returns:
        ``(sharding_groups, replica_groups)``: ``sharding_groups[g][i]`` is the global rank at
        position ``i`` of group ``g``; ``replica_groups[i]`` are the ranks at position ``i``.

    Raises:
        ValueError: the sizes are not positive or the group size does not divide the world.
    """
    for what, value in (("world_size", world_size), ("sharding_group_size", sharding_group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    if world_size % sharding_group_size:
        raise ValueError(
            f"sharding_group_size {sharding_group_size} does not divide the {world_size} ranks "
            "of the job; pick a divisor (the number of replicas is world / group size)"
        )
    groups = world_size // sharding_group_size
    if use_inter_host_allreduce:
        shards = [
            [g * sharding_group_size + i for i in range(sharding_group_size)] for g in range(groups)
        ]
    else:
        shards = [[g + groups * i for i in range(sharding_group_size)] for g in range(groups)]
    replicas = [[shard[i] for shard in shards] for i in range(sharding_group_size)]
    return shards, replicas


def create_2d_env(
    sharding_group_size: int,
    *,
    global_pg: dist.ProcessGroup | None = None,
    node_group_size: int | None = None,
    use_inter_host_allreduce: bool = False,
) -> ShardingEnv2D:
    """This process's sharding and replica groups; every process calls it at the same point.

    Raises:
        ValueError: the group size does not divide the job's world size.
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "create_2d_env needs torch.distributed: call torch.distributed.init_process_group "
            "first (or launch with torchrun)"
        )
    pg = global_pg if global_pg is not None else dist.group.WORLD
    assert pg is not None
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    shards, replicas = sharding_group_ranks(
        world, sharding_group_size, use_inter_host_allreduce=use_inter_host_allreduce
    )
    mine: dict[str, Any] = {}
    for kind, layout in (("sharding", shards), ("replica", replicas)):
        for ranks in layout:
            group = dist.new_group(ranks=[dist.get_global_rank(pg, r) for r in ranks])
            if rank in ranks:
                mine[kind] = group
    return ShardingEnv2D(
        mine["sharding"],
        pg,
        node_group_size=node_group_size,
        use_inter_host_allreduce=use_inter_host_allreduce,
        replica_pg=mine["replica"],
    )


class DMPCollection(DistributedModelParallel):
    """``DistributedModelParallel`` over a sharding group, replicated.

    Args:
        sharding_group_size: ranks a copy of the tables is sharded over (plans are for this
            many ranks).
        sync_interval: :meth:`maybe_sync` syncs the replicas every this many calls
            (``None``: only explicit :meth:`sync` calls).

    Raises:
        ValueError: bad sizes, or any error ``DistributedModelParallel`` raises.
    """

    def __init__(
        self,
        module: nn.Module,
        sharding_group_size: int,
        device: torch.device | str | None = None,
        plan: ShardingPlan | None = None,
        sharders: Sequence[ModuleSharder[Any]] | None = None,
        *,
        optimizer: OptimizerSpec | str | None = None,
        dense_optimizer: type[torch.optim.Optimizer] | DenseOptimizerFactory | None = None,
        sync_interval: int | None = 1,
        node_group_size: int | None = None,
        use_inter_host_allreduce: bool = False,
        env: ShardingEnv2D | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: DataParallelWrapper | None = None,
    ) -> None:
        if env is None:
            env = create_2d_env(
                sharding_group_size,
                node_group_size=node_group_size,
                use_inter_host_allreduce=use_inter_host_allreduce,
            )
        elif env.world_size != sharding_group_size:
            raise ValueError(
                f"DMPCollection: the environment's sharding group has {env.world_size} ranks but "
                f"sharding_group_size is {sharding_group_size}"
            )
        # Validate the interval before the (collective) sharding starts.
        ReplicaSync([], None, sync_interval)
        super().__init__(
            module,
            env,
            device,
            plan,
            sharders,
            optimizer=optimizer,
            dense_optimizer=dense_optimizer,
            init_data_parallel=init_data_parallel,
            init_parameters=init_parameters,
            data_parallel_wrapper=data_parallel_wrapper,
        )
        self._env2d = env
        self._replica_sync = ReplicaSync(
            self.sharded_modules.values(), env.replica_pg, sync_interval
        )

    @property
    def sharding_pg(self) -> dist.ProcessGroup:
        return self._env2d.sharding_pg

    @property
    def replica_pg(self) -> dist.ProcessGroup | None:
        """The ranks holding the same shards in the other sharding groups."""
        return self._env2d.replica_pg

    @property
    def num_replicas(self) -> int:
        return self._replica_sync.num_replicas

    def sync(self, include_optimizer_state: bool = True) -> None:
        """Average the tables (and optimizer state) over the replicas now (collective)."""
        self._replica_sync.sync(include_optimizer_state)

    def maybe_sync(self) -> bool:
        """Count a training step; syncs every ``sync_interval`` calls and says whether it did."""
        return self._replica_sync.step()
