"""All-to-all of sequence embeddings: rows of looked-up ids back to the ranks whose ids they are.

Rank ``s`` sends the leading ``input_splits[r]`` entries (rows, or elements of a flat payload)
to each rank ``r`` in order; rank ``r`` stacks what arrives in source-rank order. Splits must
agree across ranks. Exact without a codec (codecs code each chunk on its own); the backward
is the reverse all-to-all; waits are bounded. Permutations live in the output dists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm._async_autograd import CollectiveAwaitable
from embshard_dist.comm._codec import ChunkCodec
from embshard_dist.comm._exchange import decode_chunks, start_all_to_all
from embshard_dist.comm.timeouts import PendingCollective, Timeout
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs

__all__ = ["SequenceEmbeddingsAllToAll"]

NAME = "sequence_all_to_all"


class _SequenceAllToAllOp:
    """One call: forward sends entries to their ranks, backward sends the gradients back."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        input_splits: list[int],
        output_splits: list[int],
        codecs: QuantizedCommCodecs | None,
        timeout: Timeout,
    ) -> None:
        self._group = group
        self._input_splits = input_splits
        self._output_splits = output_splits
        self._codecs = codecs
        self._timeout = timeout
        self._trailing: tuple[int, ...] = ()
        self._pending: PendingCollective | None = None
        self._recv: Tensor | None = None
        self._coder: ChunkCodec | None = None
        self._recv_counts: list[int] = []

    def _entry_numel(self) -> int:
        numel = 1
        for size in self._trailing:
            numel *= size
        return numel

    def _exchange(
        self, payload: Tensor, send_counts: list[int], recv_counts: list[int], direction: str
    ) -> None:
        codec = None
        if self._codecs is not None:
            codec = self._codecs.forward if direction == "forward" else self._codecs.backward
        coder = ChunkCodec(codec, payload.dtype)
        per_entry = self._entry_numel()
        self._pending, self._recv = start_all_to_all(
            f"{NAME}.{direction}",
            payload.split(send_counts, dim=0),
            [n * per_entry for n in recv_counts],
            coder,
            payload,
            group=self._group,
            timeout=self._timeout,
        )
        self._coder, self._recv_counts = coder, recv_counts

    def _received(self) -> Tensor:
        assert self._pending is not None and self._recv is not None and self._coder is not None
        self._pending.wait()
        coder, counts = self._coder, self._recv_counts
        decoded = decode_chunks(self._recv, coder, [(n, *self._trailing) for n in counts])
        self._pending = self._recv = self._coder = None
        if not decoded:
            return torch.empty((0, *self._trailing), dtype=coder.payload_dtype)
        return torch.cat(decoded, dim=0)

    def start_forward(self, input: Tensor) -> None:
        self._trailing = tuple(input.shape[1:])
        self._exchange(input.contiguous(), self._input_splits, self._output_splits, "forward")

    def finish_forward(self) -> Tensor:
        return self._received()

    def start_backward(self, grad_output: Tensor) -> None:
        self._exchange(grad_output, self._output_splits, self._input_splits, "backward")

    def finish_backward(self) -> Tensor:
        return self._received()


class SequenceEmbeddingsAllToAll(nn.Module):
    """All-to-all of sequence embeddings (see the module docstring).

    Args:
        pg: the process group (``None``: the default group).
        device: unused; kept for TorchRec's signature (tensors stay on their device).
        codecs: forward / backward codecs for the payload (``None``: sent as it is).
        timeout: time limit of each wait (seconds; ``None``: the policy of ``timeouts``).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        device: torch.device | None = None,
        codecs: QuantizedCommCodecs | None = None,
        timeout: Timeout = None,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._world = dist.get_world_size(pg)
        self._rank = dist.get_rank(pg)
        self._device = device
        self._codecs = codecs
        self._timeout = timeout

    def forward(
        self, local_embs: Tensor, input_splits: Sequence[int], output_splits: Sequence[int]
    ) -> Awaitable[Tensor]:
        """Start the all-to-all; the awaitable's ``wait()`` gives ``[sum(output_splits), ...]``.

        Args:
            local_embs: ``[sum(input_splits), ...]``: the entries for rank 0, then rank 1...
            input_splits, output_splits: entries sent to / received from each rank.

        Raises:
            ValueError: the splits do not list one non-negative count per rank, or
                ``input_splits`` does not add up to the entries of ``local_embs``.
        """
        where = f"{NAME} on rank {self._rank}"
        if local_embs.dim() == 0:
            raise ValueError(f"{where}: local_embs must have a leading dimension, got a scalar")
        sends = [int(n) for n in input_splits]
        recvs = [int(n) for n in output_splits]
        for name, splits in (("input_splits", sends), ("output_splits", recvs)):
            if len(splits) != self._world or any(n < 0 for n in splits):
                raise ValueError(
                    f"{where}: {name} {splits} must list one non-negative count per rank of the "
                    f"group ({self._world} ranks)"
                )
        if sum(sends) != local_embs.shape[0]:
            raise ValueError(
                f"{where}: input_splits {sends} add up to {sum(sends)} but local_embs has "
                f"{local_embs.shape[0]} entries"
            )
        op = _SequenceAllToAllOp(self._pg, sends, recvs, self._codecs, self._timeout)
        return CollectiveAwaitable(op, local_embs)
