"""One coded all-to-all of per-peer chunks: encode, send, and cut what arrives back into chunks.

Each chunk is encoded on its own (see ``_codec``) and all travel in one ``all_to_all_single``
with a bounded wait (see ``timeouts``). Both sides know every chunk's payload size, hence its
wire size, so no sizes travel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.comm._codec import ChunkCodec
from embshard_dist.comm.timeouts import PendingCollective, Timeout, issue


@dataclass(frozen=True)
class Channel:
    """Where the exchanges of one collective go."""

    name: str
    """The collective's name in errors; a direction is appended (``"reduce_scatter.forward"``)."""
    group: dist.ProcessGroup | None
    timeout: Timeout

    def all_to_all(
        self,
        direction: str,
        chunks: Sequence[Tensor],
        recv_numels: Sequence[int],
        coder: ChunkCodec,
        like: Tensor,
        recv_buffer: Tensor | None = None,
    ) -> tuple[PendingCollective, Tensor]:
        """:func:`start_all_to_all` on this channel, named ``f"{name}.{direction}"``."""
        return start_all_to_all(
            f"{self.name}.{direction}",
            chunks,
            recv_numels,
            coder,
            like,
            group=self.group,
            timeout=self.timeout,
            recv_buffer=recv_buffer,
        )


def start_all_to_all(
    collective: str,
    chunks: Sequence[Tensor],
    recv_numels: Sequence[int],
    coder: ChunkCodec,
    like: Tensor,
    *,
    group: dist.ProcessGroup | None,
    timeout: Timeout,
    recv_buffer: Tensor | None = None,
) -> tuple[PendingCollective, Tensor]:
    """Start sending ``chunks[r]`` to rank ``r``; the pending collective and the wire buffer.

    Args:
        collective: the name used in errors (e.g. ``"pooled_all_to_all.forward"``).
        chunks, recv_numels: the payload for each rank; the payload elements from each rank.
        coder: encodes the chunks (and sizes what arrives).
        like: a tensor on the payload's device (for an empty send).
        recv_buffer: a flat wire-dtype buffer to receive into (``None``: a new one).
    """
    wire = [coder.encode(c) for c in chunks]
    send = _joined(wire)
    if send is None:
        send = torch.cat(wire) if wire else like.new_empty(0, dtype=coder.wire_dtype)
    recv_sizes = [coder.wire_size(n) for n in recv_numels]
    total = sum(recv_sizes)
    recv = send.new_empty(total) if recv_buffer is None else recv_buffer[:total]
    send_sizes = [w.numel() for w in wire]
    pending = issue(
        collective,
        lambda: dist.all_to_all_single(
            recv, send, recv_sizes, send_sizes, group=group, async_op=True
        ),
        group=group,
        timeout=timeout,
        device=send.device,
    )
    return pending, recv


def _joined(wire: Sequence[Tensor]) -> Tensor | None:
    """One flat view of ``wire`` when its chunks already lie one after another in one buffer
    (e.g. row blocks of a contiguous tensor, sent as they are), so that nothing is copied."""
    if torch.compiler.is_compiling():
        return None  # storage offsets are not traceable: a traced graph copies the chunks
    if not wire or any(w.dim() != 1 or w.stride(0) != 1 for w in wire):
        return None
    first = wire[0]
    at = first.storage_offset()
    for w in wire:
        if w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        if w.storage_offset() != at:
            return None
        at += w.numel()
    total = at - first.storage_offset()
    return first.as_strided((total,), (1,), first.storage_offset())


def keep_own_rows(
    input: Tensor, chunks: list[Tensor], batches: Sequence[int], rank: int, coder: ChunkCodec
) -> Tensor:
    """Take this rank's own row block out of ``chunks`` (``input`` cut by ``batches``) and
    return it, coded and decoded as if it had travelled (views without a codec).

    Its chunk becomes an empty one at the edge of the others' rows, which for the first or last
    rank are one contiguous block of ``input``, sent without a copy.
    """
    own = chunks[rank]
    kept = coder.decode(coder.encode(own), (own.shape[0], *own.shape[1:]))
    at = sum(batches[:rank]) + (batches[rank] if rank == 0 else 0)
    chunks[rank] = input[at:at]
    return kept


def join_rows(chunks: Sequence[Tensor]) -> Tensor:
    """``torch.cat(chunks)`` along dim 0, without a copy when the chunks are contiguous and
    already lie one after another in one buffer (what arrives, decoded as it is)."""
    if chunks and all(c.is_contiguous() for c in chunks):
        flat = _joined([c.view(-1) for c in chunks])
        if flat is not None:
            return flat.view(sum(c.shape[0] for c in chunks), *chunks[0].shape[1:])
    return torch.cat(list(chunks))


def decode_chunks(
    recv: Tensor, coder: ChunkCodec, shapes: Sequence[tuple[int, ...]]
) -> list[Tensor]:
    """The chunks of ``shapes`` (one per source rank, in rank order) carried by ``recv``."""
    parts = recv.split([coder.wire_size(math.prod(s)) for s in shapes])
    return [coder.decode(p, s) for p, s in zip(parts, shapes, strict=True)]
