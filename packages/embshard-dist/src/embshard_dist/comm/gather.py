"""All-gather of equal blocks straight into the caller's buffer, with a bounded wait.

Rank ``r``'s block lands at ``out[r * n : (r + 1) * n]``, bit for bit; ``dispatch`` picks the
algorithm (the backend's all-gather, or an all-to-all on the CPU). A dead or hung peer raises
``CollectiveError`` naming the collective (see ``timeouts``).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from embshard_dist.comm import dispatch
from embshard_dist.comm.algorithms.all_gather import PendingGather
from embshard_dist.comm.timeouts import Timeout

__all__ = ["PendingGather", "start_all_gather"]


def start_all_gather(
    collective: str,
    out: Tensor,
    local: Tensor,
    *,
    group: dist.ProcessGroup | None,
    timeout: Timeout = None,
) -> PendingGather:
    """Start gathering every rank's ``local`` into ``out`` (rank ``r``'s block at ``r * n``).

    Args:
        collective: the name used in errors.
        out: contiguous, ``world * local.numel()`` elements of ``local``'s dtype; may hold
            ``local`` itself as this rank's block (then it is not copied).
        local: this rank's contiguous block, the same size on every rank.
        group: the process group (``None``: the default group).
        timeout: time limit of the wait (``None``: the policy of ``timeouts``).

    Raises:
        ValueError: ``out`` does not have ``world`` blocks of ``local``'s size and dtype.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = local.numel()
    if rank >= 0 and (out.numel() != world * n or out.dtype != local.dtype):
        raise ValueError(
            f"{collective}: the output must hold {world} blocks of {n} {local.dtype} elements, "
            f"got {out.numel()} {out.dtype}"
        )
    algorithm = dispatch.all_gather(local, world, rank)
    return algorithm(collective, out, local, world=world, rank=rank, group=group, timeout=timeout)
