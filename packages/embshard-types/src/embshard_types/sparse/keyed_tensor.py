"""KeyedTensor: dense per-key outputs (e.g. pooled embeddings) side by side in one tensor.

Key ``k`` owns ``length_per_key[k]`` entries of ``key_dim``; per-key views are slices. Checks run
at construction and never read tensor data. ``regroup`` gathers keys from several KeyedTensors
with one ``torch.cat`` per group and keeps autograd intact; the module functions ``regroup_kts``
and ``permute_multi_embedding`` are TorchRec's names for the same operation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from embshard_types.sparse._format import describe, preview
from embshard_types.sparse._ops import cumulative
from embshard_types.sparse._validation import check_keys, check_tensor

_OWNER = "KeyedTensor"
_MAX_KEYS_IN_MESSAGE = 32


class KeyedTensor:
    """Per-key dense blocks concatenated along one dimension.

    Args:
        length_per_key: the size of each key's block along ``key_dim``.

    Raises:
        ValueError: counts or sizes do not fit (the message names the key or the sizes).
    """

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: Tensor,
        key_dim: int = 1,
    ) -> None:
        key_list = check_keys(_OWNER, keys)
        check_tensor(values, "values", _OWNER)
        lengths = [int(n) for n in length_per_key]
        if len(lengths) != len(key_list):
            raise ValueError(
                f"{_OWNER}: {len(lengths)} entries in length_per_key for {len(key_list)} keys "
                f"{key_list}; give one length per key"
            )
        for key, n in zip(key_list, lengths, strict=True):
            if n < 0:
                raise ValueError(f"{_OWNER}: length_per_key for key {key!r} is negative ({n})")
        if not -values.dim() <= key_dim < values.dim():
            raise ValueError(
                f"{_OWNER}: key_dim {key_dim} is not a dimension of values with shape "
                f"{tuple(values.shape)}"
            )
        key_dim %= values.dim()
        if values.shape[key_dim] != sum(lengths):
            per_key = ", ".join(f"{k}: {n}" for k, n in zip(key_list, lengths, strict=True))
            raise ValueError(
                f"{_OWNER}: values has {values.shape[key_dim]} entries along key_dim {key_dim} "
                f"but length_per_key adds up to {sum(lengths)} ({per_key})"
            )
        self._keys = key_list
        self._length_per_key = lengths
        self._offset_per_key = cumulative(lengths)
        self._values = values
        self._key_dim = key_dim
        self._index_per_key = {key: i for i, key in enumerate(key_list)}
        self._tensor_dict: dict[str, Tensor] | None = None

    # ---- construction --------------------------------------------------------------------

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str], tensors: Sequence[Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """Build from one tensor per key, concatenated along ``cat_dim`` (normally ``key_dim``)."""
        if len(keys) != len(tensors) or not tensors:
            raise ValueError(
                f"{_OWNER}.from_tensor_list: got {len(keys)} keys and {len(tensors)} tensors; "
                "give one tensor per key (at least one)"
            )
        lengths = [t.shape[key_dim] for t in tensors]
        return KeyedTensor(keys, lengths, torch.cat(list(tensors), dim=cat_dim), key_dim=key_dim)

    # ---- accessors -----------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The keys, in block order."""
        return list(self._keys)

    def values(self) -> Tensor:
        """All blocks, concatenated along ``key_dim()``."""
        return self._values

    def key_dim(self) -> int:
        """The dimension the blocks are concatenated along (non-negative)."""
        return self._key_dim

    def length_per_key(self) -> list[int]:
        """The size of each key's block along ``key_dim()``."""
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Where each key's block starts along ``key_dim()``, plus the total."""
        return list(self._offset_per_key)

    def index_per_key(self) -> dict[str, int]:
        """Key -> its position in ``keys()``."""
        return dict(self._index_per_key)

    def device(self) -> torch.device:
        """The device of the values."""
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes held by the values (``numel * element_size``; views count their own part)."""
        return self._values.numel() * self._values.element_size()

    def __getitem__(self, key: str) -> Tensor:
        """The block of ``key`` (a view); KeyError listing the keys if absent."""
        index = self._index_per_key.get(key)
        if index is None:
            raise KeyError(f"key {key!r} is not in this {_OWNER}; its keys are {self._keys}")
        start = self._offset_per_key[index]
        return self._values.narrow(self._key_dim, start, self._length_per_key[index])

    def to_dict(self) -> dict[str, Tensor]:
        """Key -> block (views; built once and cached)."""
        if self._tensor_dict is None:
            blocks = torch.split(self._values, self._length_per_key, dim=self._key_dim)
            self._tensor_dict = dict(zip(self._keys, blocks, strict=True))
        return dict(self._tensor_dict)

    # ---- regrouping ----------------------------------------------------------------------

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[Tensor]:
        """Gather keys from several KeyedTensors into one tensor per group.

        Output ``i`` is the blocks of ``groups[i]``'s keys, in that order, concatenated along
        the shared ``key_dim``. A key may appear in several groups.

        Raises:
            ValueError: inputs that do not line up, a key held by two inputs, or a requested
                key that no input holds (the message names it).
        """
        return _regroup(keyed_tensors, groups, f"{_OWNER}.regroup")

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, Tensor]:
        """``regroup`` with output ``i`` stored under ``keys[i]`` (distinct, one per group)."""
        names = check_keys(f"{_OWNER}.regroup_as_dict", keys)
        if len(names) != len(groups):
            raise ValueError(
                f"{_OWNER}.regroup_as_dict: {len(names)} keys for {len(groups)} groups; give "
                "one key per group"
            )
        return dict(zip(names, KeyedTensor.regroup(keyed_tensors, groups), strict=True))

    # ---- devices and streams -------------------------------------------------------------

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        """Return a copy on ``device`` (no copy if the values are already there)."""
        values = self._values.to(device, non_blocking=non_blocking)
        return KeyedTensor(self._keys, self._length_per_key, values, key_dim=self._key_dim)

    def pin_memory(self) -> KeyedTensor:
        """Return a copy whose values are in page-locked host memory."""
        values = self._values.pin_memory()
        return KeyedTensor(self._keys, self._length_per_key, values, key_dim=self._key_dim)

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark the values as in use by ``stream`` (see ``Tensor.record_stream``)."""
        self._values.record_stream(stream)

    # ---- text ----------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"{_OWNER}(keys={self._keys}, length_per_key={self._length_per_key}, "
            f"key_dim={self._key_dim}, values={describe(self._values)})"
        )

    def __str__(self) -> str:
        lines = [repr(self)]
        for key, block in self.to_dict().items():
            lines.append(f"  {key!r}: {tuple(block.shape)} {preview(block.reshape(-1))}")
        return "\n".join(lines)


# ---- TorchRec's module-level names for regrouping ----------------------------------------


def regroup_kts(
    keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
) -> list[Tensor]:
    """Gather keys from several KeyedTensors into one tensor per group (``KeyedTensor.regroup``).

    Raises:
        ValueError: as ``KeyedTensor.regroup`` (the message names ``regroup_kts``).
    """
    return _regroup(keyed_tensors, groups, "regroup_kts")


def permute_multi_embedding(
    keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
) -> list[Tensor]:
    """Gather keys from several KeyedTensors into one tensor per group (``KeyedTensor.regroup``).

    TorchRec runs FBGEMM's multi-embedding permute kernel here; embshard slices and concatenates
    (one ``torch.cat`` per group), with the same outputs and gradients.

    Raises:
        ValueError: as ``KeyedTensor.regroup`` (the message names ``permute_multi_embedding``).
    """
    return _regroup(keyed_tensors, groups, "permute_multi_embedding")


def _regroup(
    keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]], owner: str
) -> list[Tensor]:
    """See ``KeyedTensor.regroup``; ``owner`` starts every error message."""
    if isinstance(keyed_tensors, KeyedTensor):
        raise TypeError(f"{owner}: got one KeyedTensor; give a list of KeyedTensors")
    if not keyed_tensors:
        raise ValueError(f"{owner}: keyed_tensors is empty; give at least one")
    for i, item in enumerate(keyed_tensors):
        if not isinstance(item, KeyedTensor):
            raise TypeError(
                f"{owner}: keyed_tensors[{i}] is a {type(item).__name__}, not a KeyedTensor; "
                "give a list of KeyedTensors"
            )
    where = _locate_keys(keyed_tensors, owner)
    key_dim = keyed_tensors[0].key_dim()
    out: list[Tensor] = []
    for g, group in enumerate(groups):
        if isinstance(group, str):
            raise TypeError(
                f"{owner}: groups[{g}] is the string {group!r}; give a list of keys per group"
            )
        pieces: list[tuple[int, int, int]] = []  # (input, start, stop), adjacent merged
        for key in group:
            found = where.get(key)
            if found is None:
                raise ValueError(
                    f"{owner}: key {key!r} in groups[{g}] is not in any of the "
                    f"keyed tensors; they hold {_key_listing(where)}"
                )
            kt, start, stop = found
            if pieces and pieces[-1][0] == kt and pieces[-1][2] == start:
                pieces[-1] = (kt, pieces[-1][1], stop)
            else:
                pieces.append((kt, start, stop))
        if not pieces:
            out.append(keyed_tensors[0].values().narrow(key_dim, 0, 0).clone())
            continue
        slices = [keyed_tensors[kt].values().narrow(key_dim, a, b - a) for kt, a, b in pieces]
        out.append(torch.cat(slices, dim=key_dim))
    return out


def _locate_keys(
    keyed_tensors: Sequence[KeyedTensor], owner: str
) -> dict[str, tuple[int, int, int]]:
    """Map every key to ``(input index, start, stop)``; check the inputs line up."""
    first = keyed_tensors[0]
    key_dim = first.key_dim()
    other_dims = _other_dims(first)
    where: dict[str, tuple[int, int, int]] = {}
    for i, kt in enumerate(keyed_tensors):
        if kt.key_dim() != key_dim or _other_dims(kt) != other_dims:
            raise ValueError(
                f"{owner}: keyed_tensors[{i}] has values {tuple(kt.values().shape)} "
                f"with key_dim {kt.key_dim()} but keyed_tensors[0] has "
                f"{tuple(first.values().shape)} with key_dim {key_dim}; they must match "
                "except along key_dim"
            )
        offsets = kt.offset_per_key()
        for k, key in enumerate(kt.keys()):
            if key in where:
                raise ValueError(
                    f"{owner}: key {key!r} is in keyed_tensors[{where[key][0]}] and "
                    f"keyed_tensors[{i}]; each key may come from one input only"
                )
            where[key] = (i, offsets[k], offsets[k + 1])
    return where


def _other_dims(kt: KeyedTensor) -> tuple[int, ...]:
    """The values' rank and sizes outside key_dim: what regroup's inputs must share."""
    shape = kt.values().shape
    return (len(shape), *(s for d, s in enumerate(shape) if d != kt.key_dim()))


def _key_listing(where: dict[str, tuple[int, int, int]]) -> str:
    keys = list(where)
    if len(keys) <= _MAX_KEYS_IN_MESSAGE:
        return str(keys)
    return f"{keys[:_MAX_KEYS_IN_MESSAGE]} and {len(keys) - _MAX_KEYS_IN_MESSAGE} more"
