"""Batch sizes that vary per feature, on real gloo ranks, against the unsharded collections.

Pooled (ShardedEmbeddingBagCollection): every rank deduplicates the bags of each feature of its
local batch (so features carry different numbers of samples, and ranks different numbers per
feature, an empty batch too) and passes inverse indices mapping each sample to its bag. The
output must equal the unsharded EmbeddingBagCollection's on the full (duplicated) global batch,
and after 3 steps weights and optimizer state must equal the unsharded module's under the
``L = (1/N) * sum_i L_i`` rule (within 1e-6: removing duplicates only reorders the sums of a
row's gradients). A batch with variable sizes but no inverse indices is refused with a
``ValueError`` on every rank before any collective.

Sequence (ShardedEmbeddingCollection): each feature carries its own number of samples per rank;
every feature's JaggedTensor must hold the rank's lengths and the unsharded collection's rows,
and training must match, as for uniform batches.

FBGEMM facts this relies on (fbgemm-gpu-cpu 1.8.0): the CPU training TBE takes batch sizes per
feature and rank for pooled tables (forward and fused backward agree with embshard's torch
TBE), but refuses them for sequence tables (PoolingMode.NONE); the sequence lookups therefore
hand the kernel one bag per feature (the rows do not depend on the bags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device

from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import PoolingType, ShardingType

BAGS = (
    EmbeddingBagConfig(name="t_sum", num_embeddings=13, embedding_dim=8, feature_names=("f_a",)),
    EmbeddingBagConfig(
        name="t_shared",
        num_embeddings=11,
        embedding_dim=12,
        feature_names=("f_b", "f_c"),
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(name="t_wide", num_embeddings=5, embedding_dim=16, feature_names=("f_d",)),
    EmbeddingBagConfig(
        name="t_small", num_embeddings=9, embedding_dim=4, feature_names=("f_e",), pooling="mean"
    ),
)
SEQUENCES = tuple(
    EmbeddingConfig(
        name=c.name,
        num_embeddings=c.num_embeddings,
        embedding_dim=c.embedding_dim,
        feature_names=c.feature_names,
    )
    for c in BAGS
)
KEYS = [f for t in BAGS for f in t.feature_names]
STEPS = 3
OPTIMIZERS = {
    "rowwise_adagrad": OptimizerSpec.from_name("rowwise_adagrad", lr=0.3, eps=1e-3),
    "adam": OptimizerSpec.from_name("adam", lr=0.05),
}
TOL = 1e-6


@dataclass(frozen=True)
class Case:
    plan: str
    optimizer: str


def plan_for(name: str, world: int) -> EmbeddingModuleShardingPlan:
    last = world - 1
    tw, rw, dp = ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL
    cw = ShardingType.COLUMN_WISE

    def ps(kind: ShardingType, ranks: list[int] | None = None) -> ParameterSharding:
        return ParameterSharding(kind, "fused", ranks=ranks)

    plans = {
        "tw": {t.name: ps(tw, [(i + 1) % world]) for i, t in enumerate(BAGS)},
        "rw": {t.name: ps(rw) for t in BAGS},
        "dp": {t.name: ps(dp) for t in BAGS},
        "cw": {
            "t_sum": ps(cw, [last, 0]),
            "t_shared": ps(cw, list(range(world))),
            "t_wide": ps(cw, [0, last]),
            "t_small": ps(cw, [last]),
        },
        "mixed": {
            "t_sum": ps(tw, [last]),
            "t_shared": ps(rw),
            "t_wide": ps(cw, [last, 0]),
            "t_small": ps(dp),
        },
    }
    return EmbeddingModuleShardingPlan(plans[name])


def local_batches(world: int) -> list[int]:
    return [3, 4] if world == 2 else [0, 4, 3]


def rank_data(step: int, rank: int, batch: int) -> dict[str, Any]:
    """Per feature of one rank's batch: its distinct bags (lengths, ids) and inverse indices."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out: dict[str, Any] = {}
    for i, feature in enumerate(KEYS):
        rows = next(t for t in BAGS if feature in t.feature_names).num_embeddings
        bags = 0 if batch == 0 else max(1, batch - 1 - i % 3)
        lengths = torch.randint(0, 4, (bags,), generator=g)
        ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        covering = torch.cat([torch.arange(bags), torch.randint(0, max(bags, 1), (batch - bags,))])
        inverse = covering[torch.randperm(batch, generator=g)]
        out[feature] = (lengths, ids, inverse)
    return out


def expanded(lengths: torch.Tensor, ids: torch.Tensor, inverse: torch.Tensor) -> tuple[Any, Any]:
    """The full batch's bags (lengths, ids) of one feature: bag ``inverse[j]`` for sample j."""
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    new_lengths = lengths[inverse] if inverse.numel() else lengths[:0]
    pieces = [ids[starts[b] : starts[b + 1]] for b in inverse.tolist()]
    return new_lengths, torch.cat(pieces) if pieces else ids[:0]


def deduplicated_kjt(data: dict[str, Any], keys: list[str], batch: int) -> KeyedJaggedTensor:
    lengths = [data[k][0] for k in keys]
    return KeyedJaggedTensor(
        keys,
        torch.cat([data[k][1] for k in keys]),
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[len(n)] for n in lengths],
        inverse_indices=(keys, torch.stack([data[k][2] for k in keys]).reshape(len(keys), batch)),
    )


def full_kjt(per_rank: list[dict[str, Any]]) -> KeyedJaggedTensor:
    lengths, values = [], []
    for key in KEYS:
        for data in per_rank:
            n, ids = expanded(*data[key])
            lengths.append(n)
            values.append(ids)
    return KeyedJaggedTensor(KEYS, torch.cat(values), lengths=torch.cat(lengths))


def compare_state(sharded: Any, reference: Any, what: str) -> int:
    """Weights and optimizer state, local shard by local shard, within 1e-6."""
    compared = 0

    def check(actual: Any, expected: torch.Tensor, name: str) -> None:
        nonlocal compared
        if hasattr(actual, "local_shards"):
            pieces = [(s.tensor, tuple(s.metadata.shard_offsets)) for s in actual.local_shards()]
        else:
            pieces = [(actual, (0,) * actual.dim())]
        for tensor, offsets in pieces:
            if tensor.dim() == 1:
                start = offsets[0] % expected.shape[0]
                want = expected[start : start + tensor.shape[0]]
            else:
                (r, c), (nr, nc) = offsets, tensor.shape
                want = expected[r : r + nr, c : c + nc]
            torch.testing.assert_close(
                tensor.detach().cpu(), want, atol=TOL, rtol=TOL, msg=lambda m: f"{name}: {m}"
            )
            compared += 1

    ref_weights = reference.state_dict()
    for key, value in sharded.state_dict().items():
        check(value, ref_weights[key], f"{what} {key}")
    ref_states = reference.fused_optimizer.state_dict()["state"]
    for param, state in sharded.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            check(value, ref_states[param][name], f"{what} {param} {name}")
    return compared


def run_pooled(case: Case) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = OPTIMIZERS[case.optimizer]
    torch.manual_seed(3)
    reference = EmbeddingBagCollection(list(BAGS), optimizer=spec)
    torch.manual_seed(3)
    source = EmbeddingBagCollection(list(BAGS), optimizer=spec)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    device = test_device()
    sharded = EmbeddingBagCollectionSharder().shard(source, plan_for(case.plan, world), env, device)
    batches = local_batches(world)
    lo, hi = sum(batches[:rank]), sum(batches[: rank + 1])
    shuffled = [*reversed(KEYS), "f_extra"]
    for step in range(STEPS):
        per_rank = [rank_data(step, r, b) for r, b in enumerate(batches)]
        mine = dict(per_rank[rank])
        mine["f_extra"] = mine[KEYS[0]]
        features = deduplicated_kjt(mine, shuffled, batches[rank])
        assert features.variable_stride_per_key() or batches[rank] == 0
        out = sharded(features.to(device))
        expected = reference(full_kjt(per_rank))
        assert out.keys() == expected.keys()
        got = out.values().cpu()
        torch.testing.assert_close(
            got, expected.values()[lo:hi].detach(), atol=TOL, rtol=TOL, msg=lambda m: f"{case} {m}"
        )
        factors = torch.randn(
            expected.values().shape, generator=torch.Generator().manual_seed(step)
        )
        (out.values() * factors[lo:hi].to(device)).sum().backward()
        ((expected.values() * factors).sum() / world).backward()
        sharded.fused_optimizer.step()
        reference.fused_optimizer.step()
    return compare_state(sharded, reference, str(case))


def run_sequence(case: Case) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = OPTIMIZERS[case.optimizer]
    torch.manual_seed(4)
    reference = EmbeddingCollection(list(SEQUENCES), optimizer=spec)
    torch.manual_seed(4)
    source = EmbeddingCollection(list(SEQUENCES), optimizer=spec)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    device = test_device()
    sharded = EmbeddingCollectionSharder().shard(source, plan_for(case.plan, world), env, device)
    batches = local_batches(world)
    for step in range(STEPS):
        per_rank = [rank_data(step, r, b) for r, b in enumerate(batches)]
        mine = per_rank[rank]
        lengths = [mine[k][0] for k in KEYS]
        features = KeyedJaggedTensor(
            KEYS,
            torch.cat([mine[k][1] for k in KEYS]),
            lengths=torch.cat(lengths),
            stride_per_key_per_rank=[[len(n)] for n in lengths],
        )
        out = sharded(features.to(device)).wait()
        # the reference: every feature's samples of all ranks, padded with empty bags
        totals = {k: sum(len(d[k][0]) for d in per_rank) for k in KEYS}
        width = max(totals.values())
        ref_lengths = [
            torch.cat(
                [*(d[k][0] for d in per_rank), torch.zeros(width - totals[k], dtype=torch.long)]
            )
            for k in KEYS
        ]
        ref_ids = [torch.cat([d[k][1] for d in per_rank]) for k in KEYS]
        expected = reference(
            KeyedJaggedTensor(KEYS, torch.cat(ref_ids), lengths=torch.cat(ref_lengths))
        )
        g = torch.Generator().manual_seed(50 + step)
        loss = torch.zeros((), device=device)
        ref_loss = torch.zeros(())
        for k in KEYS:
            start = sum(int(d[k][0].sum()) for d in per_rank[:rank])
            rows = slice(start, start + int(mine[k][0].sum()))
            assert torch.equal(out[k].lengths().cpu(), mine[k][0]), f"{case} {k} lengths"
            want = expected[k].values()
            torch.testing.assert_close(
                out[k].values().cpu(), want[rows].detach(), atol=TOL, rtol=TOL
            )
            factors = torch.randn(want.shape, generator=g)
            loss = loss + (out[k].values() * factors[rows].to(device)).sum()
            ref_loss = ref_loss + (want * factors).sum()
        loss.backward()
        (ref_loss / world).backward()
        sharded.fused_optimizer.step()
        reference.fused_optimizer.step()
    return compare_state(sharded, reference, f"sequence {case}")


def run_all(pooled: list[Case], sequence: list[Case]) -> list[int]:
    torch.set_num_threads(1)
    return [run_pooled(c) for c in pooled] + [run_sequence(c) for c in sequence]


POOLED = [
    Case("tw", "rowwise_adagrad"),
    Case("rw", "adam"),
    Case("cw", "rowwise_adagrad"),
    Case("dp", "adam"),
    Case("mixed", "rowwise_adagrad"),
    Case("mixed", "adam"),
]
SEQUENCE = [Case("mixed", "rowwise_adagrad"), Case("rw", "adam"), Case("cw", "adam")]


@pytest.mark.parametrize("world_size", [2, 3])
def test_variable_batch_matches_unsharded(world_size: int) -> None:
    results = run_on_ranks(world_size, run_all, POOLED, SEQUENCE, timeout_s=240)
    for case_results in zip(*results, strict=True):
        assert sum(case_results) > 0


def _no_inverse_indices() -> str:
    world = dist.get_world_size()
    source = EmbeddingBagCollection(list(BAGS), optimizer=OPTIMIZERS["adam"])
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharded = EmbeddingBagCollectionSharder().shard(
        source, plan_for("mixed", world), env, test_device()
    )
    data = rank_data(0, dist.get_rank(), 3)
    lengths = [data[k][0] for k in KEYS]
    features = KeyedJaggedTensor(
        KEYS,
        torch.cat([data[k][1] for k in KEYS]),
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[len(n)] for n in lengths],
    )
    try:
        sharded(features.to(test_device()))
    except ValueError as e:
        return str(e)
    return "no error"


def test_variable_batch_without_inverse_indices_is_refused() -> None:
    messages = run_on_ranks(2, _no_inverse_indices)
    assert all("no inverse_indices" in m for m in messages), messages
