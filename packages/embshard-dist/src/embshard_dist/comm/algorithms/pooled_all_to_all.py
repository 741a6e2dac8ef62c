"""The pooled all-to-all's exchanges: every rank's rows through the backend, or this rank's own
rows kept in place while the others' travel as one block.

Both give the same values: with a codec the kept rows are encoded and decoded in place, as if
they had travelled. Only the first and the last rank can keep their own rows, since only there
do the others' rows form one contiguous block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from embshard_dist.comm._codec import ChunkCodec
from embshard_dist.comm._exchange import Channel, decode_chunks, join_rows, keep_own_rows
from embshard_dist.comm.columns import ColumnAssembly
from embshard_kernels.workspace import BufferPool

__all__ = [
    "PooledAllToAll",
    "backward_keeping_own_rows",
    "backward_through_backend",
    "forward_keeping_own_rows",
    "forward_through_backend",
]


class PooledForward(Protocol):
    """Start sending ``input``'s row blocks (``batches``) to their ranks; the buffer lent by
    ``pool`` and a call that waits and gives the ``[batch, dims[s]]`` block from each rank ``s``."""

    def __call__(
        self,
        channel: Channel,
        input: Tensor,
        batches: list[int],
        dims: list[int],
        rank: int,
        coder: ChunkCodec,
        pool: BufferPool,
    ) -> tuple[Callable[[], list[Tensor]], Tensor]: ...


class PooledBackward(Protocol):
    """Start sending each rank the gradient of its columns (cut by ``assembly`` into ``lent``,
    times ``scale``); a call that waits and gives the ``[sum(batches), width]`` gradient."""

    def __call__(
        self,
        channel: Channel,
        grad_output: Tensor,
        batches: list[int],
        rank: int,
        coder: ChunkCodec,
        assembly: ColumnAssembly,
        scale: float,
        lent: Tensor,
    ) -> Callable[[], Tensor]: ...


@dataclass(frozen=True)
class PooledAllToAll:
    """The forward and the backward exchange of one rank's pooled all-to-all."""

    forward: PooledForward
    backward: PooledBackward


def forward_through_backend(
    channel: Channel,
    input: Tensor,
    batches: list[int],
    dims: list[int],
    rank: int,
    coder: ChunkCodec,
    pool: BufferPool,
) -> tuple[Callable[[], list[Tensor]], Tensor]:
    """Every row block to its rank in one coded all-to-all, this rank's own included."""
    chunks = list(input.split(batches, dim=0))
    return _forward(channel, chunks, [(batches[rank], d) for d in dims], coder, input, pool)


def forward_keeping_own_rows(
    channel: Channel,
    input: Tensor,
    batches: list[int],
    dims: list[int],
    rank: int,
    coder: ChunkCodec,
    pool: BufferPool,
) -> tuple[Callable[[], list[Tensor]], Tensor]:
    """This rank's own rows stay here (views without a codec); the others' rows are one block of
    ``input``, sent as it is, behind an empty own chunk at that block's edge."""
    chunks = list(input.split(batches, dim=0))
    recv_shapes = [(batches[rank], d) for d in dims]
    kept = keep_own_rows(input, chunks, batches, rank, coder)
    recv_shapes[rank] = (0, dims[rank])
    return _forward(channel, chunks, recv_shapes, coder, input, pool, (rank, kept))


def _forward(
    channel: Channel,
    chunks: list[Tensor],
    recv_shapes: list[tuple[int, int]],
    coder: ChunkCodec,
    input: Tensor,
    pool: BufferPool,
    kept: tuple[int, Tensor] | None = None,
) -> tuple[Callable[[], list[Tensor]], Tensor]:
    numel = sum(coder.wire_size(b * d) for b, d in recv_shapes)
    lent = pool.lend(numel, coder.wire_dtype, input.device)
    recv_numels = [b * d for b, d in recv_shapes]
    pending, recv = channel.all_to_all("forward", chunks, recv_numels, coder, input, lent)

    def finish() -> list[Tensor]:
        pending.wait()
        parts = decode_chunks(recv, coder, recv_shapes)
        if kept is not None:
            parts[kept[0]] = kept[1]
        return parts

    return finish, lent


def backward_through_backend(
    channel: Channel,
    grad_output: Tensor,
    batches: list[int],
    rank: int,
    coder: ChunkCodec,
    assembly: ColumnAssembly,
    scale: float,
    lent: Tensor,
) -> Callable[[], Tensor]:
    """Every rank's gradient in one coded all-to-all, this rank's own included; what arrives is
    the gradient (without a codec, the receive buffer itself)."""
    width = assembly.widths[rank]
    chunks = assembly.split(grad_output, lent, scale)
    recv_shapes = [(b, width) for b in batches]
    recv_numels = [b * width for b in batches]
    pending, recv = channel.all_to_all("backward", chunks, recv_numels, coder, grad_output)

    def finish() -> Tensor:
        pending.wait()
        return join_rows(decode_chunks(recv, coder, recv_shapes))

    return finish


def backward_keeping_own_rows(
    channel: Channel,
    grad_output: Tensor,
    batches: list[int],
    rank: int,
    coder: ChunkCodec,
    assembly: ColumnAssembly,
    scale: float,
    lent: Tensor,
) -> Callable[[], Tensor]:
    """This rank's own rows' gradient is cut straight into its place in the gradient handed on;
    the other ranks' rows arrive around it, in one block (in place without a codec)."""
    width = assembly.widths[rank]
    grad = grad_output.new_empty(sum(batches), width)
    start = sum(batches[:rank])
    own = grad[start : start + batches[rank]]
    chunks = assembly.split(grad_output, lent, scale, (rank, own))
    if not coder.passthrough:
        own.copy_(coder.decode(coder.encode(own), (own.shape[0], width)))
    at = 0 if rank == 0 else sum(c.numel() for r, c in enumerate(chunks) if r != rank)
    chunks[rank] = lent[at:at]
    recv_shapes = [(0 if r == rank else b, width) for r, b in enumerate(batches)]
    flat = grad.view(-1)
    rest = flat[own.numel() :] if rank == 0 else flat[: start * width]
    into = rest if coder.passthrough else None
    recv_numels = [b * d for b, d in recv_shapes]
    pending, recv = channel.all_to_all("backward", chunks, recv_numels, coder, grad_output, into)

    def finish() -> Tensor:
        pending.wait()
        if not coder.passthrough:
            parts = decode_chunks(recv, coder, recv_shapes)
            torch.cat([p.reshape(-1) for p in parts], out=rest)
        return grad

    return finish
