"""Which sub-modules of a model can be sharded, by which sharder, and what tables they hold.

Modules are found in ``named_modules()`` order and matched by exact type (a subclass may change
``forward``); table shapes come from the table configs or the 2-D parameters, so meta-device
modules work too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from embshard_types.interfaces import ModuleSharder, ShardedModule
from embshard_types.vocab import DataType

__all__ = ["TableShape", "find_shardable_modules", "sharder_for", "table_shapes"]


@dataclass(frozen=True)
class TableShape:
    """What a planner needs to know of one table."""

    name: str
    rows: int
    dim: int
    data_type: DataType = DataType.FP32

    @property
    def element_bytes(self) -> int:
        """Bytes per stored weight element (packed types rounded up to a byte)."""
        return max(1, self.data_type.bits // 8)


def sharder_for(
    module: nn.Module, sharders: Sequence[ModuleSharder[Any]]
) -> ModuleSharder[Any] | None:
    """The first sharder whose ``module_type`` is exactly ``type(module)``, or ``None``."""
    for sharder in sharders:
        if type(module) is sharder.module_type:
            return sharder
    return None


def find_shardable_modules(
    model: nn.Module, sharders: Sequence[ModuleSharder[Any]]
) -> dict[str, tuple[nn.Module, ModuleSharder[Any]]]:
    """Module path -> (module, its sharder) for every shardable sub-module (the model is ``""``).

    Descendants of a matched module and already sharded modules are skipped.
    """
    found: dict[str, tuple[nn.Module, ModuleSharder[Any]]] = {}
    for path, module in model.named_modules():
        if any(_inside(path, p) for p in found):
            continue
        if isinstance(module, ShardedModule):
            continue
        sharder = sharder_for(module, sharders)
        if sharder is not None:
            found[path] = (module, sharder)
    return found


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def table_shapes(module: nn.Module, sharder: ModuleSharder[Any]) -> list[TableShape]:
    """The tables of a shardable module, in its own order.

    Raises:
        ValueError: a shardable parameter is not 2-D.
    """
    configs = getattr(module, "embedding_bag_configs", None)
    if configs is None:
        configs = getattr(module, "embedding_configs", None)
    if callable(configs):
        return [
            TableShape(c.name, c.num_embeddings, c.embedding_dim, c.data_type) for c in configs()
        ]
    shapes = []
    for name, param in sharder.shardable_parameters(module).items():
        if param.dim() != 2:
            raise ValueError(
                f"shardable parameter {name!r} of {type(module).__name__} has shape "
                f"{tuple(param.shape)}; a planner shards 2-D tables only"
            )
        rows, dim = param.shape
        shapes.append(TableShape(name, int(rows), int(dim)))
    return shapes
