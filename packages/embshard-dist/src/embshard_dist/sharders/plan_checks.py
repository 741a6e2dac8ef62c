"""Checks of an embedding-bag collection's plan, and the shard specs each table gets from it.

:func:`check_plan` runs before a sharded collection builds anything or talks to any rank, so
that a bad plan makes every rank raise the same ``ValueError`` (each message names the module
path and the table, says what is wrong and how to fix it) instead of leaving ranks waiting in a
collective. :func:`table_specs` turns a table's ``ParameterSharding`` into the shard specs the
strategies use: the plan's own ``shards`` when given, else the layout of
:mod:`embshard_dist.sharding.layout` for its ``ranks``.

What is checked, per table: the plan names exactly the collection's tables; the sharding type
and the compute kernel are supported (and the kernel runs on the device); every rank is in the
world; the shards tile the table; table-wise tables sit on one rank; row-wise tables have one
row block per rank, block ``r`` on rank ``r``; column-wise blocks span all rows, are at least
4 columns wide and multiples of 4, and no rank holds two blocks of one table; data-parallel
tables are replicated on every rank; fused kernels get local widths that are multiples of 4;
shards are placed on the compute device's type. Table-row-wise, table-column-wise and grid
layouts are checked against the nodes (``local_world_size`` ranks each) by
:mod:`embshard_dist.sharders.node_plan_checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from embshard_dist.sharders.node_plan_checks import NODE_AWARE, check_node_layout
from embshard_dist.sharding.layout import MIN_COLUMN_BLOCK, shard_specs
from embshard_dist.sharding.nodes import NodeTopology, resolve_local_world_size
from embshard_kernels.fbgemm_mapping import check_kernel_available, resolve_kernel
from embshard_optim.sharded_state import check_tiling
from embshard_types.configs import BaseEmbeddingConfig
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, ShardingType

_FUSED = (ComputeKernel.FUSED, ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)


def table_specs(
    config: BaseEmbeddingConfig,
    sharding: ParameterSharding,
    world_size: int,
    device_type: str,
    *,
    local_world_size: int | None = None,
) -> tuple[ShardSpec, ...] | None:
    """Every shard of ``config`` under ``sharding`` (``None`` for data-parallel).

    Args:
        config: the table.
        sharding: the plan's entry for it.
        world_size: ranks in the sharding group (row-wise tables default to all of them).
        device_type: device type for computed placements (``cpu``, ``cuda``).
        local_world_size: ranks per node (grid tables given by ranks; see
            :mod:`embshard_dist.sharding.nodes` for the default).

    Raises:
        ValueError: the ranks do not fit the sharding type (named with the table).
    """
    kind = sharding.sharding_type
    if kind is ShardingType.DATA_PARALLEL:
        return None
    if sharding.shards is not None:
        return tuple(sharding.shards)
    ranks = sharding.ranks
    if ranks is None:
        if kind is not ShardingType.ROW_WISE:
            raise ValueError(
                f"table {config.name!r}: a {kind.value} sharding needs ranks (or shards); "
                "give the rank of each shard"
            )
        ranks = tuple(range(world_size))
    specs = shard_specs(
        kind,
        config.num_embeddings,
        config.embedding_dim,
        list(ranks),
        device_type,
        local_world_size=(
            resolve_local_world_size(world_size, local_world_size)
            if kind is ShardingType.GRID_SHARD
            else None
        ),
        table_name=config.name,
    )
    assert specs is not None
    return tuple(specs)


def check_plan(
    configs: Sequence[BaseEmbeddingConfig],
    plan: object,
    world_size: int,
    device_type: str,
    *,
    path: str = "",
    sharding_types: Sequence[ShardingType],
    compute_kernels: Callable[[ShardingType], Sequence[ComputeKernel]],
    module_kind: str = "EmbeddingBagCollection",
    local_world_size: int | None = None,
) -> None:
    """Raise ``ValueError`` unless ``plan`` can shard the tables ``configs`` (see module doc).

    Args:
        configs: the collection's tables.
        plan: the module's plan (an ``EmbeddingModuleShardingPlan``).
        world_size: ranks in the sharding group.
        device_type: the compute device type (``cpu``, ``cuda``).
        path: the module's path in the model, for messages.
        sharding_types: the sharding types supported on the device.
        compute_kernels: the kernels supported for a sharding type on the device.
        module_kind: the collection's class name, for messages.
        local_world_size: ranks per node for the node-aware types (see
            :mod:`embshard_dist.sharding.nodes` for the default).

    Raises:
        TypeError: ``plan`` is not an ``EmbeddingModuleShardingPlan``.
        ValueError: the first problem found, naming the module and the table.
    """
    where = f"module {path!r}" if path else f"the {module_kind}"
    if not isinstance(plan, EmbeddingModuleShardingPlan):
        raise TypeError(
            f"{where}: expected an EmbeddingModuleShardingPlan, got {type(plan).__name__}"
        )
    names = [c.name for c in configs]
    unknown = [name for name in plan if name not in names]
    if unknown:
        raise ValueError(
            f"{where}: the plan names table {unknown[0]!r}, which the collection does not have; "
            f"its tables are {names}"
        )
    for config in configs:
        if config.name not in plan:
            raise ValueError(
                f"{where}: table {config.name!r} has no entry in the plan; give every table of "
                f"the collection a ParameterSharding (tables: {names})"
            )
        try:
            _check_table(
                config,
                plan[config.name],
                world_size,
                device_type,
                sharding_types,
                compute_kernels,
                module_kind,
                local_world_size,
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _check_table(
    config: BaseEmbeddingConfig,
    sharding: ParameterSharding,
    world_size: int,
    device_type: str,
    sharding_types: Sequence[ShardingType],
    compute_kernels: Callable[[ShardingType], Sequence[ComputeKernel]],
    module_kind: str = "EmbeddingBagCollection",
    local_world_size: int | None = None,
) -> None:
    name = config.name
    kind = sharding.sharding_type
    if kind not in sharding_types:
        raise ValueError(
            f"table {name!r}: sharding type {kind.value!r} is not supported by the "
            f"{module_kind} sharder on {device_type}; use one of "
            f"{[t.value for t in sharding_types]}"
        )
    kernel = resolve_kernel(sharding.compute_kernel, table=name)
    allowed = list(compute_kernels(kind))
    if kernel not in allowed:
        raise ValueError(
            f"table {name!r}: compute kernel {kernel.value!r} is not supported for {kind.value} "
            f"sharding on {device_type}; use one of {[k.value for k in allowed]}"
        )
    check_kernel_available(kernel, device_type, table=name)
    sharding.check_world(world_size, table=name)
    specs = table_specs(
        config, sharding, world_size, device_type, local_world_size=local_world_size
    )
    if specs is None:
        _check_data_parallel(name, sharding, world_size)
        widths = [config.embedding_dim]
    else:
        check_tiling(specs, (config.num_embeddings, config.embedding_dim), f"table {name!r}")
        for spec in specs:
            if spec.rank >= world_size:
                raise ValueError(
                    f"table {name!r}: shard placed on rank {spec.rank} ({spec.placement!r}) is "
                    f"outside the world of size {world_size}; re-plan for {world_size} ranks"
                )
            if spec.device.split(":")[0] != device_type:
                raise ValueError(
                    f"table {name!r}: shard placed on {spec.placement!r} but the module computes "
                    f"on {device_type}; plan for {device_type}"
                )
        if kind is ShardingType.COLUMN_WISE and any(
            s.sizes[0] != config.num_embeddings for s in specs
        ):
            raise ValueError(
                f"table {name!r}: every column_wise block spans all {config.num_embeddings} rows; "
                "use grid sharding to split rows too"
            )
        if kind in NODE_AWARE:
            lws = resolve_local_world_size(world_size, local_world_size)
            topology = NodeTopology(world_size, lws, 0)
            check_node_layout(
                kind, name, specs, (config.num_embeddings, config.embedding_dim), topology
            )
        else:
            _LAYOUT_CHECKS[kind](name, specs, world_size)
        widths = [s.sizes[1] for s in specs]
    if kernel in _FUSED:
        odd = [w for w in widths if w % MIN_COLUMN_BLOCK]
        if odd:
            raise ValueError(
                f"table {name!r}: the fused kernel needs local widths that are multiples of "
                f"{MIN_COLUMN_BLOCK}, but a shard is {odd[0]} columns wide; use a dimension (or "
                "column split) that is a multiple of 4, or compute kernel 'dense'"
            )


def _check_data_parallel(name: str, sharding: ParameterSharding, world_size: int) -> None:
    if sharding.ranks is not None and sorted(sharding.ranks) != list(range(world_size)):
        raise ValueError(
            f"table {name!r}: a data_parallel table is replicated on every rank, got ranks "
            f"{list(sharding.ranks)}; set ranks=None (or all {world_size} ranks)"
        )


def _check_table_wise(name: str, specs: Sequence[ShardSpec], world_size: int) -> None:
    if len(specs) != 1:
        raise ValueError(
            f"table {name!r}: a table_wise table lives whole on one rank, got {len(specs)} "
            "shards; use row_wise or column_wise sharding to split it"
        )


def _check_row_wise(name: str, specs: Sequence[ShardSpec], world_size: int) -> None:
    ranks = [s.rank for s in specs]
    if ranks != list(range(world_size)):
        raise ValueError(
            f"table {name!r}: a row_wise table needs one row block per rank, block r on rank r "
            f"(ranks {list(range(world_size))}), got shards on ranks {ranks}"
        )
    row = 0
    for spec in specs:
        if spec.offsets[0] != row or spec.offsets[1] != 0:
            raise ValueError(
                f"table {name!r}: row_wise blocks must follow one another in rank order and "
                f"span all columns; the block of rank {spec.rank} starts at {list(spec.offsets)}"
            )
        row += spec.sizes[0]


def _check_column_wise(name: str, specs: Sequence[ShardSpec], world_size: int) -> None:
    ranks = [s.rank for s in specs]
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})
    if repeated:
        raise ValueError(
            f"table {name!r}: rank {repeated[0]} holds several column blocks of the table; "
            "give each block its own rank (or merge the blocks)"
        )
    widths = [s.sizes[1] for s in sorted(specs, key=lambda s: s.offsets[1])]
    if len(specs) > 1 and any(w % MIN_COLUMN_BLOCK for w in widths):
        raise ValueError(
            f"table {name!r}: column_wise block widths {widths} must each be a multiple of "
            f"{MIN_COLUMN_BLOCK}; choose widths that are"
        )


_LAYOUT_CHECKS: Mapping[ShardingType, Callable[[str, Sequence[ShardSpec], int], None]] = {
    ShardingType.TABLE_WISE: _check_table_wise,
    ShardingType.ROW_WISE: _check_row_wise,
    ShardingType.COLUMN_WISE: _check_column_wise,
}
