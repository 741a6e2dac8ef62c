"""Overlap inside a DLRM step, on real ranks: the embeddings' all-to-alls travel while the dense
part runs, and the results stay those of the plain loop.

Two ``DistributedModelParallel(DLRMTrain(DLRM(...)))`` models from one seed and plan: one trained
by ``TrainPipelineSparseDist``, the other by the plain loop, 20 steps. Checked on every rank:

* the outputs of every step, the weights and the fused and dense optimizer states are equal
  (bit for bit on the CPU) for a table-wise plan with SGD and a mixed plan with RowWiseAdagrad;
* the overlap happened, from the order of events recorded during each step (no timing): the
  output dist's forward collective is issued before the dense arch starts and waited for after
  it ends; its backward collective (the embeddings' gradients) is issued before, and waited for
  after, a dense-gradient all-reduce of DDP. Events come from real collectives: the issue and
  the first wait of every ``PendingCollective``, DDP's bucket all-reduces (through a comm hook
  that runs TorchRec's and torch's default all-reduce), and the dense arch's forward hooks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import require_devices, run_on_ranks, test_device
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from embshard_dist.comm.timeouts import PendingCollective
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.models.dlrm import DLRM, DLRMTrain
from embshard_dist.train_pipeline import TrainPipelineSparseDist
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ShardingType

WORLD = 2
DIM = 8
NUM_DENSE = 5
LOCAL_BATCH = 4
STEPS = 20
TABLES = [
    EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f])
    for i, (rows, f) in enumerate([(17, "f_a"), (11, "f_b"), (7, "f_c")])
]
FEATURES = [f for t in TABLES for f in t.feature_names]
MODULE = "model.sparse_arch.embedding_bag_collection"
OPTIMIZERS = {
    "sgd": OptimizerSpec.from_name("sgd", lr=0.3),
    "rowwise_adagrad": OptimizerSpec.from_name("rowwise_adagrad", lr=0.3, eps=1e-3),
}
OUTPUT_DISTS = ("pooled_all_to_all", "reduce_scatter")
"""The collectives of a pooled output dist (the embeddings' all-to-all in both passes)."""


@dataclass(frozen=True)
class Batch:
    dense_features: Tensor
    sparse_features: KeyedJaggedTensor
    labels: Tensor


def make_batch(step: int, rank: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (len(FEATURES) * LOCAL_BATCH,), generator=g)
    ids = [
        torch.randint(0, t.num_embeddings, (int(n),), generator=g)
        for t, n in zip(TABLES, lengths.view(len(FEATURES), -1).sum(1), strict=True)
    ]
    return Batch(
        torch.randn(LOCAL_BATCH, NUM_DENSE, generator=g),
        KeyedJaggedTensor(FEATURES, torch.cat(ids), lengths=lengths),
        torch.randint(0, 2, (LOCAL_BATCH,), generator=g).float(),
    )


def plan(name: str) -> ShardingPlan:
    tw, rw, cw = ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE

    def ps(kind: ShardingType, ranks: list[int] | None = None) -> ParameterSharding:
        return ParameterSharding(kind, "fused", ranks=ranks)

    plans = {
        "tw": {"t0": ps(tw, [0]), "t1": ps(tw, [1]), "t2": ps(tw, [1])},
        "mixed": {"t0": ps(rw), "t1": ps(tw, [1]), "t2": ps(cw, [1, 0])},
    }
    return ShardingPlan({MODULE: EmbeddingModuleShardingPlan(plans[name])})


def build(spec: OptimizerSpec, plan_name: str) -> DistributedModelParallel:
    torch.manual_seed(5)
    model = DLRMTrain(
        DLRM(EmbeddingBagCollection(TABLES, optimizer=spec), NUM_DENSE, [6, DIM], [6, 1])
    )
    return DistributedModelParallel(
        model, plan=plan(plan_name), optimizer=spec, device=test_device()
    )


class Events:
    """The events of one model's steps, in the order they happened on this rank."""

    def __init__(self, dmp: DistributedModelParallel) -> None:
        self.log: list[tuple[str, str]] = []
        dense_arch = dmp.module.model.dense_arch
        dense_arch.register_forward_pre_hook(lambda *_: self.log.append(("dense_arch", "start")))
        dense_arch.register_forward_hook(lambda *_: self.log.append(("dense_arch", "end")))
        ddp = dmp._dmp_wrapped_module
        assert isinstance(ddp, DistributedDataParallel)

        # Unannotated: DDP checks the annotations, which this module's future import makes strings.
        def all_reduce(state, bucket):  # type: ignore[no-untyped-def]
            self.log.append(("all_reduce", f"bucket {bucket.index()}"))
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, all_reduce)

    def step(self, index: int) -> None:
        self.log.append(("step", str(index)))

    def steps(self) -> list[list[tuple[str, str]]]:
        """The events of each step."""
        out: list[list[tuple[str, str]]] = []
        for event in self.log:
            if event[0] == "step":
                out.append([])
            else:
                out[-1].append(event)
        return out


@contextmanager
def collectives_to(events: list[Events | None]) -> Iterator[None]:
    """Record every ``PendingCollective``'s issue and first wait into ``events[0]``'s log."""
    init, wait = PendingCollective.__init__, PendingCollective.wait

    def recording_init(self: PendingCollective, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if events[0] is not None:
            events[0].log.append(("issue", self.collective))

    def recording_wait(self: PendingCollective) -> None:
        if events[0] is not None and not self._done:
            events[0].log.append(("wait", self.collective))
        wait(self)

    PendingCollective.__init__ = recording_init  # type: ignore[method-assign]
    PendingCollective.wait = recording_wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        PendingCollective.__init__ = init  # type: ignore[method-assign]
        PendingCollective.wait = wait  # type: ignore[method-assign]


def overlap_violations(step: list[tuple[str, str]], where: str) -> list[str]:
    """What in one step's events shows a missing overlap (empty: both overlaps happened)."""

    def first(kind: str, direction: str) -> int:
        hits = [
            i
            for i, (k, name) in enumerate(step)
            if k == kind and name.startswith(OUTPUT_DISTS) and name.endswith(direction)
        ]
        return hits[0] if hits else -1

    bad = []
    fwd_issue, fwd_wait = first("issue", ".forward"), first("wait", ".forward")
    start, end = step.index(("dense_arch", "start")), step.index(("dense_arch", "end"))
    if not 0 <= fwd_issue < start < end < fwd_wait:
        bad.append(
            f"{where}: output dist issued at {fwd_issue}, waited at {fwd_wait}, "
            f"dense arch {start}-{end}"
        )
    bwd_issue, bwd_wait = first("issue", ".backward"), first("wait", ".backward")
    reduces = [i for i, (k, _) in enumerate(step) if k == "all_reduce"]
    if not any(0 <= bwd_issue < i < bwd_wait for i in reduces):
        bad.append(
            f"{where}: gradient all-to-all issued at {bwd_issue}, waited at {bwd_wait}, "
            f"all-reduces at {reduces}"
        )
    return bad


def check_equal(a: Tensor, b: Tensor, what: str) -> None:
    if test_device().type == "cpu":
        assert torch.equal(a, b), f"rank {dist.get_rank()}: {what} differs"
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{what} differs")


def local_tensors(value: Any) -> list[Tensor]:
    if hasattr(value, "local_shards"):
        return [s.tensor for s in value.local_shards()]
    if hasattr(value, "to_local"):
        return [value.to_local()]
    return [value] if isinstance(value, Tensor) else []


def compare_models(piped: DistributedModelParallel, plain: DistributedModelParallel) -> int:
    compared = 0
    ref = plain.state_dict()
    for key, value in piped.state_dict().items():
        for a, b in zip(local_tensors(value), local_tensors(ref[key]), strict=True):
            check_equal(a, b, key)
            compared += 1
    states, ref_states = (
        piped.optimizer().state_dict()["state"],
        plain.optimizer().state_dict()["state"],
    )
    assert sorted(states) == sorted(ref_states)
    for param, state in states.items():
        for name, value in state.items():
            for a, b in zip(
                local_tensors(value), local_tensors(ref_states[param][name]), strict=True
            ):
                check_equal(a, b, f"optimizer state {param}/{name}")
                compared += 1
    return compared


def on_device(batch: Batch) -> Batch:
    device = test_device()
    return Batch(
        batch.dense_features.to(device), batch.sparse_features.to(device), batch.labels.to(device)
    )


def run(plan_name: str, optimizer: str) -> tuple[int, list[str]]:
    """20 pipelined and 20 plain steps: pieces compared, and overlap violations (both loops)."""
    torch.set_num_threads(1)
    spec = OPTIMIZERS[optimizer]
    piped, plain = build(spec, plan_name), build(spec, plan_name)
    piped_events, plain_events = Events(piped), Events(plain)
    batches = [make_batch(step, dist.get_rank()) for step in range(STEPS)]
    pipeline = TrainPipelineSparseDist(piped, piped.optimizer(), test_device())
    current: list[Events | None] = [None]
    with collectives_to(current):
        current[0] = piped_events
        loader, outputs = iter(batches), []
        for step in range(STEPS):
            piped_events.step(step)
            outputs.append(pipeline.progress(loader))
        with pytest.raises(StopIteration):
            pipeline.progress(loader)
        current[0] = plain_events
        optimizer_ = plain.optimizer()
        for step, batch in enumerate(batches):
            plain_events.step(step)
            optimizer_.zero_grad()
            loss, out = plain(on_device(batch))
            loss.backward()
            optimizer_.step()
            for got, want in zip(outputs[step], out, strict=True):
                check_equal(got, want, f"output of step {step}")
    violations = []
    for name, events in (("pipelined", piped_events), ("plain", plain_events)):
        for step, logged in enumerate(events.steps()):
            violations += overlap_violations(logged, f"{name} step {step}")
    return compare_models(piped, plain), violations


@pytest.mark.parametrize(("plan_name", "optimizer"), [("tw", "sgd"), ("mixed", "rowwise_adagrad")])
def test_dlrm_pipeline_overlaps_and_equals_plain_loop(plan_name: str, optimizer: str) -> None:
    require_devices(WORLD)
    results = run_on_ranks(WORLD, run, plan_name, optimizer, timeout_s=240)
    for rank, (compared, violations) in enumerate(results):
        assert compared > 0
        assert not violations, f"rank {rank}: {violations[:4]}"
