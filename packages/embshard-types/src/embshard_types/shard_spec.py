"""Where one shard of a tensor lives: its offsets, its sizes and its placement.

embshard's import-cheap counterpart of torch's ``ShardMetadata``: frozen, hashable, validated at
construction, exact round trip through ``to_dict`` / ``from_dict``; ``to_torch()`` converts.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed._shard.metadata import ShardMetadata

_PLACEMENT = re.compile(r"rank:([0-9]+)(?:/(.+))?", re.ASCII)


def _ints(values: Any, what: str) -> tuple[int, ...]:
    """Convert ``values`` to a tuple of ints, refusing floats, bools and strings."""
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise TypeError(f"shard {what} must be a sequence of ints, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool):
            raise TypeError(f"shard {what} must be ints, got {values!r}")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(f"shard {what} must be ints, got {values!r}") from None
    return tuple(out)


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a 2-D (or N-D) tensor.

    Args:
        placement: ``"rank:R/DEVICE"``, e.g. ``"rank:1/cuda:1"`` or ``"rank:0/cpu"``.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    placement: str

    def __post_init__(self) -> None:
        offsets = _ints(self.offsets, "offsets")
        sizes = _ints(self.sizes, "sizes")
        if len(offsets) != len(sizes):
            raise ValueError(f"shard offsets {offsets} and sizes {sizes} have different lengths")
        if any(x < 0 for x in offsets) or any(x < 0 for x in sizes):
            raise ValueError(f"shard offsets {offsets} and sizes {sizes} must be non-negative")
        if not isinstance(self.placement, str) or _PLACEMENT.fullmatch(self.placement) is None:
            raise ValueError(
                f"shard placement {self.placement!r} is not of the form 'rank:R/DEVICE' "
                "(e.g. 'rank:0/cpu' or 'rank:1/cuda:1')"
            )
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)

    @property
    def rank(self) -> int:
        """The rank that holds the shard."""
        match = _PLACEMENT.fullmatch(self.placement)
        assert match is not None  # checked at construction
        return int(match.group(1))

    @property
    def device(self) -> str:
        """The device string of the placement (``cpu``, ``cuda:1``...); ``cpu`` if none is named."""
        match = _PLACEMENT.fullmatch(self.placement)
        assert match is not None  # checked at construction
        return match.group(2) or "cpu"

    @classmethod
    def on(
        cls, rank: int, device: str, offsets: tuple[int, ...], sizes: tuple[int, ...]
    ) -> ShardSpec:
        """Build a spec placed on ``rank`` and ``device`` (bare ``"cuda"`` means ``cuda:RANK``)."""
        if device != "cpu" and ":" not in device:
            device = f"{device}:{rank}"
        return cls(offsets=offsets, sizes=sizes, placement=f"rank:{rank}/{device}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"offsets": [...], "sizes": [...], "placement": "..."}``."""
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "placement": self.placement,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardSpec:
        """Inverse of ``to_dict``; ``ValueError`` for a missing, unknown or invalid field."""
        if not isinstance(data, Mapping):
            raise TypeError(f"shard spec must be a mapping, got {data!r}")
        unknown = sorted(set(data) - {"offsets", "sizes", "placement"})
        if unknown:
            raise ValueError(f"shard spec {dict(data)!r} has unknown field(s) {unknown}")
        try:
            return cls(tuple(data["offsets"]), tuple(data["sizes"]), data["placement"])
        except KeyError as e:
            raise ValueError(f"shard spec {dict(data)!r} lacks field {e.args[0]!r}") from None

    def to_torch(self) -> ShardMetadata:
        """The equivalent ``torch.distributed._shard.metadata.ShardMetadata`` (imported lazily)."""
        from torch.distributed._shard.metadata import ShardMetadata

        return ShardMetadata(
            shard_offsets=list(self.offsets), shard_sizes=list(self.sizes), placement=self.placement
        )

    @classmethod
    def from_torch(cls, md: ShardMetadata) -> ShardSpec:
        """Build a spec from a torch ``ShardMetadata``."""
        return cls(tuple(md.shard_offsets), tuple(md.shard_sizes), str(md.placement))
