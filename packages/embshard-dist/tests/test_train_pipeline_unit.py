"""TrainPipelineSparseDist in one process (a one-rank gloo group): the order of its stages, the
end of the data, the contract for finding each sharded module's input and its refusals, and
moving batches. The results on real ranks against the plain loop are in
``tests/test_train_pipeline.py``.
"""

from __future__ import annotations

import inspect
import socket
import threading
from collections import namedtuple
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.models import DLRM, DLRMTrain
from embshard_dist.train_pipeline import (
    DataLoadingThread,
    EvalPipelineSparseDist,
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
    TorchCompileConfig,
    TrainPipelineBase,
    TrainPipelineFusedSparseDist,
    TrainPipelinePT2,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
    find_sharded_modules,
    move_batch,
)
from embshard_dist.train_pipeline.semi_sync import detach_embeddings
from embshard_dist.train_pipeline.sparse_inputs import find_in_batch
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor
from embshard_types.vocab import ShardingType

TABLES = [
    EmbeddingBagConfig(name="t_a", num_embeddings=10, embedding_dim=4, feature_names=("f_a",)),
    EmbeddingBagConfig(name="t_b", num_embeddings=6, embedding_dim=4, feature_names=("f_b",)),
]
SPEC = OptimizerSpec.from_name("rowwise_adagrad", lr=0.2, eps=1e-3)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group in this process (unless the session already has one)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Batch:
    dense_features: Tensor
    sparse_features: KeyedJaggedTensor
    labels: Tensor


class Model(nn.Module):
    """``forward(batch) -> (loss, logits)``; ``mode`` bends how it calls its collection."""

    def __init__(self, mode: str = "plain") -> None:
        super().__init__()
        self.mode = mode
        self.sparse = EmbeddingBagCollection(TABLES, optimizer=SPEC)
        self.top = nn.Linear(3 + 8, 1)
        self.seen: list[Tensor] = []

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        self.seen.append(batch.dense_features)
        features = batch.sparse_features
        if self.mode == "copies":
            features = features.to("cpu")  # another KeyedJaggedTensor object
        if self.mode == "skips":
            pooled = torch.zeros(batch.labels.numel(), 8)
        else:
            pooled = self.sparse(features).values()
        if self.mode == "twice":
            pooled = pooled + self.sparse(features).values()
        logits = self.top(torch.cat([batch.dense_features, pooled], dim=1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def sharded(mode: str = "plain", kind: ShardingType = ShardingType.ROW_WISE) -> Any:
    torch.manual_seed(0)
    ranks = [0] if kind is ShardingType.TABLE_WISE else None
    shardings = {t.name: ParameterSharding(kind, "fused", ranks=ranks) for t in TABLES}
    plan = ShardingPlan({"sparse": EmbeddingModuleShardingPlan(shardings)})
    return DistributedModelParallel(Model(mode), plan=plan, optimizer=SPEC, device="cpu")


def batches(count: int, start: int = 0) -> list[Batch]:
    out = []
    for step in range(start, start + count):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 3, (2 * 4,), generator=g)
        rows = [10] * 4 + [6] * 4
        ids = torch.cat(
            [
                torch.randint(0, r, (int(n),), generator=g)
                for r, n in zip(rows, lengths, strict=True)
            ]
        )
        kjt = KeyedJaggedTensor(["f_a", "f_b"], ids, lengths=lengths)
        out.append(
            Batch(
                torch.randn(4, 3, generator=g), kjt, torch.randint(0, 2, (4,), generator=g).float()
            )
        )
    return out


def assert_same_state(model: Any, reference: Any) -> None:
    """Every weight of ``model`` equals ``reference``'s, bit for bit (local shards)."""
    for key, value in model.state_dict().items():
        ref = reference.state_dict()[key]
        mine = value.local_shards()[0].tensor if hasattr(value, "local_shards") else value
        theirs = ref.local_shards()[0].tensor if hasattr(ref, "local_shards") else ref
        assert torch.equal(mine, theirs), key


def run(pipeline: TrainPipelineSparseDist[Any, Tensor], data: Iterator[Any]) -> list[Tensor]:
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(data))
        except StopIteration:
            return outputs


def test_next_input_dist_starts_before_this_forward_and_results_equal_plain() -> None:
    data = batches(4)
    model = sharded()
    module = model.sharded_modules["sparse"]
    events: list[tuple[str, int]] = []
    original = module.input_dist

    def spy(ctx: Any, features: KeyedJaggedTensor) -> Any:
        index = [b.sparse_features.values() for b in data]
        events.append(("input_dist", [v is features.values() for v in index].index(True)))
        return original(ctx, features)

    module.input_dist = spy  # type: ignore[method-assign]
    pipeline = TrainPipelineSparseDist(
        model, model.optimizer(), torch.device("cpu"), sparse_of=lambda b: b.sparse_features
    )
    it = iter(data)
    outputs = []
    for _ in range(4):
        outputs.append(pipeline.progress(it))
        forwarded = model.module.seen[-1]
        events.append(("forward", [b.dense_features is forwarded for b in data].index(True)))
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    assert events == [
        ("input_dist", 0),
        ("input_dist", 1),
        ("forward", 0),
        ("input_dist", 2),
        ("forward", 1),
        ("input_dist", 3),
        ("forward", 2),
        ("forward", 3),
    ]
    assert "forward" not in module.__dict__  # the module's own forward is back after each step

    reference = sharded()
    optimizer = reference.optimizer()
    for batch, out in zip(data, outputs, strict=True):
        optimizer.zero_grad()
        loss, expected = reference(batch)
        loss.backward()
        optimizer.step()
        assert torch.equal(out, expected)
    assert_same_state(model, reference)


def plain_loop(model: Any, data: list[Batch], step: Any = None) -> list[Tensor]:
    optimizer = model.optimizer()
    outputs = []
    for batch in data:
        optimizer.zero_grad()
        loss, out = (step or model)(batch)
        loss.backward()
        optimizer.step()
        outputs.append(out)
    return outputs


def dlrm_train() -> Any:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, optimizer=SPEC)
    path = "model.sparse_arch.embedding_bag_collection"
    shardings = {t.name: ParameterSharding(ShardingType.ROW_WISE, "fused") for t in TABLES}
    plan = ShardingPlan({path: EmbeddingModuleShardingPlan(shardings)})
    model = DLRMTrain(DLRM(ebc, 3, [6, 4], [5, 1]))
    return DistributedModelParallel(model, plan=plan, optimizer=SPEC, device="cpu")


def test_dlrm_train_and_a_custom_forward_equal_the_plain_loop() -> None:
    data = batches(5)
    model, reference = dlrm_train(), dlrm_train()
    pipeline = TrainPipelineSparseDist(model, model.optimizer(), "cpu")
    assert list(pipeline.pipelined_modules) == ["model.sparse_arch.embedding_bag_collection"]
    for out, expected in zip(run(pipeline, iter(data)), plain_loop(reference, data), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))

    def step(dmp: Any) -> Any:
        inner = dmp.module.model  # DLRM.forward(dense, sparse): no loss of its own

        def forward(batch: Batch) -> tuple[Tensor, Tensor]:
            logits = inner(batch.dense_features, batch.sparse_features).squeeze(-1)
            return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()

        return forward

    model, reference = dlrm_train(), dlrm_train()
    custom = TrainPipelineSparseDist(model, model.optimizer(), "cpu", custom_model_fwd=step(model))
    outputs = run(custom, iter(data))
    for out, expected in zip(outputs, plain_loop(reference, data, step(reference)), strict=True):
        assert torch.equal(out, expected)


def test_end_of_data_and_a_second_epoch() -> None:
    model = sharded()
    pipeline = TrainPipelineSparseDist(model, model.optimizer(), "cpu")
    with pytest.raises(StopIteration):
        pipeline.progress(iter([]))
    assert len(run(pipeline, iter(batches(1)))) == 1
    assert len(run(pipeline, iter(batches(3)))) == 3
    stopping = TrainPipelineSparseDist(model, model.optimizer(), "cpu", execute_all_batches=False)
    assert len(run(stopping, iter(batches(3)))) == 2  # the last batch was in flight
    assert len(run(stopping, iter(batches(3)))) == 2  # and the pipeline starts afresh


def test_eval_mode_steps_nothing() -> None:
    model = sharded()
    before = {
        k: v.local_shards()[0].tensor.clone()
        for k, v in model.state_dict().items()
        if hasattr(v, "local_shards")
    }
    model.eval()
    pipeline = TrainPipelineSparseDist(model, model.optimizer(), "cpu")
    assert len(run(pipeline, iter(batches(3)))) == 3
    for key, value in model.state_dict().items():
        if key in before:
            assert torch.equal(value.local_shards()[0].tensor, before[key])


def test_finds_sharded_modules_under_their_model_paths() -> None:
    model = sharded(kind=ShardingType.TABLE_WISE)
    assert list(find_sharded_modules(model)) == ["sparse"]
    assert find_sharded_modules(model.module) == find_sharded_modules(model)
    with pytest.raises(ValueError, match=r"holds no sharded module.*DistributedModelParallel"):
        TrainPipelineSparseDist(Model(), torch.optim.SGD(Model().parameters(), lr=0.1), "cpu")


@pytest.mark.parametrize(
    ("mode", "error", "match"),
    [
        ("copies", ValueError, r"'sparse' was called with another KeyedJaggedTensor"),
        ("twice", RuntimeError, r"'sparse' was called twice"),
        ("skips", RuntimeError, r"did not call the sharded modules \['sparse'\]"),
    ],
)
def test_refuses_a_model_that_does_not_pass_sparse_of_on(
    mode: str, error: type[Exception], match: str
) -> None:
    model = sharded(mode)
    pipeline = TrainPipelineSparseDist(
        model, model.optimizer(), "cpu", sparse_of=lambda b: b.sparse_features
    )
    with pytest.raises(error, match=match):
        pipeline.progress(iter(batches(2)))
    assert "forward" not in model.sharded_modules["sparse"].__dict__


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("copies", "not an attribute, key or item of the batch"),
        ("twice", "called it 2 times"),
        ("skips", "did not call it"),
    ],
)
def test_learning_leaves_a_module_it_cannot_pipeline_to_the_forward(
    mode: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Without ``sparse_of``, a module the first batch shows cannot be pipelined distributes
    its own input (a warning says which and why), and the results are the plain loop's."""
    data = batches(4)
    model, reference = sharded(mode), sharded(mode)
    pipeline = TrainPipelineSparseDist(model, model.optimizer(), "cpu")
    with caplog.at_level("WARNING"):
        outputs = run(pipeline, iter(data))
    assert f"'sparse': the first batch's forward {why}" in caplog.text or why in caplog.text
    assert "sparse_of" in caplog.text
    for out, expected in zip(outputs, plain_loop(reference, data), strict=True):
        assert torch.equal(out, expected)


class TwoTowers(nn.Module):
    """Two collections fed from different parts of a dict batch."""

    def __init__(self) -> None:
        super().__init__()
        self.users = EmbeddingBagCollection(TABLES[:1], optimizer=SPEC)
        self.items = EmbeddingBagCollection(TABLES[1:], optimizer=SPEC)
        self.top = nn.Linear(3 + 8, 1)

    def forward(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        users = self.users(batch["features"]["user"]).values()
        items = self.items(batch["features"]["item"][0]).values()
        logits = self.top(torch.cat([batch["dense"], users, items], dim=1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch["labels"]), logits.detach()


def two_towers() -> Any:
    torch.manual_seed(0)
    plan = ShardingPlan(
        {
            "users": EmbeddingModuleShardingPlan(
                {"t_a": ParameterSharding(ShardingType.ROW_WISE, "fused")}
            ),
            "items": EmbeddingModuleShardingPlan(
                {"t_b": ParameterSharding(ShardingType.TABLE_WISE, "fused", ranks=[0])}
            ),
        }
    )
    return DistributedModelParallel(TwoTowers(), plan=plan, optimizer=SPEC, device="cpu")


def dict_batches(count: int) -> list[dict[str, Any]]:
    out = []
    for batch in batches(count):
        ids = batch.sparse_features.to_dict()
        user = KeyedJaggedTensor.from_jt_dict({"f_a": ids["f_a"]})
        item = KeyedJaggedTensor.from_jt_dict({"f_b": ids["f_b"]})
        features = {"user": user, "item": (item,)}
        out.append({"dense": batch.dense_features, "features": features, "labels": batch.labels})
    return out


def test_learns_each_modules_input_from_the_first_batch() -> None:
    """TorchRec's pipeline finds each sharded module's input by tracing the model; embshard's
    learns it from the first batch (run as the plain loop) and pipelines the rest."""
    data = dict_batches(4)
    model, reference = two_towers(), two_towers()
    events: list[tuple[str, int]] = []
    users = model.sharded_modules["users"]
    original = users.input_dist

    def spy(ctx: Any, features: KeyedJaggedTensor) -> Any:
        index = [b["features"]["user"].values() for b in data]
        events.append(("input_dist", [v is features.values() for v in index].index(True)))
        return original(ctx, features)

    users.input_dist = spy  # type: ignore[method-assign]
    pipeline = TrainPipelineSparseDist(model, model.optimizer(), "cpu")
    it = iter(data)
    outputs = []
    for step in range(4):
        outputs.append(pipeline.progress(it))
        events.append(("step", step))
    learned = {path: str(where) for path, where in (pipeline._inputs.learned or {}).items()}
    assert learned == {
        "users": "batch['features']['user']",
        "items": "batch['features']['item'][0]",
    }
    assert events == [
        ("input_dist", 0),  # batch 0 runs as the plain loop: its own input dist
        ("input_dist", 1),  # learned: batch 1's input dist before batch 0's backward
        ("step", 0),
        ("input_dist", 2),
        ("step", 1),
        ("input_dist", 3),
        ("step", 2),
        ("step", 3),
    ]
    for out, expected in zip(outputs, plain_loop(reference, data), strict=True):
        assert torch.equal(out, expected)
    assert_same_state(model, reference)


def test_learned_paths_are_checked_on_every_batch() -> None:
    model = two_towers()
    pipeline = TrainPipelineSparseDist(model, model.optimizer(), "cpu")
    data = dict_batches(3)
    data[2] = {**data[2], "features": {"user": data[2]["features"]["user"]}}
    with pytest.raises(TypeError, match=r"input at batch\['features'\]\['item'\]\[0\].*sparse_of"):
        run(pipeline, iter(data))
    wrong = dict_batches(3)
    wrong[2]["features"]["user"] = torch.zeros(1)
    again = TrainPipelineSparseDist(two_towers(), model.optimizer(), "cpu")
    with pytest.raises(TypeError, match=r"'users' reads batch\['features'\]\['user'\].*Tensor"):
        run(again, iter(wrong))


def test_find_in_batch_walks_attributes_keys_and_items() -> None:
    kjt = batches(1)[0].sparse_features
    point = namedtuple("point", ["x", "y"])
    assert str(find_in_batch(Batch(torch.zeros(1), kjt, torch.zeros(1)), kjt)) == (
        "batch.sparse_features"
    )
    assert str(find_in_batch({"a": [point(1, kjt)]}, kjt)) == "batch['a'][0].y"
    assert find_in_batch({"a": kjt.to_dict()}, kjt) is None  # equal values are not the object
    assert find_in_batch([[[[[kjt]]]]], kjt) is None  # deeper than four steps
    assert str(find_in_batch(kjt, kjt)) == "batch"


def test_sparse_of_checks_its_answer_and_may_leave_modules_out() -> None:
    model = sharded()
    unknown = TrainPipelineSparseDist(
        model, model.optimizer(), "cpu", sparse_of=lambda b: {"towers.ebc": b.sparse_features}
    )
    with pytest.raises(ValueError, match=r"\['towers.ebc'\].*sharded modules are \['sparse'\]"):
        unknown.progress(iter(batches(1)))
    wrong = TrainPipelineSparseDist(model, model.optimizer(), "cpu", sparse_of=lambda b: b.labels)
    with pytest.raises(TypeError, match="KeyedJaggedTensor or a dict"):
        wrong.progress(iter(batches(1)))
    # Left out of the mapping: the module distributes its own input inside the forward.
    reference = sharded()
    unpiped = TrainPipelineSparseDist(model, model.optimizer(), "cpu", sparse_of=lambda b: {})
    outputs = run(unpiped, iter(batches(3)))
    optimizer = reference.optimizer()
    for batch, out in zip(batches(3), outputs, strict=True):
        optimizer.zero_grad()
        loss, expected = reference(batch)
        loss.backward()
        optimizer.step()
        assert torch.equal(out, expected)


def test_move_batch_keeps_structure_and_moves_every_tensor() -> None:
    point = namedtuple("point", ["x", "y"])
    kjt = batches(1)[0].sparse_features
    given = {"a": [torch.ones(2), (point(torch.zeros(1), 3), "s")], "b": batches(1)[0], "c": kjt}
    moved = move_batch(given, torch.device("meta"))
    assert moved["a"][0].is_meta and moved["a"][1][0].x.is_meta and moved["a"][1][0].y == 3
    assert isinstance(moved["a"][1][0], point) and moved["a"][1][1] == "s"
    assert isinstance(moved["b"], Batch) and moved["b"].sparse_features.values().is_meta
    assert moved["c"].values().is_meta and moved["c"].keys() == ["f_a", "f_b"]
    same = torch.ones(1)
    assert move_batch(same, torch.device("cpu")) is same


class DenseOnly(nn.Module):
    """No sharded module: ``TrainPipelineSparseDist`` refuses it, ``TrainPipelineBase`` runs it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.top = nn.Linear(3, 1)

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        logits = self.top(batch.dense_features).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def test_base_pipeline_is_the_plain_loop_for_any_model() -> None:
    data = batches(4)
    model, reference = DenseOnly(), DenseOnly()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    pipeline = TrainPipelineBase(model, optimizer, "cpu")
    with pytest.raises(StopIteration):
        pipeline.progress(iter([]))
    outputs = run(pipeline, iter(data))
    expected = []
    for batch in data:
        ref_optimizer.zero_grad()
        loss, out = reference(batch)
        loss.backward()
        ref_optimizer.step()
        expected.append(out)
    assert len(outputs) == 4
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert torch.equal(model.top.weight, reference.top.weight)
    assert len(run(pipeline, iter(batches(2)))) == 2  # a second epoch
    with pytest.raises(ValueError, match="holds no sharded module"):
        TrainPipelineSparseDist(model, optimizer, "cpu")


def test_semi_sync_looks_up_the_next_batch_before_this_backward() -> None:
    """From ``start_batch`` on, batch ``i+1``'s lookup runs between batch ``i``'s forward and
    its optimizer step; before it, after the step."""
    data = batches(4)
    model = sharded()
    module = model.sharded_modules["sparse"]
    events: list[tuple[str, int]] = []
    index = [b.sparse_features.values() for b in data]
    dense = [b.dense_features for b in data]
    lookup = module.compute_and_output_dist

    def spy_lookup(ctx: Any, features: Any) -> Any:
        events.append(("lookup", len([e for e in events if e[0] == "lookup"])))
        return lookup(ctx, features)

    class Seen(list[Tensor]):
        def append(self, value: Tensor) -> None:
            events.append(("forward", [d is value for d in dense].index(True)))
            super().append(value)

    module.compute_and_output_dist = spy_lookup  # type: ignore[method-assign]
    model.module.seen = Seen()
    optimizer = model.optimizer()
    step = optimizer.step

    def spy_step(*args: Any, **kwargs: Any) -> Any:
        events.append(("step", 0))
        return step(*args, **kwargs)

    optimizer.step = spy_step  # type: ignore[method-assign]
    pipeline = TrainPipelineSemiSync(
        model, optimizer, "cpu", start_batch=1, sparse_of=lambda b: b.sparse_features
    )
    outputs = run(pipeline, iter(data))
    assert len(outputs) == 4 and len(index) == 4
    assert events == [
        ("lookup", 0),
        ("forward", 0),
        ("step", 0),
        ("lookup", 1),  # batch 0 is synchronous: batch 1 is looked up after its step
        ("forward", 1),
        ("lookup", 2),  # semi-synchronous: before batch 1's backward and step
        ("step", 0),
        ("forward", 2),
        ("lookup", 3),
        ("step", 0),
        ("forward", 3),
        ("step", 0),
    ]
    assert "forward" not in module.__dict__


def test_semi_sync_refusals() -> None:
    model = sharded()
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"start_batch must be an int >= 0"):
            TrainPipelineSemiSync(model, model.optimizer(), "cpu", start_batch=bad)  # type: ignore[arg-type]
    table = next(p for p in model.sharded_modules["sparse"].parameters() if p.requires_grad)
    stepping_tables = torch.optim.SGD([table], lr=0.1)
    with pytest.raises(ValueError, match=r"steps parameters of the sharded modules \['sparse'\]"):
        TrainPipelineSemiSync(model, stepping_tables, "cpu", strict=True)
    TrainPipelineSemiSync(model, stepping_tables, "cpu")  # not strict: a warning only
    with pytest.raises(TypeError, match=r"'sparse' returned a list.*TrainPipelineSparseDist"):
        detach_embeddings([torch.zeros(1)], "sparse")


def test_detach_embeddings_of_every_output_type() -> None:
    source = torch.ones(2, 3, requires_grad=True)
    values = source * 2
    keyed, pairs = detach_embeddings(KeyedTensor(["a", "b"], [1, 2], values))
    assert keyed.keys() == ["a", "b"] and keyed.values().is_leaf
    assert keyed.values().requires_grad and pairs == [(values, keyed.values())]
    jagged = {"a": JaggedTensor(values.view(-1), lengths=torch.tensor([4, 2]))}
    out, pairs = detach_embeddings(jagged)
    assert out["a"].values().is_leaf and torch.equal(out["a"].lengths(), torch.tensor([4, 2]))
    assert pairs[0][0] is jagged["a"].values()
    plain, pairs = detach_embeddings(values.detach())
    assert pairs == [] and not plain.requires_grad  # nothing to backpropagate (no_grad)


def test_gradient_accumulation_wrapper_refuses_what_it_cannot_keep_apart() -> None:
    model = sharded()
    config = GradientAccumulationConfig(num_steps=2)
    semi = TrainPipelineSemiSync(model, model.optimizer(), "cpu")
    with pytest.raises(ValueError, match=r"TrainPipelineSemiSync looks up the next batch"):
        GradientAccumulationWrapper(semi, model.optimizer(), model, config)
    twice = TrainPipelineSparseDist(model, model.optimizer(), "cpu", accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"already accumulates \(accumulate_grad_batches=2\)"):
        GradientAccumulationWrapper(twice, model.optimizer(), model, config)
    plain = TrainPipelineSparseDist(model, model.optimizer(), "cpu")
    off = GradientAccumulationWrapper(plain, model.optimizer(), model, GradientAccumulationConfig())
    assert not GradientAccumulationConfig().is_enabled
    assert len(run(off, iter(batches(3)))) == 3  # disabled: the pipeline's own steps


# TorchRec 1.8.0's constructor parameters, in order (inspect.signature of its classes).
TORCHREC_PARAMETERS = {
    TrainPipelineSparseDist: (
        "model optimizer device execute_all_batches apply_jit context_type pipeline_postproc "
        "custom_model_fwd dmp_collection_sync_interval_batches enqueue_batch_after_forward "
        "enable_inplace_copy_batch free_features_storage_early clear_data_dist_inputs"
    ),
    TrainPipelineSemiSync: (
        "model optimizer device execute_all_batches apply_jit start_batch stash_gradients "
        "pipeline_postproc custom_model_fwd strict dmp_collection_sync_interval_batches "
        "enable_inplace_copy_batch free_features_storage_early clear_data_dist_inputs"
    ),
    EvalPipelineSparseDist: (
        "model optimizer device apply_jit pipeline_postproc enable_inplace_copy_batch "
        "free_features_storage_early clear_data_dist_inputs"
    ),
    TrainPipelineBase: "model optimizer device custom_model_fwd enable_inplace_copy_batch",
    TrainPipelineFusedSparseDist: (
        "model optimizer device execute_all_batches apply_jit pipeline_postproc "
        "custom_model_fwd strict emb_lookup_stream embedding_lookup_after_data_dist "
        "enable_inplace_copy_batch enqueue_batch_after_forward free_features_storage_early "
        "clear_data_dist_inputs"
    ),
}


@pytest.mark.parametrize("cls", list(TORCHREC_PARAMETERS), ids=lambda c: c.__name__)
def test_constructors_take_torchrecs_arguments_in_its_order(cls: type) -> None:
    """A TorchRec call, positional or by keyword, binds to the same parameters here; embshard's
    own come after them, keyword-only."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    torchrec = TORCHREC_PARAMETERS[cls].split()
    assert [p.name for p in parameters[: len(torchrec)]] == torchrec
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[len(torchrec) :])
    defaults = {p.name: p.default for p in parameters}
    if "pipeline_postproc" in defaults:
        postproc = cls in (TrainPipelineSemiSync, TrainPipelineFusedSparseDist)
        assert defaults["pipeline_postproc"] is postproc
    assert defaults.get("dmp_collection_sync_interval_batches", 1) == 1
    assert defaults.get("apply_jit", False) is False


def test_refuses_the_torchrec_options_it_cannot_honour() -> None:
    model = sharded()
    with pytest.raises(ValueError, match=r"apply_jit=True.*torch.compile"):
        TrainPipelineSparseDist(model, model.optimizer(), "cpu", True, True)
    with pytest.raises(ValueError, match=r"apply_jit=True"):
        EvalPipelineSparseDist(model, model.optimizer(), "cpu", True)
    with pytest.raises(ValueError, match=r"context_type=.*no per-batch TrainPipelineContext"):
        TrainPipelineSparseDist(model, model.optimizer(), "cpu", context_type=dict)
    with pytest.raises(ValueError, match=r"dmp_collection_sync_interval_batches must be an int"):
        TrainPipelineSemiSync(
            model, model.optimizer(), "cpu", dmp_collection_sync_interval_batches=0
        )
    with pytest.raises(ValueError, match=r"enqueue_batch_after_forward=True with accumulate"):
        TrainPipelineSparseDist(
            model,
            model.optimizer(),
            "cpu",
            enqueue_batch_after_forward=True,
            accumulate_grad_batches=2,
        )


def test_torchrec_hints_leave_results_as_the_plain_loop() -> None:
    """TorchRec's memory and scheduling hints, passed positionally as a TorchRec script does:
    the batch after next is taken after this forward, and the results are unchanged."""
    data = batches(5)
    model, reference = sharded(), sharded()
    taken: list[int] = []

    def counted() -> Iterator[Batch]:
        for index, batch in enumerate(data):
            taken.append(index)
            yield batch

    forwards = model.module.seen
    pipeline = TrainPipelineSparseDist(
        model, model.optimizer(), "cpu", True, False, None, True, None, 1, True, True, True, True
    )
    it = counted()
    outputs = []
    for step in range(5):
        outputs.append(pipeline.progress(it))
        if step == 1:
            # batch 3 is taken after batch 1's forward (the first two were taken to fill)
            assert len(forwards) == 2 and taken == [0, 1, 2, 3]
    for out, expected in zip(outputs, plain_loop(reference, data), strict=True):
        assert torch.equal(out, expected)


@pytest.mark.parametrize("after_dist", [False, True])
def test_fused_pipeline_looks_up_before_the_forward(after_dist: bool) -> None:
    """Batch ``i``'s lookup starts before its forward (and, ``embedding_lookup_after_data_dist``,
    after batch ``i+1``'s input dist); results equal the plain loop's."""
    data = batches(4)
    model, reference = sharded(), sharded()
    module = model.sharded_modules["sparse"]
    events: list[tuple[str, int]] = []
    ids = [b.sparse_features.values() for b in data]
    dense = [b.dense_features for b in data]
    lookup, input_dist = module.compute_and_output_dist, module.input_dist

    def spy_lookup(ctx: Any, features: Any) -> Any:
        events.append(("lookup", len([e for e in events if e[0] == "lookup"])))
        return lookup(ctx, features)

    def spy_dist(ctx: Any, features: KeyedJaggedTensor) -> Any:
        events.append(("input_dist", [v is features.values() for v in ids].index(True)))
        return input_dist(ctx, features)

    class Seen(list[Tensor]):
        def append(self, value: Tensor) -> None:
            events.append(("forward", [d is value for d in dense].index(True)))
            super().append(value)

    module.compute_and_output_dist = spy_lookup  # type: ignore[method-assign]
    module.input_dist = spy_dist  # type: ignore[method-assign]
    model.module.seen = Seen()
    pipeline = TrainPipelineFusedSparseDist(
        model,
        model.optimizer(),
        "cpu",
        sparse_of=lambda b: b.sparse_features,
        embedding_lookup_after_data_dist=after_dist,
    )
    outputs = run(pipeline, iter(data))
    expected_events = [("input_dist", 0)]
    for i in range(4):
        next_dist = [("input_dist", i + 1)] if i < 3 else []
        if after_dist:
            expected_events += [*next_dist, ("lookup", i), ("forward", i)]
        else:
            expected_events += [("lookup", i), *next_dist, ("forward", i)]
    assert events == expected_events
    for out, expected in zip(outputs, plain_loop(reference, data), strict=True):
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"emb_lookup_stream must be one of"):
        TrainPipelineFusedSparseDist(model, model.optimizer(), "cpu", emb_lookup_stream="side")


def test_pt2_pipeline_compiles_on_its_step_and_equals_the_plain_loop() -> None:
    data = batches(3)
    model, reference = sharded(), sharded()
    calls: list[tuple[str, bool]] = []
    transformed: list[Batch] = []

    def transform(batch: Batch) -> Batch:
        transformed.append(batch)
        return batch

    config = TorchCompileConfig(backend="eager", compile_on_iter=1)
    pipeline = TrainPipelinePT2(
        model,
        model.optimizer(),
        "cpu",
        config,
        pre_compile_fn=lambda m: calls.append(("pre", m is model)),
        post_compile_fn=lambda m: calls.append(("post", m is model)),
        input_transformer=transform,
    )
    it = iter(data)
    outputs = [pipeline.progress(it)]
    assert not pipeline.compiled and calls == []
    outputs += [pipeline.progress(it) for _ in range(2)]
    assert pipeline.compiled and calls == [("pre", True), ("post", True)]
    assert model._compiled_call_impl is not None  # compiled in place, as TorchRec's
    assert len(transformed) == 3
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    for out, expected in zip(outputs, plain_loop(reference, data), strict=True):
        assert torch.equal(out, expected)
    assert_same_state(model, reference)
    with pytest.raises(ValueError, match=r"compile_on_iter must be an int >= 0"):
        TorchCompileConfig(compile_on_iter=-1)


def test_data_loading_thread_loads_ahead_and_hands_errors_over() -> None:
    data = batches(3)
    taken: list[int] = []
    second_taken = threading.Event()

    def source() -> Iterator[Batch]:
        for index, batch in enumerate(data):
            taken.append(index)
            if index == 1:
                second_taken.set()
            yield batch

    loader: DataLoadingThread[Batch] = DataLoadingThread(torch.device("cpu"), source(), False)
    with pytest.raises(RuntimeError, match="call start"):
        loader.get_next_batch()
    loader.start()
    first = loader.get_next_batch()
    assert first is not None and torch.equal(first.dense_features, data[0].dense_features)
    assert second_taken.wait(timeout=30)  # the next batch is loaded before it is asked for
    got = [loader.get_next_batch(), loader.get_next_batch()]
    assert [
        b is not None and torch.equal(b.labels, d.labels)
        for b, d in zip(got, data[1:], strict=True)
    ] == [True, True]
    assert loader.get_next_batch() is None
    with pytest.raises(StopIteration):
        loader.get_next_batch(none_throws=True)
    loader.join(timeout=30)
    assert taken == [0, 1, 2]

    def failing() -> Iterator[Batch]:
        yield data[0]
        raise OSError("bad shard file day_3.npy")

    broken: DataLoadingThread[Batch] = DataLoadingThread(torch.device("cpu"), failing(), False)
    broken.start()
    assert broken.get_next_batch() is not None
    with pytest.raises(OSError, match=r"day_3\.npy"):
        broken.get_next_batch()
    assert broken.get_next_batch() is None

    stopped: DataLoadingThread[Batch] = DataLoadingThread(torch.device("cpu"), iter(data), False)
    stopped.start()
    stopped.stop()
    stopped.join(timeout=30)
    assert not stopped.is_alive()
    left = stopped.get_next_batch()
    assert left is None or torch.equal(left.labels, data[0].labels)
