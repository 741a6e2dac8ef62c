"""How a sharded table's optimizer state is laid out, and the distributed tensors that expose it.

Point-wise state is sharded like the weight; row-wise state follows the row split, with one
``[num_rows]`` block per column block laid end to end (TorchRec's column-wise layout). Layout
functions are pure and refuse shards that do not tile the table; builders wrap the local tensors
without copying and import ``torch.distributed`` tensor modules only when they run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import unique
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ParsableEnum

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


@unique
class StateFormat(ParsableEnum):
    """How a fused optimizer exposes a table's weight and state."""

    SHARDED_TENSOR = "sharded_tensor"
    """``torch.distributed._shard`` ``ShardedTensor`` (TorchRec's default)."""
    DTENSOR = "dtensor"
    """``torch.distributed.tensor.DTensor`` over a ``LocalShardsWrapper`` of the local shards."""
    TENSOR = "tensor"
    """Plain tensors: for an unsharded table (one shard covering it) outside any process group."""


def check_tiling(specs: Sequence[ShardSpec], size: Sequence[int], what: str) -> None:
    """Check that ``specs`` cover a tensor of ``size`` exactly once.

    Raises:
        ValueError: naming ``what`` (e.g. ``"table 't1' weight"``): a shard of the wrong rank,
            out of bounds or overlapping another, or part of the tensor uncovered.
    """
    size = tuple(size)
    for spec in specs:
        if len(spec.offsets) != len(size):
            raise ValueError(
                f"{what}: shard {spec.offsets}/{spec.sizes} has {len(spec.offsets)} dims, "
                f"the tensor {list(size)} has {len(size)}"
            )
        if any(o + s > n for o, s, n in zip(spec.offsets, spec.sizes, size, strict=True)):
            raise ValueError(
                f"{what}: shard at offsets {list(spec.offsets)} with sizes {list(spec.sizes)} "
                f"lies outside the tensor of size {list(size)}"
            )
    for i, a in enumerate(specs):
        for b in specs[i + 1 :]:
            if _overlap(a, b):
                raise ValueError(
                    f"{what}: shards at offsets {list(a.offsets)} (sizes {list(a.sizes)}) and "
                    f"{list(b.offsets)} (sizes {list(b.sizes)}) overlap"
                )
    covered = sum(math.prod(s.sizes) for s in specs)
    if covered != math.prod(size):
        raise ValueError(
            f"{what}: shards cover {covered} of the {math.prod(size)} elements of a tensor of "
            f"size {list(size)}; every element must belong to exactly one shard"
        )


def _overlap(a: ShardSpec, b: ShardSpec) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ and as_ > 0 and bs > 0
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


def pointwise_state_layout(
    weight_specs: Sequence[ShardSpec], size: Sequence[int]
) -> tuple[tuple[ShardSpec, ...], tuple[int, ...]]:
    """Shards and global size of a point-wise state: those of the weight."""
    return tuple(weight_specs), tuple(size)


def rowwise_state_layout(
    weight_specs: Sequence[ShardSpec], size: Sequence[int], what: str = "table"
) -> tuple[tuple[ShardSpec, ...], tuple[int]]:
    """Shards (in ``weight_specs``' order) and global size of a row-wise state.

    Raises:
        ValueError: the column blocks do not each hold a full set of rows (an irregular grid).
    """
    num_rows = int(size[0])
    blocks = sorted({spec.offsets[1] for spec in weight_specs})
    block_of = {offset: index for index, offset in enumerate(blocks)}
    state_specs = tuple(
        ShardSpec(
            offsets=(block_of[spec.offsets[1]] * num_rows + spec.offsets[0],),
            sizes=(spec.sizes[0],),
            placement=spec.placement,
        )
        for spec in weight_specs
    )
    global_size = (num_rows * len(blocks),)
    check_tiling(state_specs, global_size, f"{what} row-wise optimizer state")
    return state_specs, global_size


def state_layout(
    weight_specs: Sequence[ShardSpec], size: Sequence[int], *, rowwise: bool, what: str = "table"
) -> tuple[tuple[ShardSpec, ...], tuple[int, ...]]:
    """:func:`rowwise_state_layout` or :func:`pointwise_state_layout`."""
    if rowwise:
        return rowwise_state_layout(weight_specs, size, what)
    return pointwise_state_layout(weight_specs, size)


def make_sharded_tensor(
    local: Sequence[tuple[Tensor, ShardSpec]],
    specs: Sequence[ShardSpec],
    size: Sequence[int],
    pg: ProcessGroup | None,
) -> ShardedTensor:
    """A ``ShardedTensor`` over this rank's ``local`` tensors (not copied).

    Args:
        local: ``(tensor, spec)`` for each shard this rank holds (``spec`` among ``specs``).
        pg: the process group the placements' ranks refer to (``None``: the default group).
    """
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    first = local[0][0]
    properties = TensorProperties(
        dtype=first.dtype, layout=first.layout, requires_grad=first.requires_grad
    )
    metadata = ShardedTensorMetadata(
        shards_metadata=[spec.to_torch() for spec in specs],
        size=torch.Size(size),
        tensor_properties=properties,
    )
    shards = [Shard(tensor, spec.to_torch()) for tensor, spec in local]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=shards, sharded_tensor_metadata=metadata, process_group=pg
    )


def make_dtensor(
    local: Sequence[tuple[Tensor, ShardSpec]],
    specs: Sequence[ShardSpec],
    size: Sequence[int],
    mesh: DeviceMesh,
) -> DTensor:
    """A ``DTensor`` whose local part is a ``LocalShardsWrapper`` of ``local`` (not copied).

    The wrapper carries each local shard's offsets (what checkpointing reads); the placement
    is ``Replicate`` for one shard, ``Shard(1)`` when only columns are split, else ``Shard(0)``.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    wrapper = LocalShardsWrapper(
        local_shards=[tensor for tensor, _ in local],
        local_offsets=[spec.offsets for _, spec in local],
    )
    full_rows = all(s.offsets[0] == 0 and s.sizes[0] == size[0] for s in specs)
    if len(specs) == 1:
        placement: Replicate | Shard = Replicate()
    elif full_rows and len(size) == 2:
        placement = Shard(1)
    else:
        placement = Shard(0)
    stride = tuple(math.prod(size[i + 1 :]) for i in range(len(size)))
    return DTensor.from_local(
        wrapper,
        device_mesh=mesh,
        placements=[placement],
        run_check=False,
        shape=torch.Size(size),
        stride=stride,
    )


def make_mesh(pg: ProcessGroup | None, device_type: str) -> DeviceMesh:
    """A 1-D device mesh over ``pg`` (``None``: the default group) for :func:`make_dtensor`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = pg if pg is not None else dist.group.WORLD
    if group is None:
        raise ValueError(
            "a DTensor state needs torch.distributed to be initialised; call "
            "init_process_group() first or use StateFormat.TENSOR for an unsharded table"
        )
    return DeviceMesh.from_group(group, device_type)
