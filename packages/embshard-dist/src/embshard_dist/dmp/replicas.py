"""Keeping the replicas of a 2-D sharded model in step: average their tables and optimizer state.

In a 2-D layout (:mod:`embshard_dist.dmp.collection`) every sharding group holds a full copy of
the tables, sharded alike, and trains it on its own ranks' batches. :class:`ReplicaSync` makes
the copies equal again: every local shard of every sharded module's weights and fused optimizer
state is averaged over the replica group (the ranks holding the same shards in the other
sharding groups): one all-reduce per dtype of all those tensors flattened, divided by the number
of replicas, copied back in place. :meth:`ReplicaSync.step` syncs every ``interval`` calls.

What holds (R replicas of a sharding group of G ranks, N = R G):

* after every sync the replicas hold bit-identical weights and optimizer state (the all-reduce
  gives every replica the same sum, each divides it alike);
* SGD, syncing every step: a replica's step is ``w - lr g_r`` with ``g_r`` the gradient of its
  group's loss ``(1/G) sum_{i in r} L_i``, so the average is ``w - lr (1/R) sum_r g_r``: the
  unsharded step on the global batch with ``L = (1/N) sum_i L_i`` (the one rule of
  :mod:`embshard_dist.sharding.base`), up to float rounding of the average;
* adaptive optimizers (Adagrad, RowWiseAdagrad, Adam...), syncing every step: after a sync the
  weights and every state tensor equal the element-wise average over the replicas of the
  unsharded module stepped, from the common synced state, on that replica's group batch with
  loss ``(1/G) sum_{i in r} L_i``. This is not the unsharded step on the global batch (the
  average of ``g_r / sqrt(v_r)`` is not ``g / sqrt(v)``; TorchRec's DMPCollection behaves the
  same way); syncing every ``k`` steps averages after ``k`` such replica steps.

Integer state (none of embshard's kernels keeps one: step counters live in the kernels and
advance alike on every replica) is left alone. Dense-kernel tables' weights are averaged; their
optimizer state belongs to the caller's torch optimizer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.collectives import all_reduce

__all__ = ["ReplicaSync", "local_tensors", "replica_tensors"]


def local_tensors(value: Any) -> list[Tensor]:
    """The tensors this rank holds of ``value``: a ShardedTensor's or DTensor's local shards,
    or a plain tensor itself (live views, no copy)."""
    st_module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    if st_module is not None and isinstance(value, st_module.ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    dt_module = sys.modules.get("torch.distributed.tensor")
    if dt_module is not None and isinstance(value, dt_module.DTensor):
        inner = value.to_local()
        if hasattr(inner, "local_shards"):  # a LocalShardsWrapper
            return list(inner.local_shards())
        return [inner]
    if isinstance(value, Tensor):
        return [value]
    return []


def replica_tensors(
    modules: Iterable[nn.Module], *, include_optimizer_state: bool = True
) -> list[Tensor]:
    """Every tensor a sync averages: each module's local parameters, then (optionally) the
    floating-point state of its fused optimizer, each tensor once, in a fixed order.

    Args:
        modules: the sharded modules (in the same order on every rank).
        include_optimizer_state: also the fused optimizers' state.
    """
    out: list[Tensor] = []
    seen: set[tuple[int, int, tuple[int, ...]]] = set()

    def add(tensor: Tensor) -> None:
        key = (tensor.data_ptr(), tensor.numel(), tuple(tensor.stride()))
        if tensor.numel() and tensor.is_floating_point() and key not in seen:
            seen.add(key)
            out.append(tensor)

    for module in modules:
        for _, param in module.named_parameters():
            add(param)
        optimizer = getattr(module, "fused_optimizer", None)
        if include_optimizer_state and optimizer is not None:
            for state in optimizer.state.values():
                for name in sorted(state):
                    for tensor in local_tensors(state[name]):
                        add(tensor)
    return out


class ReplicaSync:
    """Averages sharded modules' tables and optimizer state over a replica group.

    Args:
        modules: the sharded modules (same structure and order on every rank).
        replica_pg: the ranks holding the same shards in every sharding group (``None``: no
            replicas, syncing does nothing).
        interval: :meth:`step` syncs every ``interval`` calls (``None``: only :meth:`sync`).

    Raises:
        ValueError: ``interval`` is not a positive int.
    """

    def __init__(
        self, modules: Iterable[nn.Module], replica_pg: Any, interval: int | None = 1
    ) -> None:
        if interval is not None and (
            isinstance(interval, bool) or not isinstance(interval, int) or interval < 1
        ):
            raise ValueError(
                f"the sync interval must be a positive number of steps (or None), got {interval!r}"
            )
        self._modules = list(modules)
        self._pg = replica_pg
        self._replicas = 1 if replica_pg is None else dist.get_world_size(replica_pg)
        self.interval = interval
        self._steps = 0

    @property
    def num_replicas(self) -> int:
        """How many copies of the tables are kept in step."""
        return self._replicas

    def step(self) -> bool:
        """Count a training step; sync when ``interval`` steps have passed since the last one.

        Returns:
            Whether this call synced.
        """
        self._steps += 1
        if self.interval is None or self._steps % self.interval:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self, include_optimizer_state: bool = True) -> None:
        """Average every local shard and optimizer state over the replicas (collective).

        Args:
            include_optimizer_state: also average the fused optimizers' state.
        """
        if self._replicas == 1:
            return
        tensors = replica_tensors(self._modules, include_optimizer_state=include_optimizer_state)
        by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for tensor in tensors:
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        for (dtype, _), group in sorted(
            by_kind.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))
        ):
            flat = torch.cat([t.reshape(-1) for t in group])
            all_reduce(flat, group=self._pg, name=f"replica_sync.{dtype}")
            flat.div_(self._replicas)
            at = 0
            for tensor in group:
                n = tensor.numel()
                tensor.copy_(flat[at : at + n].view_as(tensor))
                at += n
