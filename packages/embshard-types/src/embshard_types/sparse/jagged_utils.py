"""Module-level helpers around the jagged types, under TorchRec's names.

``jt_is_equal`` / ``kjt_is_equal`` compare representations field by field (lengths and offsets
both, deriving the missing one; float data within ``torch.allclose``'s default tolerance).
``flatten_kjt_list`` / ``unflatten_kjt_list`` turn a list of KeyedJaggedTensors into tensors plus
host-side contexts and back. ``ComputeKJTToJTDict`` / ``ComputeJTDictToKJT`` wrap ``to_dict`` and
``from_jt_dict`` as modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

__all__ = [
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "KJTFlatContext",
    "flatten_kjt_list",
    "jt_is_equal",
    "kjt_is_equal",
    "unflatten_kjt_list",
]

# ---- equality -------------------------------------------------------------------------------


def _tensors_equal(a: Tensor | None, b: Tensor | None) -> bool:
    """Both None, or same shape, dtype and device and ``torch.allclose`` (NaN never equal)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return bool(torch.allclose(a, b))


def jt_is_equal(jt_1: JaggedTensor, jt_2: JaggedTensor) -> bool:
    """Whether two JaggedTensors hold the same values, weights, lengths and offsets.

    Tensors compare with ``torch.allclose`` and must share shape, dtype and device; the lengths
    or offsets one of them lacks are derived (and cached) first, so building from lengths or
    from offsets does not matter. Anything but two JaggedTensors is unequal.
    """
    if not isinstance(jt_1, JaggedTensor) or not isinstance(jt_2, JaggedTensor):
        return False
    return (
        _tensors_equal(jt_1.values(), jt_2.values())
        and _tensors_equal(jt_1.weights_or_none(), jt_2.weights_or_none())
        and _tensors_equal(jt_1.lengths(), jt_2.lengths())
        and _tensors_equal(jt_1.offsets(), jt_2.offsets())
    )


def kjt_is_equal(kjt_1: KeyedJaggedTensor, kjt_2: KeyedJaggedTensor) -> bool:
    """Whether two KeyedJaggedTensors have the same keys (in order), data and layout.

    Compares, as TorchRec does: keys; values, weights, lengths and offsets as in
    ``jt_is_equal``; ``length_per_key`` and ``offset_per_key`` (computed and cached if not yet
    known); and ``stride()``. Per-rank batch sizes, inverse indices and duplicate-key
    permission are not compared. Anything but two KeyedJaggedTensors is unequal.
    """
    if not isinstance(kjt_1, KeyedJaggedTensor) or not isinstance(kjt_2, KeyedJaggedTensor):
        return False
    if kjt_1.keys() != kjt_2.keys():
        return False
    if not _tensors_equal(kjt_1.values(), kjt_2.values()):
        return False
    return (
        _tensors_equal(kjt_1.lengths(), kjt_2.lengths())
        and _tensors_equal(kjt_1.weights_or_none(), kjt_2.weights_or_none())
        and _tensors_equal(kjt_1.offsets(), kjt_2.offsets())
        and kjt_1.length_per_key() == kjt_2.length_per_key()
        and kjt_1.offset_per_key() == kjt_2.offset_per_key()
        and kjt_1.stride() == kjt_2.stride()
    )


# ---- lists of KeyedJaggedTensors as tensors plus contexts ---------------------------------


class KJTFlatContext(NamedTuple):
    """What ``unflatten_kjt_list`` needs besides the tensors to rebuild one KeyedJaggedTensor."""

    keys: tuple[str, ...]
    stride: int
    stride_per_key_per_rank: tuple[tuple[int, ...], ...] | None
    inverse_indices_keys: tuple[str, ...] | None
    allow_duplicate_keys: bool


#: Entries each KeyedJaggedTensor takes in ``flatten_kjt_list``'s tensor list.
KJT_FLAT_FIELDS = ("values", "weights", "lengths", "inverse_indices")


def flatten_kjt_list(
    kjt_arr: Sequence[KeyedJaggedTensor],
) -> tuple[list[Tensor | None], list[KJTFlatContext]]:
    """Split KeyedJaggedTensors into tensors and one host-side context each.

    Each one adds four entries to the tensor list: values, weights, lengths and the inverse
    indices' tensor (None where absent). Offsets are left out: they follow from the lengths.
    ``unflatten_kjt_list`` rebuilds the list.
    """
    tensors: list[Tensor | None] = []
    contexts: list[KJTFlatContext] = []
    for i, kjt in enumerate(kjt_arr):
        if not isinstance(kjt, KeyedJaggedTensor):
            raise TypeError(
                f"flatten_kjt_list: kjt_arr[{i}] is a {type(kjt).__name__}, not a KeyedJaggedTensor"
            )
        inverse = kjt.inverse_indices_or_none()
        tensors += [
            kjt.values(),
            kjt.weights_or_none(),
            kjt.lengths(),
            None if inverse is None else inverse[1],
        ]
        keys = tuple(kjt.keys())
        per_rank = (
            tuple(tuple(s) for s in kjt.stride_per_key_per_rank())
            if kjt.variable_stride_per_key()
            else None
        )
        contexts.append(
            KJTFlatContext(
                keys=keys,
                stride=kjt.stride(),
                stride_per_key_per_rank=per_rank,
                inverse_indices_keys=None if inverse is None else tuple(inverse[0]),
                allow_duplicate_keys=len(set(keys)) < len(keys),
            )
        )
    return tensors, contexts


def unflatten_kjt_list(
    values: Sequence[Tensor | None], contexts: Sequence[KJTFlatContext]
) -> list[KeyedJaggedTensor]:
    """Rebuild the KeyedJaggedTensors ``flatten_kjt_list`` split (one per context).

    Raises:
        ValueError: ``values`` does not hold four entries per context, or a required one
            (values, lengths) is None.
        TypeError: a context is not a ``KJTFlatContext`` (e.g. a list of keys, as TorchRec's).
    """
    width = len(KJT_FLAT_FIELDS)
    if len(values) != width * len(contexts):
        raise ValueError(
            f"unflatten_kjt_list: {len(values)} tensors for {len(contexts)} contexts; "
            f"flatten_kjt_list gives {width} per KeyedJaggedTensor ({', '.join(KJT_FLAT_FIELDS)})"
        )
    out: list[KeyedJaggedTensor] = []
    for j, context in enumerate(contexts):
        if not isinstance(context, KJTFlatContext):
            raise TypeError(
                f"unflatten_kjt_list: contexts[{j}] is a {type(context).__name__}, not a "
                "KJTFlatContext; pass the contexts flatten_kjt_list returned"
            )
        ids, weights, lengths, inverse = values[j * width : (j + 1) * width]
        if ids is None or lengths is None:
            missing = "values" if ids is None else "lengths"
            raise ValueError(
                f"unflatten_kjt_list: the {missing} of KeyedJaggedTensor {j} (keys "
                f"{list(context.keys)}) is None; only weights and inverse indices may be"
            )
        if (inverse is None) != (context.inverse_indices_keys is None):
            raise ValueError(
                f"unflatten_kjt_list: KeyedJaggedTensor {j} (keys {list(context.keys)}) has "
                f"{'no ' if inverse is None else ''}inverse indices tensor but its context says "
                f"{'it has' if inverse is None else 'it has none'}"
            )
        per_rank = context.stride_per_key_per_rank
        inverse_keys = context.inverse_indices_keys
        out.append(
            KeyedJaggedTensor(
                list(context.keys),
                ids,
                weights=weights,
                lengths=lengths,
                stride=context.stride,
                stride_per_key_per_rank=None if per_rank is None else [list(s) for s in per_rank],
                inverse_indices=(
                    None
                    if inverse is None or inverse_keys is None
                    else (list(inverse_keys), inverse)
                ),
                allow_duplicate_keys=context.allow_duplicate_keys,
            )
        )
    return out


# ---- conversions as modules -----------------------------------------------------------------


class ComputeKJTToJTDict(torch.nn.Module):
    """A module whose forward is ``keyed_jagged_tensor.to_dict()``: key -> JaggedTensor."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Key -> JaggedTensor (views of the input's tensors)."""
        if not isinstance(keyed_jagged_tensor, KeyedJaggedTensor):
            raise TypeError(
                "ComputeKJTToJTDict: expected a KeyedJaggedTensor, got "
                f"{type(keyed_jagged_tensor).__name__}"
            )
        return keyed_jagged_tensor.to_dict()


class ComputeJTDictToKJT(torch.nn.Module):
    """A module whose forward is ``KeyedJaggedTensor.from_jt_dict(jt_dict)``."""

    def forward(self, jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """One KeyedJaggedTensor with the dict's keys in order (validated; see ``from_jt_dict``)."""
        if not isinstance(jt_dict, dict):
            raise TypeError(
                f"ComputeJTDictToKJT: expected a dict of JaggedTensors, got {type(jt_dict).__name__}"
            )
        for key, jt in jt_dict.items():
            if not isinstance(jt, JaggedTensor):
                raise TypeError(
                    f"ComputeJTDictToKJT: jt_dict[{key!r}] is a {type(jt).__name__}, not a "
                    "JaggedTensor"
                )
        return KeyedJaggedTensor.from_jt_dict(jt_dict)
