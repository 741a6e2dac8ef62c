"""KeyedJaggedTensor: a batch of sparse features (one JaggedTensor per key), key-major.

Layout: ``lengths[bounds[k] + b]`` is the bag size of key ``k``, sample ``b``, where
``bounds`` is the running sum of the per-key batch sizes (``k * stride`` when every key has the
same batch size); ``values`` (1-D ids) and optional ``weights`` are concatenated in that order.
Batch sizes may differ per key ("variable stride per key"): ``stride_per_key_per_rank[k]``
lists key ``k``'s batch size on each rank and ``stride_per_key()[k]`` is their sum.

Whichever of lengths / offsets is missing is derived on first use and cached, as are
``length_per_key`` / ``offset_per_key`` (one device read, done by ``sync()`` or by the first
operation that needs them) and the ``to_dict()`` result. No operation loops over ids or
samples in Python: split, permute, to_dict, lookup and concat slice and concatenate per key.

Checks:
    * Construction (cheap, never reads tensor data): keys are distinct strings; values,
      lengths and offsets are 1-D, lengths / offsets integer; offsets have one entry more than
      lengths; there is one length per key per sample (the count is a multiple of the number
      of keys, or equals keys x stride, or matches ``stride_per_key_per_rank``); one weight per
      value; everything on one device; a given ``length_per_key`` adds up to the values.
    * ``validate()`` (O(n), reads the data): integer values and floating weights, no negative
      lengths (names key and sample), offsets start at 0 and never decrease (names key and
      sample), lengths and offsets agree when both are given, lengths add up to the values
      (says by how much and which key runs past the end), a given ``length_per_key`` matches
      the lengths (names the key).
    * ``from_lengths_sync`` / ``from_offsets_sync`` / ``from_jt_dict`` validate eagerly and sync.

A permute that repeats a key yields repeated keys (allowed there, rejected otherwise); lookups
by such a key return its first occurrence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from embshard_types.sparse._format import describe, keyed_jagged_text
from embshard_types.sparse._kjt_ops import concat_kjts, kjt_from_jt_dict, permute_kjt, split_kjt
from embshard_types.sparse._ops import (
    cumulative,
    differences,
    lengths_from_offsets,
    offsets_at,
    offsets_from_lengths,
    split_sizes,
)
from embshard_types.sparse._validation import (
    SegmentLocator,
    check_inverse_indices,
    check_jagged_args,
    check_key_sizes,
    check_keys,
    check_layout,
    check_stride_per_key_per_rank,
    validate_jagged_data,
)
from embshard_types.sparse.jagged import JaggedTensor

_OWNER = "KeyedJaggedTensor"

InverseIndices = tuple[list[str], Tensor]


class KeyedJaggedTensor:
    """Sparse features for a batch: per key, variable-length bags of ids (and weights).

    Args:
        keys: feature names, in layout order (distinct).
        values: 1-D ids of every bag, key-major.
        weights: optional per-id weights, same length as values.
        lengths: bag sizes, one per key per sample (give this and/or ``offsets``).
        offsets: complete bag offsets (``len(lengths) + 1`` entries, starting at 0).
        stride: batch size; inferred from ``lengths`` / ``offsets`` and the key count if None.
        stride_per_key_per_rank: for batch sizes that vary per key, one list per key of its
            batch size on each rank.
        length_per_key: optional number of ids per key, if already known (saves a sync).
        offset_per_key: optional running sum of ``length_per_key`` (``len(keys) + 1`` entries).
        inverse_indices: optional ``(keys, tensor[len(keys), batch])`` mapping the samples of a
            deduplicated variable-stride batch back to the full batch.
        allow_duplicate_keys: accept repeated keys (as produced by ``permute``).

    Raises:
        ValueError: a count, shape, dtype or device does not fit (see the module docstring).
        TypeError: keys are not strings or an argument is not a tensor.
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: Tensor,
        weights: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        length_per_key: Sequence[int] | None = None,
        offset_per_key: Sequence[int] | None = None,
        inverse_indices: InverseIndices | None = None,
        allow_duplicate_keys: bool = False,
    ) -> None:
        key_list = check_keys(_OWNER, keys, allow_duplicates=allow_duplicate_keys)
        num_segments = check_jagged_args(_OWNER, values, weights, lengths, offsets)
        if values.dim() != 1:
            raise ValueError(
                f"{_OWNER}: values must be 1-D ids, got shape {tuple(values.shape)} "
                "(use JaggedTensor for rows of embeddings)"
            )
        per_rank = (
            None
            if stride_per_key_per_rank is None
            else check_stride_per_key_per_rank(_OWNER, key_list, stride_per_key_per_rank)
        )
        stride_per_key = None if per_rank is None else [sum(s) for s in per_rank]
        inferred_stride = check_layout(_OWNER, key_list, num_segments, stride, stride_per_key)
        lpk, opk = check_key_sizes(
            _OWNER, key_list, values.shape[0], length_per_key, offset_per_key
        )
        if inverse_indices is not None:
            check_inverse_indices(_OWNER, inverse_indices, values.device)
        self._keys = key_list
        self._stride = inferred_stride
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride_per_key_per_rank = per_rank
        self._stride_per_key = stride_per_key or [self._stride] * len(key_list)
        self._bounds = cumulative(self._stride_per_key)
        self._length_per_key = lpk
        self._offset_per_key = opk
        self._length_per_key_given = lpk is not None
        self._inverse_indices = inverse_indices
        self._allow_duplicate_keys = allow_duplicate_keys
        self._index_per_key: dict[str, int] | None = None
        self._jt_dict: dict[str, JaggedTensor] | None = None

    # ---- construction --------------------------------------------------------------------

    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: InverseIndices | None = None,
    ) -> KeyedJaggedTensor:
        """Build from lengths, validate the data and compute the per-key sizes now.

        Args: as for the constructor.

        Raises:
            ValueError: anything ``validate()`` rejects.
        """
        kjt = KeyedJaggedTensor(
            keys,
            values,
            weights=weights,
            lengths=lengths,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        )
        kjt.validate()
        return kjt.sync()

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: Tensor,
        offsets: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: InverseIndices | None = None,
    ) -> KeyedJaggedTensor:
        """Build from complete offsets, validate the data and compute the per-key sizes now.

        Args: as for the constructor.

        Raises:
            ValueError: anything ``validate()`` rejects.
        """
        kjt = KeyedJaggedTensor(
            keys,
            values,
            weights=weights,
            offsets=offsets,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        )
        kjt.validate()
        return kjt.sync()

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> KeyedJaggedTensor:
        """Return a KeyedJaggedTensor with no keys (stride 0).

        Args:
            is_weighted: whether to give it an (empty) weights tensor.
            device: where its tensors live.
            values_dtype: dtype of values (default int64).
            weights_dtype: dtype of weights (default float32).
            lengths_dtype: dtype of lengths.
        """
        jt = JaggedTensor.empty(is_weighted, device, values_dtype, weights_dtype, lengths_dtype)
        return KeyedJaggedTensor(
            [], jt.values(), weights=jt.weights_or_none(), lengths=jt.lengths(), stride=0
        )

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Build from one JaggedTensor per key (the inverse of ``to_dict``); validates and syncs.

        Keys whose JaggedTensors have different numbers of samples give a variable-stride
        KeyedJaggedTensor (one rank per key).

        Args:
            jt_dict: key -> JaggedTensor of 1-D ids; all weighted or none.

        Raises:
            ValueError: some but not all JaggedTensors have weights, or ``validate()`` fails.
        """
        return kjt_from_jt_dict(jt_dict)

    @staticmethod
    def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Concatenate KeyedJaggedTensors key-wise (keys of the first, then the second, ...).

        If their strides differ, or any has a variable stride, the result has a variable stride
        per key. Cached per-key sizes carry over; inverse indices do not.

        Args:
            kjt_list: at least one KeyedJaggedTensor; all weighted or none.

        Raises:
            ValueError: the list is empty, some but not all are weighted, or a key repeats.
        """
        return concat_kjts(kjt_list)

    # ---- accessors -----------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The keys, in layout order."""
        return list(self._keys)

    def values(self) -> Tensor:
        """All ids, key-major."""
        return self._values

    def weights(self) -> Tensor:
        """Per-id weights; raises ValueError if there are none."""
        if self._weights is None:
            raise ValueError(f"this {_OWNER} has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> Tensor | None:
        """Per-id weights, or None."""
        return self._weights

    def lengths(self) -> Tensor:
        """Bag sizes, one per key per sample (derived from offsets on first use, cached)."""
        if self._lengths is None:
            assert self._offsets is not None  # guaranteed by the constructor
            self._lengths = lengths_from_offsets(self._offsets)
        return self._lengths

    def lengths_or_none(self) -> Tensor | None:
        """The lengths if given or already derived, else None."""
        return self._lengths

    def offsets(self) -> Tensor:
        """Complete bag offsets (derived from lengths on first use, cached)."""
        if self._offsets is None:
            assert self._lengths is not None  # guaranteed by the constructor
            self._offsets = offsets_from_lengths(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> Tensor | None:
        """The offsets if given or already derived, else None."""
        return self._offsets

    def stride(self) -> int:
        """The batch size (the largest per-key batch size when it varies per key)."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        """The batch size of each key."""
        return list(self._stride_per_key)

    def variable_stride_per_key(self) -> bool:
        """Whether batch sizes were given per key and rank."""
        return self._stride_per_key_per_rank is not None

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """Per key, its batch size on each rank (``[[stride]]`` per key if not variable)."""
        if self._stride_per_key_per_rank is None:
            return [[self._stride] for _ in self._keys]
        return [list(s) for s in self._stride_per_key_per_rank]

    def lengths_offset_per_key(self) -> list[int]:
        """Where each key's lengths start in ``lengths()``, plus the total."""
        return list(self._bounds)

    def length_per_key(self) -> list[int]:
        """Number of ids per key (one device read on first use, then cached)."""
        return list(self._key_sizes()[0])

    def length_per_key_or_none(self) -> list[int] | None:
        """Number of ids per key if already known, else None (never syncs)."""
        return None if self._length_per_key is None else list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Where each key's ids start in ``values()``, plus the total."""
        return list(self._key_sizes()[1])

    def offset_per_key_or_none(self) -> list[int] | None:
        """``offset_per_key()`` if already known, else None (never syncs)."""
        return None if self._offset_per_key is None else list(self._offset_per_key)

    def index_per_key(self) -> dict[str, int]:
        """Key -> its position in ``keys()`` (first position for a repeated key)."""
        return dict(self._key_index_map())

    def key_to_index(self, key: str) -> int:
        """The position of ``key`` in ``keys()``; KeyError listing the keys if absent."""
        index = self._key_index_map().get(key)
        if index is None:
            raise KeyError(f"key {key!r} is not in this {_OWNER}; its keys are {self._keys}")
        return index

    def inverse_indices(self) -> InverseIndices:
        """The inverse indices; raises ValueError if none were given."""
        if self._inverse_indices is None:
            raise ValueError(f"this {_OWNER} has no inverse indices; use inverse_indices_or_none()")
        return self._inverse_indices

    def inverse_indices_or_none(self) -> InverseIndices | None:
        """The inverse indices, or None."""
        return self._inverse_indices

    def device(self) -> torch.device:
        """The device of the values."""
        return self._values.device

    def sync(self) -> KeyedJaggedTensor:
        """Compute and cache ``length_per_key`` / ``offset_per_key`` now; return self."""
        self._key_sizes()
        return self

    # ---- per-key views -------------------------------------------------------------------

    def __getitem__(self, key: str) -> JaggedTensor:
        """The JaggedTensor of one key (views of this one's tensors)."""
        k = self.key_to_index(key)
        offsets = self._key_sizes()[1]
        lo, hi = self._bounds[k], self._bounds[k + 1]
        start, stop = offsets[k], offsets[k + 1]
        return JaggedTensor(
            self._values[start:stop],
            weights=None if self._weights is None else self._weights[start:stop],
            lengths=self.lengths()[lo:hi],
        )

    def to_dict(self) -> dict[str, JaggedTensor]:
        """Key -> JaggedTensor (views; built once and cached)."""
        if self._jt_dict is None:
            sizes = self._key_sizes()[0]
            values = split_sizes(self._values, sizes)
            weights = None if self._weights is None else split_sizes(self._weights, sizes)
            lengths = split_sizes(self.lengths(), self._stride_per_key)
            jts: dict[str, JaggedTensor] = {}
            for k, key in enumerate(self._keys):
                if key not in jts:
                    w = None if weights is None else weights[k]
                    jts[key] = JaggedTensor(values[k], weights=w, lengths=lengths[k])
            self._jt_dict = jts
        return dict(self._jt_dict)

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Split key-wise into consecutive groups of ``segments[i]`` keys each.

        Args:
            segments: non-negative key counts adding up to ``len(keys())``.

        Raises:
            ValueError: a segment is negative or they do not add up to the key count.
        """
        return split_kjt(self, segments)

    def permute(self, indices: Sequence[int]) -> KeyedJaggedTensor:
        """Reorder keys: output key ``i`` is input key ``indices[i]`` (repeats and drops allowed).

        Args:
            indices: positions into ``keys()``.

        Raises:
            IndexError: an index is out of range (the message gives it and the keys).
        """
        return permute_kjt(self, indices)

    # ---- devices and streams -------------------------------------------------------------

    def to(
        self,
        device: torch.device | str,
        non_blocking: bool = False,
        dtype: torch.dtype | None = None,
    ) -> KeyedJaggedTensor:
        """Return a copy on ``device``; ``dtype``, if given, converts the weights.

        Args:
            device: the target device.
            non_blocking: passed to ``Tensor.to``.
            dtype: optional dtype for the weights.
        """
        weights = self._weights
        if weights is not None:
            weights = weights.to(device, dtype=dtype, non_blocking=non_blocking)
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking), weights)

    def pin_memory(self) -> KeyedJaggedTensor:
        """Return a copy whose tensors are in page-locked host memory."""
        weights = None if self._weights is None else self._weights.pin_memory()
        return self._map_tensors(Tensor.pin_memory, weights)

    def _map_tensors(
        self, fn: Callable[[Tensor], Tensor], weights: Tensor | None
    ) -> KeyedJaggedTensor:
        inverse = self._inverse_indices
        return KeyedJaggedTensor(
            self._keys,
            fn(self._values),
            weights=weights,
            lengths=None if self._lengths is None else fn(self._lengths),
            offsets=None if self._offsets is None else fn(self._offsets),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            length_per_key=self._length_per_key,
            offset_per_key=self._offset_per_key,
            inverse_indices=None if inverse is None else (inverse[0], fn(inverse[1])),
            allow_duplicate_keys=self._allow_duplicate_keys,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor as in use by ``stream`` (see ``Tensor.record_stream``)."""
        inverse = None if self._inverse_indices is None else self._inverse_indices[1]
        for t in (self._values, self._weights, self._lengths, self._offsets, inverse):
            if t is not None:
                t.record_stream(stream)

    # ---- checks and text -----------------------------------------------------------------

    def validate(self) -> None:
        """Check the data (O(n), reads the device); see the module docstring for the list.

        Raises:
            ValueError: naming the problem and, where it can be told, the key and sample.
        """
        offsets_given = self._offsets is not None
        validate_jagged_data(
            _OWNER,
            SegmentLocator(self._keys, self._bounds),
            self._values,
            self._weights,
            self._lengths,
            self.offsets(),
            offsets_given=offsets_given,
            length_per_key=self._length_per_key if self._length_per_key_given else None,
            require_ids=True,
        )

    def __repr__(self) -> str:
        stride = (
            f"stride_per_key_per_rank={self._stride_per_key_per_rank}"
            if self._stride_per_key_per_rank is not None
            else f"stride={self._stride}"
        )
        lengths = self._lengths if self._lengths is not None else self._offsets
        name = "lengths" if self._lengths is not None else "offsets"
        return (
            f"{_OWNER}(keys={self._keys}, {stride}, values={describe(self._values)}, "
            f"weights={describe(self._weights)}, {name}={describe(lengths)})"
        )

    def __str__(self) -> str:
        return keyed_jagged_text(self)

    # ---- caches --------------------------------------------------------------------------

    def _key_sizes(self) -> tuple[list[int], list[int]]:
        """``(length_per_key, offset_per_key)``, computed with one device read and cached."""
        if self._length_per_key is None or self._offset_per_key is None:
            uniform = (
                self._stride_per_key_per_rank is None and self._stride > 0 and bool(self._keys)
            )
            step = self._stride if uniform else 0
            opk = offsets_at(self.offsets(), self._bounds, uniform_step=step)
            self._offset_per_key = opk
            self._length_per_key = differences(opk)
        return self._length_per_key, self._offset_per_key

    def _key_index_map(self) -> dict[str, int]:
        if self._index_per_key is None:
            index: dict[str, int] = {}
            for i, key in enumerate(self._keys):
                index.setdefault(key, i)
            self._index_per_key = index
        return self._index_per_key
