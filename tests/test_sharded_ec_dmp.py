"""DistributedModelParallel finds and shards EmbeddingCollection modules (2 gloo ranks).

A model with a sequence EmbeddingCollection and a dense head, wrapped by
``DistributedModelParallel`` with its default sharders: the collection becomes a
``ShardedEmbeddingCollection`` (under the default plan, and under a plan mixing row-, column-wise
and data-parallel tables), and two training steps leave the tables, their optimizer state and
the head equal (within 1e-6) to the unsharded model stepped with ``L = (1/N) * sum_i L_i``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from torch import Tensor, nn

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.planner.simple import SimplePlanner
from embshard_dist.sharded.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

TABLES = [
    EmbeddingConfig(name="t_a", num_embeddings=13, embedding_dim=8, feature_names=("f_a",)),
    EmbeddingConfig(name="t_b", num_embeddings=11, embedding_dim=8, feature_names=("f_b", "f_c")),
    EmbeddingConfig(name="t_c", num_embeddings=3, embedding_dim=8, feature_names=("f_d",)),
]
KEYS = ["f_a", "f_b", "f_c", "f_d"]
SPEC = OptimizerSpec.from_name("rowwise_adagrad", lr=0.2, eps=1e-3)
BATCH = 3
TOL = 1e-6


class SequenceModel(nn.Module):
    """Every id's row through a linear head, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(TABLES, optimizer=SPEC)
        self.head = nn.Linear(8, 1)

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        out = self.ec(features)
        rows = torch.cat([out[k].values() for k in KEYS])
        return self.head(rows).sum()


def batch(step: int, lo: int, hi: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    size = BATCH * dist.get_world_size()
    lengths, values = [], []
    for config in TABLES:
        for _ in config.feature_names:
            n = torch.randint(0, 4, (size,), generator=g)
            ids = torch.randint(0, config.num_embeddings, (int(n.sum()),), generator=g)
            start = int(n[:lo].sum())
            lengths.append(n[lo:hi])
            values.append(ids[start : start + int(n[lo:hi].sum())])
    return KeyedJaggedTensor(KEYS, torch.cat(values), lengths=torch.cat(lengths))


def _train(plan_request: Any) -> int:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = SequenceModel()
    torch.manual_seed(0)
    reference = SequenceModel()
    device = test_device()
    plan = None
    if plan_request is not None:
        sharders: list[Any] = [
            EmbeddingBagCollectionSharder(optimizer=SPEC),
            EmbeddingCollectionSharder(optimizer=SPEC),
        ]
        planner = SimplePlanner(world, device_type=device.type, sharding=plan_request)
        plan = planner.plan(model, sharders)
    dmp = DistributedModelParallel(
        model, device=device, plan=plan, optimizer=SPEC, dense_optimizer=torch.optim.SGD
    )
    assert isinstance(dmp.sharded_modules["ec"], ShardedEmbeddingCollection)
    optimizer = dmp.optimizer()
    head_sgd = torch.optim.SGD(reference.head.parameters(), lr=SPEC.learning_rate)
    for step in range(2):
        dmp(batch(step, rank * BATCH, (rank + 1) * BATCH).to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
        (reference(batch(step, 0, world * BATCH)) / world).backward()
        reference.ec.fused_optimizer.step()
        head_sgd.step()
        head_sgd.zero_grad()

    compared = 0
    ref_state = reference.state_dict()
    for key, value in dmp.state_dict().items():
        pieces = (
            [(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
            if hasattr(value, "local_shards")
            else [(value, [0] * value.dim())]
        )
        for tensor, offsets in pieces:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True))
            torch.testing.assert_close(
                tensor.detach().cpu(), ref_state[key][index], atol=TOL, rtol=TOL
            )
            compared += 1
    return compared


@pytest.mark.parametrize(
    "plan_request",
    [None, {"t_a": "row_wise", "t_b": "column_wise", "t_c": "data_parallel"}],
    ids=["default_plan", "mixed_plan"],
)
def test_dmp_shards_embedding_collections(plan_request: Any) -> None:
    results = run_on_ranks(2, _train, plan_request)
    assert sum(results) >= 3 + 2 * 2  # every table's shards, and the head's two parameters
