"""Reduce-scatter of pooled embeddings: partial sums for the global batch -> my batch's sums.

With row-wise sharding every rank holds partial pooled sums for the samples of *every* rank,
``[B_0 + ... + B_{W-1}, D]`` stacked by the samples' rank; rank ``r`` gets their sum over
ranks, ``[B_r, D]``. The backward pass all-gathers the output's gradient. Batches may differ
per rank; codecs code each rank's block on its own; ``dispatch`` picks the algorithm (rank-order
sums wherever the backend does not sum). Waits are bounded (see ``timeouts``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm import dispatch
from embshard_dist.comm._async_autograd import CollectiveAwaitable
from embshard_dist.comm._codec import ChunkCodec
from embshard_dist.comm._exchange import Channel, decode_chunks, join_rows
from embshard_dist.comm.gather import PendingGather, start_all_gather

# tests/test_qcomm_training.py swaps this module's ``dist`` and ``issue`` to count bytes
from embshard_dist.comm.timeouts import Timeout, issue  # noqa: F401
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs

NAME = "reduce_scatter"


class _ReduceScatterOp:
    """One call: forward reduce-scatters rows, backward all-gathers gradients."""

    def __init__(
        self,
        channel: Channel,
        rank: int,
        batch_size_per_rank: list[int],
        codecs: QuantizedCommCodecs | None,
        backend: str,
        grad_scale: float,
    ) -> None:
        self._channel = channel
        self._rank = rank
        self._batches = batch_size_per_rank
        self._world = len(batch_size_per_rank)
        self._codecs = codecs
        self._backend = backend
        self._grad_scale = grad_scale
        self._dim = 0
        self._summed: Callable[[], Tensor] | None = None
        self._gathered: tuple[PendingGather, Tensor, ChunkCodec] | None = None

    def start_forward(self, input: Tensor) -> None:
        self._dim = input.shape[1]
        codec = self._codecs.forward if self._codecs else None
        algorithm = dispatch.reduce_scatter(self._backend, self._batches, codec)
        coder = ChunkCodec(codec, input.dtype)
        self._summed = algorithm(self._channel, input, self._batches, self._rank, coder)

    def finish_forward(self) -> Tensor:
        assert self._summed is not None
        summed, self._summed = self._summed, None
        return summed()

    def start_backward(self, grad_output: Tensor) -> None:
        coder = ChunkCodec(self._codecs.backward if self._codecs else None, grad_output.dtype)
        padded_rows = max(self._batches)
        grad = grad_output
        if grad.shape[0] < padded_rows:
            pad = grad.new_zeros(padded_rows - grad.shape[0], self._dim)
            grad = torch.cat([grad, pad])
        send = coder.encode(grad)
        recv = send.new_empty(self._world * send.numel())
        pending = start_all_gather(
            f"{NAME}.backward", recv, send, group=self._channel.group, timeout=self._channel.timeout
        )
        self._gathered = pending, recv, coder

    def finish_backward(self) -> Tensor:
        assert self._gathered is not None
        (pending, recv, coder), self._gathered = self._gathered, None
        pending.wait()
        padded = (max(self._batches), self._dim)
        chunks = decode_chunks(recv, coder, [padded] * self._world)
        rows = [c[:b] for c, b in zip(chunks, self._batches, strict=True)]
        gathered = join_rows(rows)  # this call's own buffer: scaled in place
        return gathered if self._grad_scale == 1.0 else gathered.mul_(self._grad_scale)


class PooledEmbeddingsReduceScatter(nn.Module):
    """Reduce-scatter of pooled embeddings (see the module docstring).

    Args:
        pg: the process group (``None``: the default group).
        codecs: forward / backward codecs for the payload (``None``: sent as it is).
        timeout: time limit of each wait (seconds; ``None``: the policy of ``timeouts``).
        grad_scale: the backward returns ``grad_scale`` times the gathered gradient (scaled in
            its own buffer; e.g. the 1/N rule).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        codecs: QuantizedCommCodecs | None = None,
        timeout: Timeout = None,
        grad_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._world = dist.get_world_size(pg)
        self._rank = dist.get_rank(pg)
        self._backend = dispatch.backend_of(pg)
        self._channel = Channel(NAME, pg, timeout)
        self._grad_scale = float(grad_scale)
        self._codecs = codecs

    def forward(
        self, local_embs: Tensor, input_splits: Sequence[int] | None = None
    ) -> Awaitable[Tensor]:
        """Start the reduce-scatter; the awaitable's ``wait()`` gives ``[B_me, D]``.

        Args:
            local_embs: ``[sum(input_splits), D]`` partial sums, rows stacked by the rank whose
                samples they are.
            input_splits: each rank's batch size (the same list on every rank); ``None``
                means an equal batch on every rank.

        Raises:
            ValueError: the shape of ``local_embs`` does not fit the splits.
        """
        where = f"{NAME} on rank {self._rank}"
        if local_embs.dim() != 2:
            raise ValueError(
                f"{where}: local_embs must be 2-D [rows, dim], got shape {tuple(local_embs.shape)}"
            )
        rows = local_embs.shape[0]
        if input_splits is None:
            if rows % self._world:
                raise ValueError(
                    f"{where}: {rows} rows do not split evenly over {self._world} ranks; pass "
                    "input_splits for batch sizes that differ per rank"
                )
            splits = [rows // self._world] * self._world
        else:
            splits = [int(s) for s in input_splits]
            if len(splits) != self._world or any(s < 0 for s in splits) or sum(splits) != rows:
                raise ValueError(
                    f"{where}: input_splits {splits} must list {self._world} non-negative batch "
                    f"sizes adding up to the {rows} rows of local_embs"
                )
        op = _ReduceScatterOp(
            self._channel, self._rank, splits, self._codecs, self._backend, self._grad_scale
        )
        return CollectiveAwaitable(op, local_embs)
