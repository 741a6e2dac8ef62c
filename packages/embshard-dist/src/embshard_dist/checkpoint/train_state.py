"""What a checkpoint keeps besides tensors: generator states, hyperparameters, agreement.

Guarantees: hyperparameters round-trip through JSON with their types (tuples, scalar
tensors); :func:`agree` raises the same error on every rank when any rank failed a check, so a
refusal never leaves the others waiting in a collective.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from embshard_dist.comm.collectives import all_gather_v

__all__ = [
    "agree",
    "capture_rng",
    "from_json_value",
    "gather_json",
    "restore_rng",
    "to_json_value",
]


def capture_rng() -> dict[str, Any]:
    """This process's generator states: torch CPU, Python ``random``, CUDA when initialised."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(path: Path) -> None:
    """Restore the generator states saved by :func:`capture_rng` in ``path``."""
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def to_json_value(value: Any, *, what: str) -> Any:
    """``value`` in a JSON form :func:`from_json_value` turns back into the same types.

    Raises:
        ValueError: a value other than numbers, strings, booleans, ``None``, lists, tuples,
            string-keyed dicts and scalar tensors (``what`` names it).
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"tuple": [to_json_value(v, what=what) for v in value]}
    if isinstance(value, list):
        return [to_json_value(v, what=what) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: to_json_value(v, what=what) for k, v in value.items()}}
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    raise ValueError(
        f"{what}: cannot store a hyperparameter of type {type(value).__name__} in a "
        "checkpoint; use numbers, strings, tuples or scalar tensors"
    )


def from_json_value(value: Any) -> Any:
    """The inverse of :func:`to_json_value`."""
    if isinstance(value, list):
        return [from_json_value(v) for v in value]
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(from_json_value(v) for v in value["tuple"])
        if "dict" in value:
            return {k: from_json_value(v) for k, v in value["dict"].items()}
        if "tensor" in value:
            return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_json(value: Any, *, group: dist.ProcessGroup | None, name: str) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order."""
    data = json.dumps(value, sort_keys=True).encode()
    local = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_device(group))
    gathered = all_gather_v(local, group=group, name=name)
    return [json.loads(bytes(t.cpu().tolist()).decode()) for t in gathered]


def agree(problems: Sequence[str], *, group: dist.ProcessGroup | None, name: str) -> None:
    """Raise on every rank if any rank found ``problems`` (a collective: all ranks call it).

    Raises:
        ValueError: the problems of every rank that had some (same message on every rank).
    """
    by_rank = gather_json(list(problems), group=group, name=name)
    if not any(by_rank):
        return
    failed = [(rank, found) for rank, found in enumerate(by_rank) if found]
    if all(found == failed[0][1] for _, found in failed):
        lines = list(failed[0][1])
    else:
        lines = [f"(rank {rank}) {p}" for rank, found in failed for p in found]
    raise ValueError("\n  - ".join([f"{name}: refused", *lines]))
