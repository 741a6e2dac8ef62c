"""Where one shard of a tensor lives: its offsets, its sizes and its placement.

This is embshard's own, import-cheap counterpart of ``torch.distributed``'s ``ShardMetadata``
(importing that costs ~0.4 s). Guarantees: frozen, hashable, validated at construction, and an
exact round trip through ``to_dict`` / ``from_dict``; ``to_torch()`` converts on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed._shard.metadata import ShardMetadata


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a 2-D (or N-D) tensor.

    Args:
        offsets: index of the shard's first element along each dimension.
        sizes: the shard's extent along each dimension.
        placement: ``"rank:R/DEVICE"``, e.g. ``"rank:1/cuda:1"`` or ``"rank:0/cpu"``.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    placement: str

    def __post_init__(self) -> None:
        offsets = tuple(int(x) for x in self.offsets)
        sizes = tuple(int(x) for x in self.sizes)
        if len(offsets) != len(sizes):
            raise ValueError(f"shard offsets {offsets} and sizes {sizes} have different lengths")
        if any(x < 0 for x in offsets) or any(x < 0 for x in sizes):
            raise ValueError(f"shard offsets {offsets} and sizes {sizes} must be non-negative")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)
        self.rank  # noqa: B018 - validates the placement string

    @property
    def rank(self) -> int:
        """The rank that holds the shard."""
        head = self.placement.split("/", 1)[0]
        if not head.startswith("rank:") or not head[5:].isdigit():
            raise ValueError(f"shard placement {self.placement!r} is not of the form 'rank:R/DEVICE'")
        return int(head[5:])

    @property
    def device(self) -> str:
        """The device string of the placement (``cpu``, ``cuda:1``...)."""
        parts = self.placement.split("/", 1)
        return parts[1] if len(parts) == 2 else "cpu"

    @classmethod
    def on(cls, rank: int, device: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ShardSpec:
        """Build a spec placed on ``rank`` and ``device`` (``cpu``, ``cuda``, ``cuda:3``)."""
        if device == "cuda":
            device = f"cuda:{rank}"
        return cls(offsets=offsets, sizes=sizes, placement=f"rank:{rank}/{device}")

    def to_dict(self) -> dict[str, Any]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes), "placement": self.placement}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardSpec:
        try:
            return cls(tuple(data["offsets"]), tuple(data["sizes"]), str(data["placement"]))
        except KeyError as e:
            raise ValueError(f"shard spec {data!r} lacks field {e.args[0]!r}") from None

    def to_torch(self) -> ShardMetadata:
        """The equivalent ``torch.distributed._shard.metadata.ShardMetadata`` (imported lazily)."""
        from torch.distributed._shard.metadata import ShardMetadata

        return ShardMetadata(
            shard_offsets=list(self.offsets), shard_sizes=list(self.sizes), placement=self.placement
        )

    @classmethod
    def from_torch(cls, md: ShardMetadata) -> ShardSpec:
        return cls(tuple(md.shard_offsets), tuple(md.shard_sizes), str(md.placement))
