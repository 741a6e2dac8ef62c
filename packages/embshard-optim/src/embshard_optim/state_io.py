"""Loading saved optimizer state into the tensors an optimizer already holds.

:func:`state_mismatches` lists every difference between a saved and the current state;
:func:`copy_state` then copies in place (into the kernels' buffers, shard by shard). Neither
imports ``torch.distributed``'s sharded-tensor or DTensor modules.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor


def loaded_type(module: str, name: str) -> type | None:
    """``module.name`` if ``module`` is already imported, else ``None``."""
    loaded = sys.modules.get(module)
    found = getattr(loaded, name, None) if loaded is not None else None
    return found if isinstance(found, type) else None


def _kind(value: Any) -> str:
    sharded = loaded_type("torch.distributed._shard.sharded_tensor", "ShardedTensor")
    if sharded is not None and isinstance(value, sharded):
        return "ShardedTensor"
    dtensor = loaded_type("torch.distributed.tensor", "DTensor")
    if dtensor is not None and isinstance(value, dtensor):
        return "DTensor"
    if isinstance(value, Tensor):
        return "Tensor"
    if isinstance(value, Mapping):
        return "dict"
    return "value"


def _local_parts(value: Any) -> list[tuple[tuple[int, ...], Tensor]]:
    """This rank's pieces of a sharded value as ``(offsets, tensor)``, sorted by offsets."""
    kind = _kind(value)
    if kind == "ShardedTensor":
        parts = [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    elif kind == "DTensor":
        local = value.to_local()
        if hasattr(local, "local_shards") and hasattr(local, "local_offsets"):
            offsets = [tuple(int(x) for x in o) for o in local.local_offsets()]
            parts = list(zip(offsets, local.local_shards(), strict=True))
        else:
            parts = [((), local)]
    else:
        parts = [((), value)]
    return sorted(parts, key=lambda part: part[0])


def state_mismatches(current: Any, saved: Any, where: str) -> list[str]:
    """Every way ``saved`` cannot be loaded into ``current`` (empty when it can).

    Args:
        current: the optimizer's live value (a dict of states, a tensor, or a plain value).
        saved: the value from the state dict being loaded.
        where: the key path, for the messages (e.g. ``"state['t1.weight']"``).
    """
    kind, saved_kind = _kind(current), _kind(saved)
    if kind == "value":
        return []
    if kind != saved_kind:
        return [f"{where}: expected a {kind}, got {type(saved).__name__}"]
    if kind == "dict":
        problems = []
        missing = sorted(map(str, set(current) - set(saved)))
        extra = sorted(map(str, set(saved) - set(current)))
        if missing:
            problems.append(f"{where}: missing keys {missing}")
        if extra:
            problems.append(f"{where}: unexpected keys {extra}")
        for key in current:
            if key in saved:
                problems += state_mismatches(current[key], saved[key], f"{where}[{key!r}]")
        return problems
    if tuple(current.shape) != tuple(saved.shape):
        return [f"{where}: shape {list(saved.shape)} does not match {list(current.shape)}"]
    mine = [(o, tuple(t.shape)) for o, t in _local_parts(current)]
    theirs = [(o, tuple(t.shape)) for o, t in _local_parts(saved)]
    if mine != theirs:
        return [
            f"{where}: this rank's shards {theirs} (offsets, sizes) do not match {mine}; "
            "load through a resharding checkpoint instead"
        ]
    return []


@torch.no_grad()
def copy_state(current: MutableMapping[Any, Any], saved: Mapping[Any, Any]) -> None:
    """Copy ``saved`` into ``current`` in place (check with :func:`state_mismatches` first)."""
    for key, value in saved.items():
        target = current[key]
        kind = _kind(target)
        if kind == "dict":
            copy_state(target, value)
        elif kind == "value":
            current[key] = value
        else:
            for (_, mine), (_, theirs) in zip(
                _local_parts(target), _local_parts(value), strict=True
            ):
                mine.copy_(theirs)
