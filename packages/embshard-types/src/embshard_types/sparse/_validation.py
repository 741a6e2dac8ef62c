"""Checks for jagged inputs, with error messages that say what is wrong and where.

``check_*_args`` / ``check_layout`` never read tensor data and run in every constructor;
``*_data`` checks are O(n) and run from ``validate()`` and the ``*_sync`` constructors. Failures
raise ``ValueError`` (``TypeError`` for wrong argument types) before any state changes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from embshard_types.sparse._ops import cumulative, differences, offsets_at


@dataclass(frozen=True)
class SegmentLocator:
    """Names the key and sample of a flat segment index, for error messages.

    Attributes:
        keys: the keys in layout order, or None for a lone JaggedTensor (samples only).
        bounds: the first segment of each key, plus the total (``len(keys) + 1`` entries).
    """

    keys: Sequence[str] | None
    bounds: Sequence[int]

    def key_of(self, segment: int) -> int:
        """Return the index of the key whose segments contain ``segment``."""
        return bisect_right(self.bounds, segment) - 1

    def describe(self, segment: int) -> str:
        """Return e.g. ``"key 'f2', sample 3"`` for a flat segment index."""
        if self.keys is None:
            return f"sample {segment}"
        k = self.key_of(segment)
        if 0 <= k < len(self.keys):
            return f"key {self.keys[k]!r}, sample {segment - self.bounds[k]}"
        return f"segment {segment}"


# ---- cheap checks (no tensor data read) -------------------------------------------------


def check_tensor(value: object, name: str, owner: str) -> Tensor:
    """Raise TypeError unless ``value`` is a tensor; return it."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_jagged_args(
    owner: str,
    values: Tensor,
    weights: Tensor | None,
    lengths: Tensor | None,
    offsets: Tensor | None,
) -> int:
    """Check shapes, dtypes and devices of a jagged layout; return the number of segments.

    Args:
        owner: the class name for messages (``"JaggedTensor"``, ``"KeyedJaggedTensor"``).
    """
    check_tensor(values, "values", owner)
    if values.dim() == 0:
        raise ValueError(f"{owner}: values must have at least one dimension, got a scalar")
    if lengths is None and offsets is None:
        raise ValueError(f"{owner}: give lengths or offsets (or both) to say where bags end")
    tensors = {"values": values}
    num_segments = -1
    if lengths is not None:
        check_tensor(lengths, "lengths", owner)
        _check_index_tensor(owner, "lengths", lengths)
        num_segments = lengths.numel()
        tensors["lengths"] = lengths
    if offsets is not None:
        check_tensor(offsets, "offsets", owner)
        _check_index_tensor(owner, "offsets", offsets)
        if offsets.numel() == 0:
            raise ValueError(
                f"{owner}: offsets is empty; complete offsets have one entry more than there "
                "are bags and start with 0 (use tensor([0]) for no bags)"
            )
        if lengths is not None and offsets.numel() != lengths.numel() + 1:
            raise ValueError(
                f"{owner}: offsets has {offsets.numel()} entries but lengths has "
                f"{lengths.numel()}; complete offsets need exactly one entry more than lengths"
            )
        num_segments = offsets.numel() - 1
        tensors["offsets"] = offsets
    if weights is not None:
        check_tensor(weights, "weights", owner)
        if weights.dim() != 1 or weights.shape[0] != values.shape[0]:
            raise ValueError(
                f"{owner}: weights has shape {tuple(weights.shape)} but values has "
                f"{values.shape[0]} entries; give exactly one weight per value (1-D)"
            )
        tensors["weights"] = weights
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"{owner}: tensors are on different devices ({where}); move them to one")
    return num_segments


def _check_index_tensor(owner: str, name: str, tensor: Tensor) -> None:
    if tensor.dim() != 1:
        raise ValueError(f"{owner}: {name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{owner}: {name} must be an integer tensor, got {tensor.dtype}")


def check_keys(owner: str, keys: Sequence[str], allow_duplicates: bool = False) -> list[str]:
    """Return ``keys`` as a list after checking they are (distinct, by default) strings."""
    if isinstance(keys, str):
        raise TypeError(f"{owner}: keys must be a list of strings, got the string {keys!r}")
    out = list(keys)
    seen: dict[str, int] = {}
    for i, key in enumerate(out):
        if not isinstance(key, str):
            raise TypeError(f"{owner}: keys[{i}] must be a str, got {type(key).__name__}")
        if key in seen and not allow_duplicates:
            raise ValueError(
                f"{owner}: duplicate key {key!r} at positions {seen[key]} and {i}; "
                "every key may appear once"
            )
        seen.setdefault(key, i)
    return out


def check_stride_per_key_per_rank(
    owner: str, keys: Sequence[str], stride_per_key_per_rank: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Return a copy of ``stride_per_key_per_rank`` after checking its counts and signs."""
    if len(stride_per_key_per_rank) != len(keys):
        raise ValueError(
            f"{owner}: stride_per_key_per_rank has {len(stride_per_key_per_rank)} entries but "
            f"there are {len(keys)} keys; give one list of per-rank batch sizes per key"
        )
    out: list[list[int]] = []
    for key, per_rank in zip(keys, stride_per_key_per_rank, strict=True):
        sizes = [int(s) for s in per_rank]
        for rank, size in enumerate(sizes):
            if size < 0:
                raise ValueError(
                    f"{owner}: stride_per_key_per_rank for key {key!r} has a negative batch "
                    f"size {size} on rank {rank}"
                )
        out.append(sizes)
    return out


def check_layout(
    owner: str,
    keys: Sequence[str],
    num_segments: int,
    stride: int | None,
    stride_per_key: Sequence[int] | None,
) -> int:
    """Check that the segment count fits keys x stride (or ``stride_per_key``); return stride."""
    name = "lengths"
    if stride is not None and stride < 0:
        raise ValueError(f"{owner}: stride must be >= 0, got {stride}")
    if stride_per_key is not None:
        expected = sum(stride_per_key)
        if expected != num_segments:
            per_key = ", ".join(f"{k}: {s}" for k, s in zip(keys, stride_per_key, strict=True))
            raise ValueError(
                f"{owner}: {name} has {num_segments} entries but stride_per_key_per_rank adds "
                f"up to {expected} ({per_key}); give one length per key per sample"
            )
        return stride if stride is not None else (max(stride_per_key) if stride_per_key else 0)
    if not keys:
        if num_segments != 0:
            raise ValueError(f"{owner}: no keys but {name} has {num_segments} entries")
        return stride if stride is not None else 0
    if stride is None:
        if num_segments % len(keys) != 0:
            raise ValueError(
                f"{owner}: {name} has {num_segments} entries, which is not a multiple of the "
                f"{len(keys)} keys {list(keys)}; lengths holds one entry per key per sample, "
                "key-major (pass stride_per_key_per_rank if batch sizes differ per key)"
            )
        return num_segments // len(keys)
    if num_segments != stride * len(keys):
        raise ValueError(
            f"{owner}: {name} has {num_segments} entries but {len(keys)} keys x stride "
            f"{stride} = {stride * len(keys)}; lengths holds one entry per key per sample"
        )
    return stride


def check_inverse_indices(
    owner: str, inverse_indices: tuple[Sequence[str], Tensor], device: torch.device
) -> None:
    """Check that inverse indices are ``(keys, tensor[len(keys), batch])`` on ``device``."""
    keys, tensor = inverse_indices
    if not isinstance(tensor, Tensor) or tensor.dim() != 2 or tensor.shape[0] != len(keys):
        shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(
            f"{owner}: inverse_indices must be (keys, tensor[len(keys), batch]); got "
            f"{len(keys)} keys and {shape}"
        )
    if tensor.device != device:
        raise ValueError(f"{owner}: inverse_indices is on {tensor.device} but values on {device}")


# ---- data checks (read tensors; O(n)) ---------------------------------------------------


def check_lengths_data(owner: str, lengths: Tensor, locator: SegmentLocator) -> None:
    """Raise if any length is negative, naming the first offending key and sample."""
    if lengths.numel() == 0:
        return
    negative = (lengths < 0).nonzero()
    if negative.numel():
        i = int(negative[0, 0])
        raise ValueError(
            f"{owner}: lengths[{i}] = {int(lengths[i])} is negative ({locator.describe(i)}); "
            "bag lengths must be >= 0"
        )


def check_offsets_data(owner: str, offsets: Tensor, locator: SegmentLocator) -> None:
    """Raise unless offsets start at 0 and never decrease, naming where they go wrong."""
    first = int(offsets[0])
    if first != 0:
        raise ValueError(f"{owner}: offsets must start at 0 but offsets[0] = {first}")
    if offsets.numel() < 2:
        return
    drops = (offsets[1:] < offsets[:-1]).nonzero()
    if drops.numel():
        i = int(drops[0, 0])
        raise ValueError(
            f"{owner}: offsets decrease from offsets[{i}] = {int(offsets[i])} to "
            f"offsets[{i + 1}] = {int(offsets[i + 1])} ({locator.describe(i)}); offsets "
            "must be non-decreasing"
        )


def check_lengths_match_offsets(
    owner: str, lengths: Tensor, offsets: Tensor, locator: SegmentLocator
) -> None:
    """Raise if lengths and offsets (both given) describe different bags."""
    if lengths.numel() == 0:
        return
    derived = offsets[1:] - offsets[:-1]
    mismatch = (derived != lengths.to(derived.dtype)).nonzero()
    if mismatch.numel():
        i = int(mismatch[0, 0])
        raise ValueError(
            f"{owner}: lengths[{i}] = {int(lengths[i])} but offsets give {int(derived[i])} "
            f"({locator.describe(i)}); lengths and offsets must describe the same bags"
        )


def check_total(owner: str, offsets: Tensor, num_values: int, locator: SegmentLocator) -> None:
    """Raise unless the bags cover exactly ``num_values`` values; say by how much and where."""
    total = int(offsets[-1])
    if total == num_values:
        return
    if total > num_values:
        where = ""
        if locator.keys:
            ends = offsets_at(offsets, locator.bounds)
            k = next(i for i in range(len(locator.keys)) if ends[i + 1] > num_values)
            where = (
                f"; key {locator.keys[k]!r} spans values[{ends[k]}:{ends[k + 1]}], "
                f"past the end of values"
            )
        raise ValueError(
            f"{owner}: lengths add up to {total} but values has {num_values} entries "
            f"({total - num_values} too few values){where}"
        )
    where = ""
    if locator.keys:
        where = f"; the last key {locator.keys[-1]!r} ends at values[{total}]"
    raise ValueError(
        f"{owner}: lengths add up to {total} but values has {num_values} entries "
        f"({num_values - total} values not covered by any bag){where}"
    )


def check_length_per_key(
    owner: str, keys: Sequence[str], given: Sequence[int], computed: Sequence[int]
) -> None:
    """Raise if a caller-supplied length_per_key disagrees with the lengths, naming the key."""
    for key, want, got in zip(keys, given, computed, strict=True):
        if want != got:
            raise ValueError(
                f"{owner}: length_per_key says key {key!r} has {want} values but its lengths "
                f"add up to {got}"
            )


def check_key_sizes(
    owner: str,
    keys: Sequence[str],
    num_values: int,
    length_per_key: Sequence[int] | None,
    offset_per_key: Sequence[int] | None,
) -> tuple[list[int] | None, list[int] | None]:
    """Check caller-supplied per-key sizes against the keys and values (Python ints only).

    Returns:
        ``(length_per_key, offset_per_key)`` as lists, each derived from the other if missing.
    """
    lpk = None if length_per_key is None else [int(v) for v in length_per_key]
    opk = None if offset_per_key is None else [int(v) for v in offset_per_key]
    if opk is not None:
        if len(opk) != len(keys) + 1 or opk[0] != 0:
            raise ValueError(
                f"{owner}: offset_per_key must have len(keys) + 1 = {len(keys) + 1} entries "
                f"starting at 0, got {opk}"
            )
        derived = differences(opk)
        if lpk is None:
            lpk = derived
        elif lpk != derived:
            raise ValueError(f"{owner}: offset_per_key {opk} does not match length_per_key {lpk}")
    if lpk is None:
        return None, None
    if len(lpk) != len(keys):
        raise ValueError(
            f"{owner}: length_per_key has {len(lpk)} entries but there are {len(keys)} keys"
        )
    for key, n in zip(keys, lpk, strict=True):
        if n < 0:
            raise ValueError(f"{owner}: length_per_key for key {key!r} is negative ({n})")
    if sum(lpk) != num_values:
        raise ValueError(
            f"{owner}: length_per_key adds up to {sum(lpk)} but values has {num_values} "
            f"entries ({sum(lpk) - num_values:+d})"
        )
    return lpk, cumulative(lpk) if opk is None else opk


def validate_jagged_data(
    owner: str,
    locator: SegmentLocator,
    values: Tensor,
    weights: Tensor | None,
    lengths: Tensor | None,
    offsets: Tensor,
    *,
    offsets_given: bool,
    length_per_key: Sequence[int] | None = None,
    require_ids: bool = False,
) -> None:
    """Run every data check of a jagged layout, cheapest first.

    Args:
        offsets_given: whether ``offsets`` came from the caller (so must be checked itself).
        length_per_key: a caller-supplied length_per_key to cross-check, if any.
        require_ids: values must be integer ids and weights floating point.
    """
    if require_ids:
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(
                f"{owner}: values must be integer ids, got {values.dtype}; cast them with "
                ".long() (use a JaggedTensor for float data)"
            )
        if weights is not None and not weights.is_floating_point():
            raise ValueError(f"{owner}: weights must be floating point, got {weights.dtype}")
    if lengths is not None:
        check_lengths_data(owner, lengths, locator)
    if offsets_given:
        check_offsets_data(owner, offsets, locator)
        if lengths is not None:
            check_lengths_match_offsets(owner, lengths, offsets, locator)
    check_total(owner, offsets, values.shape[0], locator)
    if length_per_key is not None and locator.keys is not None:
        ends = offsets_at(offsets, locator.bounds)
        computed = differences(ends)
        check_length_per_key(owner, locator.keys, length_per_key, computed)


def check_same_weighting(owner: str, dst_weighted: bool, src_weighted: bool) -> None:
    """Check that the destination and source of an in-place copy both have weights or neither."""
    if dst_weighted != src_weighted:
        has, lacks = ("this one", "the source") if dst_weighted else ("the source", "this one")
        raise ValueError(
            f"{owner}: {has} has weights but {lacks} has none; allocate the destination with "
            "empty_like(source, device)"
        )


def copy_checked(
    owner: str, pairs: Sequence[tuple[str, Tensor, Tensor]], non_blocking: bool
) -> None:
    """Copy each ``(name, destination, source)`` in place after checking all shapes match.

    ``Tensor.copy_`` would broadcast a smaller source; here a shape mismatch is an error and
    nothing is copied.
    """
    for name, dst, src in pairs:
        if dst.shape != src.shape:
            raise ValueError(
                f"{owner}: {name} has shape {tuple(dst.shape)} here but {tuple(src.shape)} in "
                "the source; allocate the destination with empty_like(source, device)"
            )
    for _, dst, src in pairs:
        dst.copy_(src, non_blocking=non_blocking)
