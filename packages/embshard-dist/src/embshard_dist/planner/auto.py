"""The default plan: the cost-based planner, fed the machine this job runs on.

:func:`default_plan` plans on the group's first rank for a :func:`runtime_topology` (this run's
ranks, node size and free memory, with the speeds of a calibration file or the defaults) and
broadcasts the plan, so all ranks shard alike even when their memory readings differ.

Guarantees: a ``Topology`` object is used as given; a file's speeds are kept and the rest
replaced by the run's; an unreadable file raises ``ValueError`` naming it before any collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from embshard_dist.planner.constraints import DEFAULT_BATCH_SIZE, ParameterConstraints
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.topology import Topology, default_topology
from embshard_dist.strategies.nodes import env_local_world_size, resolve_local_world_size
from embshard_optim.specs import OptimizerSpec
from embshard_types.env import ShardingEnv
from embshard_types.plan import ShardingPlan

__all__ = ["TopologySource", "available_memory_per_rank", "default_plan", "runtime_topology"]

TopologySource = Topology | str | os.PathLike[str]
"""A topology, or the path of a topology file (``embshard calibrate --out FILE``)."""


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _host_available() -> int:
    found = _meminfo_available()
    if found:
        return found
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return default_topology(1).memory_per_rank


def available_memory_per_rank(device_type: str, local_world_size: int) -> tuple[int, int]:
    """``(device bytes, host bytes)`` one rank may use now, shared by ``local_world_size`` ranks."""
    host = max(1, _host_available() // max(1, local_world_size))
    if device_type != "cuda":
        return host, 0
    import torch

    free, _ = torch.cuda.mem_get_info(torch.cuda.current_device())
    return int(free), host


def runtime_topology(
    world_size: int,
    device_type: str,
    *,
    local_world_size: int | None = None,
    topology: TopologySource | None = None,
) -> Topology:
    """The topology of this run (see the module docstring).

    Args:
        local_world_size: ranks per node (default: ``LOCAL_WORLD_SIZE``, else one node).
        topology: a calibrated topology, or the path of a topology file.

    Raises:
        ValueError: a file that is not a topology, or a ``Topology`` for another world size.
    """
    if isinstance(topology, Topology):
        if topology.world_size != world_size:
            raise ValueError(
                f"the topology given is for {topology.world_size} ranks but the job shards over "
                f"{world_size}; use Topology.with_world({world_size}) or a topology file"
            )
        return topology
    local = resolve_local_world_size(world_size, local_world_size)
    device = "cuda" if device_type == "cuda" else "cpu"
    memory, host = available_memory_per_rank(device, local)
    if topology is None:
        base = default_topology(
            world_size, compute_device=device, local_world_size=local, memory_per_rank=memory
        )
        return replace(base, host_memory_per_rank=host) if device == "cuda" else base
    if not isinstance(topology, str | os.PathLike):
        raise TypeError(
            f"topology must be a Topology or the path of a topology file, got {topology!r}"
        )
    loaded = Topology.load(topology, world_size=world_size, local_world_size=local)
    if loaded.compute_device != device:
        raise ValueError(
            f"topology file {os.fspath(topology)!r} was calibrated for {loaded.compute_device} "
            f"but this job runs on {device}; calibrate on this device"
        )
    return replace(loaded, memory_per_rank=memory, host_memory_per_rank=host)


def default_plan(
    module: nn.Module,
    sharders: Sequence[Any],
    env: ShardingEnv,
    device_type: str,
    *,
    optimizer: OptimizerSpec | None = None,
    topology: TopologySource | None = None,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> ShardingPlan:
    """Plan ``module`` for this run with the cost-based planner (one rank plans, all receive).

    Args:
        env: the ranks to shard over (its process group carries the broadcast).
        topology: a calibrated topology, or the path of a topology file.

    Raises:
        ValueError: bad constraints or topology, or no plan fits (on every rank).
    """
    topo = runtime_topology(
        env.world_size,
        device_type,
        local_world_size=env_local_world_size(env),
        topology=topology,
    )
    planner = EmbeddingShardingPlanner(
        topo, constraints=constraints, batch_size=batch_size, optimizer=optimizer
    )
    if env.process_group is None or env.world_size == 1:
        return planner.plan(module, sharders)
    return planner.collective_plan(module, sharders, env.process_group)
