"""KeyedJaggedTensor: a batch of sparse features (one JaggedTensor per key), key-major.

``lengths[bounds[k] + b]`` is the bag size of key ``k``, sample ``b``; batch sizes may vary per
key (``stride_per_key_per_rank``). Derived lengths / offsets and per-key sizes are cached (one
device read). Construction never reads tensor data; ``validate()`` does and names key and
sample. No operation loops over ids or samples in Python. ``empty_like`` and ``copy_`` stage a
batch on another device (allocate once, copy in place); ``clear_storage`` frees a batch early.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain, pairwise

import torch
from torch import Tensor

from embshard_types.sparse._format import describe, preview
from embshard_types.sparse._ops import (
    cumulative,
    differences,
    gather_segments,
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
    check_same_weighting,
    check_stride_per_key_per_rank,
    copy_checked,
    validate_jagged_data,
)
from embshard_types.sparse.jagged import JaggedTensor

_OWNER = "KeyedJaggedTensor"

InverseIndices = tuple[list[str], Tensor]


class KeyedJaggedTensor:
    """Sparse features for a batch: per key, variable-length bags of ids (and weights).

    Args:
        lengths: bag sizes, one per key per sample (give this and/or complete ``offsets``).
        stride: batch size; inferred from ``lengths`` / ``offsets`` and the key count if None.
        stride_per_key_per_rank: for batch sizes that vary per key, one list per key of its
            batch size on each rank.
        length_per_key: number of ids per key, if already known (saves a sync).
        inverse_indices: ``(keys, tensor[len(keys), batch])`` mapping the samples of a
            deduplicated variable-stride batch back to the full batch.
        allow_duplicate_keys: accept repeated keys (as produced by ``permute``).

    Raises:
        ValueError: a count, shape, dtype or device does not fit.
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
        """Build from lengths, ``validate()`` the data and compute the per-key sizes now."""
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
        """Build from offsets, ``validate()`` the data and compute the per-key sizes now."""
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
        """Return a KeyedJaggedTensor with no keys (stride 0); see ``JaggedTensor.empty``."""
        jt = JaggedTensor.empty(is_weighted, device, values_dtype, weights_dtype, lengths_dtype)
        return KeyedJaggedTensor(
            [], jt.values(), weights=jt.weights_or_none(), lengths=jt.lengths(), stride=0
        )

    @staticmethod
    def empty_like(
        kjt: KeyedJaggedTensor, device: torch.device | str | None = None
    ) -> KeyedJaggedTensor:
        """Return an uninitialized KeyedJaggedTensor shaped for ``copy_`` from ``kjt``, or empty.

        Without ``device``: no keys and no ids, with ``kjt``'s stride, dtypes, weightedness and
        device. With ``device``: ``torch.empty_like`` of each tensor ``kjt`` holds (lengths
        and/or offsets as it holds them, inverse indices) on ``device``, with its keys, strides
        and known per-key sizes.
        """
        return _kjt_empty_like(kjt, device)

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Build from one JaggedTensor of ids per key (all weighted or none); validates and syncs.

        Different sample counts per key give a variable stride (one rank per key).
        """
        return _kjt_from_jt_dict(jt_dict)

    @staticmethod
    def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Concatenate at least one KeyedJaggedTensor key-wise (all weighted or none).

        Differing or variable strides give a variable stride per key. Cached per-key sizes
        carry over; inverse indices do not.
        """
        return _concat_kjts(kjt_list)

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

    def size_in_bytes(self) -> int:
        """Bytes held by the values, weights and the lengths / offsets present (given or cached).

        Inverse indices are not counted, nor host-side lists such as the per-rank strides.
        """
        return sum(
            t.numel() * t.element_size()
            for t in (self._values, self._weights, self._lengths, self._offsets)
            if t is not None
        )

    def sync(self) -> KeyedJaggedTensor:
        """Compute and cache ``length_per_key`` / ``offset_per_key`` now; return self."""
        self._key_sizes()
        return self

    def unsync(self) -> KeyedJaggedTensor:
        """Forget cached ``length_per_key`` / ``offset_per_key`` (recomputed on next use); self."""
        self._length_per_key = None
        self._offset_per_key = None
        self._length_per_key_given = False
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
        """Split key-wise into consecutive groups of ``segments[i]`` keys (summing to all keys)."""
        return _split_kjt(self, segments)

    def permute(self, indices: Sequence[int]) -> KeyedJaggedTensor:
        """Reorder keys: output key ``i`` is input key ``indices[i]`` (repeats, drops allowed)."""
        return _permute_kjt(self, indices)

    def flatten_lengths(self) -> KeyedJaggedTensor:
        """Return a KeyedJaggedTensor of the same ids and lengths with per-key sizes computed.

        Lengths are always 1-D here, so what remains of TorchRec's method: the result holds
        no offsets and no inverse indices (as TorchRec's), and ``length_per_key`` is synced.
        """
        return KeyedJaggedTensor(
            self._keys,
            self._values,
            weights=self._weights,
            lengths=self.lengths().view(-1),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            length_per_key=self.length_per_key(),
            allow_duplicate_keys=self._allow_duplicate_keys,
        )

    # ---- devices and streams -------------------------------------------------------------

    def to(
        self,
        device: torch.device | str,
        non_blocking: bool = False,
        dtype: torch.dtype | None = None,
    ) -> KeyedJaggedTensor:
        """Return a copy on ``device``; ``dtype``, if given, converts the weights."""
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

    def copy_(self, kjt: KeyedJaggedTensor, non_blocking: bool = False) -> KeyedJaggedTensor:
        """Copy ``kjt``'s data into this KeyedJaggedTensor's tensors in place; return self.

        This one's tensors keep their device and dtype; the lengths / offsets it holds are
        filled from ``kjt``'s (derived there if ``kjt`` holds only the other), and so are its
        inverse indices. The host-side layout (strides, per-key sizes) is taken from ``kjt``.

        Raises:
            ValueError: the keys differ, a tensor's shape differs from ``kjt``'s, or only one
                of them has weights / inverse indices (allocate this one with
                ``KeyedJaggedTensor.empty_like(kjt, device)``).
        """
        _copy_kjt(self, kjt, non_blocking)
        return self

    def clear_storage(self) -> int:
        """Free the storage of the values, weights, lengths and offsets; return the bytes freed.

        Releases a batch's device memory before the object goes away; it is unusable after.
        Storage is freed for every tensor that shares it (e.g. the batch these are views of).
        The count is ``size_in_bytes()`` before clearing.
        """
        size = self.size_in_bytes()
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.untyped_storage().resize_(0)
        self._jt_dict = None
        return size

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor as in use by ``stream`` (see ``Tensor.record_stream``)."""
        inverse = None if self._inverse_indices is None else self._inverse_indices[1]
        for t in (self._values, self._weights, self._lengths, self._offsets, inverse):
            if t is not None:
                t.record_stream(stream)

    # ---- checks and text -----------------------------------------------------------------

    def validate(self) -> None:
        """Check the data (O(n), reads the device); ``ValueError`` names the key and sample."""
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
        """``repr`` followed by one line per key with its lengths, ids and weights."""
        lines = [repr(self)]
        offsets = self.offset_per_key()
        bounds = self.lengths_offset_per_key()
        lengths, values, weights = self.lengths(), self.values(), self.weights_or_none()
        for k, key in enumerate(self.keys()):
            start, stop = offsets[k], offsets[k + 1]
            line = f"  {key!r}: lengths={preview(lengths[bounds[k] : bounds[k + 1]])}"
            line += f" values={preview(values[start:stop])}"
            if weights is not None:
                line += f" weights={preview(weights[start:stop])}"
            lines.append(line)
        return "\n".join(lines)

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


# ---- key-wise operations that build new KeyedJaggedTensors -----------------------------


def _kjt_empty_like(kjt: KeyedJaggedTensor, device: torch.device | str | None) -> KeyedJaggedTensor:
    """See ``KeyedJaggedTensor.empty_like``."""
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"{_OWNER}.empty_like: expected a {_OWNER}, got {type(kjt).__name__}")
    weights = kjt.weights_or_none()
    if device is None:
        index = kjt.lengths_or_none()
        index_dtype = (index if index is not None else kjt.offsets()).dtype
        return KeyedJaggedTensor(
            [],
            kjt.values().new_empty(0),
            weights=None if weights is None else weights.new_empty(0),
            lengths=torch.empty(0, dtype=index_dtype, device=kjt.device()),
            stride=kjt.stride(),
        )

    def like(t: Tensor | None) -> Tensor | None:
        return None if t is None else torch.empty_like(t, device=device)

    inverse = kjt.inverse_indices_or_none()
    keys = kjt.keys()
    return KeyedJaggedTensor(
        keys,
        torch.empty_like(kjt.values(), device=device),
        weights=like(weights),
        lengths=like(kjt.lengths_or_none()),
        offsets=like(kjt.offsets_or_none()),
        stride=kjt.stride(),
        stride_per_key_per_rank=(
            kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None
        ),
        length_per_key=kjt.length_per_key_or_none(),
        offset_per_key=kjt.offset_per_key_or_none(),
        inverse_indices=(
            None if inverse is None else (inverse[0], torch.empty_like(inverse[1], device=device))
        ),
        allow_duplicate_keys=len(set(keys)) < len(keys),
    )


def _copy_kjt(dst: KeyedJaggedTensor, src: KeyedJaggedTensor, non_blocking: bool) -> None:
    """See ``KeyedJaggedTensor.copy_``."""
    owner = f"{_OWNER}.copy_"
    if not isinstance(src, KeyedJaggedTensor):
        raise TypeError(f"{owner}: expected a {_OWNER}, got {type(src).__name__}")
    if dst.keys() != src.keys():
        raise ValueError(
            f"{owner}: the source has keys {src.keys()} but this one has {dst.keys()}; allocate "
            "the destination with empty_like(source, device)"
        )
    check_same_weighting(owner, dst._weights is not None, src._weights is not None)
    dst_inverse, src_inverse = dst._inverse_indices, src._inverse_indices
    if (dst_inverse is None) != (src_inverse is None):
        has, lacks = (
            ("this one", "the source") if dst_inverse is not None else ("the source", "this one")
        )
        raise ValueError(
            f"{owner}: {has} has inverse indices but {lacks} has none; allocate the destination "
            "with empty_like(source, device)"
        )
    pairs = [("values", dst._values, src._values)]
    if dst._weights is not None:
        pairs.append(("weights", dst._weights, src.weights()))
    if dst._lengths is not None:
        pairs.append(("lengths", dst._lengths, src.lengths()))
    if dst._offsets is not None:
        pairs.append(("offsets", dst._offsets, src.offsets()))
    if dst_inverse is not None and src_inverse is not None:
        pairs.append(("inverse indices", dst_inverse[1], src_inverse[1]))
    copy_checked(owner, pairs, non_blocking)
    # The host-side layout follows the source (same keys and lengths shape, so it fits).
    dst._stride = src._stride
    per_rank = src._stride_per_key_per_rank
    dst._stride_per_key_per_rank = None if per_rank is None else [list(s) for s in per_rank]
    dst._stride_per_key = list(src._stride_per_key)
    dst._bounds = list(src._bounds)
    dst._length_per_key = src.length_per_key_or_none()
    dst._offset_per_key = src.offset_per_key_or_none()
    dst._length_per_key_given = src._length_per_key_given
    if dst_inverse is not None and src_inverse is not None:
        dst._inverse_indices = (list(src_inverse[0]), dst_inverse[1])
    dst._jt_dict = None


def _split_kjt(kjt: KeyedJaggedTensor, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
    """See ``KeyedJaggedTensor.split``."""
    keys = kjt.keys()
    if any(s < 0 for s in segments) or sum(segments) != len(keys):
        raise ValueError(
            f"{_OWNER}.split: segments {list(segments)} must be >= 0 and add up to the "
            f"{len(keys)} keys {keys}"
        )
    ends = cumulative(segments)
    return [kjt if b - a == len(keys) else _key_range(kjt, a, b) for a, b in pairwise(ends)]


def _key_range(kjt: KeyedJaggedTensor, a: int, b: int) -> KeyedJaggedTensor:
    """The keys ``a..b-1`` of ``kjt`` as a new KeyedJaggedTensor of views."""
    bounds = kjt.lengths_offset_per_key()
    start = stop = 0
    sizes: list[int] = []
    if a < b:
        offsets = kjt.offset_per_key()
        start, stop, sizes = offsets[a], offsets[b], kjt.length_per_key()[a:b]
    weights = kjt.weights_or_none()
    keys = kjt.keys()[a:b]
    return KeyedJaggedTensor(
        keys,
        kjt.values()[start:stop],
        weights=None if weights is None else weights[start:stop],
        lengths=kjt.lengths()[bounds[a] : bounds[b]],
        stride=kjt.stride(),
        stride_per_key_per_rank=(
            kjt.stride_per_key_per_rank()[a:b] if kjt.variable_stride_per_key() else None
        ),
        length_per_key=sizes,
        inverse_indices=kjt.inverse_indices_or_none(),
        allow_duplicate_keys=len(set(keys)) < len(keys),
    )


def _permute_kjt(kjt: KeyedJaggedTensor, indices: Sequence[int]) -> KeyedJaggedTensor:
    """See ``KeyedJaggedTensor.permute``."""
    keys = kjt.keys()
    for position, i in enumerate(indices):
        if not 0 <= i < len(keys):
            raise IndexError(
                f"{_OWNER}.permute: indices[{position}] = {i} is out of range for the "
                f"{len(keys)} keys {keys}"
            )
    order = list(indices)
    sizes, offsets = kjt.length_per_key(), kjt.offset_per_key()
    weights = kjt.weights_or_none()
    new_keys = [keys[i] for i in order]
    per_rank = kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None
    return KeyedJaggedTensor(
        new_keys,
        gather_segments(kjt.values(), offsets, order),
        weights=None if weights is None else gather_segments(weights, offsets, order),
        lengths=gather_segments(kjt.lengths(), kjt.lengths_offset_per_key(), order),
        stride=kjt.stride(),
        stride_per_key_per_rank=None if per_rank is None else [per_rank[i] for i in order],
        length_per_key=[sizes[i] for i in order],
        inverse_indices=kjt.inverse_indices_or_none(),
        allow_duplicate_keys=len(set(new_keys)) < len(new_keys),
    )


def _concat_kjts(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """See ``KeyedJaggedTensor.concat``."""
    if not kjt_list:
        raise ValueError(f"{_OWNER}.concat: kjt_list is empty; give at least one")
    weighted = [k.weights_or_none() is not None for k in kjt_list]
    if any(weighted) and not all(weighted):
        unweighted = weighted.index(False)
        raise ValueError(
            f"{_OWNER}.concat: kjt_list[{unweighted}] (keys {kjt_list[unweighted].keys()}) has "
            f"no weights but kjt_list[{weighted.index(True)}] has; give weights for all or none"
        )
    variable = any(k.variable_stride_per_key() for k in kjt_list) or (
        len({k.stride() for k in kjt_list}) > 1
    )
    sizes = [k.length_per_key_or_none() for k in kjt_list]
    keys = list(chain.from_iterable(k.keys() for k in kjt_list))
    repeated = any(len(set(k.keys())) < len(k.keys()) for k in kjt_list)
    return KeyedJaggedTensor(
        keys,
        torch.cat([k.values() for k in kjt_list]),
        weights=torch.cat([k.weights() for k in kjt_list]) if all(weighted) else None,
        lengths=torch.cat([k.lengths() for k in kjt_list]),
        stride=max(k.stride() for k in kjt_list),
        stride_per_key_per_rank=(
            [s for k in kjt_list for s in k.stride_per_key_per_rank()] if variable else None
        ),
        length_per_key=(
            None if any(s is None for s in sizes) else [n for s in sizes for n in s or ()]
        ),
        allow_duplicate_keys=repeated,
    )


def _kjt_from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
    """See ``KeyedJaggedTensor.from_jt_dict``."""
    if not jt_dict:
        return KeyedJaggedTensor.empty()
    keys = list(jt_dict)
    jts = list(jt_dict.values())
    weighted = [jt.weights_or_none() is not None for jt in jts]
    if any(weighted) and not all(weighted):
        raise ValueError(
            f"{_OWNER}.from_jt_dict: key {keys[weighted.index(False)]!r} has no weights but "
            f"key {keys[weighted.index(True)]!r} has; give weights for all keys or none"
        )
    sizes = [jt.lengths().numel() for jt in jts]
    uniform = len(set(sizes)) == 1
    kjt = KeyedJaggedTensor(
        keys,
        torch.cat([jt.values() for jt in jts]),
        weights=torch.cat([jt.weights() for jt in jts]) if all(weighted) else None,
        lengths=torch.cat([jt.lengths() for jt in jts]),
        stride=sizes[0] if uniform else None,
        stride_per_key_per_rank=None if uniform else [[s] for s in sizes],
        length_per_key=[jt.values().shape[0] for jt in jts],
    )
    kjt.validate()
    return kjt
