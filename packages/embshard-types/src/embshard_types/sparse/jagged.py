"""JaggedTensor: one feature's variable-length bags for a batch of samples.

Holds ``values`` (ids or embedding rows; dim 0 is jagged), optional ``weights`` and ``lengths``
and/or complete ``offsets``; the missing one is derived on first use and cached. Construction
never reads tensor data; ``validate()`` does (O(n)) and names the offending sample.
``empty_like`` and ``copy_`` stage a batch on another device: allocate once, copy in place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embshard_types.sparse._format import describe, preview
from embshard_types.sparse._ops import lengths_from_offsets, offsets_from_lengths
from embshard_types.sparse._validation import (
    SegmentLocator,
    check_jagged_args,
    check_same_weighting,
    copy_checked,
    validate_jagged_data,
)

_OWNER = "JaggedTensor"


class JaggedTensor:
    """Variable-length bags of values (and optional weights) for a batch of samples.

    Args:
        values: the bags' values concatenated, ``[N, ...]``; ``weights`` is ``[N]``.
        lengths: bag sizes, ``[B]`` (give this and/or ``offsets``, ``[B + 1]`` from 0).

    Raises:
        ValueError: neither lengths nor offsets is given, or a shape / dtype / device is wrong.
    """

    def __init__(
        self,
        values: Tensor,
        weights: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
    ) -> None:
        check_jagged_args(_OWNER, values, weights, lengths, offsets)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets

    # ---- construction --------------------------------------------------------------------

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> JaggedTensor:
        """Return a JaggedTensor with no samples (values int64, weights float32 by default)."""
        values = torch.empty(0, dtype=values_dtype or torch.int64, device=device)
        weights = (
            torch.empty(0, dtype=weights_dtype or torch.float32, device=device)
            if is_weighted
            else None
        )
        lengths = torch.empty(0, dtype=lengths_dtype, device=device)
        offsets = torch.zeros(1, dtype=lengths_dtype, device=device)
        return JaggedTensor(values, weights=weights, lengths=lengths, offsets=offsets)

    @staticmethod
    def empty_like(jt: JaggedTensor, device: torch.device | str | None = None) -> JaggedTensor:
        """Return an uninitialized JaggedTensor shaped for ``copy_`` from ``jt``, or no samples.

        Without ``device``: no samples, with ``jt``'s dtypes, trailing value dims, weightedness
        and device. With ``device``: ``torch.empty_like`` of each tensor ``jt`` holds (lengths
        and/or offsets as it holds them), on ``device``.
        """
        if not isinstance(jt, JaggedTensor):
            raise TypeError(f"{_OWNER}.empty_like: expected a {_OWNER}, got {type(jt).__name__}")
        weights = jt._weights
        if device is None:
            values = jt._values.new_empty((0, *jt._values.shape[1:]))
            return JaggedTensor(
                values,
                weights=None if weights is None else weights.new_empty(0),
                lengths=torch.empty(0, dtype=jt._index_dtype(), device=values.device),
            )

        def like(t: Tensor | None) -> Tensor | None:
            return None if t is None else torch.empty_like(t, device=device)

        return JaggedTensor(
            torch.empty_like(jt._values, device=device),
            weights=like(weights),
            lengths=like(jt._lengths),
            offsets=like(jt._offsets),
        )

    @staticmethod
    def from_dense(values: list[Tensor], weights: list[Tensor] | None = None) -> JaggedTensor:
        """Build from one ``[n_i, ...]`` tensor (and ``[n_i]`` weights) per sample."""
        if weights is not None and len(weights) != len(values):
            raise ValueError(
                f"{_OWNER}.from_dense: {len(weights)} weight tensors for {len(values)} samples"
            )
        if not values:
            return JaggedTensor.empty(is_weighted=weights is not None)
        device = values[0].device
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int32, device=device)
        flat_weights = torch.cat(weights) if weights is not None else None
        return JaggedTensor(torch.cat(values), weights=flat_weights, lengths=lengths)

    @staticmethod
    def from_dense_lengths(
        values: Tensor, lengths: Tensor, weights: Tensor | None = None
    ) -> JaggedTensor:
        """Build from a padded ``[B, L, ...]`` tensor, keeping the first ``lengths[b]`` of row b."""
        if values.dim() < 2 or lengths.shape != values.shape[:1]:
            raise ValueError(
                f"{_OWNER}.from_dense_lengths: values must be [B, L, ...] and lengths [B]; got "
                f"values {tuple(values.shape)} and lengths {tuple(lengths.shape)}"
            )
        positions = torch.arange(values.shape[1], device=values.device)
        mask = positions.unsqueeze(0) < lengths.unsqueeze(1)
        kept_weights = weights[mask] if weights is not None else None
        return JaggedTensor(values[mask], weights=kept_weights, lengths=lengths)

    # ---- accessors -----------------------------------------------------------------------

    def values(self) -> Tensor:
        """The concatenated values, ``[N, ...]``."""
        return self._values

    def weights(self) -> Tensor:
        """The per-value weights; raises ValueError if there are none."""
        if self._weights is None:
            raise ValueError(f"this {_OWNER} has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> Tensor | None:
        """The per-value weights, or None."""
        return self._weights

    def lengths(self) -> Tensor:
        """Bag sizes ``[B]`` (derived from offsets on first use and cached)."""
        if self._lengths is None:
            assert self._offsets is not None  # guaranteed by the constructor
            self._lengths = lengths_from_offsets(self._offsets)
        return self._lengths

    def lengths_or_none(self) -> Tensor | None:
        """The lengths if given or already derived, else None."""
        return self._lengths

    def offsets(self) -> Tensor:
        """Complete offsets ``[B + 1]`` (derived from lengths on first use and cached)."""
        if self._offsets is None:
            assert self._lengths is not None  # guaranteed by the constructor
            self._offsets = offsets_from_lengths(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> Tensor | None:
        """The offsets if given or already derived, else None."""
        return self._offsets

    def device(self) -> torch.device:
        """The device of the values."""
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes held by the values, weights and the lengths / offsets present (given or cached)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self._values, self._weights, self._lengths, self._offsets)
            if t is not None
        )

    def _index_dtype(self) -> torch.dtype:
        """The dtype of the lengths (that of the offsets they would be derived from)."""
        index = self._lengths if self._lengths is not None else self._offsets
        assert index is not None  # guaranteed by the constructor
        return index.dtype

    # ---- conversions ---------------------------------------------------------------------

    def to_dense(self) -> list[Tensor]:
        """One tensor per sample (views of values).

        Raises:
            ValueError: the lengths are negative or do not add up to the values (``validate``).
        """
        return self._split(self._values)

    def to_dense_weights(self) -> list[Tensor] | None:
        """One weights tensor per sample, or None if unweighted."""
        if self._weights is None:
            return None
        return self._split(self._weights)

    def _split(self, data: Tensor) -> list[Tensor]:
        sizes = self.lengths().tolist()
        if sum(sizes) != data.shape[0] or any(n < 0 for n in sizes):
            self.validate()  # names the sample and says how far off the lengths are
        return list(torch.split(data, sizes, dim=0))

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> Tensor:
        """Values padded (or cut) to ``[B, desired_length, ...]`` (default: the longest bag)."""
        return self._padded(self._values, desired_length, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> Tensor | None:
        """Weights padded like ``to_padded_dense``, or None if unweighted."""
        if self._weights is None:
            return None
        return self._padded(self._weights, desired_length, padding_value)

    def _padded(self, data: Tensor, desired_length: int | None, padding_value: float) -> Tensor:
        lengths = self.lengths()
        num_rows, num_values = lengths.numel(), data.shape[0]
        if desired_length is None:
            width = int(lengths.max()) if num_rows else 0
        elif desired_length < 0:
            raise ValueError(f"desired_length must be >= 0, got {desired_length}")
        else:
            width = desired_length
        out = data.new_full((num_rows, width, *data.shape[1:]), padding_value)
        if num_values == 0 or width == 0:
            return out
        rows = torch.repeat_interleave(
            torch.arange(num_rows, device=data.device), lengths, output_size=num_values
        )
        starts = self.offsets()[:-1].repeat_interleave(lengths, output_size=num_values)
        cols = torch.arange(num_values, device=data.device) - starts
        if desired_length is not None:
            keep = cols < width
            rows, cols, data = rows[keep], cols[keep], data[keep]
        out[rows, cols] = data
        return out

    # ---- devices and streams -------------------------------------------------------------

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        """Return a copy on ``device`` (tensors already there are not copied)."""

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return JaggedTensor(
            self._values.to(device, non_blocking=non_blocking),
            weights=move(self._weights),
            lengths=move(self._lengths),
            offsets=move(self._offsets),
        )

    def pin_memory(self) -> JaggedTensor:
        """Return a copy whose tensors are in page-locked host memory."""

        def pin(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.pin_memory()

        return JaggedTensor(
            self._values.pin_memory(),
            weights=pin(self._weights),
            lengths=pin(self._lengths),
            offsets=pin(self._offsets),
        )

    def copy_(self, jt: JaggedTensor, non_blocking: bool = False) -> JaggedTensor:
        """Copy ``jt``'s data into this JaggedTensor's tensors in place; return self.

        This one's tensors keep their device and dtype; the lengths / offsets it holds are
        filled from ``jt``'s (derived there if ``jt`` holds only the other).

        Raises:
            ValueError: a tensor's shape differs from ``jt``'s, or only one of them is weighted
                (allocate this one with ``JaggedTensor.empty_like(jt, device)``).
        """
        if not isinstance(jt, JaggedTensor):
            raise TypeError(f"{_OWNER}.copy_: expected a {_OWNER}, got {type(jt).__name__}")
        owner = f"{_OWNER}.copy_"
        check_same_weighting(owner, self._weights is not None, jt._weights is not None)
        pairs = [("values", self._values, jt._values)]
        if self._weights is not None:
            pairs.append(("weights", self._weights, jt.weights()))
        if self._lengths is not None:
            pairs.append(("lengths", self._lengths, jt.lengths()))
        if self._offsets is not None:
            pairs.append(("offsets", self._offsets, jt.offsets()))
        copy_checked(owner, pairs, non_blocking)
        return self

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor as in use by ``stream`` (see ``Tensor.record_stream``)."""
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)

    # ---- checks and text -----------------------------------------------------------------

    def validate(self) -> None:
        """Check the data (O(n), reads the device); raise ValueError naming the sample."""
        offsets_given = self._offsets is not None
        validate_jagged_data(
            _OWNER,
            SegmentLocator(keys=None, bounds=(0, self._num_samples())),
            self._values,
            self._weights,
            self._lengths,
            self.offsets(),
            offsets_given=offsets_given,
        )

    def _num_samples(self) -> int:
        """The number of samples (known from shapes alone)."""
        if self._lengths is not None:
            return self._lengths.numel()
        assert self._offsets is not None
        return self._offsets.numel() - 1

    def __repr__(self) -> str:
        return (
            f"{_OWNER}(values={describe(self._values)}, weights={describe(self._weights)}, "
            f"samples={self._num_samples()})"
        )

    def __str__(self) -> str:
        lines = [f"{_OWNER}({self._num_samples()} samples)"]
        lines.append(f"  lengths: {preview(self.lengths())}")
        lines.append(f"  values:  {preview(self._values)}")
        if self._weights is not None:
            lines.append(f"  weights: {preview(self._weights)}")
        return "\n".join(lines)
