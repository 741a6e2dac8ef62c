"""Fills the local shards of a freshly sharded collection: copied, or drawn deterministically.

Drawn weights depend only on the table's name, shape and init range (block ``k`` of table ``t``
seeded with ``crc32("t:k")``), so every rank, plan and world size gets the same row values;
torch's global random state is untouched.
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

from embshard_types.configs import BaseEmbeddingConfig
from embshard_types.shard_spec import ShardSpec

ROWS_PER_DRAW = 4096
"""Rows drawn from one generator (the unit of deterministic initialisation)."""


def draw_shard(config: BaseEmbeddingConfig, spec: ShardSpec, dtype: torch.dtype) -> Tensor:
    """The initial values of one shard of a table; only the row blocks it overlaps are drawn."""
    out = torch.empty(spec.sizes[0], spec.sizes[1], dtype=dtype)
    fill_shard(config, spec, out)
    return out


def fill_shard(config: BaseEmbeddingConfig, spec: ShardSpec, out: Tensor) -> None:
    """Write :func:`draw_shard`'s values into ``out`` (the shard's ``sizes``) in place, one row
    block at a time: besides ``out``, at most :data:`ROWS_PER_DRAW` rows are held."""
    (r0, c0), (nr, nc) = spec.offsets, spec.sizes
    if tuple(out.shape) != (nr, nc):
        raise ValueError(
            f"table {config.name!r}: a shard of {nr} x {nc} cannot be written into a tensor of "
            f"shape {tuple(out.shape)}"
        )
    low, high = config.weight_init_min, config.weight_init_max
    first, last = r0 // ROWS_PER_DRAW, (r0 + nr - 1) // ROWS_PER_DRAW
    for block in range(first, last + 1) if nr else ():
        start = block * ROWS_PER_DRAW
        rows = min(ROWS_PER_DRAW, config.num_embeddings - start)
        seed = zlib.crc32(f"{config.name}:{block}".encode())
        generator = torch.Generator().manual_seed(seed)
        values = torch.empty(rows, config.embedding_dim).uniform_(low, high, generator=generator)
        lo, hi = max(r0, start) - start, min(r0 + nr, start + rows) - start
        at = start + lo - r0
        out[at : at + hi - lo].copy_(values[lo:hi, c0 : c0 + nc])


def is_materialised(weight: Tensor) -> bool:
    return weight.device.type != "meta"
