"""The plan checks of sharded collections, and the shard specs each table gets from its plan.

:func:`check_plan` runs before anything is built or any rank contacted, so a bad plan makes every
rank raise the same error, naming the module path and table and how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from embshard_dist.sharded.node_plan_checks import NODE_AWARE, check_node_layout
from embshard_dist.sharded.shardable import sharder_for, table_shapes
from embshard_dist.strategies.layout import MIN_COLUMN_BLOCK, shard_specs
from embshard_dist.strategies.nodes import NodeTopology, resolve_local_world_size
from embshard_kernels.fbgemm_mapping import check_kernel_available, resolve_kernel
from embshard_optim.sharded_state import check_tiling
from embshard_types.configs import BaseEmbeddingConfig
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import ModuleSharder
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, ShardingType

_FUSED = (ComputeKernel.FUSED, ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)
_NOT_SHARDED = {
    ComputeKernel.QUANT: (
        "it is the inference-only quantized kernel (embshard_kernels.quant), and this "
        "collection trains; quantize the model first (quantize_embeddings), whose "
        "QuantEmbeddingBagCollection the default sharders shard for inference"
    ),
    ComputeKernel.KEY_VALUE: (
        "it is FBGEMM's key-value (SSD) kernel, which runs on CUDA only and which the sharders "
        "do not place yet; for tables larger than device memory use 'fused_uvm_caching' on CUDA"
    ),
}


def table_specs(
    config: BaseEmbeddingConfig,
    sharding: ParameterSharding,
    world_size: int,
    device_type: str,
    *,
    local_world_size: int | None = None,
) -> tuple[ShardSpec, ...] | None:
    """Every shard of ``config``: the plan's ``shards``, else the layout of its ranks.

    Returns ``None`` for data-parallel; row-wise tables without ranks use every rank.

    Raises:
        ValueError: the ranks do not fit the sharding type.
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


def check_module_plan(
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
    """Check that ``plan`` can shard the tables ``configs`` on this world and device.

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
    if kernel in _NOT_SHARDED and kernel not in allowed:
        raise ValueError(
            f"table {name!r}: compute kernel {kernel.value!r} cannot be sharded by the "
            f"{module_kind} sharder: {_NOT_SHARDED[kernel]}; use one of "
            f"{[k.value for k in allowed]}"
        )
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


def check_plan(
    model: nn.Module,
    plan: ShardingPlan,
    sharders: Sequence[ModuleSharder[Any]],
    env: ShardingEnv,
    device_type: str,
) -> dict[str, tuple[nn.Module, ModuleSharder[Any]]]:
    """Check ``plan`` against ``model`` and the world of ``env``.

    Returns:
        Module path -> (module, sharder) for every module the plan shards, in plan order.

    Raises:
        ValueError: the first problem found, naming the module path and the table.
    """
    if not isinstance(plan, ShardingPlan):
        raise TypeError(
            f"plan must be a ShardingPlan, got {type(plan).__name__}; wrap a dict as "
            "ShardingPlan({path: {table: ParameterSharding}})"
        )
    modules = dict(model.named_modules())
    targets: dict[str, tuple[nn.Module, ModuleSharder[Any]]] = {}
    for path, module_plan in plan.items():
        module = modules.get(path)
        if module is None:
            shardable = sorted(p for p, m in modules.items() if sharder_for(m, sharders))
            raise ValueError(
                f"the plan names module path {path!r}, which the model does not have; its "
                f"shardable modules are at {shardable}. Re-plan for this model"
            )
        sharder = sharder_for(module, sharders)
        if sharder is None:
            kinds = sorted(s.module_type.__name__ for s in sharders)
            raise ValueError(
                f"the plan names module {path!r}, a {type(module).__name__}, but no sharder "
                f"shards that type (the sharders given shard {kinds}); drop it from the plan "
                "or pass a sharder for it"
            )
        if not isinstance(module_plan, EmbeddingModuleShardingPlan):
            raise ValueError(
                f"module {path!r}: expected an EmbeddingModuleShardingPlan, got "
                f"{type(module_plan).__name__}"
            )
        _check_tables(path, module, sharder, module_plan)
        for table, sharding in module_plan.items():
            try:
                sharding.check_world(env.world_size, table=table)
            except ValueError as e:
                raise ValueError(f"module {path!r}: {e}") from None
        check = getattr(sharder, "check_plan", None)
        if check is not None:
            check(module, module_plan, env, device_type, path)
        targets[path] = (module, sharder)
    _check_not_nested(targets)
    return targets


def _check_tables(
    path: str, module: nn.Module, sharder: ModuleSharder[Any], module_plan: Mapping[str, Any]
) -> None:
    tables = [s.name for s in table_shapes(module, sharder)]
    for table in module_plan:
        if table not in tables:
            raise ValueError(
                f"the plan names table {table!r} in module {path!r}, which has no such table; "
                f"its tables are {tables}. Re-plan for this model"
            )


def _check_not_nested(targets: Mapping[str, object]) -> None:
    paths = sorted(targets)
    for outer in paths:
        for inner in paths:
            if inner != outer and (outer == "" or inner.startswith(outer + ".")):
                raise ValueError(
                    f"the plan shards module {inner!r} inside module {outer!r}, which it also "
                    "shards; plan one of them"
                )
