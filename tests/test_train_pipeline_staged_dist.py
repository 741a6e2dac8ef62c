"""StagedTrainPipeline with SparseDataDistUtil on real ranks against the plain training loop.

Two ``DistributedModelParallel`` models are built from the same seed with the same plan: one is
trained by TorchRec's staged loop (stages: copy to the device, an identity postproc, then the
start of the input dist; ``while (batch := pipeline.progress(it)) is not None: loss, out =
model(batch); loss.backward(); optimizer.step()``), the other by the plain loop. For a
table-wise and a row-wise plan with RowWiseAdagrad: every step's output, the weights (every
local shard) and the fused optimizer's state are equal, bit for bit on the CPU, over a 10-batch
epoch that runs to the end of the data and a second, 2-batch epoch (fewer batches than stages)
on a fresh iterator. The table-wise run learns where the features are from its first batch; the
row-wise run names them with ``sparse_of`` and flushes the pipeline mid-epoch. Under
``EMBSHARD_TEST_BACKEND=nccl`` the stages run on CUDA streams, compared within 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mp import require_devices, run_on_ranks, test_device
from torch import Tensor, nn

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.train_pipeline.batch import move_batch
from embshard_dist.train_pipeline.staged import (
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
)
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import PoolingType, ShardingType

WORLD = 2
NUM_DENSE = 5
LOCAL_BATCH = 4
EPOCHS = (10, 2)
TABLES = [
    EmbeddingBagConfig(name="t_a", num_embeddings=17, embedding_dim=8, feature_names=("f_a",)),
    EmbeddingBagConfig(
        name="t_b",
        num_embeddings=11,
        embedding_dim=8,
        feature_names=("f_b", "f_c"),
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(name="t_c", num_embeddings=7, embedding_dim=8, feature_names=("f_d",)),
]
FEATURES = [f for t in TABLES for f in t.feature_names]
POOLED = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)
SPEC = OptimizerSpec.from_name("rowwise_adagrad", lr=0.3, eps=1e-3)


@dataclass(frozen=True)
class Batch:
    """TorchRec's batch fields."""

    dense_features: Tensor
    sparse_features: KeyedJaggedTensor
    labels: Tensor


class SmallModel(nn.Module):
    """An embedding-bag collection, a dense tower and a logistic loss; ``forward(batch) ->
    (loss, logits)`` like ``DLRMTrain``."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(TABLES, optimizer=SPEC)
        self.bottom = nn.Sequential(nn.Linear(NUM_DENSE, 6), nn.ReLU())
        self.top = nn.Linear(6 + POOLED, 1)

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        pooled = self.sparse(batch.sparse_features)
        dense = self.bottom(batch.dense_features)
        logits = self.top(torch.cat([dense, pooled.values()], dim=1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def plan(name: str) -> ShardingPlan:
    def ps(kind: ShardingType, ranks: list[int] | None = None) -> ParameterSharding:
        return ParameterSharding(kind, "fused", ranks=ranks)

    tw, rw = ShardingType.TABLE_WISE, ShardingType.ROW_WISE
    plans = {
        "tw": {"t_a": ps(tw, [0]), "t_b": ps(tw, [1]), "t_c": ps(tw, [1])},
        "rw": {t.name: ps(rw) for t in TABLES},
    }
    return ShardingPlan({"sparse": EmbeddingModuleShardingPlan(plans[name])})


def make_batch(step: int, rank: int) -> Batch:
    """Rank ``rank``'s batch of step ``step``: empty bags included, different on every rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (len(FEATURES) * LOCAL_BATCH,), generator=g)
    rows = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
    ids = [
        torch.randint(0, rows[f], (int(n),), generator=g)
        for f, n in zip(FEATURES, lengths.view(len(FEATURES), -1).sum(1), strict=True)
    ]
    return Batch(
        torch.randn(LOCAL_BATCH, NUM_DENSE, generator=g),
        KeyedJaggedTensor(FEATURES, torch.cat(ids), lengths=lengths),
        torch.randint(0, 2, (LOCAL_BATCH,), generator=g).float(),
    )


def build(plan_name: str) -> Any:
    torch.manual_seed(3)
    return DistributedModelParallel(
        SmallModel(), plan=plan(plan_name), optimizer=SPEC, device=test_device()
    )


def local_tensors(value: Any) -> list[Tensor]:
    """The local pieces of a state-dict value (ShardedTensor, DTensor or plain tensor)."""
    if hasattr(value, "local_shards"):
        return [s.tensor for s in value.local_shards()]
    if hasattr(value, "to_local"):
        return [value.to_local()]
    return [value] if isinstance(value, Tensor) else []


def check_equal(a: Tensor, b: Tensor, what: str) -> None:
    if test_device().type == "cpu":
        assert torch.equal(a, b), f"rank {dist.get_rank()}: {what} differs"
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{what} differs")


def compare_models(piped: Any, plain: Any, what: str) -> int:
    """Weights and optimizer state, local piece by local piece; the number of pieces compared."""
    compared = 0
    weights, ref = piped.state_dict(), plain.state_dict()
    assert sorted(weights) == sorted(ref)
    for key, value in weights.items():
        for a, b in zip(local_tensors(value), local_tensors(ref[key]), strict=True):
            check_equal(a, b, f"{what}: {key}")
            compared += 1
    states = piped.optimizer().state_dict()["state"]
    ref_states = plain.optimizer().state_dict()["state"]
    assert sorted(states) == sorted(ref_states)
    for param, state in states.items():
        for name, value in state.items():
            for a, b in zip(
                local_tensors(value), local_tensors(ref_states[param][name]), strict=True
            ):
                check_equal(a, b, f"{what}: optimizer state {param}/{name}")
                compared += 1
    return compared


def new_stream() -> torch.Stream:
    device = test_device()
    return torch.cuda.Stream(device) if device.type == "cuda" else torch.Stream("cpu")


def staged_pipeline(model: Any, learned: bool) -> StagedTrainPipeline[Batch, Batch]:
    device = test_device()
    sdd = SparseDataDistUtil[Batch](
        model=model,
        data_dist_stream=new_stream(),
        apply_jit=False,
        sparse_of=None if learned else (lambda b: b.sparse_features),
    )
    stages = [
        PipelineStage(
            name="data_copy",
            runnable=lambda b: move_batch(b, device, non_blocking=True),
            stream=new_stream(),
        ),
        PipelineStage(name="gpu_postproc", runnable=lambda b: b, stream=new_stream()),
        PipelineStage(
            name="start_sparse_data_dist",
            runnable=sdd.start_sparse_data_dist,
            stream=sdd.data_dist_stream,
            fill_callback=sdd.wait_sdd_fill_callback,
            data_exhausted_callback=sdd.data_exhausted_callback,
        ),
    ]
    compute = torch.cuda.current_stream(device) if device.type == "cuda" else None
    return StagedTrainPipeline(pipeline_stages=stages, compute_stream=compute)


def run_plan(plan_name: str, learned: bool, flush_at: int | None) -> list[int]:
    """Staged against plain over the epochs; per epoch, the pieces compared (and the steps)."""
    torch.set_num_threads(1)
    piped, plain = build(plan_name), build(plan_name)
    pipeline = staged_pipeline(piped, learned)
    optimizer, plain_optimizer = piped.optimizer(), plain.optimizer()
    device = test_device()
    results = []
    start = 0
    for count in EPOCHS:
        host = [make_batch(step, dist.get_rank()) for step in range(start, start + count)]
        start += count
        expected = []
        for batch in host:
            plain_optimizer.zero_grad()
            loss, out = plain(move_batch(batch, device))
            loss.backward()
            plain_optimizer.step()
            expected.append(out)
        it = iter(host)
        outputs = []
        while (batch := pipeline.progress(it)) is not None:
            optimizer.zero_grad()
            loss, out = piped(batch)
            loss.backward()
            optimizer.step()
            outputs.append(out)
            if len(outputs) == flush_at:
                pipeline.set_flush(True)
        what = f"{plan_name} (learned={learned}) epoch of {count}"
        assert len(outputs) == count, f"{what}: {len(outputs)} steps"
        assert pipeline.progress(it) is None, f"{what}: a batch after the end"
        for step, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
            check_equal(out, ref, f"{what}: output of step {step}")
        results.append(compare_models(piped, plain, what))
    return results


@pytest.mark.parametrize(
    ("plan_name", "learned", "flush_at"), [("tw", True, None), ("rw", False, 4)]
)
def test_staged_pipeline_equals_plain_loop(
    plan_name: str, learned: bool, flush_at: int | None
) -> None:
    require_devices(WORLD)
    results = run_on_ranks(WORLD, run_plan, plan_name, learned, flush_at, timeout_s=240)
    assert all(n > 0 for per_rank in results for n in per_rank)
