"""All-to-all of pooled embeddings: from "my tables, everyone's batch" to "my batch, all tables".

Rank ``s`` holds pooled embeddings of its tables (``D_s`` columns) for every rank's samples,
``[B_0 + ... + B_{W-1}, D_s]`` stacked by the samples' rank. Rank ``r`` gets its samples' rows
from every ``s``, side by side in rank order (or as ``columns`` says): ``[B_r, sum(D)]``. The
backward pass sends each gradient block back. Exact without a codec (codecs code each block on
its own); batches may differ per rank; ``dispatch`` picks the exchanges; waits are bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm import dispatch
from embshard_dist.comm._async_autograd import CollectiveAwaitable
from embshard_dist.comm._codec import ChunkCodec
from embshard_dist.comm._exchange import Channel
from embshard_dist.comm.algorithms.pooled_all_to_all import PooledAllToAll
from embshard_dist.comm.columns import ColumnAssembly
from embshard_dist.comm.placement import SharedOutput
from embshard_dist.comm.timeouts import Timeout
from embshard_kernels.workspace import BufferPool
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs

NAME = "pooled_all_to_all"


class _PooledAllToAllOp:
    """One call: forward sends rows to their batch's rank, backward sends gradients back.

    The module's pool lends the forward's receive buffer (the assembly copies out of it) and
    the backward's send buffer; the backward's receive buffer is the gradient handed on.
    """

    def __init__(
        self,
        channel: Channel,
        algorithm: PooledAllToAll,
        rank: int,
        dim_sum_per_rank: list[int],
        batch_size_per_rank: list[int],
        codecs: QuantizedCommCodecs | None,
        assembly: ColumnAssembly,
        pool: BufferPool,
        grad_scale: float,
    ) -> None:
        self._channel = channel
        self._algorithm = algorithm
        self._rank = rank
        self._dims = dim_sum_per_rank
        self._batches = batch_size_per_rank
        self._codecs = codecs
        self._assembly = assembly
        self._pool = pool
        self._grad_scale = grad_scale
        self._lent: Tensor | None = None
        self._received: Callable[[], list[Tensor]] | None = None
        self._gradient: Callable[[], Tensor] | None = None
        self._shared: SharedOutput | None = None

    def place(self, shared: SharedOutput, destinations: Sequence[int]) -> None:
        """Write the output into ``shared``'s columns ``destinations`` (before the forward's
        finish); the finish then returns an empty token and the backward reads the columns'
        gradient from ``shared``."""
        self._assembly = self._assembly.place(destinations, shared.width)
        self._shared = shared

    def start_forward(self, input: Tensor) -> None:
        coder = ChunkCodec(self._codecs.forward if self._codecs else None, input.dtype)
        self._received, self._lent = self._algorithm.forward(
            self._channel, input, self._batches, self._dims, self._rank, coder, self._pool
        )

    def finish_forward(self) -> Tensor:
        assert self._received is not None
        received, self._received = self._received, None
        parts = received()
        if self._shared is None:
            out = self._assembly.assemble(parts)
        else:
            batch = self._batches[self._rank]
            self._assembly.assemble(parts, out=self._shared.values(parts[0], batch))
            out = parts[0].new_empty(0)
        self._return_lent()
        return out

    def start_backward(self, grad_output: Tensor) -> None:
        if self._shared is not None:
            grad_output = self._shared.grad
        numel = grad_output.shape[0] * sum(self._assembly.widths)
        self._lent = self._pool.lend(numel, grad_output.dtype, grad_output.device)
        coder = ChunkCodec(self._codecs.backward if self._codecs else None, grad_output.dtype)
        self._gradient = self._algorithm.backward(
            self._channel,
            grad_output,
            self._batches,
            self._rank,
            coder,
            self._assembly,
            self._grad_scale,
            self._lent,
        )

    def finish_backward(self) -> Tensor:
        assert self._gradient is not None
        gradient, self._gradient = self._gradient, None
        out = gradient()
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
        device: unused; kept for TorchRec's signature (tensors stay on their device).
        callbacks: functions applied in order to the output when it is waited for.
        codecs: forward / backward codecs for the payload (``None``: sent as it is).
        timeout: time limit of each wait (seconds; ``None``: the policy of ``timeouts``).
        columns: output column ``j`` is column ``columns[j]`` of the received blocks side by
            side (applied while they are put together).
        grad_scale: the backward sends ``grad_scale`` times the output's gradient (scaled
            while it is cut per rank; e.g. the 1/N rule).

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
        self._algorithm = dispatch.pooled_all_to_all(self._world, self._rank)
        self._channel = Channel(NAME, pg, timeout)
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
            self._channel,
            self._algorithm,
            self._rank,
            self._dim_sum_per_rank,
            batches,
            self._codecs,
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
