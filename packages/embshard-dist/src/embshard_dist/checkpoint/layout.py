"""What a ``DistributedModelParallel`` holds on this rank, described plan-independently.

:func:`describe_model` lists every table's shards and this rank's live pieces of its weight and
fused optimizer states, plus the dense tensors and optimizer; copying into the pieces loads a
checkpoint. A column-wise table's row-wise state is kept once (block 0's copy), since
column-wise sharding keeps the copies equal.

Guarantees: a collective that changes nothing; a model it cannot describe raises
``ValueError`` on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.checkpoint.format import StateInfo, TableInfo, dtype_name
from embshard_dist.checkpoint.tensors import Piece, Shard, local_pieces, quiet
from embshard_dist.checkpoint.train_state import gather_json, to_json_value
from embshard_dist.sharded.plan_checks import table_specs
from embshard_kernels.fbgemm_mapping import data_type_to_dtype
from embshard_types.env import ShardingEnv2D

if TYPE_CHECKING:
    from embshard_dist.dmp.model_parallel import DistributedModelParallel

__all__ = ["ModelLayout", "TableLayout", "TableState", "describe_model"]


@dataclass
class TableState:
    """One fused optimizer state of a table on this rank.

    Args:
        pieces: this rank's pieces, at the fused optimizer's offsets (row-wise: ``block *
            rows + row``).
    """

    info: StateInfo
    pieces: list[Piece]


@dataclass
class TableLayout:
    """One table on this rank.

    Args:
        shards: every block of its weight under the current plan (``None``: data-parallel).
        states: this rank's pieces of each optimizer state, by state name.
    """

    info: TableInfo
    shards: list[Shard] | None
    weight: list[Piece]
    states: dict[str, TableState] = field(default_factory=dict)

    @property
    def size(self) -> tuple[int, int]:
        return (self.info.rows, self.info.dim)

    def row_shards(self) -> list[Shard] | None:
        """The row-wise states' blocks: the rows of the weight's first column block."""
        if self.shards is None:
            return None
        return [
            Shard((s.offsets[0],), (s.sizes[0],), s.rank) for s in self.shards if not s.offsets[1]
        ]


@dataclass
class ModelLayout:
    """Everything a checkpoint holds for one model on this rank (see the module docstring)."""

    tables: dict[str, TableLayout]
    dense: dict[str, Tensor]
    dense_state: dict[str, dict[str, Any]]
    dense_param_groups: list[dict[str, Any]]
    fused_hyperparameters: dict[str, dict[str, Any]]
    rank: int
    world_size: int
    pg: dist.ProcessGroup | None


def describe_model(dmp: DistributedModelParallel) -> ModelLayout:
    """This rank's :class:`ModelLayout` of ``dmp`` (a collective over its process group).

    Raises:
        ValueError: the model cannot be checkpointed (a 2-D environment, an unsupported
            sharded module, ranks that disagree on a table's states).
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "checkpoints of a DistributedModelParallel need torch.distributed: call "
            "init_process_group first (embshard train and torchrun do)"
        )
    with quiet():
        return _describe(dmp)


def _describe(dmp: DistributedModelParallel) -> ModelLayout:
    env = dmp.env
    if isinstance(env, ShardingEnv2D):
        raise ValueError(
            "checkpoints of a model sharded over a 2-D environment (ShardingEnv2D) are not "
            "supported; shard it over a 1-D ShardingEnv to checkpoint it"
        )
    pg = env.process_group
    state = dmp.state_dict()
    tables = _tables(dmp, state, pg)
    fused = dmp.fused_optimizer
    fused_state = fused.state_dict()["state"]
    mine: dict[str, dict[str, list[Any]]] = {}
    for key, table in tables.items():
        for full_name, value in fused_state.get(key, {}).items():
            name = full_name.removeprefix(f"{table.info.name}.")
            pieces = local_pieces(value)
            rowwise = len(value.shape) == 1
            dtype = dtype_name(pieces[0].tensor.dtype if pieces else torch.float32)
            table.states[name] = TableState(StateInfo(rowwise, dtype), pieces)
            mine.setdefault(key, {})[name] = [rowwise, dtype]
    hyper = _fused_hyperparameters(fused)
    gathered = gather_json([mine, hyper], group=pg, name="checkpoint.describe")
    _merge_state_kinds(tables, [g[0] for g in gathered])
    merged_hyper: dict[str, dict[str, Any]] = {}
    for _, theirs in gathered:
        merged_hyper.update(theirs)
    dense: dict[str, Tensor] = {}
    for key, value in state.items():
        if key in tables:
            continue
        if type(value) not in (Tensor, torch.nn.Parameter):
            raise ValueError(
                f"state-dict entry {key!r} is a {type(value).__name__} outside any sharded "
                "table; a checkpoint holds sharded tables and plain dense tensors only"
            )
        dense[key] = value.detach()
    dense_sd = dmp.dense_optimizer.state_dict()
    return ModelLayout(
        tables=tables,
        dense=dense,
        dense_state={p: dict(s) for p, s in dense_sd.get("state", {}).items()},
        dense_param_groups=[
            {k: to_json_value(v, what=f"dense optimizer {k!r}") for k, v in g.items()}
            for g in dense_sd.get("param_groups", [])
        ],
        fused_hyperparameters=merged_hyper,
        rank=dist.get_rank(pg),
        world_size=env.world_size,
        pg=pg,
    )


def _tables(
    dmp: DistributedModelParallel, state: Mapping[str, Any], pg: dist.ProcessGroup | None
) -> dict[str, TableLayout]:
    tables: dict[str, TableLayout] = {}
    for path, module in dmp.sharded_modules.items():
        found = [(a, getattr(module, f, None)) for a, f in _COLLECTIONS]
        attr, configs = next(((a, f) for a, f in found if f is not None), ("", None))
        plan = getattr(module, "plan", None)
        if configs is None or plan is None:
            raise ValueError(
                f"sharded module {path!r} ({type(module).__name__}) is not an embedding "
                "collection; checkpoints hold sharded EmbeddingBagCollection and "
                "EmbeddingCollection modules"
            )
        prefix = f"{path}." if path else ""
        for config in configs():
            key = f"{prefix}{attr}.{config.name}.weight"
            sharding = plan[config.name]
            specs = table_specs(config, sharding, dmp.env.world_size, dmp.device.type)
            shards = (
                None
                if specs is None
                else [Shard(s.offsets, s.sizes, _global_rank(pg, s.rank)) for s in specs]
            )
            info = TableInfo(
                key=key,
                module=path,
                name=config.name,
                rows=config.num_embeddings,
                dim=config.embedding_dim,
                dtype=dtype_name(data_type_to_dtype(config.data_type)),
                sharding=sharding.sharding_type.value,
            )
            tables[key] = TableLayout(info, shards, local_pieces(state[key]))
    return tables


_COLLECTIONS = (("embedding_bags", "embedding_bag_configs"), ("embeddings", "embedding_configs"))
"""Sharded collections: where their tables' weights live, and how they list the tables."""


def _global_rank(pg: dist.ProcessGroup | None, rank: int) -> int:
    if pg is None or pg == dist.group.WORLD:
        return rank
    return dist.get_global_rank(pg, rank)


def _fused_hyperparameters(fused: Any) -> dict[str, dict[str, Any]]:
    names = {id(p): name for name, p in fused.params.items()}
    out: dict[str, dict[str, Any]] = {}
    for group in fused.param_groups:
        hyper = {
            k: to_json_value(v, what=f"fused optimizer {k!r}")
            for k, v in group.items()
            if k != "params"
        }
        for param in group["params"]:
            out[names[id(param)]] = hyper
    return out


def _merge_state_kinds(
    tables: dict[str, TableLayout], by_rank: list[dict[str, dict[str, list[Any]]]]
) -> None:
    """Give every table the states some rank holds; ranks must agree on them."""
    for key, table in tables.items():
        seen = [(rank, states[key]) for rank, states in enumerate(by_rank) if key in states]
        if not seen:
            continue
        first_rank, first = seen[0]
        for rank, states in seen[1:]:
            if states != first:
                raise ValueError(
                    f"table {table.info.name!r}: rank {first_rank} holds optimizer states "
                    f"{first} but rank {rank} holds {states}; every shard of a table must use "
                    "the same optimizer"
                )
        for name, (rowwise, dtype) in first.items():
            if name not in table.states:
                table.states[name] = TableState(StateInfo(bool(rowwise), str(dtype)), [])
    for table in tables.values():
        infos = {n: s.info for n, s in sorted(table.states.items())}
        table.info = replace(table.info, states=infos)
