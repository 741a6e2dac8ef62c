"""A sharding plan checked against the model and the world, before any collective runs.

``DistributedModelParallel`` calls :func:`check_plan` on every rank before it communicates. The
checks depend only on the plan, the model's structure and the world size, so every rank that
was given the same model and plan raises the same ``ValueError``, and none is left waiting in
a collective for a rank that gave up.

Checked here: every module path of the plan names a sub-module of the model; that sub-module
has a sharder; the plan of an embedding module is an ``EmbeddingModuleShardingPlan``; every
table it names is one of the module's tables; every rank is inside the world. The sharder's own
``check_plan`` (when it has one) checks the rest: tables left out of the plan, column splits,
kernels and sharding types the device cannot run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from embshard_dist.planner.shardable import sharder_for, table_shapes
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import ModuleSharder
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan

__all__ = ["check_plan"]


def check_plan(
    model: nn.Module,
    plan: ShardingPlan,
    sharders: Sequence[ModuleSharder[Any]],
    env: ShardingEnv,
    device_type: str,
) -> dict[str, tuple[nn.Module, ModuleSharder[Any]]]:
    """Check ``plan`` against ``model`` and the world of ``env``.

    Args:
        model: the unsharded model.
        plan: module path -> module plan.
        sharders: one sharder per kind of shardable module.
        env: the ranks the model is sharded over.
        device_type: the compute device type (``cpu``, ``cuda``).

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
