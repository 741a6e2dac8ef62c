"""ShardedQuantEmbeddingBagCollection: quantized inference tables spread over ranks.

The training strategies' flow, with the quantized kernel as the lookup: input dist (route, and
for row-wise the bucketizing) -> lookup of this rank's shards -> output dist. Table-wise,
row-wise and column-wise. Each rank keeps only its shards' packed rows: a row-wise quantized row
carries its own fp16 scale and bias, so a block of rows, or of columns with the rows' scale and
bias, dequantizes exactly as in the whole table. No optimizer and no backward: the forward runs
under ``torch.no_grad``. Outputs equal the unsharded ``QuantEmbeddingBagCollection``'s exactly:
table-wise and column-wise pool on the owner; row-wise fetches each id's packed row and pools on
the caller (:mod:`~embshard_dist.sharded.quant_row_fetch`), since summing partial pools across
ranks would change the order of a bag's fp32 sum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from embshard_dist.sharded.common import build_strategies, build_tables, sharding_group
from embshard_dist.sharded.context import (
    EmbeddingBagCollectionContext,
    FeaturesAwaitable,
    KeyedTensorAwaitable,
)
from embshard_dist.sharded.embedding_bag import _column_index, _input_gate
from embshard_dist.sharded.quant_row_fetch import RwRowFetchSharding, fetch_rows
from embshard_dist.sharded.sharder import CollectionKind, CollectionSharder
from embshard_dist.strategies.base import EmbeddingBagSharding
from embshard_dist.strategies.cw import CwSharding
from embshard_dist.strategies.lookup import GroupedBagLookup
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.sequence import SequenceStepContext
from embshard_dist.strategies.tw import TwSharding
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.quant import QuantTableWeight
from embshard_kernels.quantize import QuantEmbeddingBagCollection
from embshard_optim.fused import EmptyFusedOptimizer
from embshard_optim.keyed import KeyedOptimizer
from embshard_optim.sharded_state import StateFormat
from embshard_optim.specs import OptimizerSpec
from embshard_types.awaitables import Awaitable, LazyAwaitable
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import ShardedModule
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor
from embshard_types.vocab import ComputeKernel, DataType, ShardingType

__all__ = ["QuantEmbeddingBagCollectionSharder", "ShardedQuantEmbeddingBagCollection"]

STRATEGIES: dict[ShardingType, type] = {
    ShardingType.TABLE_WISE: TwSharding,
    ShardingType.ROW_WISE: RwRowFetchSharding,
    ShardingType.COLUMN_WISE: CwSharding,
}


class ShardedQuantEmbeddingBagCollection(
    ShardedModule[list[KeyedJaggedTensor], list[Tensor], KeyedTensor, EmbeddingBagCollectionContext]
):
    """A :class:`QuantEmbeddingBagCollection` sharded over the ranks of ``env``, for inference.

    Args:
        module: the unsharded quantized collection (every rank holds the same one; each keeps
            a copy of its own shards only).
        plan: compute kernel ``quant`` for every table; table-wise, row-wise or column-wise.
        optimizer: must be ``None``: quantized tables are not trained.

    Raises:
        ValueError / TypeError: the plan does not fit (checked by the sharder, before this).
    """

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        plan: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | str | None = None,
        *,
        optimizer: OptimizerSpec | None = None,
        fused_params: FusedParams | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        path: str = "",
        check_inputs: bool | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if optimizer is not None:
            raise ValueError(
                f"{path or 'ShardedQuantEmbeddingBagCollection'}: quantized tables are for "
                "inference and take no optimizer; train the float model, then quantize it"
            )
        dev = torch.device(device) if device is not None else torch.device("cpu")
        configs = module.embedding_bag_configs()
        self._device = dev
        self._plan = plan
        self._configs = configs
        self._data_type = module.data_type
        self._is_weighted = module.is_weighted()
        self._pg = sharding_group(env)
        options = ShardingOptions(
            device=dev,
            pg=self._pg,
            # The strategies' kernel options; the SGD spec is never stepped (no backward).
            fused_params=fused_params or FusedParams(),
            is_weighted=self._is_weighted,
            state_format=StateFormat.SHARDED_TENSOR,
            world_size=env.world_size,
            rank=env.rank,
            qcomm_codecs_registry=dict(self.qcomm_codecs_registry),
        )
        self._tables = build_tables(configs, plan, env.world_size, dev.type)
        self._shardings: list[EmbeddingBagSharding] = build_strategies(
            self._tables, STRATEGIES, options
        )
        self._input_dists = [s.create_input_dist() for s in self._shardings]
        # Registered: the lookups hold this rank's packed shards (its state_dict).
        self.lookups = nn.ModuleList(s.create_lookup() for s in self._shardings)
        self._output_dists = [s.create_output_dist() for s in self._shardings]
        _fill_shards(module, self._lookups())
        self._keys = [f for c in configs for f in c.feature_names]
        self._gate = _input_gate(configs, self._is_weighted, check_inputs)
        if self._gate.enabled:
            for lookup in self._lookups():
                lookup.trust_inputs()
        dims = {f: c.embedding_dim for c in configs for f in c.feature_names}
        self._dims = [dims[f] for f in self._keys]
        self._columns = _column_index(self._shardings, self._keys, dims)

    def _lookups(self) -> list[GroupedBagLookup]:
        return [lk for lk in self.lookups if isinstance(lk, GroupedBagLookup)]

    def create_context(self) -> EmbeddingBagCollectionContext:
        # Row fetching reads its lookup's input back in the output dist (a sequence context).
        return EmbeddingBagCollectionContext([SequenceStepContext() for _ in self._shardings])

    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, *input: Any, **kwargs: Any
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        """Start routing every strategy's features; a bad input raises on every rank alike."""
        (given,) = input
        features, status = self._gate.check(given, "ShardedQuantEmbeddingBagCollection")
        if features.variable_stride_per_key():
            raise ValueError(
                "ShardedQuantEmbeddingBagCollection: variable batch sizes per feature are not "
                "served by the quantized sharded collection; pad every feature to one batch size"
            )
        for sctx in ctx.sharding_contexts:
            sctx.input_status = status
        started = [
            dist(features, sctx)
            for dist, sctx in zip(self._input_dists, ctx.sharding_contexts, strict=True)
        ]
        return self._gate.agreed(
            FeaturesAwaitable(started), started, self._input_dists, status, self._pg
        )

    def compute(
        self, ctx: EmbeddingBagCollectionContext, dist_input: list[KeyedJaggedTensor]
    ) -> list[Tensor]:
        out = []
        with torch.no_grad():
            for sharding, lookup, kjt, sctx in zip(
                self._shardings, self._lookups(), dist_input, ctx.sharding_contexts, strict=True
            ):
                if isinstance(sharding, RwRowFetchSharding):
                    assert isinstance(sctx, SequenceStepContext)
                    sctx.lookup_input = kjt
                    out.append(fetch_rows(lookup, kjt))
                else:
                    out.append(lookup(kjt))
        return out

    def output_dist(
        self, ctx: EmbeddingBagCollectionContext, output: list[Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        with torch.no_grad():
            pending = [
                dist(embeddings, sctx)
                for dist, embeddings, sctx in zip(
                    self._output_dists, output, ctx.sharding_contexts, strict=True
                )
            ]
        return KeyedTensorAwaitable(pending, self._keys, self._dims, self._columns)

    def forward(self, *input: Any, **kwargs: Any) -> LazyAwaitable[KeyedTensor]:
        with torch.no_grad():
            return super().forward(*input, **kwargs)

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return QuantEmbeddingBagCollection

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return EmptyFusedOptimizer()

    @property
    def plan(self) -> EmbeddingModuleShardingPlan:
        return self._plan

    @property
    def shardings(self) -> list[EmbeddingBagSharding]:
        return list(self._shardings)

    @property
    def data_type(self) -> DataType:
        return self._data_type

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def local_tables(self) -> dict[str, QuantTableWeight]:
        """Per table this rank holds a shard of, that shard's packed rows, scale and bias."""
        return {
            table.name: kernel.table_weight(table.name)  # type: ignore[operator]
            for lookup in self._lookups()
            for kernel in lookup.kernels
            for table in kernel.config.embedding_tables  # type: ignore[union-attr]
        }

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        """Every shard of every table."""
        return {name: list(t.specs or ()) for name, t in self._tables.items()}


def _fill_shards(module: QuantEmbeddingBagCollection, lookups: list[GroupedBagLookup]) -> None:
    """Copy each local shard's packed rows (and their scale and bias) out of ``module``."""
    source = module.packed_tables()
    for lookup in lookups:
        for kernel in lookup.kernels:
            for table in kernel.config.embedding_tables:  # type: ignore[union-attr]
                spec = table.local_metadata
                assert spec is not None
                holder = kernel.table_weight(table.name)  # type: ignore[operator]
                _copy_block(source[table.name], holder, spec, table.data_type, table.name)


def _copy_block(
    full: QuantTableWeight, shard: QuantTableWeight, spec: ShardSpec, dt: DataType, name: str
) -> None:
    (r0, c0), (nr, nc) = spec.offsets, spec.sizes
    per = dt.bits / 8  # bytes per element of the packed rows
    b0, nb = c0 * per, nc * per
    if b0 != int(b0) or nb != int(nb):
        raise ValueError(
            f"table {name!r}: the {dt.value} column block at {c0} (+{nc}) does not start and end "
            "on a byte; plan column blocks whose widths are multiples of "
            f"{int(1 / per)}"
        )
    with torch.no_grad():
        shard.weight[:, : int(nb)].copy_(full.weight[r0 : r0 + nr, int(b0) : int(b0 + nb)])
        if shard.weight_qscaleshift is not None:
            assert full.weight_qscaleshift is not None
            shard.weight_qscaleshift.copy_(full.weight_qscaleshift[r0 : r0 + nr])


class QuantEmbeddingBagCollectionSharder(CollectionSharder[QuantEmbeddingBagCollection]):
    """Shards ``QuantEmbeddingBagCollection`` modules (table-, row- and column-wise) for inference.

    Plans use compute kernel ``quant``. Column blocks must start and end on whole bytes of the
    packed rows, and FBGEMM packs a block into an even number of bytes: widths that are
    multiples of 4 (int4: 4, int2: 8) always fit.
    """

    kind = CollectionKind(
        module_type=QuantEmbeddingBagCollection,
        weights_attr="",
        strategies=STRATEGIES,
        sharded_type=ShardedQuantEmbeddingBagCollection,
        configs=QuantEmbeddingBagCollection.embedding_bag_configs,
    )

    def compute_kernels(
        self, sharding_type: ShardingType | str, compute_device_type: str
    ) -> list[ComputeKernel]:
        kind = ShardingType.parse(sharding_type, what="compute_kernels")
        super().compute_kernels(kind, compute_device_type)  # checks the device type
        return [ComputeKernel.QUANT] if kind in STRATEGIES else []

    def shardable_parameters(self, module: QuantEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        """Per table, a ``meta`` stand-in of its float shape (the packed rows are buffers)."""
        return {
            c.name: nn.Parameter(
                torch.empty(c.num_embeddings, c.embedding_dim, device="meta"),
                requires_grad=False,
            )
            for c in module.embedding_bag_configs()
        }

    def check_plan(
        self,
        module: QuantEmbeddingBagCollection,
        params: Any,
        env: ShardingEnv,
        device_type: str,
        path: str = "",
    ) -> None:
        """As the other sharders, and every column block fits the packed rows' bytes."""
        super().check_plan(module, params, env, device_type, path)
        where = f"module {path!r}" if path else "the QuantEmbeddingBagCollection"
        bits = module.data_type.bits
        tables = build_tables(module.embedding_bag_configs(), params, env.world_size, device_type)
        for name, table in tables.items():
            for spec in table.specs or ():
                for edge in (spec.offsets[1], spec.sizes[1]):
                    if (edge * bits) % 16:
                        raise ValueError(
                            f"{where}: table {name!r}: a column block at column "
                            f"{spec.offsets[1]} of width {spec.sizes[1]} does not pack into "
                            f"whole pairs of bytes of {module.data_type.value}; use column "
                            f"blocks whose offsets and widths are multiples of {16 // bits}"
                        )
