"""Builders and hypothesis strategies of valid sharding plans, shared by the plan tests."""

from __future__ import annotations

from hypothesis import strategies as st

from embshard_types.kernel_params import (
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    KeyValueParams,
    MultiPassPrefetchConfig,
)
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ObjectPoolShardingPlan, ShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import (
    ComputeKernel,
    DataType,
    ObjectPoolShardingType,
    ShardingType,
)


def _blocks(total: int, parts: int) -> list[tuple[int, int]]:
    """Split ``total`` into ``parts`` contiguous (offset, size) blocks (sizes may be 0)."""
    base, extra = divmod(total, parts)
    out, offset = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((offset, size))
        offset += size
    return out


def layout(
    sharding_type: ShardingType,
    rows: int,
    dim: int,
    ranks: list[int],
    device: str = "cpu",
) -> tuple[tuple[int, ...] | None, tuple[ShardSpec, ...] | None]:
    """Ranks and shard specs of a table of ``rows`` x ``dim`` sharded over ``ranks``."""
    if sharding_type is ShardingType.DATA_PARALLEL:
        return tuple(ranks), None
    if sharding_type is ShardingType.TABLE_WISE:
        r = ranks[0]
        return (r,), (ShardSpec.on(r, device, (0, 0), (rows, dim)),)
    if sharding_type in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
        cols = _blocks(dim, len(ranks))
        shards = [
            ShardSpec.on(r, device, (0, c), (rows, n))
            for r, (c, n) in zip(ranks, cols, strict=True)
        ]
    elif sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        blocks = _blocks(rows, len(ranks))
        shards = [
            ShardSpec.on(r, device, (o, 0), (n, dim))
            for r, (o, n) in zip(ranks, blocks, strict=True)
        ]
    else:  # GRID_SHARD: two column blocks, each row-split over half the ranks
        half = max(1, len(ranks) // 2)
        groups = [ranks[:half], ranks[half:] or ranks[:half]]
        cols = _blocks(dim, 2)
        shards = []
        for group, (c, n) in zip(groups, cols, strict=True):
            for r, (o, m) in zip(group, _blocks(rows, len(group)), strict=True):
                shards.append(ShardSpec.on(r, device, (o, c), (m, n)))
    return tuple(s.rank for s in shards), tuple(shards)


def make_sharding(
    sharding_type: ShardingType,
    world_size: int = 4,
    rows: int = 100,
    dim: int = 16,
    kernel: ComputeKernel = ComputeKernel.FUSED,
    device: str = "cpu",
    **extras: object,
) -> ParameterSharding:
    ranks, shards = layout(sharding_type, rows, dim, list(range(world_size)), device)
    return ParameterSharding(sharding_type, kernel, ranks, shards, **extras)  # type: ignore[arg-type]


# --- hypothesis strategies ----------------------------------------------------------------------

_opt_bool = st.none() | st.booleans()

multipass = st.builds(
    MultiPassPrefetchConfig,
    num_passes=st.integers(1, 64),
    min_splitable_pass_size=st.integers(1, 1 << 30),
)

cache_params = st.builds(
    CacheParams,
    algorithm=st.none() | st.sampled_from(CacheAlgorithm),
    load_factor=st.none() | st.floats(min_value=1e-6, max_value=1.0),
    reserved_memory=st.none() | st.floats(min_value=0.0, max_value=1e6),
    precision=st.none() | st.sampled_from(DataType),
    prefetch_pipeline=_opt_bool,
    multipass_prefetch_config=st.none() | multipass,
)

key_value_params = st.builds(
    KeyValueParams,
    ssd_storage_directory=st.none() | st.text(min_size=1, max_size=20),
    ssd_rocksdb_shards=st.none() | st.integers(1, 64),
    gather_ssd_cache_stats=_opt_bool,
    use_passed_in_path=st.booleans(),
    l2_cache_size=st.none() | st.integers(0, 1 << 20),
    ps_hosts=st.none()
    | st.lists(st.tuples(st.text(min_size=1, max_size=10), st.integers(0, 65535)), max_size=3).map(
        tuple
    ),
    ps_client_thread_num=st.none() | st.integers(1, 32),
)


@st.composite
def parameter_shardings(draw: st.DrawFn, world_size: int | None = None) -> ParameterSharding:
    ws = world_size if world_size is not None else draw(st.integers(1, 8))
    sharding_type = draw(st.sampled_from(ShardingType))
    rows = draw(st.integers(1, 10_000))
    dim = draw(st.integers(1, 512))
    if sharding_type is ShardingType.TABLE_WISE:
        ranks = [draw(st.integers(0, ws - 1))]
    else:
        ranks = draw(st.permutations(range(ws)))
        ranks = ranks[: draw(st.integers(1, ws))]
    device = draw(st.sampled_from(["cpu", "cuda"]))
    rank_tuple, shards = layout(sharding_type, rows, dim, list(ranks), device)
    return ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel=draw(st.sampled_from(ComputeKernel)),
        ranks=rank_tuple,
        shards=shards,
        cache_params=draw(st.none() | cache_params),
        enforce_hbm=draw(_opt_bool),
        stochastic_rounding=draw(_opt_bool),
        bounds_check_mode=draw(st.none() | st.sampled_from(BoundsCheckMode)),
        output_dtype=draw(st.none() | st.sampled_from(DataType)),
        key_value_params=draw(st.none() | key_value_params),
    )


_names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)

module_plans = st.dictionaries(_names, parameter_shardings(), max_size=4).map(
    EmbeddingModuleShardingPlan
) | st.builds(ObjectPoolShardingPlan, st.sampled_from(ObjectPoolShardingType), st.booleans())

sharding_plans = st.dictionaries(_names, module_plans, max_size=3).map(ShardingPlan)
