"""Per-table plan helpers with TorchRec's names (``torchrec.distributed.sharding_plan``).

``construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0), "t1": row_wise()})`` builds an
``EmbeddingModuleShardingPlan``. Each helper returns a generator ``(param, local_size,
world_size, device_type, sharder) -> ParameterSharding``; shards are laid out by
:mod:`embshard_dist.strategies.layout` (as the planner lays them out), and the compute kernel
defaults to the first the sharder runs for the type (``fused``). Errors name the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.sharded.quant_embedding_bag import QuantEmbeddingBagCollectionSharder
from embshard_dist.strategies.layout import (
    column_wise_dims,
    column_wise_specs,
    row_wise_specs,
    shard_specs,
)
from embshard_dist.strategies.nodes import resolve_local_world_size
from embshard_types.interfaces import ModuleSharder
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = [
    "ParameterShardingGenerator",
    "get_module_to_default_sharders",
    "apply_to_all",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_default_sharders",
    "grid_shard",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
]

ParameterShardingGenerator = Callable[
    [nn.Parameter, int, int, str, ModuleSharder[Any]], ParameterSharding
]
"""``(param, local_size, world_size, device_type, sharder) -> ParameterSharding``."""

Kernel = ComputeKernel | str | None


def get_default_sharders() -> list[ModuleSharder[Any]]:
    """embshard's sharders for ``EmbeddingBagCollection``, ``EmbeddingCollection`` and
    (for inference) ``QuantEmbeddingBagCollection``.

    They run the optimizer the collections were built with (or that DistributedModelParallel
    gives them); TorchRec's list also holds managed-collision sharders, which embshard does not
    shard.
    """
    return [
        EmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(),
        QuantEmbeddingBagCollectionSharder(),
    ]


def get_module_to_default_sharders() -> dict[type[nn.Module], ModuleSharder[Any]]:
    """Each default sharder (:func:`get_default_sharders`) by the module type it shards."""
    return {sharder.module_type: sharder for sharder in get_default_sharders()}


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Mapping[str, ParameterShardingGenerator],
    sharder: ModuleSharder[Any] | None = None,
    local_size: int | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
) -> EmbeddingModuleShardingPlan:
    """The plan of one module from a generator per table.

    Args:
        per_param_sharding: table name -> generator (``table_wise(rank=0)``, ``row_wise()``...),
            one for every table of the module.
        sharder: default: the default sharder of the module's type.
        local_size: ranks per node (default: ``LOCAL_WORLD_SIZE``, else ``world_size``).
        world_size: default: that of ``torch.distributed``'s default group.
        device_type: default: ``"cuda"`` if a GPU is visible, else ``"cpu"``.

    Raises:
        ValueError: no sharder for the module, tables missing or unknown, no world size, or a
            layout that does not fit a table (naming it).
    """
    if sharder is None:
        sharder = next((s for s in get_default_sharders() if type(module) is s.module_type), None)
        if sharder is None:
            raise ValueError(
                f"no default sharder shards {type(module).__name__}; pass sharder=... for it"
            )
    elif not isinstance(module, sharder.module_type):
        raise ValueError(
            f"{type(sharder).__name__} shards {sharder.module_type.__name__} modules, not "
            f"{type(module).__name__}"
        )
    params = sharder.shardable_parameters(module)
    missing = [t for t in params if t not in per_param_sharding]
    unknown = [t for t in per_param_sharding if t not in params]
    if missing or unknown:
        raise ValueError(
            f"per_param_sharding must name every table of the {type(module).__name__} once: "
            f"missing {missing}, unknown {unknown} (its tables are {list(params)})"
        )
    if world_size is None:
        if not dist.is_initialized():
            raise ValueError(
                "construct_module_sharding_plan: torch.distributed is not initialised; pass "
                "world_size (and local_size for node-aware types)"
            )
        world_size = dist.get_world_size()
    local = resolve_local_world_size(world_size, local_size)
    device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    plan: dict[str, ParameterSharding] = {}
    for table, generator in per_param_sharding.items():
        try:
            plan[table] = generator(params[table], local, world_size, device, sharder)
        except ValueError as e:
            message = str(e)
            raise ValueError(
                message if f"{table!r}" in message else f"table {table!r}: {message}"
            ) from None
    return EmbeddingModuleShardingPlan(plan)


def apply_to_all(
    module: nn.Module,
    parameter_sharding_generator: ParameterShardingGenerator,
    sharder: ModuleSharder[Any] | None = None,
) -> dict[str, ParameterShardingGenerator]:
    """The same generator for every table of ``module`` (for :func:`construct_module_sharding_plan`)."""
    if sharder is None:
        sharder = next((s for s in get_default_sharders() if type(module) is s.module_type), None)
        if sharder is None:
            raise ValueError(
                f"no default sharder shards {type(module).__name__}; pass sharder=... for it"
            )
    return {name: parameter_sharding_generator for name in sharder.shardable_parameters(module)}


def data_parallel(compute_kernel: Kernel = None) -> ParameterShardingGenerator:
    """The table replicated on every rank (gradients all-reduced)."""

    def generate(
        param: nn.Parameter,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder[Any],
    ) -> ParameterSharding:
        kind = ShardingType.DATA_PARALLEL
        kernel = _kernel(compute_kernel, sharder, kind, device_type)
        return ParameterSharding(kind, kernel, tuple(range(world_size)), None)

    return generate


def table_wise(
    rank: int, device: str | None = None, compute_kernel: Kernel = None
) -> ParameterShardingGenerator:
    """The whole table on ``rank``.

    Args:
        device: the shard's device type (default: the plan's ``device_type``).
    """

    def ranks(param: nn.Parameter, local_size: int, world_size: int) -> list[int]:
        _check_rank(rank, world_size, "table_wise(rank=...)")
        return [rank]

    return _laid_out(ShardingType.TABLE_WISE, ranks, compute_kernel, device)


def row_wise(
    sizes_placement: tuple[Sequence[int], str] | None = None, compute_kernel: Kernel = None
) -> ParameterShardingGenerator:
    """One row block per rank, block ``r`` on rank ``r``.

    Args:
        sizes_placement: ``(rows of each rank's block, device type)`` for uneven blocks
            (default: ``ceil(rows / world_size)`` rows per block).
    """

    def generate(
        param: nn.Parameter,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder[Any],
    ) -> ParameterSharding:
        kind = ShardingType.ROW_WISE
        ranks = list(range(world_size))
        if sizes_placement is None:
            return _sharding(
                kind, param, ranks, device_type, device_type, sharder, compute_kernel, local_size
            )
        sizes, device = sizes_placement
        rows, dim = _shape(param)
        specs = row_wise_specs(rows, dim, ranks, device, sizes=sizes)
        kernel = _kernel(compute_kernel, sharder, kind, device_type)
        return ParameterSharding(kind, kernel, tuple(ranks), tuple(specs))

    return generate


def column_wise(
    ranks: Sequence[int] | None = None,
    size_per_rank: Sequence[int] | None = None,
    compute_kernel: Kernel = None,
) -> ParameterShardingGenerator:
    """Column blocks, block ``i`` on ``ranks[i]``.

    Args:
        ranks: one rank per block; widths as even as multiples of 4 allow.
        size_per_rank: the width of each block instead (block ``i`` on ``ranks[i]``, or on
            rank ``i`` without ``ranks``).

    Raises:
        ValueError: neither given, or they disagree in length.
    """
    if ranks is None and size_per_rank is None:
        raise ValueError("column_wise needs ranks=[...] (one per column block) or size_per_rank")

    def generate(
        param: nn.Parameter,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder[Any],
    ) -> ParameterSharding:
        kind = ShardingType.COLUMN_WISE
        placed = list(ranks) if ranks is not None else list(range(len(size_per_rank or ())))
        for r in placed:
            _check_rank(r, world_size, "column_wise(ranks=...)")
        rows, dim = _shape(param)
        widths = column_wise_dims(dim, len(placed), shard_dims=size_per_rank)
        specs = column_wise_specs(rows, dim, placed, device_type, shard_dims=widths)
        kernel = _kernel(compute_kernel, sharder, kind, device_type)
        return ParameterSharding(kind, kernel, tuple(placed), tuple(specs))

    return generate


def table_row_wise(host_index: int, compute_kernel: Kernel = None) -> ParameterShardingGenerator:
    """Row blocks on the ranks of node ``host_index``, one per rank of the node."""

    def ranks(param: nn.Parameter, local_size: int, world_size: int) -> list[int]:
        return _node_ranks(host_index, local_size, world_size, "table_row_wise")

    return _laid_out(ShardingType.TABLE_ROW_WISE, ranks, compute_kernel)


def table_column_wise(
    host_index: int, num_shards: int | None = None, compute_kernel: Kernel = None
) -> ParameterShardingGenerator:
    """Column blocks on the first ``num_shards`` ranks of node ``host_index``.

    Args:
        num_shards: default: one block per rank of the node, at most ``embedding_dim // 4``.
    """

    def ranks(param: nn.Parameter, local_size: int, world_size: int) -> list[int]:
        node = _node_ranks(host_index, local_size, world_size, "table_column_wise")
        _, dim = _shape(param)
        count = num_shards or len(column_wise_dims(dim, world_size=local_size))
        if count > local_size:
            raise ValueError(
                f"table_column_wise: {count} column blocks do not fit the {local_size} ranks "
                "of a node; use at most one block per rank"
            )
        return node[:count]

    return _laid_out(ShardingType.TABLE_COLUMN_WISE, ranks, compute_kernel)


def grid_shard(
    host_indexes: Sequence[int], compute_kernel: Kernel = None
) -> ParameterShardingGenerator:
    """One column block per node of ``host_indexes``, each cut row-wise over its node's ranks."""
    hosts = list(host_indexes)
    if not hosts:
        raise ValueError("grid_shard needs host_indexes=[...] (one node per column block)")

    def ranks(param: nn.Parameter, local_size: int, world_size: int) -> list[int]:
        return [r for h in hosts for r in _node_ranks(h, local_size, world_size, "grid_shard")]

    return _laid_out(ShardingType.GRID_SHARD, ranks, compute_kernel)


def _laid_out(
    kind: ShardingType,
    ranks_of: Callable[[nn.Parameter, int, int], list[int]],
    compute_kernel: Kernel,
    device: str | None = None,
) -> ParameterShardingGenerator:
    """The generator of a ``kind`` sharding over the ranks ``ranks_of(param, local_size,
    world_size)`` names, laid out as the strategies lay it out."""

    def generate(
        param: nn.Parameter,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder[Any],
    ) -> ParameterSharding:
        ranks = ranks_of(param, local_size, world_size)
        return _sharding(
            kind, param, ranks, device or device_type, device_type, sharder, compute_kernel,
            local_size,
        )  # fmt: skip

    return generate


def _sharding(
    kind: ShardingType,
    param: nn.Parameter,
    ranks: list[int],
    device: str,
    device_type: str,
    sharder: ModuleSharder[Any],
    compute_kernel: Kernel,
    local_size: int,
) -> ParameterSharding:
    rows, dim = _shape(param)
    specs = shard_specs(kind, rows, dim, ranks, device, local_world_size=local_size)
    assert specs is not None
    kernel = _kernel(compute_kernel, sharder, kind, device_type)
    return ParameterSharding(kind, kernel, tuple(ranks), tuple(specs))


def _kernel(
    given: Kernel, sharder: ModuleSharder[Any], kind: ShardingType, device_type: str
) -> ComputeKernel:
    if given is not None:
        return ComputeKernel.parse(given, what="compute_kernel")
    offered = getattr(sharder, "compute_kernels", None)
    kernels = list(offered(kind, device_type)) if callable(offered) else []
    if not kernels:
        return ComputeKernel.FUSED
    return ComputeKernel.parse(kernels[0], what="compute_kernel")


def _shape(param: nn.Parameter) -> tuple[int, int]:
    if param.dim() != 2:
        raise ValueError(f"a table must be 2-D, got a parameter of shape {tuple(param.shape)}")
    return int(param.shape[0]), int(param.shape[1])


def _check_rank(rank: int, world_size: int, what: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank {rank!r} is not a rank of the {world_size}-rank world")


def _node_ranks(host: int, local_size: int, world_size: int, what: str) -> list[int]:
    nodes = world_size // local_size
    if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < nodes:
        raise ValueError(
            f"{what}: host index {host!r} is not a node of the world ({nodes} nodes of "
            f"{local_size} ranks); pass local_size (ranks per node) if it is not "
            f"{local_size}"
        )
    return list(range(host * local_size, (host + 1) * local_size))
