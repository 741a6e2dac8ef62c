"""The per-rank iterable Criteo dataset: each rank its own rows, batched, resumable.

Partition (the same for TSV and NumPy sources): the stream is cut into global batches of
``batch_size * world_size`` rows and rank ``r`` takes rows ``[r * batch_size, (r + 1) *
batch_size)`` of each. A final partial global batch of ``m`` rows is split into ``world_size``
equal parts of ``m // world_size`` rows; the stated remainder, its last ``m % world_size`` rows
(fewer than ``world_size``), is dropped. With ``drop_last=True`` the whole partial batch is
dropped, so every batch has ``batch_size`` rows. Every rank yields the same number of batches,
no row goes to two ranks, and no other row is dropped.

Position: ``state_dict()`` holds the rows of the stream consumed by the batches yielded so far
(and the epoch); ``load_state_dict`` makes the next iteration continue with the next batch. The
position counts global rows, so a job may resume with another world size or batch size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from embshard_dist.data.criteo_format import DEFAULT_CAT_NAMES
from embshard_dist.data.criteo_rows import CriteoRows, RowSource
from embshard_dist.data.synthetic import Batch
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

_STATE_VERSION = 1


def rows_to_batch(rows: CriteoRows, keys: Sequence[str] = DEFAULT_CAT_NAMES) -> Batch:
    """A ``Batch``: dense [n, 13], a KJT with one id per sample per key, labels [n]."""
    n = len(rows)
    if len(keys) != rows.sparse.shape[1]:
        raise ValueError(f"{len(keys)} keys for {rows.sparse.shape[1]} categorical columns")
    values = torch.from_numpy(np.ascontiguousarray(rows.sparse.T).reshape(-1))
    sparse = KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        lengths=torch.ones(n * len(keys), dtype=torch.long),
        stride=n,
    )
    return Batch(
        dense=torch.from_numpy(np.ascontiguousarray(rows.dense)),
        sparse=sparse,
        labels=torch.from_numpy(np.ascontiguousarray(rows.labels)),
    )


def rank_slice(block_len: int, batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a global batch of ``block_len`` rows that go to ``rank``."""
    per = batch_size if block_len == batch_size * world_size else block_len // world_size
    return rank * per, (rank + 1) * per


class CriteoIterDataset(IterableDataset[Batch]):
    """Batches of one rank's share of a Criteo source (see the module doc for the partition).

    Args:
        source: a ``TsvSource`` or ``NpySource`` (anything with ``blocks``).
        batch_size: rows per rank per batch.
        rank / world_size: this rank's place (default: the default process group, else 0 / 1).
        drop_last: drop the final partial global batch instead of splitting it.
        keys: the KJT's feature names (default ``cat_0`` .. ``cat_25``, as TorchRec).

    Use it directly or in a ``DataLoader(batch_size=None, num_workers=0 or 1)``.
    """

    def __init__(
        self,
        source: RowSource,
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        keys: Sequence[str] = DEFAULT_CAT_NAMES,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        joined = dist.is_available() and dist.is_initialized()
        self.world_size = (
            world_size if world_size is not None else (dist.get_world_size() if joined else 1)
        )
        self.rank = rank if rank is not None else (dist.get_rank() if joined else 0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of size {self.world_size}")
        self.source = source
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.keys = tuple(keys)
        self._rows_consumed = 0
        self._epoch = 0

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                f"CriteoIterDataset already splits rows by rank; with {info.num_workers} "
                "DataLoader workers every worker would yield the same batches. Use num_workers "
                "0 or 1."
            )
        global_rows = self.batch_size * self.world_size
        for block in self.source.blocks(self._rows_consumed, global_rows):
            n = len(block)
            if n < global_rows and (self.drop_last or n < self.world_size):
                break
            lo, hi = rank_slice(n, self.batch_size, self.rank, self.world_size)
            batch = rows_to_batch(block.take(lo, hi), self.keys)
            self._rows_consumed += n
            yield batch
        self._rows_consumed = 0
        self._epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """The position: global rows consumed by the batches yielded so far, and the epoch."""
        return {
            "version": _STATE_VERSION,
            "rows_consumed": self._rows_consumed,
            "epoch": self._epoch,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a position saved by ``state_dict`` (the next batch comes next)."""
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            raise ValueError(
                f"CriteoIterDataset state version {version!r} is not {_STATE_VERSION}; it was "
                "saved by another embshard release"
            )
        rows = int(state_dict["rows_consumed"])
        if rows < 0:
            raise ValueError(f"rows_consumed must be >= 0, got {rows}")
        self._rows_consumed = rows
        self._epoch = int(state_dict["epoch"])
