"""Sharding environments: which ranks a model is sharded over, and this process's place in them.

``ShardingEnv`` wraps a process group, or just a world size and rank. ``ShardingEnv2D`` shards
within a sharding group and replicates across groups (``world_size`` / ``rank`` are relative to
the group, ``global_*`` to the job). Ranks are validated at construction; a device mesh is built,
and ``torch.distributed.device_mesh`` imported, only when first read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from embshard_types.vocab import ShardingType

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardingEnv", "ShardingEnv2D", "rank_device"]


def _check_size_and_rank(world_size: object, rank: object, what: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what}: world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"{what}: rank must be an int, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{what}: rank {rank} is outside the world of size {world_size}; "
            f"a rank must be in [0, {world_size})"
        )


def _pg_device_type(pg: dist.ProcessGroup) -> str:
    """The device type a process group's collectives run on by default."""
    backend = str(dist.get_backend(pg)).lower()
    if "nccl" in backend:
        return "cuda"
    if "xccl" in backend:
        return "xpu"
    return "cpu"


class ShardingEnv:
    """The ranks a model is sharded over.

    Args:
        pg: the process group of those ranks (``None`` for local, single-process use).
        output_dtensor: whether sharded modules expose their shards as DTensors.
        device_mesh: the 1-D mesh of ``pg``; built on first read when not given.
    """

    def __init__(
        self,
        world_size: int,
        rank: int,
        pg: dist.ProcessGroup | None = None,
        output_dtensor: bool = False,
        *,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        _check_size_and_rank(world_size, rank, "ShardingEnv")
        if pg is not None and dist.get_world_size(pg) != world_size:
            raise ValueError(
                f"ShardingEnv: world_size {world_size} differs from the process group's size "
                f"{dist.get_world_size(pg)}; use ShardingEnv.from_process_group(pg)"
            )
        self.world_size: int = world_size
        self.rank: int = rank
        self.process_group: dist.ProcessGroup | None = pg
        self.output_dtensor: bool = bool(output_dtensor)
        self._device_mesh: DeviceMesh | None = device_mesh

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The 1-D device mesh over the process group (``None`` without a process group)."""
        if self._device_mesh is None and self.process_group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            pg = self.process_group
            self._device_mesh = DeviceMesh.from_group(pg, _pg_device_type(pg))
        return self._device_mesh

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup, output_dtensor: bool = False) -> ShardingEnv:
        """An environment over the ranks of the initialised group ``pg`` (for training)."""
        return cls(dist.get_world_size(pg), dist.get_rank(pg), pg, output_dtensor)

    @classmethod
    def from_local(cls, world_size: int, rank: int) -> ShardingEnv:
        """An environment without a process group (single-host inference, planning)."""
        return cls(world_size, rank, None)

    def __repr__(self) -> str:
        pg = "set" if self.process_group is not None else "None"
        return f"{type(self).__name__}(world_size={self.world_size}, rank={self.rank}, pg={pg})"


_REMAPPED_TYPES = (ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE, ShardingType.GRID_SHARD)


class ShardingEnv2D(ShardingEnv):
    """Shard within groups of ranks, replicate across the groups (2-D parallelism).

    Two layouts exist. Without ``use_inter_host_allreduce`` sharding groups are strided: global
    rank ``r`` is at position ``r // num_sharding_groups()`` of group ``r % num_sharding_groups()``.
    With it they are contiguous blocks: position ``r % world_size`` of group ``r // world_size``.

    Args:
        sharding_pg: the ranks this process's model copy is sharded over.
        device_mesh: the 2-D ``(replicate, shard)`` mesh, if one was built.
        use_inter_host_allreduce: whether sharding groups are contiguous blocks of ranks.
        replica_pg: the ranks holding the same shards in the other sharding groups.
    """

    def __init__(
        self,
        sharding_pg: dist.ProcessGroup,
        global_pg: dist.ProcessGroup,
        device_mesh: DeviceMesh | None = None,
        node_group_size: int | None = None,
        use_inter_host_allreduce: bool = False,
        *,
        replica_pg: dist.ProcessGroup | None = None,
    ) -> None:
        world_size, rank = dist.get_world_size(sharding_pg), dist.get_rank(sharding_pg)
        global_world_size, global_rank = dist.get_world_size(global_pg), dist.get_rank(global_pg)
        _check_size_and_rank(world_size, rank, "ShardingEnv2D sharding group")
        _check_size_and_rank(global_world_size, global_rank, "ShardingEnv2D global group")
        if global_world_size % world_size != 0:
            raise ValueError(
                f"ShardingEnv2D: the sharding group size {world_size} does not divide the "
                f"global world size {global_world_size}"
            )
        if device_mesh is not None and device_mesh.ndim != 2:
            raise ValueError(
                f"ShardingEnv2D: device_mesh must be 2-D (replicate, shard), got {device_mesh.ndim}-D"
            )
        if node_group_size is not None and (
            isinstance(node_group_size, bool)
            or not isinstance(node_group_size, int)
            or node_group_size < 1
        ):
            raise ValueError(
                f"ShardingEnv2D: node_group_size must be a positive int, got {node_group_size!r}"
            )
        self.world_size = world_size
        self.rank = rank
        self.global_world_size: int = global_world_size
        self.global_rank: int = global_rank
        self.process_group = global_pg
        self.sharding_pg: dist.ProcessGroup = sharding_pg
        self.replica_pg: dist.ProcessGroup | None = replica_pg
        self.node_group_size: int | None = node_group_size
        self.use_inter_host_allreduce: bool = bool(use_inter_host_allreduce)
        self.output_dtensor = True
        self._device_mesh = device_mesh

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The 2-D mesh passed at construction (never built implicitly)."""
        return self._device_mesh

    def num_sharding_groups(self) -> int:
        """How many times the sharded model is replicated."""
        return self.global_world_size // self.world_size

    def remap_rank(self, rank: int, sharding_type: ShardingType | str) -> int:
        """The position of global rank ``rank`` within its sharding group.

        Raises:
            ValueError: the rank is out of range, or ``sharding_type`` is not table-wise,
                column-wise or grid (the only ones placed by this position).
        """
        st = ShardingType.parse(sharding_type, what="remap_rank")
        if st not in _REMAPPED_TYPES:
            names = ", ".join(t.value for t in _REMAPPED_TYPES)
            raise ValueError(f"remap_rank applies to {names} sharding only, not {st.value}")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"remap_rank: rank must be an int, got {rank!r}")
        if not 0 <= rank < self.global_world_size:
            raise ValueError(
                f"remap_rank: rank {rank} is outside the world of size {self.global_world_size}"
            )
        if self.use_inter_host_allreduce:
            return rank % self.world_size
        return rank // self.num_sharding_groups()


def rank_device(device_type: str, rank: int) -> torch.device:
    """The device rank ``rank`` computes on: ``cpu`` for the CPU, ``DEVICE:RANK`` otherwise."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank_device: rank must be a non-negative int, got {rank!r}")
    if device_type in ("cpu", "meta"):
        return torch.device(device_type)
    return torch.device(device_type, rank)
