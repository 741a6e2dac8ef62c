"""Source weights: the same on every rank, and the dense rest materialised on the device.

:func:`check_same_source_weights` compares exact integer checksums of the tensors' bits (equal
tensors give equal checksums whatever the thread count) with one all-gather; sharded
sub-modules are left alone by :func:`materialize_dense` and :func:`move_dense`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from embshard_dist.comm.collectives import all_gather_ints

__all__ = ["check_same_source_weights", "materialize_dense", "move_dense", "tensor_checksum"]

_CHUNK = 1 << 20
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_POSITION_MOD = 65521


def tensor_checksum(t: Tensor) -> tuple[int, int]:
    """Two exact checksums of ``t``'s bits: their sum and a position-weighted sum (mod 2**64)."""
    flat = t.detach().contiguous().reshape(-1)
    int_type = _INT_OF_SIZE.get(flat.element_size())
    if int_type is None:
        raise ValueError(f"cannot checksum a tensor of dtype {flat.dtype}")
    bits = flat.view(int_type)
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=flat.device) % _POSITION_MOD + 1
        plain += chunk.sum()
        weighted += (chunk * pos).sum()
    return int(plain), int(weighted)


def check_same_source_weights(
    modules: Mapping[str, nn.Module],
    group: Any = None,
    *,
    table_of: Callable[[str, str], str | None] | None = None,
) -> None:
    """Raise on every rank unless every rank holds the same tensors (or ``meta``) in ``modules``.

    Args:
        table_of: (module path, state-dict key) -> the table's name, for the message.

    Raises:
        ValueError: ranks disagree on the tensors, naming module, table and ranks.
        CollectiveError: a peer died or hung.
    """
    entries = [(path, key, t) for path, m in modules.items() for key, t in _tensors(m)]
    counts = [row[0] for row in all_gather_ints([len(entries)], group=group, name="dmp.weights")]
    if len(set(counts)) > 1:
        raise ValueError(
            f"the ranks' models hold different numbers of tensors in the modules to shard "
            f"({counts} by rank); give every rank the same model"
        )
    values: list[int] = []
    for _, _, t in entries:
        values.extend((1, 0, 0) if t.is_meta else (0, *tensor_checksum(t)))
    if not values:
        return
    by_rank = all_gather_ints(values, group=group, name="dmp.weights")
    for i, (path, key, _) in enumerate(entries):
        seen = [tuple(row[3 * i : 3 * i + 3]) for row in by_rank]
        if len(set(seen)) == 1:
            continue
        table = table_of(path, key) if table_of is not None else None
        what = f"table {table!r} ({key!r})" if table else repr(key)
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, value in enumerate(seen):
            groups.setdefault(value, []).append(rank)
        listed = "; ".join(
            f"ranks {ranks} {'on meta' if v[0] else f'checksum {v[1]:x}'}"
            for v, ranks in groups.items()
        )
        raise ValueError(
            f"module {path!r}: the ranks hold different source weights for {what} ({listed}). "
            "DistributedModelParallel copies each shard from the model it is given, so every "
            "rank must hold the same weights: seed the model identically on every rank, or "
            "load the same checkpoint, or build it on the meta device"
        )


def _tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor):
            yield key, value


def _dense_modules(model: nn.Module, sharded: set[str]) -> Iterator[nn.Module]:
    if "" in sharded:
        return
    for path, module in model.named_modules():
        if path in sharded or any(path.startswith(p + ".") for p in sharded):
            continue
        yield module


def materialize_dense(model: nn.Module, device: torch.device, sharded: set[str]) -> None:
    """Give every ``meta`` parameter / buffer outside ``sharded`` storage on ``device``.

    Their modules are re-initialised by ``reset_parameters()``; ranks may differ until DDP
    broadcasts rank 0's values.
    """
    for module in _dense_modules(model, sharded):
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not any(t.is_meta for t in own):
            continue
        module._apply(
            lambda t: torch.empty_like(t, device=device) if t.is_meta else t, recurse=False
        )
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def move_dense(model: nn.Module, device: torch.device, sharded: set[str]) -> None:
    """Move the parameters and buffers outside ``sharded`` to ``device`` (kept as they are);
    those still on ``meta`` stay there."""
    for module in _dense_modules(model, sharded):
        module._apply(lambda t: t if t.is_meta else t.to(device), recurse=False)
