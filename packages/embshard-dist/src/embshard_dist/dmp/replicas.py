"""Keeps the replicas of a 2-D sharded model in step by averaging their tables and optimizer state.

After every sync the replicas are bit-identical. Synced every step, SGD equals the unsharded step
on the global batch; adaptive optimizers get the average of the replicas' steps instead (as in
TorchRec's DMPCollection). Integer state and dense-kernel optimizer state are left alone.
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
    """The local shards (live views) of a ShardedTensor or DTensor, or a plain tensor itself."""
    st_module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    if st_module is not None and isinstance(value, st_module.ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    dt_module = sys.modules.get("torch.distributed.tensor")
    if dt_module is not None and isinstance(value, dt_module.DTensor):
        inner = value.to_local()
        if hasattr(inner, "local_shards"):
            return list(inner.local_shards())
        return [inner]
    if isinstance(value, Tensor):
        return [value]
    return []


def replica_tensors(
    modules: Iterable[nn.Module], *, include_optimizer_state: bool = True
) -> list[Tensor]:
    """Every tensor a sync averages, each once, in a fixed order: parameters, then float state."""
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
        replica_pg: ``None``: no replicas, syncing does nothing.
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
        return self._replicas

    def step(self) -> bool:
        """Count a training step; sync every ``interval`` steps and say whether it did."""
        self._steps += 1
        if self.interval is None or self._steps % self.interval:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self, include_optimizer_state: bool = True) -> None:
        """Average every local shard and optimizer state over the replicas (collective)."""
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
