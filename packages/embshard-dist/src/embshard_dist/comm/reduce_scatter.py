"""Reduce-scatter of pooled embeddings: partial sums for the global batch -> my batch's sums.

With row-wise sharding every rank computes partial pooled sums over its rows for the samples of
*every* rank: ``[B_0 + ... + B_{W-1}, D]``, stacked by the rank owning the samples. This
collective sums those partials over ranks and leaves rank ``r`` with ``[B_r, D]``. Its
backward pass is the all-gather of the output's gradient.

Guarantees:
    * two paths, chosen identically on every rank: on a backend other than gloo, when every
      rank has the same batch size and no forward codec is active, ``reduce_scatter_single``
      does the sum (its summation order is the backend's); otherwise (gloo, whose
      reduce-scatter moves the whole tensor and measured ~15% slower on a row-wise W2 step,
      uneven batches, or a codec) each rank sends every other rank its rows with an
      all-to-all, decodes them and sums them **in rank order** (rank 0's partial + rank 1's
      + ...): exact with respect to that order and deterministic;
    * backward: an all-gather of the gradient (sent as an all-to-all on the CPU, see
      ``gather``), padded to the largest batch when batches are uneven; with a backward codec
      each rank's (padded) gradient is encoded before and decoded after the exchange;
    * works on gloo (CPU), where ``reduce_scatter`` of uneven sizes is not available;
    * timeouts: every wait is bounded (see ``timeouts``); a dead or hung peer raises
      ``CollectiveError`` naming ``reduce_scatter.forward`` or ``.backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm._async_autograd import CollectiveAwaitable
from embshard_dist.comm._codec import ChunkCodec, is_active
from embshard_dist.comm._exchange import decode_chunks, join_rows, start_all_to_all
from embshard_dist.comm.gather import PendingGather, start_all_gather
from embshard_dist.comm.timeouts import PendingCollective, Timeout, issue
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs

NAME = "reduce_scatter"


class _ReduceScatterOp:
    """One call: forward reduce-scatters rows, backward all-gathers gradients."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        batch_size_per_rank: list[int],
        codecs: QuantizedCommCodecs | None,
        timeout: Timeout,
        on_gloo: bool,
        grad_scale: float,
    ) -> None:
        self._grad_scale = grad_scale
        self._group = group
        self._rank = rank
        self._batches = batch_size_per_rank
        self._world = len(batch_size_per_rank)
        self._codecs = codecs
        self._timeout = timeout
        self._native = len(set(batch_size_per_rank)) == 1 and not on_gloo
        self._pending: PendingCollective | PendingGather | None = None
        self._recv: Tensor | None = None
        self._coder: ChunkCodec | None = None
        self._dim = 0
        self._summed_by_backend = False

    def _issue(
        self, direction: str, start: Callable[[], dist.Work | None], device: torch.device
    ) -> None:
        self._pending = issue(
            f"{NAME}.{direction}", start, group=self._group, timeout=self._timeout, device=device
        )

    # ---- forward: reduce-scatter -----------------------------------------------------------

    def start_forward(self, input: Tensor) -> None:
        self._dim = input.shape[1]
        forward_codec = self._codecs.forward if self._codecs else None
        coder = ChunkCodec(forward_codec, input.dtype)
        self._coder = coder
        if self._native and not is_active(forward_codec):
            out = input.new_empty(self._batches[self._rank], self._dim)
            send = input.contiguous()
            self._recv = out
            self._summed_by_backend = True
            self._issue(
                "forward",
                lambda: dist.reduce_scatter_single(out, send, group=self._group, async_op=True),
                input.device,
            )
            return
        self._pending, self._recv = start_all_to_all(
            f"{NAME}.forward",
            input.split(self._batches, dim=0),
            [self._batches[self._rank] * self._dim] * self._world,
            coder,
            input,
            group=self._group,
            timeout=self._timeout,
        )

    def finish_forward(self) -> Tensor:
        assert self._pending is not None and self._recv is not None and self._coder is not None
        self._pending.wait()
        recv, coder = self._recv, self._coder
        self._pending = self._recv = self._coder = None
        if self._summed_by_backend:
            return recv
        shape = (self._batches[self._rank], self._dim)
        parts = [
            coder.decode(p, shape)
            for p in recv.split([coder.wire_size(shape[0] * shape[1])] * self._world)
        ]
        if len(parts) == 1:
            return parts[0].clone()
        total = torch.add(parts[0], parts[1])
        for part in parts[2:]:
            total += part
        return total

    # ---- backward: all-gather --------------------------------------------------------------

    def start_backward(self, grad_output: Tensor) -> None:
        backward_codec = self._codecs.backward if self._codecs else None
        coder = ChunkCodec(backward_codec, grad_output.dtype)
        self._coder = coder
        padded_rows = max(self._batches)
        grad = grad_output
        if grad.shape[0] < padded_rows:
            pad = grad.new_zeros(padded_rows - grad.shape[0], self._dim)
            grad = torch.cat([grad, pad])
        send = coder.encode(grad)
        recv = send.new_empty(self._world * send.numel())
        self._recv = recv
        self._pending = start_all_gather(
            f"{NAME}.backward", recv, send, group=self._group, timeout=self._timeout
        )

    def finish_backward(self) -> Tensor:
        assert self._pending is not None and self._recv is not None and self._coder is not None
        self._pending.wait()
        recv, coder = self._recv, self._coder
        self._pending = self._recv = self._coder = None
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
        timeout: time limit of each wait (seconds); ``None`` uses the policy of ``timeouts``.
        grad_scale: the backward returns ``grad_scale`` times the gathered gradient (scaled in
            its own buffer, no extra tensor; e.g. the 1/N rule).
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
        self._on_gloo = "gloo" in str(dist.get_backend(pg)).lower()
        self._grad_scale = float(grad_scale)
        self._codecs = codecs
        self._timeout = timeout

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
            self._pg,
            self._rank,
            splits,
            self._codecs,
            self._timeout,
            self._on_gloo,
            self._grad_scale,
        )
        return CollectiveAwaitable(op, local_embs)
