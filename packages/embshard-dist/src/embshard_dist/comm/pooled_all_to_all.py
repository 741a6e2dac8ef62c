"""All-to-all of pooled embeddings: from "my tables, everyone's batch" to "my batch, all tables".

After the input all-to-all, rank ``s`` holds pooled embeddings of *its* tables (``D_s`` columns
in all, ``dim_sum_per_rank[s]``) for the samples of *every* rank, stacked by source rank:
``[B_0 + ... + B_{W-1}, D_s]``. This collective sends to rank ``r`` the rows of rank ``r``'s
samples; rank ``r`` receives ``[B_r, D_s]`` from every ``s`` and concatenates them along the
columns in rank order: ``[B_r, D_0 + ... + D_{W-1}]`` (or in the order ``columns`` gives).

Guarantees:
    * exact: without a codec the output holds the very bits of the input rows; columns come in
      source-rank order, rows in the order they were sent;
    * differentiable: the backward pass is the reverse all-to-all of the output's gradient
      (each source rank gets back the gradient of the rows it sent);
    * codecs: ``codecs.forward`` encodes what is sent in the forward pass and decodes what
      arrives, ``codecs.backward`` does the same for gradients; each per-peer chunk is coded on
      its own (see ``_codec``); the first and the last rank code and decode their own rows
      (forward) and their own rows' gradient (backward) in place instead of sending them to
      themselves, so the values are those of a round trip and nothing is copied through the
      backend for them;
    * batch sizes may differ per rank (``batch_size_per_rank``), ranks may hold no tables
      (``D_s = 0``);
    * timeouts: every wait is bounded (see ``timeouts``); a dead or hung peer raises
      ``CollectiveError`` naming ``pooled_all_to_all.forward`` or ``.backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm._async_autograd import CollectiveAwaitable
from embshard_dist.comm._codec import ChunkCodec
from embshard_dist.comm._exchange import decode_chunks, join_rows, start_all_to_all
from embshard_dist.comm.columns import ColumnAssembly
from embshard_dist.comm.timeouts import PendingCollective, Timeout
from embshard_kernels.workspace import BufferPool
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs

NAME = "pooled_all_to_all"


class _PooledAllToAllOp:
    """One call: forward sends rows to their batch's rank, backward sends gradients back."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        dim_sum_per_rank: list[int],
        batch_size_per_rank: list[int],
        codecs: QuantizedCommCodecs | None,
        timeout: Timeout,
        assembly: ColumnAssembly,
        pool: BufferPool,
        grad_scale: float,
    ) -> None:
        self._grad_scale = grad_scale
        self._assembly = assembly
        self._pool = pool
        self._lent: Tensor | None = None
        self._group = group
        self._rank = rank
        self._dims = dim_sum_per_rank
        self._batches = batch_size_per_rank
        self._codecs = codecs
        self._timeout = timeout
        self._pending: PendingCollective | None = None
        self._recv: Tensor | None = None
        self._coder: ChunkCodec | None = None
        self._recv_shapes: list[tuple[int, int]] = []
        self._own: Tensor | None = None  # the forward's own rows, when they skip the backend
        self._grad: Tensor | None = None  # the backward's gradient, when its own rows skip it
        self._grad_rest: Tensor | None = None  # where the other ranks' rows go in it

    def _exchange(
        self,
        chunks: Sequence[Tensor],
        recv_shapes: list[tuple[int, int]],
        coder: ChunkCodec,
        direction: str,
        like: Tensor,
        recv_buffer: Tensor | None = None,
    ) -> None:
        self._pending, self._recv = start_all_to_all(
            f"{NAME}.{direction}",
            chunks,
            [b * d for b, d in recv_shapes],
            coder,
            like,
            group=self._group,
            timeout=self._timeout,
            recv_buffer=recv_buffer,
        )
        self._coder, self._recv_shapes = coder, recv_shapes

    def _received(self) -> list[Tensor]:
        assert self._pending is not None and self._recv is not None and self._coder is not None
        self._pending.wait()
        out = decode_chunks(self._recv, self._coder, self._recv_shapes)
        self._pending = self._recv = self._coder = None
        return out

    # The forward's receive buffer and the backward's send buffer are lent by the module's
    # pool: what arrives in the forward is copied out by the assembly, what the backward sends
    # is done with once the exchange completes. The backward's receive buffer becomes the
    # gradient handed on, so it is always new.

    def start_forward(self, input: Tensor) -> None:
        chunks = list(input.split(self._batches, dim=0))
        coder = ChunkCodec(self._codecs.forward if self._codecs else None, input.dtype)
        me, batch = self._rank, self._batches[self._rank]
        recv_shapes = [(batch, d) for d in self._dims]
        self._own = None
        if me in (0, len(chunks) - 1) and len(chunks) > 1:
            # this rank's own rows stay here (coded and decoded in place when there is a codec,
            # as if they had travelled): the others' rows are then one block of the input,
            # sent as it is (no copy of it, nor of the own rows, through the backend)
            own = chunks[me]  # without a codec, both steps are views: nothing is copied
            self._own = coder.decode(coder.encode(own), (own.shape[0], own.shape[1]))
            at = sum(self._batches[:me]) + (batch if me == 0 else 0)
            chunks[me] = input[at:at]
            recv_shapes[me] = (0, self._dims[me])
        numel = sum(coder.wire_size(b * d) for b, d in recv_shapes)
        self._lent = self._pool.lend(numel, coder.wire_dtype, input.device)
        self._exchange(chunks, recv_shapes, coder, "forward", input, self._lent)

    def finish_forward(self) -> Tensor:
        parts = self._received()
        if self._own is not None:
            parts[self._rank], self._own = self._own, None
        out = self._assembly.assemble(parts)
        self._return_lent()
        return out

    def start_backward(self, grad_output: Tensor) -> None:
        self._lent = self._pool.lend(grad_output.numel(), grad_output.dtype, grad_output.device)
        coder = ChunkCodec(self._codecs.backward if self._codecs else None, grad_output.dtype)
        me, world, width = self._rank, len(self._batches), self._dims[self._rank]
        recv_shapes = [(b, width) for b in self._batches]
        self._grad = None
        if me in (0, world - 1) and world > 1:
            # the gradient of this rank's own rows is cut straight into its place in the
            # gradient handed on (coded and decoded in place when there is a codec, as if it
            # had travelled); the other ranks' rows arrive around it, in one block
            self._grad = grad_output.new_empty(sum(self._batches), width)
            start = sum(self._batches[:me])
            own = self._grad[start : start + self._batches[me]]
            chunks = self._assembly.split(grad_output, self._lent, self._grad_scale, (me, own))
            if not coder.passthrough:
                own.copy_(coder.decode(coder.encode(own), (own.shape[0], width)))
            # an empty own chunk where the others' block starts (first rank) or ends (last)
            at = 0 if me == 0 else sum(c.numel() for r, c in enumerate(chunks) if r != me)
            chunks[me] = self._lent[at:at]
            recv_shapes[me] = (0, width)
            flat = self._grad.view(-1)
            rest = flat[own.numel() :] if me == 0 else flat[: start * width]
            # without a codec the others' rows land in place; with one they are decoded there
            into = rest if coder.passthrough else None
            self._exchange(chunks, recv_shapes, coder, "backward", grad_output, into)
            self._grad_rest = rest
            return
        chunks = self._assembly.split(grad_output, self._lent, self._grad_scale)
        self._exchange(chunks, recv_shapes, coder, "backward", grad_output)

    def finish_backward(self) -> Tensor:
        if self._grad is not None:
            assert self._coder is not None and self._grad_rest is not None
            passthrough, rest = self._coder.passthrough, self._grad_rest
            parts = self._received()
            if not passthrough:
                torch.cat([p.reshape(-1) for p in parts], out=rest)
            out, self._grad, self._grad_rest = self._grad, None, None
            self._return_lent()
            return out
        out = join_rows(self._received())
        self._return_lent()
        return out

    def _return_lent(self) -> None:
        if self._lent is not None:
            self._pool.give_back(self._lent)
            self._lent = None


class PooledEmbeddingsAllToAll(nn.Module):
    """All-to-all of pooled embeddings (see the module docstring for the layout).

    Args:
        pg: the process group (``None``: the default group).
        dim_sum_per_rank: total embedding width each rank contributes, in rank order.
        device: unused on CPU; kept for TorchRec's signature (tensors stay on their device).
        callbacks: functions applied in order to the output when it is waited for.
        codecs: forward / backward codecs for the payload (``None``: sent as it is).
        timeout: time limit of each wait (seconds); ``None`` uses the policy of ``timeouts``.
        columns: if given, the output's column order: output column ``j`` is column
            ``columns[j]`` of the received blocks side by side (applied while the blocks are
            put together, no extra copy).
        grad_scale: the backward sends ``grad_scale`` times the output's gradient (scaled
            while it is cut into per-rank chunks, no extra pass; e.g. the 1/N rule).

    Raises:
        ValueError: ``dim_sum_per_rank`` does not have one non-negative width per rank, or
            ``columns`` is not a permutation of the received columns.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        dim_sum_per_rank: Sequence[int],
        device: torch.device | None = None,
        callbacks: Sequence[Callable[[Tensor], Tensor]] | None = None,
        codecs: QuantizedCommCodecs | None = None,
        timeout: Timeout = None,
        columns: Sequence[int] | None = None,
        grad_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self._grad_scale = float(grad_scale)
        self._pg = pg
        self._world = dist.get_world_size(pg)
        self._rank = dist.get_rank(pg)
        dims = [int(d) for d in dim_sum_per_rank]
        if len(dims) != self._world or any(d < 0 for d in dims):
            raise ValueError(
                f"{NAME}: dim_sum_per_rank {dims} must list one non-negative width per rank "
                f"of the group ({self._world} ranks)"
            )
        self._dim_sum_per_rank = dims
        self._assembly = ColumnAssembly(dims, columns)
        self._pool = BufferPool()
        self._device = device
        self._callbacks = list(callbacks or [])
        self._codecs = codecs
        self._timeout = timeout

    @property
    def dim_sum_per_rank(self) -> list[int]:
        """Embedding width each rank contributes."""
        return list(self._dim_sum_per_rank)

    def forward(
        self, local_embs: Tensor, batch_size_per_rank: Sequence[int] | None = None
    ) -> Awaitable[Tensor]:
        """Start the all-to-all; the returned awaitable's ``wait()`` gives ``[B_me, sum(D)]``.

        Args:
            local_embs: ``[sum(batch_size_per_rank), dim_sum_per_rank[me]]``, rows stacked by
                the rank whose sample they belong to.
            batch_size_per_rank: each rank's batch size (the same list on every rank);
                ``None`` means an equal batch on every rank.

        Raises:
            ValueError: the shape of ``local_embs`` does not fit the batch sizes and widths.
        """
        batches = self._batch_sizes(local_embs, batch_size_per_rank)
        op = _PooledAllToAllOp(
            self._pg,
            self._rank,
            self._dim_sum_per_rank,
            batches,
            self._codecs,
            self._timeout,
            self._assembly,
            self._pool,
            self._grad_scale,
        )
        awaitable = CollectiveAwaitable(op, local_embs)
        awaitable.callbacks.extend(self._callbacks)
        return awaitable

    def _batch_sizes(self, local_embs: Tensor, given: Sequence[int] | None) -> list[int]:
        where = f"{NAME} on rank {self._rank}"
        if local_embs.dim() != 2:
            raise ValueError(
                f"{where}: local_embs must be 2-D [rows, dim], got shape {tuple(local_embs.shape)}"
            )
        rows, width = local_embs.shape
        if width != self._dim_sum_per_rank[self._rank]:
            raise ValueError(
                f"{where}: local_embs has {width} columns but dim_sum_per_rank says this rank "
                f"sends {self._dim_sum_per_rank[self._rank]}"
            )
        if given is None:
            if rows % self._world:
                raise ValueError(
                    f"{where}: {rows} rows do not split evenly over {self._world} ranks; pass "
                    "batch_size_per_rank for a batch size that differs per rank"
                )
            return [rows // self._world] * self._world
        batches = [int(b) for b in given]
        if len(batches) != self._world or any(b < 0 for b in batches) or sum(batches) != rows:
            raise ValueError(
                f"{where}: batch_size_per_rank {batches} must list {self._world} non-negative "
                f"batch sizes adding up to the {rows} rows of local_embs"
            )
        return batches
