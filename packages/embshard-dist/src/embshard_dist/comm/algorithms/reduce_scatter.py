"""Reduce-scatter of row blocks: the backend's own, or an all-to-all and a local sum.

Both leave rank ``r`` with the sum over ranks of their ``r``-th row block. The backend sums in
its own order; the all-to-all variant in rank order, so its result is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.comm._codec import ChunkCodec
from embshard_dist.comm._exchange import Channel, keep_own_rows
from embshard_dist.comm.timeouts import issue

__all__ = ["ReduceScatter", "reduce_scatter_as_all_to_all", "reduce_scatter_by_backend"]


class ReduceScatter(Protocol):
    """Start reduce-scattering ``input`` (row blocks ``batches``); the returned call waits and
    gives this rank's sum."""

    def __call__(
        self, channel: Channel, input: Tensor, batches: list[int], rank: int, coder: ChunkCodec
    ) -> Callable[[], Tensor]: ...


def reduce_scatter_by_backend(
    channel: Channel, input: Tensor, batches: list[int], rank: int, coder: ChunkCodec
) -> Callable[[], Tensor]:
    """``reduce_scatter_single`` (equal blocks, no codec: ``coder`` is passthrough)."""
    out = input.new_empty(batches[rank], input.shape[1])
    send = input.contiguous()
    pending = issue(
        f"{channel.name}.forward",
        lambda: dist.reduce_scatter_single(out, send, group=channel.group, async_op=True),
        group=channel.group,
        timeout=channel.timeout,
        device=input.device,
    )

    def finish() -> Tensor:
        pending.wait()
        return out

    return finish


def reduce_scatter_as_all_to_all(
    channel: Channel, input: Tensor, batches: list[int], rank: int, coder: ChunkCodec
) -> Callable[[], Tensor]:
    """Each rank's block to its rank in one coded all-to-all, then the received blocks decoded
    and summed in rank order (any block sizes, any codec).

    The first and the last rank keep their own block out of the exchange (the others' blocks
    are one contiguous piece of ``input``; with a codec the kept block is coded and decoded as
    if it had travelled). On 2 ranks the sum is then made in the received block, which holds
    nothing else: no new tensor (``a + b`` and ``b + a`` are the same float).
    """
    world, shape = len(batches), (batches[rank], input.shape[1])
    chunks = list(input.split(batches, dim=0))
    numels = [shape[0] * shape[1]] * world
    own: Tensor | None = None
    if world > 1 and rank in (0, world - 1):
        own = keep_own_rows(input, chunks, batches, rank, coder)
        numels[rank] = 0
    pending, recv = channel.all_to_all("forward", chunks, numels, coder, input)

    def finish() -> Tensor:
        pending.wait()
        pieces = recv.split([coder.wire_size(n) for n in numels])
        parts = [
            own if own is not None and r == rank else coder.decode(piece, shape)
            for r, piece in enumerate(pieces)
        ]
        if len(parts) == 1:
            return parts[0].clone()
        if own is not None and world == 2:  # the received block is the other part
            return parts[1 - rank].add_(parts[rank])
        total = torch.add(parts[0], parts[1])
        for part in parts[2:]:
            total += part
        return total

    return finish
