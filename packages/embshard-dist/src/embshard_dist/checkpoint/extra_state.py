"""The job's own state in a checkpoint: ``Stateful`` objects saved and restored per rank.

A data loader's position, an LR scheduler or metrics go into the same atomic save as the model,
in ``extra/rank-RRRRR.pt`` (their ``state_dict()``s by name, ``torch.save``'d, checksummed like
every file): each rank keeps its own copy, because such state usually differs per rank (each
rank's loader is at its own position). A load reads it with ``weights_only=True`` (tensors,
numbers, strings, containers) and hands each object its state only after every value was read,
so a failed load leaves the objects untouched.

Guarantees: names and objects are checked before anything is written or read; the state of a
checkpoint saved by N ranks loads only into N ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from embshard_dist.checkpoint.format import CheckpointMetadata

__all__ = [
    "capture_extra_state",
    "check_extra_state",
    "check_loadable",
    "extra_file",
    "read_extra_state",
    "restore_extra_state",
    "write_extra_state",
]


def extra_file(rank: int) -> str:
    """The file (relative to the checkpoint) holding rank ``rank``'s extra state."""
    return f"extra/rank-{rank:05d}.pt"


def check_extra_state(extra: Mapping[str, Any], *, what: str) -> list[str]:
    """Problems with an ``extra_state=`` argument (names, objects); empty when fine."""
    if not isinstance(extra, Mapping):
        return [f"{what}: extra_state must be a dict of name -> Stateful, got {type(extra)}"]
    problems = []
    for name, obj in extra.items():
        if not isinstance(name, str) or not name or "/" in name:
            problems.append(
                f"{what}: extra_state name {name!r} must be a non-empty string without '/'"
            )
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                problems.append(
                    f"{what}: extra_state {name!r} ({type(obj).__name__}) has no {method}(); "
                    "pass Stateful objects (with state_dict() and load_state_dict())"
                )
    return problems


def capture_extra_state(extra: Mapping[str, Stateful], *, stage: bool) -> dict[str, Any]:
    """Each object's ``state_dict()`` by name (``stage``: copies, for a background save)."""
    states = {name: obj.state_dict() for name, obj in extra.items()}
    return copy.deepcopy(states) if stage else states


def write_extra_state(states: Mapping[str, Any], path: Path) -> None:
    """``torch.save`` the captured states to ``path`` (a file of the temporary checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(states), path)


def check_loadable(
    extra: Mapping[str, Any], metadata: CheckpointMetadata, world_size: int
) -> list[str]:
    """Problems loading ``extra`` from a checkpoint: names it lacks, another world size."""
    problems = check_extra_state(extra, what="load")
    missing = sorted(set(extra) - set(metadata.extra_state))
    if missing:
        problems.append(
            f"extra state {missing} is not in the checkpoint (it holds "
            f"{sorted(metadata.extra_state) or 'none'}); save it with extra_state= or leave it "
            "out of the load"
        )
    if extra and metadata.world_size != world_size:
        problems.append(
            f"extra state is kept per rank and the checkpoint was saved by "
            f"{metadata.world_size} ranks, not {world_size}; load it with "
            f"{metadata.world_size} ranks, or without extra_state="
        )
    return problems


def read_extra_state(path: Path, names: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The states ``names`` from ``path``, or the problem reading them (nothing restored yet)."""
    try:
        states = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # a damaged or foreign file raises anything
        return {}, [f"cannot read the extra state in {str(path)!r}: {type(e).__name__}: {e}"]
    missing = [n for n in names if n not in states]
    if missing:
        return {}, [f"{str(path)!r} holds no extra state {missing}"]
    return {n: states[n] for n in names}, []


def restore_extra_state(extra: Mapping[str, Stateful], states: Mapping[str, Any]) -> None:
    """Hand each object its saved state."""
    for name, obj in extra.items():
        obj.load_state_dict(states[name])
