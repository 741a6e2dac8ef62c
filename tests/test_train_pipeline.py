"""TrainPipelineSparseDist on real ranks against the plain training loop.

Two ``DistributedModelParallel`` models are built from the same seed with the same plan: one is
trained by ``TrainPipelineSparseDist.progress`` (the next batch's input dist in flight during
this batch's step), the other by the plain loop ``loss, out = model(batch); loss.backward();
optimizer.step()``. For table-wise, row-wise, data-parallel, column-wise and a mixed plan, with
SGD and RowWiseAdagrad: the outputs of every step, the weights (every local shard) and the state
of the fused and dense optimizers are equal after 20 steps, bit for bit on the CPU. Also: a
loader that ends mid-pipeline (7 batches, run to the end; then a second epoch on a fresh
iterator), ``execute_all_batches=False``, and a model that reads its features from another field
through ``sparse_of``. ``TrainPipelineFusedSparseDist`` (each batch's lookup started before its
forward, in both of TorchRec's orders) equals the plain loop in the same runs. ``TrainPipelineBase`` (the plain loop behind the pipeline interface)
equals the plain loop too, and ``EvalPipelineSparseDist`` gives the plain forward's outputs and
never steps, whatever the model's mode. Under ``EMBSHARD_TEST_BACKEND=nccl`` the same runs on the GPUs, through
the side-stream path, compared within 1e-6 (CUDA kernels may sum in another order).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mp import require_devices, run_on_ranks, test_device
from torch import Tensor, nn

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.train_pipeline import (
    EvalPipelineSparseDist,
    TrainPipelineBase,
    TrainPipelineFusedSparseDist,
    TrainPipelineSparseDist,
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
STEPS = 20
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
OPTIMIZERS = {
    "sgd": OptimizerSpec.from_name("sgd", lr=0.3),
    "rowwise_adagrad": OptimizerSpec.from_name("rowwise_adagrad", lr=0.3, eps=1e-3),
}


@dataclass(frozen=True)
class Batch:
    """TorchRec's batch fields."""

    dense_features: Tensor
    sparse_features: KeyedJaggedTensor
    labels: Tensor


@dataclass(frozen=True)
class OtherBatch:
    """A batch whose features are not under ``sparse_features``."""

    dense: Tensor
    ids: KeyedJaggedTensor
    labels: Tensor


class SmallModel(nn.Module):
    """An embedding-bag collection, a dense tower over dense features and pooled embeddings,
    and a logistic loss; ``forward(batch) -> (loss, logits)`` like ``DLRMTrain``."""

    def __init__(self, spec: OptimizerSpec, field: str = "sparse_features") -> None:
        super().__init__()
        self.field = field
        self.sparse = EmbeddingBagCollection(TABLES, optimizer=spec)
        self.bottom = nn.Sequential(nn.Linear(NUM_DENSE, 6), nn.ReLU())
        self.top = nn.Linear(6 + POOLED, 1)

    def forward(self, batch: Any) -> tuple[Tensor, Tensor]:
        pooled = self.sparse(getattr(batch, self.field))
        dense = batch.dense_features if self.field == "sparse_features" else batch.dense
        logits = self.top(torch.cat([self.bottom(dense), pooled.values()], dim=1)).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def plan(name: str) -> ShardingPlan:
    tw, rw, dp = ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL
    cw = ShardingType.COLUMN_WISE

    def ps(kind: ShardingType, ranks: list[int] | None = None) -> ParameterSharding:
        return ParameterSharding(kind, "fused", ranks=ranks)

    plans = {
        "tw": {"t_a": ps(tw, [0]), "t_b": ps(tw, [1]), "t_c": ps(tw, [1])},
        "rw": {t.name: ps(rw) for t in TABLES},
        "dp": {t.name: ps(dp) for t in TABLES},
        "cw": {"t_a": ps(cw, [1, 0]), "t_b": ps(cw, [0, 1]), "t_c": ps(cw, [0, 1])},
        "mixed": {"t_a": ps(rw), "t_b": ps(tw, [1]), "t_c": ps(cw, [1, 0])},
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


def build(spec: OptimizerSpec, plan_name: str, field: str = "sparse_features") -> Any:
    torch.manual_seed(3)
    model = SmallModel(spec, field)
    return DistributedModelParallel(
        model, plan=plan(plan_name), optimizer=spec, device=test_device()
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


def plain_steps(model: Any, batches: list[Any]) -> list[Tensor]:
    optimizer = model.optimizer()
    outputs = []
    for batch in batches:
        optimizer.zero_grad()
        loss, out = model(batch)
        loss.backward()
        optimizer.step()
        outputs.append(out)
    return outputs


def piped_steps(pipeline: Any, batches: Iterator[Any]) -> list[Tensor]:
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(batches))
        except StopIteration:
            return outputs


def host_batches(count: int, start: int = 0) -> list[Batch]:
    return [make_batch(step, dist.get_rank()) for step in range(start, start + count)]


def on_device(batch: Batch) -> Batch:
    device = test_device()
    return Batch(
        batch.dense_features.to(device), batch.sparse_features.to(device), batch.labels.to(device)
    )


def run_plan(plan_name: str, optimizer: str) -> int:
    """20 steps and a 7-batch epoch then a 4-batch one, pipelined against plain."""
    torch.set_num_threads(1)
    spec = OPTIMIZERS[optimizer]
    piped, fused, plain = (build(spec, plan_name) for _ in range(3))
    pipeline = TrainPipelineSparseDist(piped, piped.optimizer(), test_device())
    # Both of TorchRec's orders for the fused pipeline's lookup: first, or after the next dist.
    after_dist = optimizer == "sgd"
    fused_pipeline = TrainPipelineFusedSparseDist(
        fused, fused.optimizer(), test_device(), embedding_lookup_after_data_dist=after_dist
    )
    assert list(pipeline.pipelined_modules) == ["sparse"]
    compared = 0
    start = 0
    for count in (STEPS, 7, 4):
        batches = host_batches(count, start)
        start += count
        expected = plain_steps(plain, [on_device(b) for b in batches])
        for model, runner, name in (
            (piped, pipeline, "sparse-dist"),
            (fused, fused_pipeline, "fused"),
        ):
            what = f"{plan_name}/{optimizer}/{name}"
            outputs = piped_steps(runner, iter(batches))
            assert len(outputs) == count, f"{what}: {len(outputs)} steps for {count} batches"
            for step, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
                check_equal(out, ref, f"{what}: output of step {step}")
            compared += compare_models(model, plain, f"{what} after {start} steps")
    return compared


def run_edges() -> list[int]:
    """``execute_all_batches=False``, and features read from another field with ``sparse_of``."""
    torch.set_num_threads(1)
    spec = OPTIMIZERS["rowwise_adagrad"]
    piped, plain = build(spec, "mixed"), build(spec, "mixed")
    pipeline = TrainPipelineSparseDist(
        piped, piped.optimizer(), test_device(), execute_all_batches=False
    )
    batches = host_batches(7)
    outputs = piped_steps(pipeline, iter(batches))
    # The iterator ends while batch 6's input dist is in flight: batch 6 is dropped.
    expected = plain_steps(plain, [on_device(b) for b in batches[:6]])
    assert len(outputs) == 6
    for out, ref in zip(outputs, expected, strict=True):
        check_equal(out, ref, "execute_all_batches=False output")
    dropped = compare_models(piped, plain, "execute_all_batches=False")

    other, reference = build(spec, "rw", "ids"), build(spec, "rw", "ids")
    pipeline = TrainPipelineSparseDist(
        other, other.optimizer(), test_device(), sparse_of=lambda batch: batch.ids
    )
    moved = [OtherBatch(b.dense_features, b.sparse_features, b.labels) for b in host_batches(5)]
    outputs = piped_steps(pipeline, iter(moved))
    expected = plain_steps(
        reference,
        [
            OtherBatch(
                b.dense.to(test_device()), b.ids.to(test_device()), b.labels.to(test_device())
            )
            for b in moved
        ],
    )
    for out, ref in zip(outputs, expected, strict=True):
        check_equal(out, ref, "sparse_of output")
    return [dropped, compare_models(other, reference, "sparse_of")]


def run_base_and_eval() -> list[int]:
    """TrainPipelineBase against the plain loop (two epochs); then EvalPipelineSparseDist in
    eval and in train mode against plain forwards, with nothing stepped."""
    torch.set_num_threads(1)
    spec = OPTIMIZERS["rowwise_adagrad"]
    based, plain = build(spec, "mixed"), build(spec, "mixed")
    pipeline = TrainPipelineBase(based, based.optimizer(), test_device())
    start = 0
    for count in (6, 3):
        batches = host_batches(count, start)
        start += count
        outputs = piped_steps(pipeline, iter(batches))
        expected = plain_steps(plain, [on_device(b) for b in batches])
        assert len(outputs) == count
        for out, ref in zip(outputs, expected, strict=True):
            check_equal(out, ref, "TrainPipelineBase output")
    trained = compare_models(based, plain, "TrainPipelineBase")

    evaluated = []
    for training in (False, True):
        based.train(training)
        plain.train(training)
        batches = host_batches(5, start)
        with torch.no_grad():
            outputs = piped_steps(
                EvalPipelineSparseDist(based, based.optimizer(), test_device()), iter(batches)
            )
            expected = [plain(on_device(b))[1] for b in batches]
        assert len(outputs) == 5
        for out, ref in zip(outputs, expected, strict=True):
            check_equal(out, ref, f"EvalPipelineSparseDist output (training={training})")
        evaluated.append(compare_models(based, plain, f"after eval (training={training})"))
    return [trained, *evaluated]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("plan_name", ["tw", "rw", "dp", "cw", "mixed"])
def test_pipeline_equals_plain_loop(plan_name: str, optimizer: str) -> None:
    require_devices(WORLD)
    compared = run_on_ranks(WORLD, run_plan, plan_name, optimizer, timeout_s=240)
    assert all(n > 0 for n in compared)


def test_pipeline_stops_early_and_reads_sparse_of() -> None:
    require_devices(WORLD)
    results = run_on_ranks(WORLD, run_edges, timeout_s=240)
    assert all(n > 0 for per_rank in results for n in per_rank)


def test_base_pipeline_trains_and_eval_pipeline_only_forwards() -> None:
    require_devices(WORLD)
    results = run_on_ranks(WORLD, run_base_and_eval, timeout_s=240)
    assert all(n > 0 for per_rank in results for n in per_rank)
