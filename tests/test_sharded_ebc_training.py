"""ShardedEmbeddingBagCollection on real gloo ranks against the unsharded collection.

For every sharding type and a mixed plan, with a fused optimizer FBGEMM runs (RowWiseAdagrad)
and one embshard's torch kernels run (Adam), weighted and unweighted, on 2 and 3 ranks: the
forward equals the unsharded collection's on the global batch, and after 3 training steps every
table's weights and optimizer state (read through ``state_dict()`` and
``fused_optimizer.state_dict()``, local shard by local shard) equal the unsharded module's
stepped with ``L = (1/N) * sum_i L_i``. The batches have empty bags, a table read by two
features, MEAN and SUM pooling, uneven local batch sizes (an empty one too), extra input
features, a key order that differs from the collection's, and per-id weights an unweighted
collection must ignore. Where the sharded module runs the reference's very arithmetic the
results must be bit-identical (see ``exact_forward`` / ``exact_training``), elsewhere within
1e-6; data-parallel tables are bit-identical on every rank. Column-wise and data-parallel
cases run again on each fused path (FBGEMM's row loop or the torch rules). One process launch
per world size checks every case.

Under ``EMBSHARD_TEST_BACKEND=nccl`` the sharded collection runs on each rank's GPU and the
reference stays on the CPU: CUDA and CPU kernels do not share arithmetic, so there every case
is checked within 1e-6 (none bit for bit).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device

import embshard_dist.strategies.dp as dp_module
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.path_probe import ENV_VAR
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import PoolingType, ShardingType

TABLES = (
    EmbeddingBagConfig(name="t_sum", num_embeddings=13, embedding_dim=8, feature_names=("f_a",)),
    EmbeddingBagConfig(
        name="t_shared",
        num_embeddings=11,
        embedding_dim=12,
        feature_names=("f_b", "f_c"),
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(name="t_wide", num_embeddings=2, embedding_dim=16, feature_names=("f_d",)),
    EmbeddingBagConfig(
        name="t_mean", num_embeddings=9, embedding_dim=4, feature_names=("f_e",), pooling="mean"
    ),
)
STEPS = 3
OPTIMIZERS = {
    "rowwise_adagrad": OptimizerSpec.from_name("rowwise_adagrad", lr=0.3, eps=1e-3),
    "adam": OptimizerSpec.from_name("adam", lr=0.05),
}
MORE_OPTIMIZERS = {  # checked on fewer plans
    "sgd": OptimizerSpec.from_name("sgd", lr=0.5),
    "adagrad": OptimizerSpec.from_name("adagrad", lr=0.3),
    "partial_rowwise_adam": OptimizerSpec.from_name("partial_rowwise_adam", lr=0.05),
    "lamb": OptimizerSpec.from_name("lamb", lr=0.05, weight_decay=0.01),
    "lars_sgd": OptimizerSpec.from_name("lars_sgd", lr=0.5, eta=0.05),
    "rowwise_adagrad_l2": OptimizerSpec.from_name(
        "rowwise_adagrad", lr=0.3, weight_decay=0.01, weight_decay_mode="l2"
    ),
}
DENSE = "dense_sgd"
"""Dense kernels, trained by ``torch.optim.SGD`` over the (local) parameters."""
ATOL = RTOL = 1e-6


@dataclass(frozen=True)
class Case:
    """One configuration checked on every rank."""

    plan: str
    optimizer: str
    weighted: bool


def tables(weighted: bool) -> list[EmbeddingBagConfig]:
    """The collection's tables (all SUM when weighted: per-id weights need SUM pooling)."""
    return [replace(t, pooling=PoolingType.SUM) if weighted else t for t in TABLES]


def plan_for(name: str, world: int, kernel: str = "fused") -> EmbeddingModuleShardingPlan:
    """The plan named ``name`` for ``world`` ranks, every table on compute kernel ``kernel``."""

    def ps(kind: ShardingType, ranks: list[int] | None = None) -> ParameterSharding:
        return ParameterSharding(kind, kernel, ranks=ranks)

    def columns(widths: list[int], ranks: list[int], rows: int) -> ParameterSharding:
        specs, at = [], 0
        for width, rank in zip(widths, ranks, strict=True):
            specs.append(ShardSpec.on(rank, test_device().type, (0, at), (rows, width)))
            at += width
        return ParameterSharding(ShardingType.COLUMN_WISE, kernel, ranks=ranks, shards=specs)

    last = world - 1
    tw = ShardingType.TABLE_WISE
    rw = ShardingType.ROW_WISE
    dp = ShardingType.DATA_PARALLEL
    plans = {
        "tw": {t.name: ps(tw, [i % world]) for i, t in enumerate(TABLES)},
        "rw": {t.name: ps(rw) for t in TABLES},
        "dp": {t.name: ps(dp) for t in TABLES},
        "cw": {
            "t_sum": columns([4, 4], [last, 0], 13),
            "t_shared": columns([4, 8], [0, 1], 11)
            if world == 2
            else columns([4, 4, 4], [2, 0, 1], 11),
            "t_wide": ps(ShardingType.COLUMN_WISE, list(range(world))),
            "t_mean": columns([4], [last], 9),
        },
        "mixed_dense": {  # data-parallel tables need a fused kernel
            "t_sum": ps(tw, [last]),
            "t_shared": ps(rw),
            "t_wide": ps(ShardingType.COLUMN_WISE, [last, 0]),
            "t_mean": columns([4], [0], 9),
        },
        "mixed": {
            "t_sum": ps(tw, [last]),
            "t_shared": ps(rw),
            "t_wide": ps(ShardingType.COLUMN_WISE, [last, 0]),
            "t_mean": ps(dp),
        },
    }
    return EmbeddingModuleShardingPlan(plans[name])


def batch_sizes(world: int, plan: str) -> list[int]:
    """Local batch sizes: uneven on 3 ranks, and an empty local batch for the mixed plan."""
    if world == 2:
        return [3, 3]
    return [0, 4, 3] if plan.startswith("mixed") else [2, 4, 3]


def global_batch(configs: list[EmbeddingBagConfig], step: int, size: int) -> dict[str, Any]:
    """Per feature: lengths (0 to 3, so some bags are empty), ids, weights of the global batch."""
    g = torch.Generator().manual_seed(100 + step)
    out: dict[str, Any] = {}
    for config in configs:
        for feature in config.feature_names:
            lengths = torch.randint(0, 4, (size,), generator=g)
            ids = torch.randint(0, config.num_embeddings, (int(lengths.sum()),), generator=g)
            weights = torch.rand(ids.shape, generator=g) + 0.1
            out[feature] = (lengths, ids, weights)
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


def check_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, *, exact: bool = False
) -> None:
    """Equal bit for bit when ``exact``, else within 1e-6 (compared on the CPU)."""
    actual, expected = actual.cpu(), expected.cpu()
    if exact:
        assert torch.equal(actual, expected), f"{what}: not bit-identical"
    else:
        torch.testing.assert_close(
            actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}"
        )


def exact_forward(case: Case) -> bool:
    """Whether the first forward runs the reference's very arithmetic on every bag.

    Table-wise tables run the same kernels as the reference; column-wise and data-parallel
    ones run embshard's torch kernels, as the reference does for Adam (FBGEMM's kernels pool
    in another order than ``torch.nn.functional.embedding_bag``). Row-wise tables add partial
    bags across ranks.
    """
    return case.plan == "tw" or (case.plan in ("cw", "dp") and case.optimizer == "adam")


def exact_training(case: Case) -> bool:
    """Whether training adds every gradient in the reference's order.

    True for table- and column-wise tables on embshard's torch kernels (Adam): all ids of a
    row meet in one backward, in global batch order. FBGEMM's RowWiseAdagrad accumulates in an
    order that depends on the kernel's other tables, data-parallel tables add each rank's sum,
    and row-wise tables add partial bags.
    """
    return case.plan in ("tw", "cw") and case.optimizer == "adam"


def local_pieces(value: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``(tensor, offsets)`` per local shard of a ShardedTensor, or the whole plain tensor."""
    if hasattr(value, "local_shards"):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    return [(value, (0,) * value.dim())]


def check_state(actual: Any, expected: torch.Tensor, what: str, *, exact: bool) -> int:
    """Compare each local piece with its slice of ``expected``; return how many were compared.

    A 1-D piece is row-wise state; a column-wise table's row-wise state holds one block of
    ``rows`` values per column block, each of which must equal the full-row state.
    """
    n = 0
    for tensor, offsets in local_pieces(actual):
        if tensor.dim() == 1:
            start = offsets[0] % expected.shape[0]
            check_close(tensor, expected[start : start + tensor.shape[0]], what, exact=exact)
        else:
            (r, c), (nr, nc) = offsets, tensor.shape
            check_close(tensor, expected[r : r + nr, c : c + nc], what, exact=exact)
        n += 1
    return n


@contextmanager
def data_parallel_exchange(kind: str) -> Iterator[None]:
    """Data-parallel blocks exchange their touched rows however small (``rows``: not one
    all-reduce, never the calls), or always gather every rank's call (``call``)."""
    saved = dp_module.DENSE_EXCHANGE_BYTES, dp_module.CALL_GATHER_RATIO
    if kind == "rows":
        dp_module.DENSE_EXCHANGE_BYTES, dp_module.CALL_GATHER_RATIO = 0, 0.0
    else:
        dp_module.CALL_GATHER_RATIO = math.inf
    try:
        yield
    finally:
        dp_module.DENSE_EXCHANGE_BYTES, dp_module.CALL_GATHER_RATIO = saved


def assert_replicas_identical(weights: dict[str, Any], what: str) -> None:
    """Every rank holds bit for bit the same data-parallel tables."""
    for key, value in weights.items():
        copies = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, value.contiguous())
        assert all(torch.equal(c, copies[0]) for c in copies), f"{what} {key}: replicas differ"


def run_case(case: Case) -> int:
    """Train sharded and unsharded side by side; return the number of local shards compared."""
    if case.plan == "dp_sparse":
        with data_parallel_exchange("rows"):
            return run_case(replace(case, plan="dp"))
    if case.plan.endswith("_call"):  # "dp_call", "mixed_call"
        with data_parallel_exchange("call"):
            return run_case(replace(case, plan=case.plan.removesuffix("_call")))
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = tables(case.weighted)
    dense = case.optimizer == DENSE
    spec = None if dense else {**OPTIMIZERS, **MORE_OPTIMIZERS}[case.optimizer]
    torch.manual_seed(7)
    reference = EmbeddingBagCollection(configs, is_weighted=case.weighted, optimizer=spec)
    torch.manual_seed(7)
    source = EmbeddingBagCollection(configs, is_weighted=case.weighted, optimizer=spec)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    plan = plan_for(case.plan, world, "dense" if dense else "fused")
    device = test_device()
    same_kernels = device.type == "cpu"  # else GPU kernels against the CPU reference
    sharded = EmbeddingBagCollectionSharder().shard(source, plan, env, device)
    optimizers = (
        [torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, reference)]
        if dense
        else [sharded.fused_optimizer, reference.fused_optimizer]
    )

    sizes = batch_sizes(world, case.plan)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    keys = [f for c in configs for f in c.feature_names]
    shuffled = [*reversed(keys), "f_extra"]
    for step in range(STEPS):
        data = global_batch(configs, step, sum(sizes))
        data["f_extra"] = data[keys[0]]
        out = sharded(kjt_of(data, shuffled, lo, hi, True).to(device))  # unweighted: no weights
        expected = reference(kjt_of(data, keys, 0, sum(sizes), case.weighted))
        assert out.keys() == expected.keys()
        exact = same_kernels and (exact_training(case) or (step == 0 and exact_forward(case)))
        check_close(
            out.values(), expected.values()[lo:hi], f"{case} step {step} forward", exact=exact
        )

        g = torch.Generator().manual_seed(1000 + step)
        factors = torch.randn(expected.values().shape, generator=g)
        ((out.values() * factors[lo:hi].to(device)).sum()).backward()
        ((expected.values() * factors).sum() / world).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    compared = 0
    exact = same_kernels and exact_training(case)
    weights = sharded.state_dict()
    if case.plan == "dp":
        assert_replicas_identical(weights, str(case))
    ref_weights = reference.state_dict()
    assert sorted(weights) == sorted(ref_weights)
    for key, value in weights.items():
        compared += check_state(value, ref_weights[key], f"{case} {key}", exact=exact)
    states = sharded.fused_optimizer.state_dict()["state"]
    ref_states = reference.fused_optimizer.state_dict()["state"]
    for param, state in states.items():
        for name, value in state.items():
            compared += check_state(value, ref_states[param][name], f"{case} {name}", exact=exact)
    return compared


def run_cases(cases: list[Case]) -> list[int]:
    torch.set_num_threads(1)
    return [run_case(case) for case in cases]


ALL_CASES = [
    Case(plan, optimizer, weighted)
    for plan in ("tw", "rw", "cw", "dp", "dp_sparse", "dp_call", "mixed")
    for optimizer in OPTIMIZERS
    for weighted in (False, True)
] + [
    Case("cw", "partial_rowwise_adam", True),  # row-wise statistics over column blocks
    Case("cw", "lamb", False),
    Case("cw", "lars_sgd", True),
    Case("cw", "rowwise_adagrad_l2", False),
    Case("mixed", "sgd", True),
    Case("mixed", "adagrad", False),
    Case("mixed", "lamb", True),
    Case("mixed_call", "rowwise_adagrad", True),  # an empty local batch on 3 ranks
    Case("mixed_dense", DENSE, False),
    Case("mixed_dense", DENSE, True),
]


ROW_LOOP_CASES = [
    *(Case("cw", "rowwise_adagrad", weighted) for weighted in (False, True)),
    Case("mixed", "rowwise_adagrad", True),
    *(Case("dp_sparse", "rowwise_adagrad", weighted) for weighted in (False, True)),
    Case("dp_sparse", "sgd", True),
    *(Case("dp_call", "rowwise_adagrad", weighted) for weighted in (False, True)),
    Case("dp_call", "sgd", False),
]
"""Cases whose rows FBGEMM's row loop writes on the ``fbgemm`` path: column blocks (momentum
completed first) and data-parallel tables (every rank's rows handed over unsummed, or every
rank's call joined)."""


def run_cases_on_path(path: str, cases: list[Case]) -> list[int]:
    """``run_cases`` with ``EMBSHARD_FUSED_PATH=path`` (restored after: the ranks are pooled)."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = path
    try:
        return run_cases(cases)
    finally:
        if before is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = before


@pytest.mark.parametrize("path", ["fbgemm", "torch"])
def test_row_loop_cases_on_either_fused_path(path: str) -> None:
    # Column blocks and data-parallel tables: the rows written by FBGEMM's row loop, or by the
    # torch rules; the test below takes the probe's path.
    results = run_on_ranks(2, run_cases_on_path, path, ROW_LOOP_CASES, timeout_s=240)
    for case_results in zip(*results, strict=True):
        assert sum(case_results) > 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_matches_unsharded(world_size: int) -> None:
    results = run_on_ranks(world_size, run_cases, ALL_CASES, timeout_s=240)
    for case_results in zip(*results, strict=True):
        assert sum(case_results) > 0  # every case compared some local shards
