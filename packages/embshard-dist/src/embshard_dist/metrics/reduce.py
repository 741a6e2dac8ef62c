"""Reductions of metric states over a process group (or none, outside a distributed job).

Outside an initialised process group these return the local value, so a metric computes the
same on one process with or without ``torch.distributed``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embshard_dist.comm.collectives import all_gather_v, all_reduce, collective_device


def joined(group: dist.ProcessGroup | None) -> bool:
    """Whether a process group is up (metrics then reduce over ``group``)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def sum_over_ranks(
    t: torch.Tensor,
    group: dist.ProcessGroup | None,
    name: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """``t`` reduced with ``op`` over the ranks of ``group`` (a new tensor, on ``t``'s device)."""
    if not joined(group):
        return t.clone()
    out = t.detach().to(collective_device(group), copy=True)
    return all_reduce(out, op, group=group, name=name).to(t.device)


def gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None, name: str) -> list[torch.Tensor]:
    """Every rank's rows of ``t`` (a 2-D tensor; row counts may differ), in rank order."""
    if not joined(group):
        return [t]
    local = t.detach().to(collective_device(group))
    return [g.to(t.device) for g in all_gather_v(local, group=group, name=name)]
