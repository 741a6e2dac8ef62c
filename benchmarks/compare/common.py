"""What both contenders share: the step protocol, the loss, KJT inputs and weight loading, the
module that roots a collection, and how a spawned rank joins its group.

A contender is built on one rank of an initialised gloo group and exposes ``forward`` (pooled
outputs by feature, no gradient) and ``step`` (forward, backward with the optimizer fused in,
plus any optimizer step the library needs outside the backward). ``load_global_weights`` writes
the workload's initial weights into a sharded state dict in place, whatever the shard layout
(``ShardedTensor`` local shards, ``DTensor`` local tensors, or whole replicated tensors).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.compare.plans import Plan, Shard, TablePlan
from benchmarks.compare.workloads import Batch, Workload

LEARNING_RATE = 0.01
EPS = 1e-8


class Contender(Protocol):
    """One library's sharded model on this rank."""

    name: str

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """Pooled embeddings of ``batch`` by feature (no gradient)."""
        ...

    def step(self, batch: Batch) -> None:
        """One training step: forward, backward (optimizer fused in), any optimizer step."""
        ...

    def profile(self, batch: Batch) -> tuple[dict[str, float], dict[str, float]]:
        """One training step, phase by phase (see ``benchmarks.compare.profile``)."""
        ...


class Root(nn.Module):
    """Holds a collection as ``.ebc`` (the module path the plans name) and calls it."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: Any) -> Any:
        return self.ebc(kjt)


def join_group(rank: int, world: int, port: int, threads: int, local_size: int = 0) -> None:
    """Set the rank's launcher variables, its torch threads, and join the gloo group on
    ``127.0.0.1:port`` (``local_size``: ranks per node, 0 for one node)."""
    local = local_size or world
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local),
        LOCAL_WORLD_SIZE=str(local),
    )
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Unsupported(Exception):
    """The contender cannot run this plan; the message says what is missing."""


def loss_weights_in_order(
    weights: Mapping[str, Tensor], keys: list[str] | tuple[str, ...]
) -> Tensor:
    """The loss weights laid out as a library's output ``[b, sum dims]`` in its key order."""
    return torch.cat([weights[k] for k in keys], dim=1).contiguous()


def table_index(workload: Workload) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(workload.tables)}


def load_global_weights(
    state: Mapping[str, Any],
    workload: Workload,
    table_of_key: Callable[[str], str | None],
) -> set[str]:
    """Copy each table's initial weight into its local shards in ``state`` (in place).

    Args:
        state: a sharded model's ``state_dict()`` whose tensors are views of the live weights.
        workload: gives each table's full initial weight.
        table_of_key: state-dict key -> table name (``None``: not a table weight).

    Returns:
        The tables that were written.
    """
    index = table_index(workload)
    by_table: dict[str, list[Any]] = {}
    for key, value in state.items():
        table = table_of_key(key)
        if table is not None:
            by_table.setdefault(table, []).append(value)
    with torch.no_grad():
        for table, values in by_table.items():
            full = workload.initial_weight(index[table])
            for value in values:
                _copy_into(value, full, table)
            del full  # one full table at a time: the next draw must not find this one alive
    return set(by_table)


def _copy_into(value: Any, full: Tensor, table: str) -> None:
    if hasattr(value, "local_shards"):  # ShardedTensor
        for shard in value.local_shards():
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
        return
    if hasattr(value, "to_local") and hasattr(value, "placements"):  # DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = value.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        local.copy_(full[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]])
        return
    if tuple(value.shape) != tuple(full.shape):
        raise ValueError(
            f"table {table!r}: a replicated weight of shape {tuple(value.shape)} where the table "
            f"is {tuple(full.shape)}"
        )
    value.copy_(full)


def same_plan(side: str, table: str, want: TablePlan, got: TablePlan) -> None:
    """Raise unless a library's plan for ``table`` holds the neutral plan's shards."""

    def key(shards: tuple[Shard, ...] | None) -> list[Shard] | None:
        return (
            None
            if shards is None
            else sorted(shards, key=lambda s: (s.col_offset, s.row_offset, s.rank))
        )

    if want.sharding_type != got.sharding_type or key(want.shards) != key(got.shards):
        raise ValueError(
            f"{side}: table {table!r} was planned as {got} but the harness asked for {want}"
        )


def check_tables(plan: Plan, workload: Workload) -> None:
    names = [t.name for t in workload.tables]
    if list(plan) != names:
        raise ValueError(f"the plan covers tables {list(plan)}, the workload has {names}")
