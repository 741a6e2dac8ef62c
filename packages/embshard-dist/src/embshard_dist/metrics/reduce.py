"""Reductions of metric states over a process group (or none, outside a distributed job).

:func:`all_reduce_states` is the ``dist_sync_fn`` of every metric here: torchmetrics hands it one
state at a time and sums what it returns, so a state is summed over the ranks by one all-reduce
of its fixed-size tensor; no rank ever sees another rank's predictions. Outside an initialised
process group the functions return the local value, so a metric computes the same on one
process with or without ``torch.distributed``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embshard_dist.comm.collectives import all_reduce, collective_device


def joined(group: dist.ProcessGroup | None) -> bool:
    """Whether a process group is up (metrics then reduce over ``group``)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group: dist.ProcessGroup | None) -> int:
    """The ranks of ``group`` (1 outside a distributed job)."""
    return dist.get_world_size(group) if joined(group) else 1


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


def all_reduce_states(
    state: torch.Tensor, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """A torchmetrics ``dist_sync_fn`` for ``dist_reduce_fx="sum"`` states: ``[sum over ranks]``.

    torchmetrics stacks the returned list and sums it over its first dimension, which leaves
    the all-reduced state. It runs on the device collectives of ``group`` use (the current
    GPU under NCCL) and comes back on ``state``'s device.
    """
    return [sum_over_ranks(state, group, "metrics.state")]
