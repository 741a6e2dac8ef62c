"""DistributedModelParallel honours optimizers declared with ``apply_optimizer_in_backward``.

As in TorchRec, the optimizer declared on a collection's table parameters is fused into its
sharded kernels. embshard's sharded collections run one fused optimizer per collection, so all
tables of a collection must declare the same one (or none). Every declaration is either used or
refused with an error naming the module, the table and the class: never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from embshard_dist.sharded.shardable import find_shardable_modules
from embshard_dist.sharded.sharder import CollectionSharder
from embshard_optim.in_backward import in_backward_spec
from embshard_optim.specs import OptimizerSpec
from embshard_types.interfaces import ModuleSharder

__all__ = ["check_declared_against", "declared_optimizers", "sharders_with_declared"]


def declared_optimizers(
    model: nn.Module, sharders: Sequence[ModuleSharder[Any]]
) -> dict[str, OptimizerSpec]:
    """Module path -> the fused optimizer its tables declare in backward (paths without any
    declaration are left out).

    Raises:
        ValueError: a class that cannot be fused, several optimizers on one table, tables of one
            collection that declare different optimizers, or only some tables declaring one.
    """
    out: dict[str, OptimizerSpec] = {}
    for path, (module, sharder) in find_shardable_modules(model, sharders).items():
        where = f"module {path!r}" if path else f"the root {type(module).__name__}"
        params = sharder.shardable_parameters(module)
        specs = {
            table: in_backward_spec(param, where=f"{where}, table {table!r}")
            for table, param in params.items()
        }
        marked = {t: s for t, s in specs.items() if s is not None}
        if not marked:
            continue
        unmarked = [t for t, s in specs.items() if s is None]
        if unmarked:
            raise ValueError(
                f"{where}: tables {sorted(marked)} declare an optimizer with "
                f"apply_optimizer_in_backward but tables {unmarked} do not, and embshard fuses "
                "one optimizer per collection; apply it to all of the collection's parameters "
                "(apply_optimizer_in_backward(cls, collection.parameters(), kwargs))"
            )
        distinct: dict[OptimizerSpec, list[str]] = {}
        for table, spec in marked.items():
            distinct.setdefault(spec, []).append(table)
        if len(distinct) > 1:
            listed = "; ".join(
                f"{spec.optim_type.value} lr={spec.learning_rate} for {tables}"
                for spec, tables in distinct.items()
            )
            raise ValueError(
                f"{where}: its tables declare different in-backward optimizers ({listed}); "
                "embshard fuses one optimizer per collection: put tables that train differently "
                "in separate collections, or declare one optimizer"
            )
        out[path] = next(iter(distinct))
    return out


def check_declared_against(
    declared: Mapping[str, OptimizerSpec], optimizer: OptimizerSpec, what: str
) -> None:
    """Raise unless every declared optimizer equals ``optimizer`` (given as ``what``).

    Raises:
        ValueError: naming the module and both optimizers.
    """
    for path, spec in declared.items():
        if spec != optimizer:
            raise ValueError(
                f"module {path!r}: its tables declare {_describe(spec)} with "
                f"apply_optimizer_in_backward but {what} is {_describe(optimizer)}; "
                "declare the embedding optimizer one way (drop one of them)"
            )


def sharders_with_declared(
    model: nn.Module,
    sharders: Sequence[ModuleSharder[Any]],
    declared: Mapping[str, OptimizerSpec],
    *,
    user_given: bool,
) -> dict[str, ModuleSharder[Any]]:
    """Module path -> a sharder that runs the optimizer the module's tables declare.

    Args:
        user_given: the sharders are the caller's; one with its own optimizer must agree.

    Raises:
        ValueError: a user sharder with another optimizer, or a sharder that cannot take one.
    """
    found = find_shardable_modules(model, sharders)
    out: dict[str, ModuleSharder[Any]] = {}
    for path, spec in declared.items():
        _, sharder = found[path]
        if not isinstance(sharder, CollectionSharder):
            raise ValueError(
                f"module {path!r}: its tables declare {_describe(spec)} with "
                f"apply_optimizer_in_backward, but its sharder {type(sharder).__name__} is not "
                "an embshard collection sharder, so the optimizer cannot be given to it; give "
                "the optimizer to your sharder and drop apply_optimizer_in_backward"
            )
        own = sharder.optimizer
        if user_given and own is not None and own != spec:
            raise ValueError(
                f"module {path!r}: its tables declare {_describe(spec)} with "
                f"apply_optimizer_in_backward but the {type(sharder).__name__} passed in "
                f"sharders= runs {_describe(own)}; declare the embedding optimizer one way"
            )
        out[path] = sharder.with_optimizer(spec)
    return out


def _describe(spec: OptimizerSpec) -> str:
    return f"{spec.optim_type.value} (lr={spec.learning_rate})"
