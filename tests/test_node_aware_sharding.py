"""Table-row-wise, table-column-wise and grid sharding on 4 ranks laid out as 2 nodes x 2.

One process launch (the session's pool of 4 ranks) checks every case. For each plan (every
table table-row-wise; every table table-column-wise; every table grid; one plan mixing all
seven sharding types) with RowWiseAdagrad (FBGEMM's kernels, row-wise state) and Adam
(embshard's torch kernels), the forward equals the unsharded collection's on the global batch
and, after 3 steps, every local shard of every table's weights and optimizer state equals the
unsharded module stepped with ``L = (1/N) * sum_i L_i`` (within 1e-6: row blocks add partial
bags). Row-wise state of column blocks (grid, table-column-wise) must equal the full row's.
The node size comes from the sharder's ``local_world_size=2`` in most cases, from the
``LOCAL_WORLD_SIZE`` environment variable in one, one case puts all 4 ranks in one node
(table-row-wise is then row-wise with a fixed summation order) and two give every rank a node
of its own (table-row-wise and grid without an intra-node stage). Batches have uneven local sizes (one rank has
none), empty bags, a table read by two features, SUM and MEAN pooling, a table with fewer rows
than a node has ranks' worth of blocks, and a key order that differs from the collection's.

The plan checks of the node-aware types run in this process (no ranks needed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device

from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.strategies.layout import grid_specs
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, PoolingType, ShardingType

WORLD = 4
NODE = 2
STEPS = 3
ATOL = RTOL = 1e-6
TABLES = (
    EmbeddingBagConfig(name="t0", num_embeddings=13, embedding_dim=8, feature_names=("f0",)),
    EmbeddingBagConfig(
        name="t1",
        num_embeddings=11,
        embedding_dim=12,
        feature_names=("f1a", "f1b"),
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(name="t2", num_embeddings=3, embedding_dim=16, feature_names=("f2",)),
    EmbeddingBagConfig(
        name="t3", num_embeddings=9, embedding_dim=4, feature_names=("f3",), pooling="mean"
    ),
    EmbeddingBagConfig(name="t4", num_embeddings=7, embedding_dim=8, feature_names=("f4",)),
    EmbeddingBagConfig(name="t5", num_embeddings=10, embedding_dim=8, feature_names=("f5",)),
    EmbeddingBagConfig(
        name="t6", num_embeddings=5, embedding_dim=12, feature_names=("f6",), pooling="mean"
    ),
)
OPTIMIZERS = {
    "rowwise_adagrad": OptimizerSpec.from_name("rowwise_adagrad", lr=0.3, eps=1e-3),
    "adam": OptimizerSpec.from_name("adam", lr=0.05),
    "sgd": OptimizerSpec.from_name("sgd", lr=0.5),
}
DENSE = "dense_sgd"
"""Dense kernels, trained by ``torch.optim.SGD`` over the (local) parameters."""


@dataclass(frozen=True)
class Case:
    """One configuration checked on every rank."""

    plan: str
    optimizer: str
    weighted: bool = False
    node_size_from_env: bool = False
    node_size: int = NODE


def tables(weighted: bool) -> list[EmbeddingBagConfig]:
    """The collection's tables (all SUM when weighted: per-id weights need SUM pooling)."""
    return [replace(t, pooling=PoolingType.SUM) if weighted else t for t in TABLES]


def _ps(
    kind: ShardingType, ranks: list[int] | None = None, shards: Any = None
) -> ParameterSharding:
    return ParameterSharding(kind, "fused", ranks=ranks, shards=shards)


def _grid(
    name: str, widths: list[int], nodes: list[int], node_size: int = NODE
) -> ParameterSharding:
    """A grid sharding with explicit block widths, block ``c`` on node ``nodes[c]``."""
    config = next(t for t in TABLES if t.name == name)
    blocks = [[n * node_size + lr for lr in range(node_size)] for n in nodes]
    specs = grid_specs(
        config.num_embeddings,
        config.embedding_dim,
        blocks,
        test_device().type,
        shard_dims=widths,
        table_name=name,
    )
    return _ps(ShardingType.GRID_SHARD, [s.rank for s in specs], specs)


def _columns(
    name: str, widths: list[int], ranks: list[int], kind: ShardingType
) -> ParameterSharding:
    config = next(t for t in TABLES if t.name == name)
    specs, at = [], 0
    for width, rank in zip(widths, ranks, strict=True):
        specs.append(
            ShardSpec.on(rank, test_device().type, (0, at), (config.num_embeddings, width))
        )
        at += width
    return _ps(kind, ranks, specs)


def plan_for(name: str) -> EmbeddingModuleShardingPlan:
    """The plan named ``name`` (nodes: ranks 0, 1 and ranks 2, 3)."""
    twrw, twcw = ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE
    node = [[0, 1], [2, 3]]
    plans: dict[str, dict[str, ParameterSharding]] = {
        "twrw": {t.name: _ps(twrw, node[(i + 1) % 2]) for i, t in enumerate(TABLES)},
        "one_node": {t.name: _ps(twrw, [0, 1, 2, 3]) for t in TABLES},
        "twcw": {
            "t0": _columns("t0", [4, 4], [3, 2], twcw),
            "t1": _columns("t1", [8, 4], [0, 1], twcw),
            "t2": _ps(twcw, [1, 0]),
            "t3": _columns("t3", [4], [2], twcw),
            "t4": _ps(twcw, [3]),
            "t5": _ps(twcw, [0, 1]),
            "t6": _columns("t6", [4, 8], [2, 3], twcw),
        },
        "grid": {
            "t0": _grid("t0", [4, 4], [1, 0]),
            "t1": _grid("t1", [8, 4], [0, 1]),
            "t2": _grid("t2", [4, 12], [1, 0]),
            "t3": _grid("t3", [4], [1]),
            "t4": _ps(ShardingType.GRID_SHARD, [0, 1, 2, 3]),
            "t5": _grid("t5", [8], [0]),
            "t6": _grid("t6", [4, 8], [1, 0]),
        },
        # one rank per node (sharder's local_world_size=1): the multi-node layouts with no
        # intra-node stage; grid blocks of MEAN tables reordered across nodes
        "rank_nodes": {
            "t0": _grid("t0", [4, 4], [3, 1], node_size=1),
            "t1": _ps(twrw, [2]),
            "t2": _grid("t2", [4, 12], [0, 2], node_size=1),
            "t3": _ps(twrw, [1]),
            "t4": _ps(twrw, [3]),
            "t5": _grid("t5", [4, 4], [2, 0], node_size=1),
            "t6": _grid("t6", [8, 4], [1, 3], node_size=1),
        },
        "mixed": {
            "t0": _ps(ShardingType.DATA_PARALLEL),
            "t1": _grid("t1", [4, 8], [1, 0]),
            "t2": _ps(twrw, [2, 3]),
            "t3": _ps(ShardingType.TABLE_WISE, [1]),
            "t4": _ps(ShardingType.ROW_WISE),
            "t5": _columns("t5", [4, 4], [3, 0], ShardingType.COLUMN_WISE),
            "t6": _columns("t6", [8, 4], [1, 0], twcw),
        },
    }
    return EmbeddingModuleShardingPlan(plans[name])


def batch_sizes(plan: str) -> list[int]:
    """Local batch sizes: uneven, and an empty local batch for the mixed plan."""
    return [2, 3, 0, 4] if plan == "mixed" else [3, 1, 4, 2]


def global_batch(configs: list[EmbeddingBagConfig], step: int, size: int) -> dict[str, Any]:
    """Per feature: lengths (0 to 3, so some bags are empty), ids and weights."""
    g = torch.Generator().manual_seed(300 + step)
    out: dict[str, Any] = {}
    for config in configs:
        for feature in config.feature_names:
            lengths = torch.randint(0, 4, (size,), generator=g)
            ids = torch.randint(0, config.num_embeddings, (int(lengths.sum()),), generator=g)
            out[feature] = (lengths, ids, torch.rand(ids.shape, generator=g) + 0.1)
    return out


def kjt_of(data: dict[str, Any], keys: list[str], lo: int, hi: int, weighted: bool):
    """The samples ``[lo, hi)`` of ``data`` for ``keys``, as a KJT."""
    lengths, values, weights = [], [], []
    for key in keys:
        length, ids, w = data[key]
        start = int(length[:lo].sum())
        stop = start + int(length[lo:hi].sum())
        lengths.append(length[lo:hi])
        values.append(ids[start:stop])
        weights.append(w[start:stop])
    return KeyedJaggedTensor(
        keys,
        torch.cat(values),
        weights=torch.cat(weights) if weighted else None,
        lengths=torch.cat(lengths),
    )


def check_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within 1e-6 (compared on the CPU)."""
    torch.testing.assert_close(
        actual.cpu(), expected.cpu(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}"
    )


def local_pieces(value: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``(tensor, offsets)`` per local shard of a ShardedTensor / DTensor, or the whole tensor."""
    if hasattr(value, "local_shards"):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    if hasattr(value, "to_local"):
        inner = value.to_local()  # a LocalShardsWrapper (which may hold no shard)
        shards = inner.local_shards()
        return [
            (t, tuple(o)) for t, o in zip(shards, inner.local_offsets()[: len(shards)], strict=True)
        ]
    return [(value, (0,) * value.dim())]


def check_state(actual: Any, expected: torch.Tensor, what: str) -> int:
    """Compare each local piece with its slice of ``expected``; return how many were compared.

    A 1-D piece is row-wise state: a table cut into column blocks holds one block of ``rows``
    values per column block, each of which must equal the full row's state.
    """
    n = 0
    for tensor, offsets in local_pieces(actual):
        if tensor.dim() == 1:
            start = offsets[0] % expected.shape[0]
            check_close(tensor, expected[start : start + tensor.shape[0]], what)
        else:
            (r, c), (nr, nc) = offsets, tensor.shape
            check_close(tensor, expected[r : r + nr, c : c + nc], what)
        n += 1
    return n


def compare_tables(sharded: Any, reference: EmbeddingBagCollection, what: str) -> int:
    """Every local shard of weights and optimizer state against ``reference``."""
    compared = 0
    weights, ref_weights = sharded.state_dict(), reference.state_dict()
    assert sorted(weights) == sorted(ref_weights)
    for key, value in weights.items():
        compared += check_state(value, ref_weights[key], f"{what} {key}")
    states = sharded.fused_optimizer.state_dict()["state"]
    ref_states = reference.fused_optimizer.state_dict()["state"]
    for param, state in states.items():
        for name, value in state.items():
            compared += check_state(value, ref_states[param][name], f"{what} {name}")
    return compared


def run_case(case: Case) -> int:
    """Train sharded and unsharded side by side; return the number of local shards compared."""
    rank = dist.get_rank()
    configs = tables(case.weighted)
    dense = case.optimizer == DENSE
    spec = None if dense else OPTIMIZERS[case.optimizer]
    torch.manual_seed(11)
    reference = EmbeddingBagCollection(configs, is_weighted=case.weighted, optimizer=spec)
    torch.manual_seed(11)
    source = EmbeddingBagCollection(configs, is_weighted=case.weighted, optimizer=spec)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    device = test_device()
    plan = plan_for(case.plan)
    if dense:
        kernel = ComputeKernel.DENSE
        plan = EmbeddingModuleShardingPlan(
            {t: replace(p, compute_kernel=kernel) for t, p in plan.items()}
        )
    if case.node_size_from_env:
        os.environ["LOCAL_WORLD_SIZE"] = str(NODE)
        try:
            sharded = EmbeddingBagCollectionSharder().shard(source, plan, env, device)
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
    else:
        sharder = EmbeddingBagCollectionSharder(local_world_size=case.node_size)
        sharded = sharder.shard(source, plan, env, device)
    optimizers = (
        [torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, reference)]
        if dense
        else [sharded.fused_optimizer, reference.fused_optimizer]
    )

    sizes = batch_sizes(case.plan)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    keys = [f for c in configs for f in c.feature_names]
    for step in range(STEPS):
        data = global_batch(configs, step, sum(sizes))
        out = sharded(kjt_of(data, keys[::-1], lo, hi, case.weighted).to(device))
        expected = reference(kjt_of(data, keys, 0, sum(sizes), case.weighted))
        assert out.keys() == expected.keys()
        check_close(out.values(), expected.values()[lo:hi], f"{case} step {step} forward")
        g = torch.Generator().manual_seed(2000 + step)
        factors = torch.randn(expected.values().shape, generator=g)
        (out.values() * factors[lo:hi].to(device)).sum().backward()
        ((expected.values() * factors).sum() / WORLD).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return compare_tables(sharded, reference, str(case))


def run_cases(cases: list[Case]) -> list[int]:
    torch.set_num_threads(1)
    return [run_case(case) for case in cases]


CASES = [
    Case(plan, optimizer)
    for plan in ("twrw", "twcw", "grid", "mixed")
    for optimizer in ("rowwise_adagrad", "adam")
] + [
    Case("mixed", "rowwise_adagrad", weighted=True),
    Case("grid", "sgd", weighted=True, node_size_from_env=True),
    Case("one_node", "adam", node_size=WORLD),
    Case("twrw", DENSE),
    Case("grid", DENSE, weighted=True),
    Case("rank_nodes", "rowwise_adagrad", node_size=1),
    Case("rank_nodes", "sgd", weighted=True, node_size=1),
]


def test_node_aware_matches_unsharded() -> None:
    results = run_on_ranks(WORLD, run_cases, CASES, timeout_s=240)
    for case, per_rank in zip(CASES, zip(*results, strict=True), strict=True):
        assert sum(per_rank) > 0, case


# -- plan checks (no ranks) --------------------------------------------------------------


def _check(plan: dict[str, ParameterSharding], local_world_size: int | None = NODE) -> None:
    module = EmbeddingBagCollection(list(TABLES[:1]), device="meta")
    sharder = EmbeddingBagCollectionSharder(local_world_size=local_world_size)
    sharder.check_plan(
        module, EmbeddingModuleShardingPlan(plan), ShardingEnv.from_local(WORLD, 0), "cpu"
    )


def test_plan_checks_accept_node_layouts() -> None:
    _check({"t0": _ps(ShardingType.TABLE_ROW_WISE, [2, 3])})
    _check({"t0": _ps(ShardingType.TABLE_COLUMN_WISE, [1, 0])})
    _check({"t0": _ps(ShardingType.GRID_SHARD, [2, 3, 0, 1])})


@pytest.mark.parametrize(
    ("sharding", "message"),
    [
        (_ps(ShardingType.TABLE_ROW_WISE, [1, 2]), "one row block per rank of one node"),
        (_ps(ShardingType.TABLE_ROW_WISE, [3, 2]), "one row block per rank of one node"),
        (_ps(ShardingType.TABLE_COLUMN_WISE, [1, 2]), "must sit on one node"),
        (_ps(ShardingType.TABLE_ROW_WISE), "needs ranks"),
    ],
)
def test_plan_checks_refuse_bad_node_layouts(sharding: ParameterSharding, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        _check({"t0": sharding})
    assert "'t0'" in str(info.value)


def test_plan_checks_refuse_grid_blocks_on_one_node() -> None:
    blocks = grid_specs(13, 8, [[0, 1], [0, 1]], table_name="t0")
    sharding = _ps(ShardingType.GRID_SHARD, [s.rank for s in blocks], blocks)
    with pytest.raises(ValueError, match="distinct nodes"):
        _check({"t0": sharding})


def test_node_size_must_divide_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="do not divide"):
        _check({"t0": _ps(ShardingType.TABLE_ROW_WISE, [0, 1, 2])}, local_world_size=3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        _check({"t0": _ps(ShardingType.TABLE_ROW_WISE, [0, 1, 2])}, local_world_size=None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    _check({"t0": _ps(ShardingType.TABLE_ROW_WISE, [2, 3])}, local_world_size=None)
