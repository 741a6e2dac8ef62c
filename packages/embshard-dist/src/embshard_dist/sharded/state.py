"""A sharded table's weight as a state-dict entry, and back into its local shard.

Saving wraps the kernels' live weights without copying (a ``ShardedTensor`` or ``DTensor`` on
every rank, the plain tensor for DP). Loading accepts the same sharded layout, the whole table or
the local shard, and raises ``ValueError`` naming the table before writing anything otherwise.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from embshard_optim.sharded_state import StateFormat
from embshard_types.shard_spec import ShardSpec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


def table_state_entry(
    local: Sequence[tuple[Tensor, ShardSpec]],
    specs: Sequence[ShardSpec],
    size: tuple[int, int],
    dtype: torch.dtype,
    *,
    fmt: StateFormat,
    pg: ProcessGroup | None,
    mesh: DeviceMesh | None,
) -> Tensor:
    """The state-dict entry of one sharded table over this rank's shards (maybe none)."""
    if fmt is StateFormat.DTENSOR:
        assert mesh is not None
        return _dtensor(local, specs, size, mesh)
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    metadata = ShardedTensorMetadata(
        shards_metadata=[spec.to_torch() for spec in specs],
        size=torch.Size(size),
        tensor_properties=TensorProperties(dtype=dtype),
    )
    shards = [Shard(tensor, spec.to_torch()) for tensor, spec in local]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=shards, sharded_tensor_metadata=metadata, process_group=pg
    )


def _dtensor(
    local: Sequence[tuple[Tensor, ShardSpec]],
    specs: Sequence[ShardSpec],
    size: tuple[int, int],
    mesh: DeviceMesh,
) -> Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    wrapper = LocalShardsWrapper(
        local_shards=[tensor for tensor, _ in local],
        local_offsets=[spec.offsets for _, spec in local],
    )
    full_rows = all(s.offsets[0] == 0 and s.sizes[0] == size[0] for s in specs)
    placement: Replicate | Shard = (
        Replicate() if len(specs) == 1 else Shard(1) if full_rows else Shard(0)
    )
    return DTensor.from_local(
        wrapper,
        device_mesh=mesh,
        placements=[placement],
        run_check=False,
        shape=torch.Size(size),
        stride=(size[1], 1),
    )


def local_part(value: Any, spec: ShardSpec, size: tuple[int, int], table: str) -> Tensor:
    """The part of a loaded entry that belongs in the local shard ``spec``.

    Raises:
        ValueError: the entry is neither the whole table, nor this shard, nor a sharded
            tensor holding this shard locally.
    """
    shards = _local_shards(value)
    if shards is not None:
        for tensor, offsets in shards:
            if tuple(offsets) == spec.offsets and tuple(tensor.shape) == spec.sizes:
                return tensor
        raise ValueError(
            f"table {table!r}: the loaded sharded entry holds local shards at offsets "
            f"{[list(o) for _, o in shards]} but this rank's shard is at {list(spec.offsets)} "
            f"with sizes {list(spec.sizes)}; load a checkpoint saved with the same plan, or "
            "reshard it with the checkpoint tools"
        )
    if not isinstance(value, Tensor):
        raise ValueError(
            f"table {table!r}: expected a tensor, ShardedTensor or DTensor, got "
            f"{type(value).__name__}"
        )
    if tuple(value.shape) == tuple(size):
        (r0, c0), (nr, nc) = spec.offsets, spec.sizes
        return value[r0 : r0 + nr, c0 : c0 + nc]
    if tuple(value.shape) == spec.sizes:
        return value
    raise ValueError(
        f"table {table!r}: loaded tensor has shape {list(value.shape)}; expected the whole "
        f"table {list(size)} or this rank's shard {list(spec.sizes)}"
    )


def check_entry(value: Any, size: tuple[int, int], table: str) -> None:
    """Raise unless a loaded entry describes the whole table (any form, any rank).

    Raises:
        ValueError: the entry is not a tensor, or its (global) shape is not the table's.
    """
    if not isinstance(value, Tensor):
        raise ValueError(
            f"table {table!r}: expected a tensor, ShardedTensor or DTensor, got "
            f"{type(value).__name__}"
        )
    if tuple(value.shape) != tuple(size):
        raise ValueError(
            f"table {table!r}: loaded entry has shape {list(value.shape)}; the table is "
            f"{list(size)}"
        )


def _local_shards(value: Any) -> list[tuple[Tensor, Sequence[int]]] | None:
    """``(tensor, offsets)`` of each local shard of a ShardedTensor / DTensor, else None.

    Looks the types up only if already imported, so plain tensors never import them.
    """
    st_module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    if st_module is not None and isinstance(value, st_module.ShardedTensor):
        return [(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
    dt_module = sys.modules.get("torch.distributed.tensor")
    if dt_module is not None and isinstance(value, dt_module.DTensor):
        inner = value.to_local()
        if hasattr(inner, "local_offsets"):
            return list(zip(inner.local_shards(), inner.local_offsets(), strict=True))
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return [(inner, offsets)] if math.prod(inner.shape) else []
    return None
