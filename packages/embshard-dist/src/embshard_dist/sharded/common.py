"""What the sharded collections (embedding bags and sequence embeddings) build alike.

Tables, strategies, initial weights, fused optimizers and state-dict entries, parametrised by
the collection's weight attribute and strategy registry. Nothing here contacts another rank
except :meth:`TableStates.entry`, which builds a sharded tensor over the collection's group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor, nn

from embshard_dist.sharded.init import fill_shard, is_materialised
from embshard_dist.sharded.plan_checks import table_specs
from embshard_dist.sharded.state import check_entry, local_part, table_state_entry
from embshard_dist.strategies.base import BagTable
from embshard_dist.strategies.options import ShardingOptions
from embshard_kernels.fbgemm_mapping import data_type_to_dtype
from embshard_kernels.fused_params import FusedParams
from embshard_optim.combined import CombinedOptimizer
from embshard_optim.fused import EmptyFusedOptimizer
from embshard_optim.keyed import KeyedOptimizer
from embshard_optim.sharded_state import StateFormat, make_mesh
from embshard_optim.specs import OptimizerSpec
from embshard_types.env import ShardingEnv, ShardingEnv2D
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ShardingType

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig

S = TypeVar("S")

LocalWeights = Mapping[str, tuple[nn.Parameter, ShardSpec]]
"""Table name -> this rank's shard (a live view of the kernel's weight) and its spec."""


def sharding_group(env: ShardingEnv) -> ProcessGroup | None:
    """The group the tables are sharded over: a 2-D env's sharding group, else its group."""
    return env.sharding_pg if isinstance(env, ShardingEnv2D) else env.process_group


def state_format(env: ShardingEnv) -> StateFormat:
    """``DTENSOR`` when the environment asks for DTensors, else ``SHARDED_TENSOR``."""
    return StateFormat.DTENSOR if env.output_dtensor else StateFormat.SHARDED_TENSOR


def resolve_fused_params(
    module: nn.Module, optimizer: OptimizerSpec | None, given: FusedParams | None
) -> FusedParams:
    """The sharded kernels' options: ``given`` or the module's own, with ``optimizer`` set."""
    # The unsharded collection keeps its kernels' options per table (all tables share them).
    own = [t.fused_params for t in getattr(module, "_tables", ()) if t.fused_params is not None]
    params = given or (own[0] if own else FusedParams())
    return params if optimizer is None else replace(params, optimizer=optimizer)


def build_tables(
    configs: Sequence[EmbeddingBagConfig] | Sequence[EmbeddingConfig],
    plan: EmbeddingModuleShardingPlan,
    world_size: int,
    device_type: str,
    *,
    local_world_size: int | None = None,
) -> dict[str, BagTable]:
    """One :class:`BagTable` per config, in config order (its shards: see ``table_specs``)."""
    return {
        c.name: BagTable(
            c,
            plan[c.name],
            table_specs(
                c, plan[c.name], world_size, device_type, local_world_size=local_world_size
            ),
        )
        for c in configs
    }


def build_strategies(
    tables: Mapping[str, BagTable],
    registry: Mapping[ShardingType, Callable[..., S]],
    options: ShardingOptions,
    extra: Callable[[ShardingType], dict[str, Any]] = lambda kind: {},
) -> list[S]:
    """One strategy per sharding type, in the order the tables first use them.

    Args:
        extra: keyword arguments a strategy of the given type takes besides those.
    """
    out = []
    for kind in dict.fromkeys(t.sharding.sharding_type for t in tables.values()):
        mine = [t for t in tables.values() if t.sharding.sharding_type is kind]
        out.append(registry[kind](mine, options, **extra(kind)))
    return out


def fill_weights(
    module: nn.Module, tables: Mapping[str, BagTable], local: LocalWeights, attr: str
) -> None:
    """Copy the module's weights (``{attr}.{table}.weight``) into the local shards, or draw them
    in place (no second copy of a shard is held)."""
    source = dict(module.named_parameters())
    with torch.no_grad():
        for name, (weight, spec) in local.items():
            full = source.get(f"{attr}.{name}.weight")
            if full is not None and is_materialised(full):
                (r0, c0), (nr, nc) = spec.offsets, spec.sizes
                weight.copy_(full.detach()[r0 : r0 + nr, c0 : c0 + nc])
            else:
                fill_shard(tables[name].config, spec, weight)


def combine_optimizers(optimizers: Sequence[KeyedOptimizer], attr: str) -> KeyedOptimizer:
    """The kernels' fused optimizers as one, their parameters keyed under ``attr``."""
    if not optimizers:
        return EmptyFusedOptimizer()
    return CombinedOptimizer([(attr, o) for o in optimizers])


class TableStates:
    """Every table's state-dict entry under ``{attr}.{table}.weight``, with save and load hooks.

    Args:
        local: this rank's shards, read by reference when an entry is built.
    """

    def __init__(
        self,
        attr: str,
        tables: Mapping[str, BagTable],
        local: LocalWeights,
        fmt: StateFormat,
        pg: ProcessGroup | None,
        device_type: str,
    ) -> None:
        self._attr = attr
        self._tables = tables
        self._local = local
        self._format = fmt
        self._pg = pg
        self._device_type = device_type
        self._mesh: DeviceMesh | None = None

    def entry(self, name: str) -> Tensor:
        """Table ``name``'s entry: its local tensor if data-parallel, else a sharded tensor."""
        table = self._tables[name]
        local = self._local.get(name)
        if table.specs is None:
            assert local is not None
            return local[0].detach()
        pieces = [] if local is None else [(local[0].detach(), local[1])]
        cfg = table.config
        if self._format is StateFormat.DTENSOR and self._mesh is None:
            self._mesh = make_mesh(self._pg, self._device_type)
        return table_state_entry(
            pieces,
            table.specs,
            (cfg.num_embeddings, cfg.embedding_dim),
            data_type_to_dtype(cfg.data_type),
            fmt=self._format,
            pg=self._pg,
            mesh=self._mesh,
        )

    def register(self, module: nn.Module) -> None:
        module.register_state_dict_post_hook(functools.partial(_save_tables, self))
        module.register_load_state_dict_pre_hook(functools.partial(_load_tables, self))

    def save(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Put every table's entry into ``state_dict``, in config order, on every rank alike.

        The entries go last in the module's block (it ends the dict when the post-hook runs),
        wherever the module listed the tables it holds, so code that walks the keys in order
        sees the same sequence on every rank, whichever tables a rank holds shards of.
        """
        for name in self._tables:
            key = f"{prefix}{self._attr}.{name}.weight"
            state_dict.pop(key, None)
            state_dict[key] = self.entry(name)

    def load(self, state_dict: dict[str, Any], prefix: str, missing_keys: list[str]) -> None:
        """Replace every table's entry by the part of it the local shard holds."""
        for name, table in self._tables.items():
            key = f"{prefix}{self._attr}.{name}.weight"
            if key not in state_dict:
                if name not in self._local:
                    missing_keys.append(key)
                continue
            local = self._local.get(name)
            value = state_dict.pop(key)
            cfg = table.config
            size = (cfg.num_embeddings, cfg.embedding_dim)
            if local is None:
                check_entry(value, size, name)
            else:
                state_dict[key] = local_part(value, local[1], size, name)


def _save_tables(
    states: TableStates,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    states.save(state_dict, prefix)


def _load_tables(
    states: TableStates,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    states.load(state_dict, prefix, missing_keys)
