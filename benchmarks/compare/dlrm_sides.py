"""W2-DLRM's contenders: each library's ``DLRMTrain(DLRM(...))`` over W2's tables, trained by its
plain loop, its ``TrainPipelineSparseDist``, ``TrainPipelineFusedSparseDist`` or
``TrainPipelineSemiSync`` (from batch 0).

W2-DLRM is W2's 26 tables (``workloads.w2``) under a DLRM dense part: 13 dense features, bottom
MLP [256, 128], top MLP [512, 256, 1], binary cross-entropy on the logits. Both libraries build
the model the same way: the same torch seed before the constructor (both give the same dense
parameters), the collection on ``meta``, the harness's neutral plan translated as for W1 / W2
(``embshard_side`` / ``torchrec_side``), the workload's initial table weights written into the
sharded state dict, and RowWiseAdagrad fused in the backward. The dense part is trained by
``torch.optim.Adagrad`` with the same learning rate and eps on both sides (embshard's default for
a RowWiseAdagrad model); TorchRec's data-parallel tables, which its fused optimizer leaves alone,
get ``torchrec.optim.RowWiseAdagrad`` (as in ``torchrec_side``).

A contender's ``step()`` is one training step of its loop: the plain loop's
``zero_grad; loss = model(batch); loss.backward(); step`` on the next batch, or one
``pipeline.progress(batches)``. Batches cycle through the pre-built ones, already in each
library's types, so building them is never timed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from benchmarks.compare.common import EPS, LEARNING_RATE, check_tables, load_global_weights
from benchmarks.compare.plans import Plan
from benchmarks.compare.workloads import Batch, Workload

DENSE_FEATURES = 13
BOTTOM_MLP = [256, 128]
TOP_MLP = [512, 256, 1]
MODULE = "model.sparse_arch.embedding_bag_collection"
"""Where DLRMTrain holds the collection: the path the plans name."""
MODEL_SEED = 11
"""The torch seed before each DLRM constructor (the dense parameters)."""
MODES = (
    "embshard-plain",
    "embshard-pipelined",
    "embshard-fused",
    "embshard-semi-sync",
    "torchrec-plain",
    "torchrec-pipelined",
    "torchrec-fused",
    "torchrec-semi-sync",
)
"""``{library}-{loop}``; loops: plain, pipelined (``TrainPipelineSparseDist``), fused
(``TrainPipelineFusedSparseDist``: the lookup started before the forward) and semi-sync
(``TrainPipelineSemiSync`` from batch 0: one step stale, not equal to the others)."""
SEMI_SYNC_START_BATCH = 0


@dataclass(frozen=True)
class DenseBatch:
    """One rank's dense features ``[b, 13]`` and labels ``[b]`` (0. or 1.)."""

    dense: Tensor
    labels: Tensor


def dense_batches(workload: Workload, rank: int, world: int, count: int) -> list[DenseBatch]:
    """``count`` dense batches of ``rank``: slices of global batches drawn from the seed."""
    gen = torch.Generator().manual_seed(workload.seed + 31)
    b = workload.batch_per_rank
    out = []
    for _ in range(count):
        dense = torch.randn(world * b, DENSE_FEATURES, generator=gen)
        labels = torch.randint(0, 2, (world * b,), generator=gen).float()
        out.append(DenseBatch(dense[rank * b : (rank + 1) * b], labels[rank * b : (rank + 1) * b]))
    return out


def _table_of(key: str) -> str | None:
    prefix = f"{MODULE}.embedding_bags."
    if key.startswith(prefix) and key.endswith(".weight"):
        return key[len(prefix) : -len(".weight")]
    return None


class DlrmContender:
    """One library's W2-DLRM on this rank, with its loop (see the module docstring)."""

    name: str
    model: Any
    optimizer: Any
    pipeline: Any | None
    batches: list[Any]

    def _start(self, loop: str, sparse_dist: Any, semi_sync: Any, fused: Any) -> None:
        """Build ``loop``'s pipeline (none for the plain loop) from the library's classes."""
        cpu = torch.device("cpu")
        self.pipeline = None
        if loop == "pipelined":
            self.pipeline = sparse_dist(self.model, self.optimizer, cpu)
        elif loop == "fused":
            self.pipeline = fused(self.model, self.optimizer, cpu)
        elif loop == "semi-sync":
            self.pipeline = semi_sync(
                self.model, self.optimizer, cpu, start_batch=SEMI_SYNC_START_BATCH
            )
        self._next: Iterator[Any] = itertools.cycle(self.batches)

    def step(self) -> None:
        """One training step of this contender's loop."""
        if self.pipeline is not None:
            self.pipeline.progress(self._next)
            return
        self.optimizer.zero_grad()
        loss, _ = self.model(next(self._next))
        loss.backward()
        self.optimizer.step()

    def logits(self, index: int) -> Tensor:
        """The model's logits on batch ``index`` (no gradient, nothing trained)."""
        with torch.no_grad():
            _, (_, logits, _) = self.model(self.batches[index])
        return logits.detach().clone()


class EmbshardDlrm(DlrmContender):
    """embshard's DLRM: ``DistributedModelParallel`` and ``embshard_dist.train_pipeline``."""

    def __init__(
        self,
        workload: Workload,
        plan: Plan,
        batches: list[Batch],
        dense: list[DenseBatch],
        world: int,
        local: int,
        loop: str,
    ) -> None:
        from benchmarks.compare.embshard_side import _embshard_plan, _sharder, _spec
        from embshard_dist.dmp.model_parallel import DistributedModelParallel
        from embshard_dist.models.dlrm import DLRM, DLRMTrain
        from embshard_dist.train_pipeline import (
            TrainPipelineFusedSparseDist,
            TrainPipelineSemiSync,
            TrainPipelineSparseDist,
        )
        from embshard_kernels.collections import EmbeddingBagCollection
        from embshard_types.configs import EmbeddingBagConfig
        from embshard_types.plan import ShardingPlan
        from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

        self.name = f"embshard-{loop}"
        check_tables(plan, workload)
        tables = [
            EmbeddingBagConfig(
                name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=(t.feature,)
            )
            for t in workload.tables
        ]
        spec, sharder = _spec(), _sharder(local)
        torch.manual_seed(MODEL_SEED)
        ebc = EmbeddingBagCollection(tables, device="meta", optimizer=spec)
        model = DLRMTrain(DLRM(ebc, DENSE_FEATURES, BOTTOM_MLP, TOP_MLP))
        module_plan = _embshard_plan(plan, workload, world, local, sharder)
        self.model = DistributedModelParallel(
            model,
            device=torch.device("cpu"),
            plan=ShardingPlan({MODULE: module_plan}),
            sharders=[sharder],
            optimizer=spec,
        )
        written = load_global_weights(self.model.state_dict(), workload, _table_of)
        if written != set(plan):
            raise RuntimeError(f"embshard: initial weights reached tables {sorted(written)} only")
        self.optimizer = self.model.optimizer()
        self.batches = [
            _EmbshardBatch(
                d.dense,
                KeyedJaggedTensor(keys=list(b.keys), values=b.values, lengths=b.lengths),
                d.labels,
            )
            for b, d in zip(batches, dense, strict=True)
        ]
        self._start(
            loop, TrainPipelineSparseDist, TrainPipelineSemiSync, TrainPipelineFusedSparseDist
        )


@dataclass(frozen=True)
class _EmbshardBatch:
    """TorchRec's batch fields, for ``embshard_dist.models.dlrm.DLRMTrain``."""

    dense_features: Tensor
    sparse_features: Any
    labels: Tensor


class TorchRecDlrm(DlrmContender):
    """TorchRec 1.8.0's DLRM: its ``DistributedModelParallel`` and ``TrainPipelineSparseDist``."""

    def __init__(
        self,
        workload: Workload,
        plan: Plan,
        batches: list[Batch],
        dense: list[DenseBatch],
        world: int,
        local: int,
        loop: str,
    ) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.datasets.utils import Batch as TorchRecBatch
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.train_pipeline import (
            TrainPipelineFusedSparseDist,
            TrainPipelineSparseDist,
        )
        from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync
        from torchrec.distributed.types import ShardingPlan
        from torchrec.models.dlrm import DLRM, DLRMTrain
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        from benchmarks.compare.torchrec_side import _torchrec_plan

        self.name = f"torchrec-{loop}"
        check_tables(plan, workload)
        tables = [
            EmbeddingBagConfig(
                name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[t.feature]
            )
            for t in workload.tables
        ]
        torch.manual_seed(MODEL_SEED)
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        model = DLRMTrain(DLRM(ebc, DENSE_FEATURES, BOTTOM_MLP, TOP_MLP))
        sharder = EmbeddingBagCollectionSharder(
            fused_params={
                "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "learning_rate": LEARNING_RATE,
                "eps": EPS,
            }
        )
        module_plan = _torchrec_plan(plan, ebc, sharder, world, local)
        self.model = DistributedModelParallel(
            model,
            device=torch.device("cpu"),
            plan=ShardingPlan({MODULE: module_plan}),
            sharders=[sharder],
        )
        written = load_global_weights(self.model.state_dict(), workload, _table_of)
        if written != set(plan):
            raise RuntimeError(f"TorchRec: initial weights reached tables {sorted(written)} only")
        dense_params = dict(in_backward_optimizer_filter(self.model.named_parameters()))
        tables_dp = {k: p for k, p in dense_params.items() if _table_of(k) is not None}
        mlps = {k: p for k, p in dense_params.items() if k not in tables_dp}
        optimizers: list[Any] = [self.model.fused_optimizer]
        optimizers.append(
            KeyedOptimizerWrapper(
                mlps, lambda ps: torch.optim.Adagrad(ps, lr=LEARNING_RATE, eps=EPS)
            )
        )
        if tables_dp:
            optimizers.append(
                KeyedOptimizerWrapper(
                    tables_dp, lambda ps: RowWiseAdagrad(ps, lr=LEARNING_RATE, eps=EPS)
                )
            )
        self.optimizer = CombinedOptimizer(optimizers)
        self.batches = [
            TorchRecBatch(
                dense_features=d.dense,
                sparse_features=KeyedJaggedTensor(
                    keys=list(b.keys), values=b.values, lengths=b.lengths
                ),
                labels=d.labels,
            )
            for b, d in zip(batches, dense, strict=True)
        ]
        self._start(
            loop, TrainPipelineSparseDist, TrainPipelineSemiSync, TrainPipelineFusedSparseDist
        )


def build(
    mode: str,
    workload: Workload,
    plan: Plan,
    batches: list[Batch],
    dense: list[DenseBatch],
    world: int,
    local: int,
) -> DlrmContender:
    """The contender of ``mode`` (one of :data:`MODES`) on this rank."""
    library, _, loop = mode.partition("-")
    if mode not in MODES:
        raise ValueError(f"unknown W2-DLRM mode {mode!r}; expected one of {', '.join(MODES)}")
    cls = EmbshardDlrm if library == "embshard" else TorchRecDlrm
    return cls(workload, plan, batches, dense, world, local or world, loop)
