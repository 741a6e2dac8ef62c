"""ShardedEmbeddingCollection on real gloo ranks against the unsharded EmbeddingCollection.

For every sharding type and a mixed plan, with a fused optimizer FBGEMM runs (RowWiseAdagrad)
and one embshard's torch kernels run (Adam), on 2 and 3 ranks: every feature's JaggedTensor
equals the unsharded collection's on the global batch (same lengths; rows bit for bit at the
first step), and after 3 training steps every table's weights and optimizer state (read through
``state_dict()`` and ``fused_optimizer.state_dict()``, local shard by local shard) equal the
unsharded module's stepped with ``L = (1/N) * sum_i L_i``. The tables have different widths
(4, 8, 12, 16: shards of several widths travel in one all-to-all), one table is read by two
features, one has fewer rows than ranks (an empty row-wise shard), bags are sometimes empty,
local batch sizes are uneven (an empty one too), the input has an extra feature and another key
order. Where the sharded module runs the reference's very arithmetic the results must be
bit-identical, elsewhere within 1e-6. A dense-kernel plan (torch SGD) and a plan sending the
rows in FP16 (``sequence_embeddings_all_to_all`` codec) are checked too.

Under ``EMBSHARD_TEST_BACKEND=nccl`` the sharded collection runs on each rank's GPU and the
reference stays on the CPU; results are then compared within 1e-6 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device

from embshard_dist.comm.qcomms import get_qcomm_codecs_registry
from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
from embshard_kernels.collections import EmbeddingCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingConfig
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import CommOp, ShardingType

TABLES = (
    EmbeddingConfig(name="t_a", num_embeddings=13, embedding_dim=8, feature_names=("f_a",)),
    EmbeddingConfig(
        name="t_shared", num_embeddings=11, embedding_dim=12, feature_names=("f_b", "f_c")
    ),
    EmbeddingConfig(name="t_wide", num_embeddings=2, embedding_dim=16, feature_names=("f_d",)),
    EmbeddingConfig(name="t_small", num_embeddings=9, embedding_dim=4, feature_names=("f_e",)),
)
KEYS = [f for t in TABLES for f in t.feature_names]
STEPS = 3
OPTIMIZERS = {
    "rowwise_adagrad": OptimizerSpec.from_name("rowwise_adagrad", lr=0.3, eps=1e-3),
    "adam": OptimizerSpec.from_name("adam", lr=0.05),
}
DENSE = "dense_sgd"
"""Dense kernels, trained by ``torch.optim.SGD`` over the (local) parameters."""
ATOL = RTOL = 1e-6
FP16_TOL = 2e-3


@dataclass(frozen=True)
class Case:
    """One configuration checked on every rank."""

    plan: str
    optimizer: str
    fp16: bool = False


def plan_for(name: str, world: int, kernel: str = "fused") -> EmbeddingModuleShardingPlan:
    """The plan named ``name`` for ``world`` ranks, every table on compute kernel ``kernel``."""
    device = test_device().type

    def ps(kind: ShardingType, ranks: list[int] | None = None) -> ParameterSharding:
        return ParameterSharding(kind, kernel, ranks=ranks)

    def columns(widths: list[int], ranks: list[int], rows: int) -> ParameterSharding:
        specs, at = [], 0
        for width, rank in zip(widths, ranks, strict=True):
            specs.append(ShardSpec.on(rank, device, (0, at), (rows, width)))
            at += width
        return ParameterSharding(ShardingType.COLUMN_WISE, kernel, ranks=ranks, shards=specs)

    last = world - 1
    tw, rw, dp = ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL
    plans = {
        "tw": {t.name: ps(tw, [i % world]) for i, t in enumerate(TABLES)},
        "rw": {t.name: ps(rw) for t in TABLES},
        "dp": {t.name: ps(dp) for t in TABLES},
        "cw": {
            "t_a": columns([4, 4], [last, 0], 13),
            "t_shared": columns([4, 8], [0, 1], 11)
            if world == 2
            else columns([4, 4, 4], [2, 0, 1], 11),
            "t_wide": ps(ShardingType.COLUMN_WISE, list(range(world))),
            "t_small": columns([4], [last], 9),
        },
        "mixed": {
            "t_a": ps(tw, [last]),
            "t_shared": ps(rw),
            "t_wide": ps(ShardingType.COLUMN_WISE, [last, 0]),
            "t_small": ps(dp),
        },
        "mixed_dense": {  # data-parallel tables need a fused kernel
            "t_a": ps(tw, [last]),
            "t_shared": ps(rw),
            "t_wide": ps(ShardingType.COLUMN_WISE, [last, 0]),
            "t_small": columns([4], [0], 9),
        },
    }
    return EmbeddingModuleShardingPlan(plans[name])


def batch_sizes(world: int, plan: str) -> list[int]:
    """Local batch sizes: uneven on 3 ranks, and an empty local batch for the mixed plan."""
    if world == 2:
        return [3, 3]
    return [0, 4, 3] if plan.startswith("mixed") else [2, 4, 3]


def global_batch(step: int, size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per feature: lengths (0 to 3, so some bags are empty) and ids of the global batch."""
    g = torch.Generator().manual_seed(100 + step)
    out = {}
    for config in TABLES:
        for feature in config.feature_names:
            lengths = torch.randint(0, 4, (size,), generator=g)
            ids = torch.randint(0, config.num_embeddings, (int(lengths.sum()),), generator=g)
            out[feature] = (lengths, ids)
    return out


def id_range(lengths: torch.Tensor, lo: int, hi: int) -> slice:
    """The ids of samples ``[lo, hi)``."""
    start = int(lengths[:lo].sum())
    return slice(start, start + int(lengths[lo:hi].sum()))


def kjt_of(data: dict[str, Any], keys: list[str], lo: int, hi: int) -> KeyedJaggedTensor:
    """The samples ``[lo, hi)`` of ``data`` for ``keys``, as a KJT (with weights to ignore)."""
    lengths = [data[k][0][lo:hi] for k in keys]
    values = [data[k][1][id_range(data[k][0], lo, hi)] for k in keys]
    ids = torch.cat(values)
    return KeyedJaggedTensor(keys, ids, weights=torch.ones(ids.shape), lengths=torch.cat(lengths))


def check_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, *, exact: bool, tol: float = ATOL
) -> None:
    """Equal bit for bit when ``exact``, else within ``tol`` (compared on the CPU)."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if exact:
        assert torch.equal(actual, expected), f"{what}: not bit-identical"
    else:
        torch.testing.assert_close(
            actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}"
        )


def check_state(
    actual: Any, expected: torch.Tensor, what: str, *, exact: bool, tol: float = ATOL
) -> int:
    """Compare each local piece with its slice of ``expected``; return how many were compared.

    A 1-D piece is row-wise state; a column-wise table's row-wise state holds one block of
    ``rows`` values per column block, each of which must equal the full-row state.
    """
    if hasattr(actual, "local_shards"):
        pieces = [(s.tensor, tuple(s.metadata.shard_offsets)) for s in actual.local_shards()]
    else:
        pieces = [(actual, (0,) * actual.dim())]
    for tensor, offsets in pieces:
        if tensor.dim() == 1:
            start = offsets[0] % expected.shape[0]
            expected_part = expected[start : start + tensor.shape[0]]
        else:
            (r, c), (nr, nc) = offsets, tensor.shape
            expected_part = expected[r : r + nr, c : c + nc]
        check_close(tensor, expected_part, what, exact=exact, tol=tol)
    return len(pieces)


def exact_training(case: Case) -> bool:
    """Whether training adds every gradient in the reference's order (embshard's torch kernels
    for table-, row- and column-wise tables: all ids of a row meet in one backward, in global
    batch order). FBGEMM's RowWiseAdagrad accumulates in its own order and data-parallel
    replicas add each rank's sums."""
    return case.plan in ("tw", "rw", "cw") and case.optimizer == "adam" and not case.fp16


def run_case(case: Case) -> int:
    """Train sharded and unsharded side by side; return the number of local shards compared."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dense = case.optimizer == DENSE
    spec = None if dense else OPTIMIZERS[case.optimizer]
    torch.manual_seed(7)
    reference = EmbeddingCollection(list(TABLES), optimizer=spec)
    torch.manual_seed(7)
    source = EmbeddingCollection(list(TABLES), optimizer=spec)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    plan = plan_for(case.plan, world, "dense" if dense else "fused")
    device = test_device()
    same_kernels = device.type == "cpu"
    registry = (
        get_qcomm_codecs_registry({CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL: ("fp16", "fp16")})
        if case.fp16
        else None
    )
    sharded = EmbeddingCollectionSharder(qcomm_codecs_registry=registry).shard(
        source, plan, env, device
    )
    optimizers = (
        [torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, reference)]
        if dense
        else [sharded.fused_optimizer, reference.fused_optimizer]
    )
    tol = FP16_TOL if case.fp16 else ATOL

    sizes = batch_sizes(world, case.plan)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    shuffled = [*reversed(KEYS), "f_extra"]
    for step in range(STEPS):
        data = global_batch(step, sum(sizes))
        data["f_extra"] = data[KEYS[0]]
        out = sharded(kjt_of(data, shuffled, lo, hi).to(device)).wait()
        expected = reference(kjt_of(data, KEYS, 0, sum(sizes)))
        assert list(out) == KEYS
        exact = same_kernels and (exact_training(case) or step == 0) and not case.fp16
        loss = torch.zeros(())
        ref_loss = torch.zeros(())
        g = torch.Generator().manual_seed(1000 + step)
        for feature in KEYS:
            lengths = data[feature][0]
            mine, want = out[feature], expected[feature]
            assert torch.equal(mine.lengths().cpu(), lengths[lo:hi]), f"{case} {feature} lengths"
            rows = id_range(lengths, lo, hi)
            what = f"{case} step {step} forward {feature}"
            check_close(mine.values(), want.values()[rows], what, exact=exact, tol=tol)
            factors = torch.randn(want.values().shape, generator=g)
            loss = loss + (mine.values().cpu() * factors[rows]).sum()
            ref_loss = ref_loss + (want.values() * factors).sum()
        loss.backward()
        (ref_loss / world).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    compared = 0
    exact = same_kernels and exact_training(case)
    weights = sharded.state_dict()
    ref_weights = reference.state_dict()
    assert sorted(weights) == sorted(ref_weights)
    for key, value in weights.items():
        what = f"{case} {key}"
        compared += check_state(value, ref_weights[key], what, exact=exact, tol=tol)
    if case.fp16:  # Adam's state divides by tiny second moments: FP16 errors grow there
        return compared
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
    Case(plan, optimizer) for plan in ("tw", "rw", "cw", "dp", "mixed") for optimizer in OPTIMIZERS
] + [
    Case("mixed_dense", DENSE),
    Case("mixed", "adam", fp16=True),
]


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_ec_matches_unsharded(world_size: int) -> None:
    results = run_on_ranks(world_size, run_cases, ALL_CASES, timeout_s=240)
    for case, case_results in zip(ALL_CASES, zip(*results, strict=True), strict=True):
        assert sum(case_results) > 0, case  # every case compared some local shards
