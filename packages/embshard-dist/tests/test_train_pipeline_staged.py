"""StagedTrainPipeline, PipelineStage and SparseDataDistUtil in one process (a one-rank gloo
group): TorchRec's signatures, the order the stages run in (filling, steady state, end of the
data, flush), the input dist started by the stage ahead of the forward that uses it, results
equal to the plain loop bit for bit, detach and re-attach, forwards outside the pipeline, and
the refusals. The results on real ranks are in ``tests/test_train_pipeline_staged_dist.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_train_pipeline_unit import (  # the same batches, the one-rank group, the checks
    Batch,
    assert_same_state,
    batches,
    plain_loop,
)
from test_train_pipeline_unit import one_rank_group as one_rank_group  # autouse fixture
from torch import Tensor, nn

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.train_pipeline.batch import move_batch
from embshard_dist.train_pipeline.staged import (
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
    StageOut,
)
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ShardingType

TABLES = [
    EmbeddingBagConfig(name="t_a", num_embeddings=10, embedding_dim=4, feature_names=("f_a",)),
    EmbeddingBagConfig(name="t_b", num_embeddings=6, embedding_dim=4, feature_names=("f_b",)),
]
SPEC = OptimizerSpec.from_name("rowwise_adagrad", lr=0.2, eps=1e-3)
CPU_STREAM = torch.Stream("cpu")


class Model(nn.Module):
    """``forward(batch) -> (loss, logits)``; records the dense features of each batch seen."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.sparse = EmbeddingBagCollection(TABLES, optimizer=SPEC)
        self.top = nn.Linear(3 + 8, 1)
        self.seen: list[Tensor] = []

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        self.seen.append(batch.dense_features)
        pooled = self.sparse(batch.sparse_features).values()
        if self.fail:
            raise RuntimeError("the model failed")
        logits = self.top(torch.cat([batch.dense_features, pooled], dim=1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def sharded(kind: ShardingType = ShardingType.ROW_WISE) -> Any:
    torch.manual_seed(0)
    ranks = [0] if kind is ShardingType.TABLE_WISE else None
    shardings = {t.name: ParameterSharding(kind, "fused", ranks=ranks) for t in TABLES}
    plan = ShardingPlan({"sparse": EmbeddingModuleShardingPlan(shardings)})
    return DistributedModelParallel(Model(), plan=plan, optimizer=SPEC, device="cpu")


def copy_stage() -> PipelineStage:
    return PipelineStage("data_copy", lambda b: move_batch(b, torch.device("cpu")), CPU_STREAM)


def staged(model: Any, *extra: PipelineStage, **sdd_kwargs: Any) -> StagedTrainPipeline[Any, Any]:
    """TorchRec's usual pipeline: copy, the given stages, then the start of the input dist."""
    sdd = SparseDataDistUtil[Batch](model, CPU_STREAM, **sdd_kwargs)
    stages = [
        copy_stage(),
        *extra,
        PipelineStage(
            name="start_sparse_data_dist",
            runnable=sdd.start_sparse_data_dist,
            stream=sdd.data_dist_stream,
            fill_callback=sdd.wait_sdd_fill_callback,
            data_exhausted_callback=sdd.data_exhausted_callback,
        ),
    ]
    return StagedTrainPipeline(pipeline_stages=stages)


def train(pipeline: StagedTrainPipeline[Any, Any], model: Any, it: Iterator[Any]) -> list[Tensor]:
    """TorchRec's staged loop, until ``progress`` returns ``None``."""
    optimizer = model.optimizer()
    outputs = []
    while (batch := pipeline.progress(it)) is not None:
        optimizer.zero_grad()
        loss, out = model(batch)
        loss.backward()
        optimizer.step()
        outputs.append(out)
    return outputs


def defaults(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]


def test_signatures_are_torchrecs() -> None:
    empty = inspect.Parameter.empty
    assert defaults(StagedTrainPipeline.__init__) == [
        ("pipeline_stages", empty),
        ("debug_mode", False),
        ("compute_stream", None),
        ("on_flush_end", None),
    ]
    assert defaults(SparseDataDistUtil.__init__) == [
        ("model", empty),
        ("data_dist_stream", empty),
        ("apply_jit", False),
        ("prefetch_stream", None),
        ("pipeline_postproc", False),
        ("embedding_lookup_stream", None),
    ]
    assert [(f.name, f.default) for f in fields(PipelineStage)][3:] == [
        ("fill_callback", None),
        ("data_exhausted_callback", None),
    ]
    assert [f.name for f in fields(PipelineStage)][:3] == ["name", "runnable", "stream"]
    assert defaults(SparseDataDistUtil.start_sparse_data_dist_stage) == [
        ("name", "start_sparse_data_dist"),
        ("runnable", None),
    ]
    assert list(inspect.signature(SparseDataDistUtil.wait_sparse_data_dist).parameters) == ["self"]


@dataclass
class Item:
    value: int


def test_stages_run_in_torchrecs_order_and_the_end_returns_none() -> None:
    calls: list[tuple[str, int]] = []

    def stage(name: str, add: int) -> PipelineStage:
        def runnable(item: Item) -> Item:
            calls.append((name, item.value))
            return Item(item.value + add)

        return PipelineStage(
            name,
            runnable,
            CPU_STREAM,
            fill_callback=lambda: calls.append((f"{name} fill", -1)),
            data_exhausted_callback=lambda: calls.append((f"{name} exhausted", -1)),
        )

    pipeline: StagedTrainPipeline[Item, Item] = StagedTrainPipeline(
        [stage("a", 100), stage("b", 1000), stage("c", 10000)]
    )
    assert pipeline.num_stages == 3
    it = iter([Item(i) for i in range(4)])
    assert pipeline.progress(it) == Item(11100)
    assert calls == [
        ("a", 0), ("a fill", -1), ("b", 100), ("b fill", -1), ("c", 1100), ("c fill", -1),
        ("a", 1), ("a fill", -1), ("b", 101), ("b fill", -1),
        ("a", 2), ("a fill", -1),
        ("a", 3), ("b", 102), ("c", 1101),
    ]  # fmt: skip
    calls.clear()
    assert [pipeline.progress(it) for _ in range(3)] == [Item(11101), Item(11102), Item(11103)]
    assert calls == [
        ("a exhausted", -1), ("b", 103), ("c", 1102),
        ("a exhausted", -1), ("b exhausted", -1), ("c", 1103),
        ("a exhausted", -1), ("b exhausted", -1), ("c exhausted", -1),
    ]  # fmt: skip
    assert pipeline.progress(it) is None
    assert pipeline.progress(it) is None  # again, never asking the ended iterator
    # A new iterator after the end starts a new epoch at once.
    assert pipeline.progress(iter([Item(7)])) == Item(11107)
    assert pipeline.progress(iter([])) is None


def test_fewer_batches_than_stages_and_no_batch() -> None:
    stages = [PipelineStage(str(i), lambda x: x, None) for i in range(3)]
    pipeline: StagedTrainPipeline[Item, Item] = StagedTrainPipeline(stages)
    assert pipeline.progress(iter([])) is None
    it = iter([Item(1)])
    assert pipeline.progress(it) == Item(1)
    assert pipeline.progress(it) is None


def spy_input_dist(model: Any, data: list[Batch], events: list[tuple[str, int]]) -> None:
    module = model.sharded_modules["sparse"]
    original = module.input_dist

    def spy(ctx: Any, features: KeyedJaggedTensor) -> Any:
        index = [b.sparse_features.values() is features.values() for b in data]
        events.append(("input_dist", index.index(True)))
        return original(ctx, features)

    module.input_dist = spy


@pytest.mark.parametrize("kind", [ShardingType.ROW_WISE, ShardingType.TABLE_WISE])
def test_next_input_dist_starts_in_the_stage_and_results_equal_plain(kind: ShardingType) -> None:
    data = batches(5)
    model = sharded(kind)
    events: list[tuple[str, int]] = []
    spy_input_dist(model, data, events)
    sdd = SparseDataDistUtil[Batch](model, None, sparse_of=lambda b: b.sparse_features)
    pipeline: StagedTrainPipeline[Batch, Batch] = StagedTrainPipeline(
        [PipelineStage("identity", lambda b: b, None), sdd.start_sparse_data_dist_stage()]
    )
    optimizer = model.optimizer()
    outputs = []
    it = iter(data)
    while (batch := pipeline.progress(it)) is not None:
        assert "forward" not in model.sharded_modules["sparse"].__dict__
        optimizer.zero_grad()
        loss, out = model(batch)
        events.append(("forward", [b is batch for b in data].index(True)))
        loss.backward()
        optimizer.step()
        outputs.append(out)
    assert events == [
        ("input_dist", 0),
        ("input_dist", 1),
        ("forward", 0),
        ("input_dist", 2),
        ("forward", 1),
        ("input_dist", 3),
        ("forward", 2),
        ("input_dist", 4),
        ("forward", 3),
        ("forward", 4),
    ]
    reference = sharded(kind)
    expected = plain_loop(reference, data)
    assert len(outputs) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert_same_state(model, reference)
    assert sdd.initialized and list(sdd.pipelined_modules) == ["sparse"]


def test_learned_inputs_and_a_second_epoch_equal_plain() -> None:
    data = batches(6)
    model, reference = sharded(), sharded()
    events: list[tuple[str, int]] = []
    spy_input_dist(model, data, events)
    pipeline = staged(model, PipelineStage("postproc", lambda b: b, CPU_STREAM))
    first = train(pipeline, model, iter(data[:4]))
    # Learning from batch 0 (it runs as the plain loop); batch 1's dist starts after it.
    assert events[:4] == [
        ("input_dist", 0),
        ("input_dist", 1),
        ("input_dist", 2),
        ("input_dist", 3),
    ]
    second = train(pipeline, model, iter(data[4:]))
    expected = plain_loop(reference, data)
    assert len(first) == 4 and len(second) == 2
    assert all(torch.equal(a, b) for a, b in zip(first + second, expected, strict=True))
    assert_same_state(model, reference)


def test_flush_refills_and_results_equal_plain() -> None:
    data = batches(10)
    model, reference = sharded(), sharded()
    ended = 0

    def on_flush_end() -> None:
        nonlocal ended
        ended += 1

    sdd = SparseDataDistUtil[Batch](model, CPU_STREAM)
    pipeline: StagedTrainPipeline[Batch, Batch] = StagedTrainPipeline(
        pipeline_stages=[
            copy_stage(),
            PipelineStage("gpu_postproc", lambda b: b, CPU_STREAM),
            sdd.start_sparse_data_dist_stage(),
        ],
        on_flush_end=on_flush_end,
    )
    optimizer = model.optimizer()
    outputs: list[Tensor] = []
    it = iter(data)

    def step() -> bool:
        batch = pipeline.progress(it)
        if batch is None:
            return False
        optimizer.zero_grad()
        loss, out = model(batch)
        loss.backward()
        optimizer.step()
        outputs.append(out)
        return True

    assert step()  # 4 batches taken: 3 in flight after the first one
    pipeline.set_flush(True)
    assert all(step() for _ in range(3))
    assert ended == 0
    assert step()  # flushed: refilled, the fifth batch
    assert ended == 1
    assert all(step() for _ in range(5))
    assert not step()
    assert ended == 1
    expected = plain_loop(reference, data)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert len(outputs) == 10
    assert_same_state(model, reference)


def test_detach_trains_plainly_and_the_pipeline_goes_on() -> None:
    data = batches(12)
    model, reference = sharded(), sharded()
    sdd = SparseDataDistUtil[Batch](model, CPU_STREAM)
    pipeline: StagedTrainPipeline[Batch, Batch] = StagedTrainPipeline(
        [copy_stage(), sdd.start_sparse_data_dist_stage()]
    )
    optimizer, ref_optimizer = model.optimizer(), reference.optimizer()
    it = iter(data)

    def both(batch: Batch, piped: Batch) -> None:
        for m, opt, b in ((reference, ref_optimizer, batch), (model, optimizer, piped)):
            opt.zero_grad()
            loss, out = m(b)
            loss.backward()
            opt.step()
            outs.append(out)
        assert torch.equal(outs[-1], outs[-2])

    outs: list[Tensor] = []
    for i in range(5):
        piped = pipeline.progress(it)
        assert piped is not None
        both(data[i], piped)
    assert len(model._forward_hooks) == 1 and sdd.initialized
    detached = sdd.detach()
    assert detached is model and not model._forward_hooks and not sdd.initialized
    extra = batches(1, start=50)[0]  # trained plainly by both, outside the pipeline
    both(extra, move_batch(extra, torch.device("cpu")))
    for i in range(5, 12):
        piped = pipeline.progress(it)
        assert piped is not None
        both(data[i], piped)
    assert len(model._forward_hooks) == 1
    assert pipeline.progress(it) is None
    assert_same_state(model, reference)


def test_other_forwards_run_plainly_between_steps() -> None:
    data, probes = batches(5), batches(5, start=20)
    model, reference = sharded(), sharded()
    pipeline = staged(model, sparse_of=lambda b: b.sparse_features)
    optimizer, ref_optimizer = model.optimizer(), reference.optimizer()
    it = iter(data)
    for i in range(5):
        batch = pipeline.progress(it)
        assert batch is not None
        with torch.no_grad():  # an eval forward on another batch, inside the pipeline's step
            assert torch.equal(model(probes[i])[1], reference(probes[i])[1])
        outs = []
        for m, opt, b in ((model, optimizer, batch), (reference, ref_optimizer, data[i])):
            opt.zero_grad()
            loss, out = m(b)
            loss.backward()
            opt.step()
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
    assert pipeline.progress(it) is None
    assert_same_state(model, reference)


def test_a_failing_forward_restores_the_modules_and_the_pipeline_goes_on() -> None:
    data = batches(3)
    model = sharded()
    events: list[tuple[str, int]] = []
    spy_input_dist(model, data, events)
    pipeline = staged(model, sparse_of=lambda b: b.sparse_features)
    it = iter(data)
    batch = pipeline.progress(it)
    model.module.fail = True
    with pytest.raises(RuntimeError, match="the model failed"):
        model(batch)
    assert "forward" not in model.sharded_modules["sparse"].__dict__
    model.module.fail = False
    forwarded = 0
    while (batch := pipeline.progress(it)) is not None:
        loss, _ = model(batch)
        loss.backward()
        forwarded += 1
    assert forwarded == 2
    assert events == [("input_dist", 0), ("input_dist", 1), ("input_dist", 2)]  # pipelined


def test_refusals() -> None:
    model = sharded()
    with pytest.raises(ValueError, match="prefetch_stream=None"):
        SparseDataDistUtil(model, None, prefetch_stream=CPU_STREAM)
    with pytest.raises(ValueError, match="TrainPipelineSemiSync"):
        SparseDataDistUtil(model, None, embedding_lookup_stream=CPU_STREAM)
    with pytest.raises(ValueError, match="apply_jit=False"):
        SparseDataDistUtil(model, None, apply_jit=True)
    with pytest.raises(ValueError, match="no sharded module"):
        SparseDataDistUtil(nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="pipeline_stages is empty"):
        StagedTrainPipeline([])
    sdd = SparseDataDistUtil[Batch](model, None)
    with pytest.raises(RuntimeError, match="no cache prefetch"):
        sdd.prefetch(batches(1)[0])
    with pytest.raises(RuntimeError, match="semi-synchronous"):
        sdd.start_embedding_lookup(batches(1)[0])
    with pytest.raises(ValueError, match="embedding_lookup_stream=None"):
        sdd.start_embedding_lookup_stage()
    sdd.load_prefetch()  # TorchRec's deprecated no-op


def test_a_loop_that_skips_the_model_is_refused() -> None:
    model = sharded()
    pipeline = staged(model)
    it = iter(batches(6))
    assert pipeline.progress(it) is not None
    with pytest.raises(RuntimeError, match="call the model once per"):
        pipeline.progress(it)


def test_stage_out_is_a_type_variable() -> None:
    def gpu_postproc(x: StageOut) -> StageOut:
        return x

    stage = PipelineStage("p", gpu_postproc, None)
    assert stage.fill_callback is None and stage.data_exhausted_callback is None
