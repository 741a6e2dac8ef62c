"""Key-wise operations that build new KeyedJaggedTensors: split, permute, concat, from_jt_dict.

They live apart from the class to keep ``keyed_jagged.py`` about one object; the class's
methods of the same names call them and document them. They use only the class's public API,
slice or concatenate once per key (never per id or sample), carry the known per-key sizes over
so the results need no device sync of their own, and check their arguments before building
anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, pairwise
from typing import TYPE_CHECKING

import torch

from embshard_types.sparse._ops import cumulative, gather_segments

if TYPE_CHECKING:
    from embshard_types.sparse.jagged import JaggedTensor
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

_OWNER = "KeyedJaggedTensor"


def split_kjt(kjt: KeyedJaggedTensor, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
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
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

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


def permute_kjt(kjt: KeyedJaggedTensor, indices: Sequence[int]) -> KeyedJaggedTensor:
    """See ``KeyedJaggedTensor.permute``."""
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

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


def concat_kjts(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """See ``KeyedJaggedTensor.concat``."""
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

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


def kjt_from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
    """See ``KeyedJaggedTensor.from_jt_dict``."""
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

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
