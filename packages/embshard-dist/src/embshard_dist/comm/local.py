"""This process's place on its node: TorchRec's ``get_local_size`` and ``get_local_rank``.

The local size (ranks per node) and local rank come from the launcher's environment, read in
TorchRec's order (torchrun's ``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK``, then MPI's variables).
Without them embshard takes one node of ``world_size`` ranks, as its planner and sharders do
(TorchRec assumes 8 ranks per node when the world is a multiple of 8); the local rank is then
``rank % local_size``. A warning says when the environment did not tell.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

__all__ = ["get_local_rank", "get_local_size"]

logger = logging.getLogger(__name__)

LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)
LOCAL_RANK_VARS = (
    "LOCAL_RANK",
    "MPI_LOCALRANKID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
)


def _from_env(names: tuple[str, ...]) -> int | None:
    """The first of ``names`` set to an int in the environment."""
    for name in names:
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                logger.warning("%s=%r is not an int; ignored", name, raw)
    return None


def get_local_size(world_size: int | None = None) -> int:
    """Ranks per node (see the module docstring); ``world_size`` defaults to the default
    group's size."""
    if world_size is None:
        world_size = dist.get_world_size()
    local = _from_env(LOCAL_SIZE_VARS)
    if local is None or local <= 0 or world_size % local != 0:
        logger.warning(
            "local size: the environment gives no ranks-per-node that divides the %d ranks; "
            "taking one node of %d",
            world_size,
            world_size,
        )
        return world_size
    return local


def get_local_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """This process's rank on its node (see the module docstring); ``rank`` defaults to the
    default group's rank of this process."""
    local_size = get_local_size(world_size)
    local = _from_env(LOCAL_RANK_VARS)
    if local is None or not 0 <= local < local_size:
        logger.warning("local rank: not in the environment; taking rank %% %d", local_size)
        if rank is None:
            rank = dist.get_rank()
        return rank % local_size
    return local
