"""Pieces of sharded tensors, and the ``ShardedTensor``s a checkpoint reads and writes.

:func:`local_pieces` reads a rank's blocks out of any state-dict value; :func:`sharded_tensor`
wraps them for ``torch.distributed.checkpoint``; :func:`read_tiling` completes a rank's wanted
blocks into a full tiling with placeholder shards that are never read.

Guarantees: no copies unless asked; empty pieces are left out.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Piece", "Shard", "local_pieces", "quiet", "read_tiling", "sharded_tensor"]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence torch's warnings about what checkpoints do on purpose.

    ``ShardedTensor`` is deprecated but serves as a plain container here, and the offline tools run
    ``torch.distributed.checkpoint`` in a single process deliberately.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        warnings.filterwarnings(
            "ignore", "torch.distributed is (disabled, )?unavailable or uninitialized", UserWarning
        )
        yield


@dataclass(frozen=True)
class Piece:
    """A local block of a tensor: its offsets in the whole tensor and its values."""

    offsets: tuple[int, ...]
    tensor: Tensor

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


@dataclass(frozen=True)
class Shard:
    """One block of a tensor's tiling: where it is and which (global) rank owns it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int


def local_pieces(value: Any) -> list[Piece]:
    """This rank's pieces of a state-dict value (a plain tensor is one piece at offset 0).

    Raises:
        TypeError: ``value`` is not a tensor of any kind.
    """
    st_module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    if st_module is not None and isinstance(value, st_module.ShardedTensor):
        with quiet():
            shards = value.local_shards()
        return [Piece(tuple(s.metadata.shard_offsets), s.tensor.detach()) for s in shards]
    dt_module = sys.modules.get("torch.distributed.tensor")
    if dt_module is not None and isinstance(value, dt_module.DTensor):
        inner = value.to_local()
        if hasattr(inner, "local_offsets"):
            shards = inner.local_shards()
            if not shards:  # it describes "no shard" with one placeholder offset
                return []
            return [
                Piece(tuple(int(x) for x in o), t.detach())
                for o, t in zip(inner.local_offsets(), shards, strict=True)
            ]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return [Piece(tuple(offsets), inner.detach())] if inner.numel() else []
    if isinstance(value, Tensor):
        return [Piece((0,) * value.dim(), value.detach())]
    raise TypeError(f"expected a tensor, ShardedTensor or DTensor, got {type(value).__name__}")


def sharded_tensor(
    pieces: Sequence[Piece],
    tiling: Sequence[Shard],
    size: Sequence[int],
    dtype: torch.dtype,
    pg: ProcessGroup | None,
) -> Any:
    """A ``ShardedTensor`` of ``size`` over this rank's ``pieces`` (not copied).

    Args:
        pieces: this rank's blocks; each must be one of ``tiling``'s shards owned by this rank.
        tiling: every block of the tensor (they must tile it exactly).
    """
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as TorchShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    me = dist.get_rank()
    device = pieces[0].tensor.device if pieces else torch.device("cpu")
    kept = [s for s in tiling if math.prod(s.sizes) > 0]
    if not kept:  # a tensor without elements: one empty block on rank 0
        kept = [Shard((0,) * len(size), tuple(size), 0)]

    def metadata(shard: Shard) -> ShardMetadata:
        where = device if shard.rank == me else torch.device(device.type)
        return ShardMetadata(
            shard_offsets=list(shard.offsets),
            shard_sizes=list(shard.sizes),
            placement=f"rank:{shard.rank}/{where}",
        )

    by_offsets = {(s.offsets, s.sizes): metadata(s) for s in kept}
    local = [
        TorchShard(p.tensor, by_offsets[(p.offsets, p.sizes)]) for p in pieces if p.tensor.numel()
    ]
    global_md = ShardedTensorMetadata(
        shards_metadata=[by_offsets[(s.offsets, s.sizes)] for s in kept],
        size=torch.Size(size),
        tensor_properties=TensorProperties(dtype=dtype),
    )
    with quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards=local, sharded_tensor_metadata=global_md, process_group=pg
        )


def read_tiling(
    wanted: Sequence[tuple[int, int]], length: int, rank: int, other: int
) -> list[Shard]:
    """A tiling of ``[0, length)`` whose blocks owned by ``rank`` are exactly ``wanted``.

    The gaps are placeholder blocks owned by ``other``, never read, so that blocks several ranks
    need can be read by all of them.

    Raises:
        ValueError: ranges overlap or fall outside ``[0, length)``, or a gap remains with
            nobody else to own it (``other == rank``).
    """
    tiling: list[Shard] = []
    at = 0
    for start, count in sorted(wanted):
        if start < at or start + count > length:
            raise ValueError(
                f"ranges {sorted(wanted)} overlap or leave [0, {length}); cannot read them"
            )
        if start > at:
            tiling.append(Shard((at,), (start - at,), other))
        tiling.append(Shard((start,), (count,), rank))
        at = start + count
    if at < length:
        tiling.append(Shard((at,), (length - at,), other))
    if other == rank and len(tiling) > len(wanted):
        raise ValueError(f"a one-rank world must read all of [0, {length}), got {wanted}")
    return tiling
