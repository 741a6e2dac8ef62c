"""JaggedTensor, KeyedJaggedTensor and KeyedTensor as pytree nodes (torch.export, torch.compile).

The leaves are tensors only; the context holds the keys and the structure (which optional
tensors exist, per-rank batch sizes, per-key widths), so ``torch.export`` accepts the types as
inputs and outputs, and ``torch.export.save`` / ``load`` round-trip them (the context is JSON).
A jagged type flattens to its canonical tensors, ``values``, ``weights`` (when it has them) and
``lengths``: whether offsets were given or cached never changes the tree structure.
:func:`register_sparse_pytrees` is idempotent; importing ``embshard_types.sparse`` calls it. It
also allows the three types in ``torch.load(weights_only=True)``, which ``torch.export.load``
uses for a saved program's example inputs (they hold only tensors, ints, strings and lists).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch.serialization
import torch.utils._pytree as pytree
from torch import Tensor

from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor

__all__ = ["register_sparse_pytrees"]

_JAGGED_FIELDS = ("values", "weights", "lengths")

JTContext = bool  # whether there are weights
KJTContext = tuple[tuple[str, ...], tuple[tuple[int, ...], ...] | None, int | None, bool, bool]
KTContext = tuple[tuple[str, ...], tuple[int, ...], int]


# ---- JaggedTensor ---------------------------------------------------------------------------


def _jt_flatten(jt: JaggedTensor) -> tuple[list[Tensor], JTContext]:
    weights = jt.weights_or_none()
    return _children(jt.values(), weights, jt.lengths()), weights is not None


def _jt_flatten_with_keys(jt: JaggedTensor) -> tuple[list[tuple[Any, Tensor]], JTContext]:
    children, weighted = _jt_flatten(jt)
    return _with_keys(children, weighted), weighted


def _jt_unflatten(children: Iterable[Any], context: JTContext) -> JaggedTensor:
    values, weights, lengths = _split(children, context, "JaggedTensor")
    return JaggedTensor(values, weights=weights, lengths=lengths)


def _jt_to_json(context: JTContext) -> str:
    return json.dumps({"weighted": bool(context)})


def _jt_from_json(text: str) -> JTContext:
    return bool(_load(text, "JaggedTensor", ("weighted",))["weighted"])


# ---- KeyedJaggedTensor ----------------------------------------------------------------------


def _kjt_context(kjt: KeyedJaggedTensor) -> KJTContext:
    keys = tuple(kjt.keys())
    per_rank = (
        tuple(tuple(s) for s in kjt.stride_per_key_per_rank())
        if kjt.variable_stride_per_key()
        else None
    )
    # The stride follows from the lengths and the key count, except when there are no keys.
    stride = kjt.stride() if not keys else None
    weighted = kjt.weights_or_none() is not None
    return keys, per_rank, stride, len(set(keys)) < len(keys), weighted


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[list[Tensor], KJTContext]:
    return _children(kjt.values(), kjt.weights_or_none(), kjt.lengths()), _kjt_context(kjt)


def _kjt_flatten_with_keys(
    kjt: KeyedJaggedTensor,
) -> tuple[list[tuple[Any, Tensor]], KJTContext]:
    children, context = _kjt_flatten(kjt)
    return _with_keys(children, context[4]), context


def _kjt_unflatten(children: Iterable[Any], context: KJTContext) -> KeyedJaggedTensor:
    values, weights, lengths = _split(children, context[4], "KeyedJaggedTensor")
    keys, per_rank, stride, duplicates, _ = context
    return KeyedJaggedTensor(
        list(keys),
        values,
        weights=weights,
        lengths=lengths,
        stride=stride,
        stride_per_key_per_rank=None if per_rank is None else [list(s) for s in per_rank],
        allow_duplicate_keys=duplicates,
    )


def _kjt_to_json(context: KJTContext) -> str:
    keys, per_rank, stride, duplicates, weighted = context
    return json.dumps(
        {
            "keys": list(keys),
            "stride_per_key_per_rank": None if per_rank is None else [list(s) for s in per_rank],
            "stride": stride,
            "allow_duplicate_keys": duplicates,
            "weighted": weighted,
        }
    )


def _kjt_from_json(text: str) -> KJTContext:
    data = _load(
        text, "KeyedJaggedTensor", ("keys", "stride_per_key_per_rank", "stride", "weighted")
    )
    per_rank = data["stride_per_key_per_rank"]
    return (
        tuple(data["keys"]),
        None if per_rank is None else tuple(tuple(s) for s in per_rank),
        data["stride"],
        bool(data.get("allow_duplicate_keys", False)),
        bool(data["weighted"]),
    )


# ---- KeyedTensor ----------------------------------------------------------------------------


def _kt_context(kt: KeyedTensor) -> KTContext:
    return tuple(kt.keys()), tuple(kt.length_per_key()), kt.key_dim()


def _kt_flatten(kt: KeyedTensor) -> tuple[list[Tensor], KTContext]:
    return [kt.values()], _kt_context(kt)


def _kt_flatten_with_keys(kt: KeyedTensor) -> tuple[list[tuple[Any, Tensor]], KTContext]:
    return [(pytree.GetAttrKey("values"), kt.values())], _kt_context(kt)


def _kt_unflatten(children: Iterable[Any], context: KTContext) -> KeyedTensor:
    (values,) = list(children)
    keys, length_per_key, key_dim = context
    return KeyedTensor(list(keys), list(length_per_key), values, key_dim=key_dim)


def _kt_to_json(context: KTContext) -> str:
    keys, length_per_key, key_dim = context
    return json.dumps(
        {"keys": list(keys), "length_per_key": list(length_per_key), "key_dim": key_dim}
    )


def _kt_from_json(text: str) -> KTContext:
    data = _load(text, "KeyedTensor", ("keys", "length_per_key", "key_dim"))
    return tuple(data["keys"]), tuple(int(n) for n in data["length_per_key"]), int(data["key_dim"])


# ---- shared ---------------------------------------------------------------------------------


def _children(values: Tensor, weights: Tensor | None, lengths: Tensor) -> list[Tensor]:
    return [values, lengths] if weights is None else [values, weights, lengths]


def _with_keys(children: list[Tensor], weighted: bool) -> list[tuple[Any, Tensor]]:
    names = _JAGGED_FIELDS if weighted else ("values", "lengths")
    return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children, strict=True)]


def _split(children: Iterable[Any], weighted: bool, owner: str) -> tuple[Any, Any, Any]:
    items = list(children)
    expected = 3 if weighted else 2
    if len(items) != expected:
        raise ValueError(
            f"{owner} unflatten: expected {expected} children (values, "
            f"{'weights, ' if weighted else ''}lengths), got {len(items)}; the tree spec does not "
            "belong to this type"
        )
    if weighted:
        return items[0], items[1], items[2]
    return items[0], None, items[1]


def _load(text: str, owner: str, required: tuple[str, ...]) -> dict[str, Any]:
    data = json.loads(text)
    missing = [k for k in required if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(
            f"{owner} pytree context {text!r} lacks {missing}; it was not written by "
            "embshard_types.sparse.pytree (re-export the program with this version)"
        )
    return dict(data)


def register_sparse_pytrees() -> None:
    """Register the three sparse types with ``torch.utils._pytree`` (once; later calls no-op)."""
    if JaggedTensor in pytree.SUPPORTED_NODES:
        return
    torch.serialization.add_safe_globals([JaggedTensor, KeyedJaggedTensor, KeyedTensor])
    pytree.register_pytree_node(
        JaggedTensor,
        _jt_flatten,
        _jt_unflatten,
        serialized_type_name="embshard_types.sparse.JaggedTensor",
        to_dumpable_context=_jt_to_json,
        from_dumpable_context=_jt_from_json,
        flatten_with_keys_fn=_jt_flatten_with_keys,
    )
    pytree.register_pytree_node(
        KeyedJaggedTensor,
        _kjt_flatten,
        _kjt_unflatten,
        serialized_type_name="embshard_types.sparse.KeyedJaggedTensor",
        to_dumpable_context=_kjt_to_json,
        from_dumpable_context=_kjt_from_json,
        flatten_with_keys_fn=_kjt_flatten_with_keys,
    )
    pytree.register_pytree_node(
        KeyedTensor,
        _kt_flatten,
        _kt_unflatten,
        serialized_type_name="embshard_types.sparse.KeyedTensor",
        to_dumpable_context=_kt_to_json,
        from_dumpable_context=_kt_from_json,
        flatten_with_keys_fn=_kt_flatten_with_keys,
    )
