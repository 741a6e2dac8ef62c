"""Checkpoints of a ``DistributedModelParallel``: save, resume, reshard, export and import.

``from embshard_dist.checkpoint import save_checkpoint, load_checkpoint`` gives the two calls a
training script needs; the rest lives in the modules (``save``, ``load``, ``inspect``,
``export``, ``import_``). Nothing is imported until a name is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embshard_dist.checkpoint.load import LoadResult, load_checkpoint
    from embshard_dist.checkpoint.save import SaveHandle, save_checkpoint, save_to_directory

__all__ = ["LoadResult", "SaveHandle", "load_checkpoint", "save_checkpoint", "save_to_directory"]

_HOMES = {
    "LoadResult": "load",
    "load_checkpoint": "load",
    "SaveHandle": "save",
    "save_checkpoint": "save",
    "save_to_directory": "save",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
