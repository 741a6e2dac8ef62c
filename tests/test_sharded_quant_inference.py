"""Sharded INT8 / INT4 inference on 2 gloo ranks equals the unsharded quantized collection.

Every rank quantizes the same trained float collection, shards it (table-wise, row-wise,
column-wise, and a mix, by the sharder and through DistributedModelParallel with its planner),
and looks up its own part of a global batch; the result is compared with the unsharded
quantized collection on that part: exactly, for every sharding type (row-wise fetches each id's
packed row and pools on the caller's rank, with the same kernel, bytes and order).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from torch import nn

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.sharded.quant_embedding_bag import (
    QuantEmbeddingBagCollectionSharder,
    ShardedQuantEmbeddingBagCollection,
)
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.quantize import QuantEmbeddingBagCollection, quantize_embeddings
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import PoolingType, ShardingType

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=16, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", num_embeddings=23, embedding_dim=8, feature_names=["f1", "f2"]),
    EmbeddingBagConfig(
        name="t2",
        num_embeddings=31,
        embedding_dim=32,
        feature_names=["f3"],
        pooling=PoolingType.MEAN,
    ),
]
KEYS = ["f0", "f1", "f2", "f3"]
BATCH = 6  # per rank


def float_collection() -> EmbeddingBagCollection:
    torch.manual_seed(7)
    ebc = EmbeddingBagCollection(TABLES)
    with torch.no_grad():
        for p in ebc.parameters():
            p.uniform_(-0.5, 0.5)
    return ebc


def global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    rows = {f: next(t.num_embeddings for t in TABLES if f in t.feature_names) for f in KEYS}
    lengths = torch.randint(0, 5, (len(KEYS), world * BATCH), generator=g)
    values = torch.cat(
        [
            torch.randint(0, rows[f], (int(lengths[i].sum()),), generator=g)
            for i, f in enumerate(KEYS)
        ]
    )
    return lengths, values


def part(lengths: torch.Tensor, values: torch.Tensor, lo: int, hi: int) -> KeyedJaggedTensor:
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.reshape(-1).cumsum(0)])
    pieces, keep = [], []
    for i in range(len(KEYS)):
        base = i * lengths.shape[1]
        pieces.append(values[offsets[base + lo] : offsets[base + hi]])
        keep.append(lengths[i, lo:hi])
    return KeyedJaggedTensor.from_lengths_sync(KEYS, torch.cat(pieces), torch.cat(keep))


def plans(world: int) -> dict[str, dict[str, ParameterSharding]]:
    tw, rw, cw = ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE

    def columns(widths: list[int], ranks: list[int], rows: int) -> ParameterSharding:
        specs, at = [], 0
        for width, rank in zip(widths, ranks, strict=True):
            specs.append(ShardSpec.on(rank, test_device().type, (0, at), (rows, width)))
            at += width
        return ParameterSharding(cw, "quant", ranks=ranks, shards=specs)

    return {
        "tw": {
            t.name: ParameterSharding(tw, "quant", ranks=[i % world]) for i, t in enumerate(TABLES)
        },
        "rw": {t.name: ParameterSharding(rw, "quant") for t in TABLES},
        "cw": {
            "t0": columns([8, 8], [1, 0], 40),
            "t1": columns([4, 4], [0, 1], 23),
            "t2": columns([16, 16], [1, 0], 31),
        },
        "mixed": {
            "t0": ParameterSharding(tw, "quant", ranks=[1]),
            "t1": ParameterSharding(rw, "quant"),
            "t2": columns([8, 24], [0, 1], 31),
        },
    }


def _run(data_type: str, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    quant = quantize_embeddings(float_collection(), data_type)
    assert isinstance(quant, QuantEmbeddingBagCollection)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    plan = EmbeddingModuleShardingPlan(plans(world)[name])
    device = test_device()
    sharded = QuantEmbeddingBagCollectionSharder().shard(quant, plan, env, device)
    assert isinstance(sharded, ShardedQuantEmbeddingBagCollection)
    lengths, values = global_batch(world)
    mine = part(lengths, values, rank * BATCH, (rank + 1) * BATCH)
    got = sharded(mine.to(device)).wait()
    expected = quant(mine)  # the unsharded quantized collection, on the CPU
    assert got.keys() == expected.keys()
    return got.values().cpu(), expected.values(), packed_bytes(sharded.local_tables())


def packed_bytes(tables: dict[str, Any]) -> int:
    return sum(
        t.weight.numel() + (0 if t.weight_qscaleshift is None else t.weight_qscaleshift.numel())
        for t in tables.values()
    )


@pytest.mark.parametrize("data_type", ["int8", "int4"])
@pytest.mark.parametrize("name", ["tw", "cw", "rw", "mixed"])
def test_sharded_quantized_matches_unsharded(data_type: str, name: str) -> None:
    results = run_on_ranks(2, _run, data_type, name)
    total = quantize_embeddings(float_collection(), data_type)
    full = packed_bytes(total.packed_tables())
    # A column block keeps its rows' 4 bytes of scale and bias; the other types split rows.
    extra = {"tw": 0, "rw": 0, "cw": 4 * (40 + 23 + 31), "mixed": 4 * 31}[name]
    for got, expected, held in results:
        assert torch.equal(got, expected)
        assert held < full  # each rank keeps only its shards
    assert sum(held for _, _, held in results) == full + extra


def _weighted_row_wise(data_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    torch.manual_seed(5)
    tables = [TABLES[0], TABLES[1]]  # SUM pooling: weighted bags
    ebc = EmbeddingBagCollection(tables, is_weighted=True)
    with torch.no_grad():
        for p in ebc.parameters():
            p.uniform_(-0.5, 0.5)
    quant = quantize_embeddings(ebc, data_type)
    assert isinstance(quant, QuantEmbeddingBagCollection) and quant.is_weighted()
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    plan = EmbeddingModuleShardingPlan(
        {t.name: ParameterSharding(ShardingType.ROW_WISE, "quant") for t in tables}
    )
    sharded = QuantEmbeddingBagCollectionSharder().shard(quant, plan, env, test_device())
    g = torch.Generator().manual_seed(rank)
    keys = ["f0", "f1", "f2"]
    lengths = torch.randint(0, 6, (len(keys) * BATCH,), generator=g)
    lengths[:BATCH] = 0  # this rank asks nothing of 'f0'
    rows = torch.tensor([40, 23, 23]).repeat_interleave(BATCH)
    values = torch.cat(
        [
            torch.randint(0, int(r), (int(n),), generator=g)
            for r, n in zip(rows, lengths, strict=True)
        ]
    )
    weights = torch.rand(values.numel(), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)
    got = sharded(kjt.to(test_device())).wait().values().cpu()
    return got, quant(kjt).values()


@pytest.mark.parametrize("data_type", ["int8", "int4"])
def test_row_wise_fetch_is_exact_with_weights_and_empty_features(data_type: str) -> None:
    for got, expected in run_on_ranks(2, _weighted_row_wise, data_type):
        assert torch.equal(got, expected)


class _Model(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.sparse = ebc
        self.head = nn.Linear(64, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(kjt)
        values = pooled.wait().values() if hasattr(pooled, "wait") else pooled.values()
        return self.head(values)


def _dmp(data_type: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Model(float_collection())
    torch.manual_seed(11)
    model.head.reset_parameters()
    model = quantize_embeddings(model, data_type)
    unsharded = copy.deepcopy(model)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    # The default sharders include the quantized collection's; the planner picks the plan.
    device = test_device()
    dmp = DistributedModelParallel(model, env, device, init_data_parallel=False)
    plan: ShardingPlan = dmp.plan
    lengths, values = global_batch(world)
    mine = part(lengths, values, rank * BATCH, (rank + 1) * BATCH)
    with torch.no_grad():
        got = dmp(mine.to(device)).cpu()
        expected = unsharded(mine)
    kinds = {t: p.sharding_type.value for t, p in plan["sparse"].items()}
    return got, expected, kinds


def test_dmp_plans_and_serves_quantized_tables() -> None:
    for got, expected, kinds in run_on_ranks(2, _dmp, "int8"):
        assert set(kinds) == {"t0", "t1", "t2"}
        assert torch.equal(got, expected), kinds


def _bad_columns() -> str:
    quant = quantize_embeddings(float_collection(), "int2")  # 4 columns: one byte, not two
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    entries = plans(2)["tw"]
    kind = test_device().type
    specs = [ShardSpec.on(0, kind, (0, 0), (23, 4)), ShardSpec.on(1, kind, (0, 4), (23, 4))]
    entries["t1"] = ParameterSharding(ShardingType.COLUMN_WISE, "quant", ranks=[0, 1], shards=specs)
    plan = EmbeddingModuleShardingPlan(entries)
    with pytest.raises(ValueError, match=r"table 't1'.*multiples of 8") as e:
        QuantEmbeddingBagCollectionSharder().shard(quant, plan, env, test_device())
    return str(e.value)


def test_column_blocks_that_split_a_packed_byte_are_refused_on_every_rank() -> None:
    messages = run_on_ranks(2, _bad_columns)
    assert messages[0] == messages[1]
