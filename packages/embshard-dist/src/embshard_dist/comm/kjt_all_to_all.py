"""All-to-all of KeyedJaggedTensors: every rank gets, for its keys, the bags of every rank.

Every rank passes the same keys, grouped by destination (``splits[r]`` keys for rank ``r``). Two
phases, as in TorchRec: a small header per peer (sizes, dtypes, a checksum of keys and splits),
then lengths, ids and weights, bit for bit, each key's batch the sources' in ``source_order``;
a rank's own keys never travel (views of its input, spliced in on arrival).
Ranks that disagree all raise the same ``ValueError`` after phase 1; waits are bounded.

The header also carries each source's input status (:class:`InputStatus`): when a source
refused its input, every rank raises the same error after phase 1, naming that source, and phase
2 never starts (a refusing source still sends its header, so nobody waits for it).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm._dtypes import dtype_code, dtype_name
from embshard_dist.comm.timeouts import PendingCollective, Timeout, at_collective, issue
from embshard_types.awaitables import Awaitable
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

NAME = "kjt_all_to_all"

# Header fields sent to each peer, followed by that peer's keys' batch sizes and id counts.
_CRC, _WEIGHTED, _LEN_DTYPE, _VAL_DTYPE, _W_DTYPE, _VBE, _STRIDE, _STATUS = range(8)
STATUS_WORDS = 6
"""Integers of an input status (``0`` first: no problem)."""
_FIXED = _STATUS + STATUS_WORDS


@dataclass(frozen=True)
class InputStatus:
    """This rank's verdict on its input, sent in the header to every peer.

    Attributes:
        words: ``STATUS_WORDS`` integers; ``words[0] == 0`` means the input is good.
        error: builds the exception for ``(source rank, its words)``; it must give the same
            exception on every rank, so that all ranks raise alike.
    """

    words: tuple[int, ...]
    error: Callable[[int, list[int]], Exception]

    def __post_init__(self) -> None:
        if len(self.words) != STATUS_WORDS:
            raise ValueError(f"{NAME}: a status is {STATUS_WORDS} integers, got {self.words}")


def source_order(world_size: int, stagger: int = 1) -> list[int]:
    """The order in which source ranks' samples are concatenated for each received key.

    ``0, 1, ..., W-1`` for ``stagger = 1``; otherwise TorchRec's staggered order (ranks grouped
    by node): ``x + (W // stagger) * y`` for ``x`` in ``range(W // stagger)``, then ``y`` in
    ``range(stagger)``.

    Raises:
        ValueError: ``stagger`` does not divide ``world_size``.
    """
    if stagger < 1 or world_size % stagger:
        raise ValueError(
            f"{NAME}: stagger {stagger} must be a positive divisor of the world size {world_size}"
        )
    per = world_size // stagger
    return [x + per * y for x in range(per) for y in range(stagger)]


def _keys_checksum(keys: Sequence[str], splits: Sequence[int]) -> int:
    text = "\x1f".join(keys) + "\x1e" + ",".join(str(s) for s in splits)
    return zlib.crc32(text.encode())


def _split_combined(
    data: Tensor, strides: list[list[int]], counts: list[list[int]]
) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """Per source, per key: its lengths and its ids, out of one message per source."""
    sizes = []
    for per_stride, per_count in zip(strides, counts, strict=True):
        sizes.extend(per_stride)
        sizes.extend(per_count)
    chunks = data.split(sizes)
    lengths: list[list[Tensor]] = []
    values: list[list[Tensor]] = []
    at = 0
    for per_stride, per_count in zip(strides, counts, strict=True):
        lengths.append(list(chunks[at : at + len(per_stride)]))
        at += len(per_stride)
        values.append(list(chunks[at : at + len(per_count)]))
        at += len(per_count)
    return lengths, values


def _to_key_major_parts(parts: list[list[Tensor]], order: list[int], like: Tensor) -> Tensor:
    """``parts[source][key]`` concatenated key by key, sources in ``order``."""
    num_keys = len(parts[0]) if parts else 0
    pieces = [parts[s][k] for k in range(num_keys) for s in order]
    return torch.cat(pieces) if pieces else like.new_empty(0)


def _split_parts(data: Tensor, sizes: list[list[int]]) -> list[list[Tensor]]:
    """``data`` (segments ``[source][key]``, as received) as per source, per key views."""
    chunks = data.split([n for per_source in sizes for n in per_source])
    out, at = [], 0
    for per_source in sizes:
        out.append(list(chunks[at : at + len(per_source)]))
        at += len(per_source)
    return out


class _OwnPart(NamedTuple):
    """This rank's own keys' lengths, ids and weights (per key), kept out of the exchange."""

    lengths: Sequence[Tensor]
    values: Sequence[Tensor]
    weights: Sequence[Tensor] | None


class KJTAllToAllTensorsAwaitable(Awaitable[KeyedJaggedTensor]):
    """Phase 2: lengths, values and weights in flight; ``wait()`` returns the received KJT.

    A plain KJT whose stride is the sum of the sources' strides, unless some source had a
    variable stride per key: then ``stride_per_key_per_rank[k][i]`` is key ``k``'s batch on the
    ``i``-th source in ``order``.

    Args:
        pending: the issued collectives (lengths and values, in one when ``combined``, then
            weights if any); ``buffers``: their receive buffers, in the same order.
        strides, counts: ``[s][k]``: batch size and id count of key ``k`` from source ``s``.
        source_strides: each source's ``stride()``.
        own: ``(rank, part)``: that source sent nothing; its keys are ``part`` (views of the
            input), spliced in at its place.
    """

    def __init__(
        self,
        pending: list[PendingCollective],
        buffers: list[Tensor],
        keys: list[str],
        strides: list[list[int]],
        counts: list[list[int]],
        order: list[int],
        variable_stride: bool,
        source_strides: list[int],
        combined: bool = False,
        own: tuple[int, _OwnPart] | None = None,
    ) -> None:
        super().__init__()
        self._own = own
        self._combined = combined
        self._pending = pending
        self._buffers = buffers
        self._keys = keys
        self._strides = strides
        self._counts = counts
        self._order = order
        self._variable_stride = variable_stride
        self._source_strides = source_strides
        self._result: KeyedJaggedTensor | None = None

    def _wait_impl(self) -> KeyedJaggedTensor:
        if self._result is not None:
            return self._result
        for p in self._pending:
            p.wait()
        buffers = list(self._buffers)
        me, own = self._own if self._own is not None else (-1, None)
        strides = [[0] * len(row) if s == me else row for s, row in enumerate(self._strides)]
        counts = [[0] * len(row) if s == me else row for s, row in enumerate(self._counts)]
        if self._combined:
            like = buffers.pop(0)
            length_parts, value_parts = _split_combined(like, strides, counts)
            length_like = value_like = like
        else:
            length_like, value_like = buffers.pop(0), buffers.pop(0)
            length_parts = _split_parts(length_like, strides)
            value_parts = _split_parts(value_like, counts)
        weight_parts = _split_parts(buffers[0], counts) if buffers else None
        if own is not None:
            length_parts[me], value_parts[me] = list(own.lengths), list(own.values)
            if weight_parts is not None and own.weights is not None:
                weight_parts[me] = list(own.weights)
        lengths = _to_key_major_parts(length_parts, self._order, length_like)
        values = _to_key_major_parts(value_parts, self._order, value_like)
        weights = (
            None
            if weight_parts is None
            else _to_key_major_parts(weight_parts, self._order, buffers[0])
        )
        per_key = range(len(self._keys))
        length_per_key = [sum(c[k] for c in self._counts) for k in per_key]
        if self._variable_stride:
            self._result = KeyedJaggedTensor(
                keys=self._keys,
                values=values,
                weights=weights,
                lengths=lengths,
                stride_per_key_per_rank=[
                    [self._strides[s][k] for s in self._order] for k in per_key
                ],
                length_per_key=length_per_key,
            )
        else:
            self._result = KeyedJaggedTensor(
                keys=self._keys,
                values=values,
                weights=weights,
                lengths=lengths,
                stride=sum(self._source_strides),
                length_per_key=length_per_key,
            )
        self._pending, self._buffers = [], []
        return self._result


class KJTAllToAllSplitsAwaitable(Awaitable[KJTAllToAllTensorsAwaitable]):
    """Phase 1: the headers in flight; ``wait()`` starts phase 2 and returns its awaitable."""

    def __init__(
        self,
        pending: PendingCollective,
        header: Tensor,
        input: KeyedJaggedTensor,
        ranges: list[tuple[int, int]],
        rank: int,
        group: dist.ProcessGroup | None,
        order: list[int],
        timeout: Timeout,
        status: InputStatus | None = None,
    ) -> None:
        super().__init__()
        self._status = status
        self._pending = pending
        self._header = header
        self._input = input
        self._ranges = ranges
        self._rank = rank
        self._group = group
        self._order = order
        self._timeout = timeout
        self._result: KJTAllToAllTensorsAwaitable | None = None

    @at_collective
    def _wait_impl(self) -> KJTAllToAllTensorsAwaitable:
        if self._result is None:
            self._pending.wait()
            self._result = self._start_tensors()
        return self._result

    def _start_tensors(self) -> KJTAllToAllTensorsAwaitable:
        world = len(self._ranges)
        a, b = self._ranges[self._rank]
        num_keys = b - a
        rows = self._header.reshape(world, _FIXED + 2 * num_keys).tolist()
        if self._status is not None:
            _check_status(rows, self._status)
        _check_agreement(rows)
        strides = [row[_FIXED : _FIXED + num_keys] for row in rows]
        counts = [row[_FIXED + num_keys :] for row in rows]
        kjt = self._input
        stride_per_key = kjt.stride_per_key()
        length_per_key = kjt.length_per_key()
        send_lengths = [sum(stride_per_key[lo:hi]) for lo, hi in self._ranges]
        send_values = [sum(length_per_key[lo:hi]) for lo, hi in self._ranges]
        recv_lengths = [sum(s) for s in strides]
        recv_values = [sum(c) for c in counts]
        lengths, values = kjt.lengths(), kjt.values()
        weights = kjt.weights_or_none()
        me = self._rank
        length_bounds = [0, *itertools.accumulate(send_lengths)]
        value_bounds = [0, *itertools.accumulate(send_values)]
        # This rank's own keys never travel: views of its input, spliced in on arrival.
        own = _OwnPart(
            lengths[length_bounds[me] : length_bounds[me + 1]].split(strides[me]),
            values[value_bounds[me] : value_bounds[me + 1]].split(counts[me]),
            None
            if weights is None
            else weights[value_bounds[me] : value_bounds[me + 1]].split(counts[me]),
        )
        send_lengths[me] = send_values[me] = recv_lengths[me] = recv_values[me] = 0
        pending, buffers = [], []

        def start(
            what: str, pieces: list[Tensor], send_sizes: list[int], recv_sizes: list[int]
        ) -> None:
            send = torch.cat(pieces) if len(pieces) != 1 else pieces[0].contiguous()
            recv = send.new_empty(sum(recv_sizes))
            pending.append(
                issue(
                    f"{NAME}.{what}",
                    _all_to_all(recv, send, recv_sizes, send_sizes, self._group),
                    group=self._group,
                    timeout=self._timeout,
                    device=send.device,
                )
            )
            buffers.append(recv)

        def others(data: Tensor, bounds: list[int]) -> list[Tensor]:
            return [data[bounds[r] : bounds[r + 1]] for r in range(world) if r != me]

        if lengths.dtype == values.dtype:
            # one collective: each peer's lengths followed by its ids
            pairs = zip(others(lengths, length_bounds), others(values, value_bounds), strict=True)
            pieces = [piece for pair in pairs for piece in pair]
            start(
                "lengths_and_values",
                pieces or [values[:0]],
                [n + m for n, m in zip(send_lengths, send_values, strict=True)],
                [n + m for n, m in zip(recv_lengths, recv_values, strict=True)],
            )
        else:
            start(
                "lengths",
                others(lengths, length_bounds) or [lengths[:0]],
                send_lengths,
                recv_lengths,
            )
            start("values", others(values, value_bounds) or [values[:0]], send_values, recv_values)
        if weights is not None:
            start(
                "weights", others(weights, value_bounds) or [weights[:0]], send_values, recv_values
            )
        return KJTAllToAllTensorsAwaitable(
            pending=pending,
            buffers=buffers,
            keys=kjt.keys()[a:b],
            strides=strides,
            counts=counts,
            order=self._order,
            variable_stride=any(row[_VBE] for row in rows),
            source_strides=[row[_STRIDE] for row in rows],
            combined=lengths.dtype == values.dtype,
            own=(me, own),
        )


def _all_to_all(
    recv: Tensor,
    send: Tensor,
    recv_sizes: list[int],
    send_sizes: list[int],
    group: dist.ProcessGroup | None,
) -> Callable[[], dist.Work | None]:
    def start() -> dist.Work | None:
        return dist.all_to_all_single(
            recv, send, recv_sizes, send_sizes, group=group, async_op=True
        )

    return start


def _check_status(rows: list[list[int]], status: InputStatus) -> None:
    """Raise the first (lowest-rank) refusing source's error, the same on every rank."""
    for source, row in enumerate(rows):
        words = row[_STATUS:_FIXED]
        if words[0]:
            raise status.error(source, words)


def _check_agreement(rows: list[list[int]]) -> None:
    """Raise the same ValueError on every rank when the sources' headers disagree."""

    def ranks_by(field: int, show: Callable[[int], str]) -> str:
        return "; ".join(f"rank {r}: {show(row[field])}" for r, row in enumerate(rows))

    if len({row[_CRC] for row in rows}) > 1:
        raise ValueError(
            f"{NAME}: the ranks' KJTs have different keys, key order or splits (checksums "
            f"{ranks_by(_CRC, str)}); every rank must pass the same keys grouped by the same splits"
        )
    if len({row[_WEIGHTED] for row in rows}) > 1:
        raise ValueError(
            f"{NAME}: some ranks' KJTs carry weights and some do not "
            f"({ranks_by(_WEIGHTED, lambda w: 'weighted' if w else 'unweighted')}); "
            "make the features weighted on every rank or on none"
        )
    for field, what in ((_LEN_DTYPE, "lengths"), (_VAL_DTYPE, "values"), (_W_DTYPE, "weights")):
        if len({row[field] for row in rows}) > 1:
            raise ValueError(
                f"{NAME}: ranks disagree on the dtype of the {what} "
                f"({ranks_by(field, dtype_name)}); cast them to one dtype on every rank"
            )


class KJTAllToAll(nn.Module):
    """Redistributes a KJT's keys to the ranks that own them (see the module docstring).

    Args:
        pg: the process group (``None``: the default group).
        splits: number of keys sent to each rank, in rank order (same on every rank).
        stagger: source order of the result (see ``source_order``); 1 for rank order.
        timeout: time limit of each wait (seconds; ``None``: the policy of ``timeouts``).

    Raises:
        ValueError: ``splits`` does not have one non-negative count per rank.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        splits: Sequence[int],
        stagger: int = 1,
        timeout: Timeout = None,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._world = dist.get_world_size(pg)
        self._rank = dist.get_rank(pg)
        self._splits = [int(s) for s in splits]
        if len(self._splits) != self._world or any(s < 0 for s in self._splits):
            raise ValueError(
                f"{NAME}: splits {self._splits} must list one non-negative key count per rank "
                f"of the group ({self._world} ranks)"
            )
        self._order = source_order(self._world, stagger)
        self._timeout = timeout
        bounds = [0]
        for s in self._splits:
            bounds.append(bounds[-1] + s)
        self._ranges = list(itertools.pairwise(bounds))

    @property
    def splits(self) -> list[int]:
        """Number of keys sent to each rank."""
        return list(self._splits)

    def forward(
        self, input: KeyedJaggedTensor, status: InputStatus | None = None
    ) -> KJTAllToAllSplitsAwaitable:
        """Start phase 1 for ``input``, this rank's KJT with keys grouped as ``splits`` says.

        Args:
            status: this rank's input status, checked against every source's before phase 2
                (a refusing rank passes any KJT with the right keys: only its header is sent).

        Raises:
            ValueError: the KJT does not have ``sum(splits)`` keys.
        """
        keys = input.keys()
        if len(keys) != self._ranges[-1][1]:
            raise ValueError(
                f"{NAME} on rank {self._rank}: the KJT has {len(keys)} keys {keys} but splits "
                f"{self._splits} add up to {self._ranges[-1][1]}"
            )
        pending, recv_header = self._start_header(input, status)
        return KJTAllToAllSplitsAwaitable(
            pending=pending,
            header=recv_header,
            input=input,
            ranges=self._ranges,
            rank=self._rank,
            group=self._pg,
            order=self._order,
            timeout=self._timeout,
            status=status,
        )

    @at_collective
    def _start_header(
        self, input: KeyedJaggedTensor, status: InputStatus | None
    ) -> tuple[PendingCollective, Tensor]:
        """Issue phase 1: each peer's header, read from ``input``'s per-key sizes."""
        weights = input.weights_or_none()
        fixed = [0] * _FIXED
        fixed[_CRC] = _keys_checksum(input.keys(), self._splits)
        fixed[_WEIGHTED] = int(weights is not None)
        fixed[_LEN_DTYPE] = dtype_code(input.lengths().dtype)
        fixed[_VAL_DTYPE] = dtype_code(input.values().dtype)
        fixed[_W_DTYPE] = dtype_code(None if weights is None else weights.dtype)
        fixed[_VBE] = int(input.variable_stride_per_key())
        fixed[_STRIDE] = input.stride()
        if status is not None:
            fixed[_STATUS:_FIXED] = list(status.words)
        stride_per_key = input.stride_per_key()
        length_per_key = input.length_per_key()
        send: list[int] = []
        for lo, hi in self._ranges:
            send += fixed + stride_per_key[lo:hi] + length_per_key[lo:hi]
        device = input.device()
        send_header = torch.tensor(send, dtype=torch.int64).to(device)
        send_sizes = [_FIXED + 2 * (hi - lo) for lo, hi in self._ranges]
        recv_sizes = [_FIXED + 2 * self._splits[self._rank]] * self._world
        recv_header = send_header.new_empty(sum(recv_sizes))
        pending = issue(
            f"{NAME}.splits",
            _all_to_all(recv_header, send_header, recv_sizes, send_sizes, self._pg),
            group=self._pg,
            timeout=self._timeout,
            device=device,
        )
        return pending, recv_header
