"""Gradient accumulation on two real ranks (gloo): k = 4 micro-batches equal one step on them.

A DLRM sharded under a mixed plan (table-wise, row-wise, column-wise, data-parallel) runs four
micro-batches through ``TrainPipelineSparseDist(accumulate_grad_batches=4)``; an equally sharded
copy takes one plain step on each rank's four micro-batches concatenated, with the mean loss.
Tables, the embedding optimizer's state, dense parameters and the dense optimizer's state agree
to 1e-6, and nothing moves before the fourth micro-batch. With SGD on values exact in float32
(table-wise and row-wise tables under ``DistributedModelParallel.no_sync``) the tables agree bit
for bit; a state dict taken inside the accumulation is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from test_dmp_training import MIXED, build_model, data, flat_state, pieces
from torch import Tensor

from embshard_dist.data.synthetic import Batch
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.planner.simple import SimplePlanner
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.train_pipeline import (
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
    TrainPipelineSparseDist,
)
from embshard_kernels.accumulate import pending_micro_batches
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

WORLD = 2
K = 4
TOL = 1e-6


def join(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The batch made of ``kjts`` one after the other (per feature, in order)."""
    keys = kjts[0].keys()
    return KeyedJaggedTensor(
        keys,
        torch.cat([kjt[k].values() for k in keys for kjt in kjts]),
        lengths=torch.cat([kjt[k].lengths() for k in keys for kjt in kjts]),
    )


def local_pieces(state: dict[str, Any]) -> dict[str, Tensor]:
    """name/offsets -> this rank's piece of every tensor in ``state``."""
    return {
        f"{name}@{offsets}": local.detach().cpu().clone()
        for name, value in state.items()
        for offsets, local in pieces(value)
    }


def _sharded(spec: OptimizerSpec, seed: int = 0) -> DistributedModelParallel:
    sharders: list[Any] = [EmbeddingBagCollectionSharder(optimizer=spec)]
    model = build_model(seed)
    planner = SimplePlanner(WORLD, device_type=test_device().type, sharding=MIXED, optimizer=spec)
    return DistributedModelParallel(
        model, plan=planner.plan(model, sharders), sharders=sharders, optimizer=spec
    )


def _snapshot(dmp: DistributedModelParallel) -> dict[str, Tensor]:
    out = local_pieces(dmp.state_dict())
    out.update(
        local_pieces(
            {f"fused:{k}": v for k, v in flat_state(dmp.fused_optimizer.state_dict()).items()}
        )
    )
    out.update(
        local_pieces(
            {f"dense:{k}": v for k, v in flat_state(dmp.dense_optimizer.state_dict()).items()}
        )
    )
    return out


def _pipeline_equals_concatenated_step(optimizer: str) -> dict[str, Any]:
    rank = dist.get_rank()
    device = test_device()
    spec = OptimizerSpec.from_name(optimizer, lr=0.1)
    accumulating, plain = _sharded(spec), _sharded(spec)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    source = data()
    micro = [source.batch(j, rank, WORLD) for j in range(K)]

    def forward(batch: Batch) -> tuple[Tensor, Tensor]:
        logits = accumulating(batch.dense, batch.sparse)  # the pipeline moved the batch
        return loss_fn(logits, batch.labels), logits.detach()

    before = local_pieces(accumulating.state_dict())
    tables_before = _tables_only(accumulating)
    pipeline = TrainPipelineSparseDist(
        accumulating,
        accumulating.optimizer(),
        device,
        custom_model_fwd=forward,
        sparse_of=lambda batch: batch.sparse,
        accumulate_grad_batches=K,
    )
    batches: Iterator[Batch] = iter(micro)
    moved_early = []
    for _ in range(K - 1):
        pipeline.progress(batches)
        now = _tables_only(accumulating)  # a state dict would be refused mid-step
        moved_early.append(any(not torch.equal(tables_before[k], v) for k, v in now.items()))
    pipeline.progress(batches)
    with pytest.raises(StopIteration):
        pipeline.progress(batches)

    opt = plain.optimizer()
    whole = Batch(
        dense=torch.cat([b.dense for b in micro]),
        sparse=join([b.sparse for b in micro]),
        labels=torch.cat([b.labels for b in micro]),
    )
    loss_fn(
        plain(whole.dense.to(device), whole.sparse.to(device)), whole.labels.to(device)
    ).backward()
    opt.step()
    opt.zero_grad()

    mine, theirs = _snapshot(accumulating), _snapshot(plain)
    assert mine.keys() == theirs.keys()
    worst = {k: (mine[k] - theirs[k]).abs().max().item() if mine[k].numel() else 0.0 for k in mine}
    moved = max((theirs[k] - before[k]).abs().max().item() for k in before if before[k].numel())
    return {"worst": worst, "moved_early": moved_early, "moved": moved}


def _tables_only(dmp: DistributedModelParallel) -> dict[str, Tensor]:
    """This rank's local table weights (live parameters, copied)."""
    return {
        k: p.detach().clone() for k, p in dmp.named_parameters() if k.startswith("sparse_arch.")
    }


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_pipeline_accumulation_equals_one_step_on_the_concatenated_batch(optimizer: str) -> None:
    results = run_on_ranks(WORLD, _pipeline_equals_concatenated_step, optimizer)
    for result in results:
        assert result["moved_early"] == [False] * (K - 1)
        assert result["moved"] > 1e-4  # the step did move the model
        kinds = {name.split("@")[0].split(":")[0] for name in result["worst"]}
        assert {"fused", "dense"} <= kinds or optimizer == "sgd"
        for name, worst in result["worst"].items():
            assert worst <= TOL, f"{name}: accumulated and concatenated differ by {worst}"


TABLES = [
    EmbeddingBagConfig(name="tw", num_embeddings=24, embedding_dim=8, feature_names=("f0",)),
    EmbeddingBagConfig(name="rw", num_embeddings=30, embedding_dim=8, feature_names=("f1", "f2")),
]


def _exact(values: Tensor, scale: int) -> Tensor:
    """Multiples of 1 / ``scale`` in [-1, 1): sums of a few of them are exact in float32."""
    return torch.round(values * scale).clamp(-scale, scale - 1) / scale


def _ebc_dmp(spec: OptimizerSpec) -> DistributedModelParallel:
    """A table-wise and a row-wise table, weights multiples of 1/16, on every rank alike."""
    sharders: list[Any] = [EmbeddingBagCollectionSharder(optimizer=spec)]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, optimizer=spec)
    with torch.no_grad():
        for w in ebc.state_dict(keep_vars=True).values():
            w.copy_(_exact(w * 8, 16))
    sharding = {"tw": "table_wise", "rw": "row_wise"}
    planner = SimplePlanner(
        WORLD, device_type=test_device().type, sharding=sharding, optimizer=spec
    )
    plan = planner.plan(ebc, sharders)
    return DistributedModelParallel(ebc, plan=plan, sharders=sharders, optimizer=spec)


def _micro_batches(count: int) -> list[tuple[KeyedJaggedTensor, Tensor]]:
    """This rank's micro-batches of 4 samples, and a weight of each output (multiples of 1/8)."""
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    rows = [24, 30, 30]
    micro = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (3 * 4,), generator=g)
        values = torch.cat(
            [
                torch.randint(0, rows[f], (int(lengths[f * 4 : (f + 1) * 4].sum()),), generator=g)
                for f in range(3)
            ]
        )
        kjt = KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths=lengths)
        micro.append((kjt, _exact(torch.randn(4, 24, generator=g) / 2, 8)))
    return micro


def _sgd_no_sync_is_exact() -> dict[str, Any]:
    device = test_device()
    spec = OptimizerSpec.from_name("sgd", lr=0.5)
    accumulating, plain = _ebc_dmp(spec), _ebc_dmp(spec)
    micro = _micro_batches(K)

    def loss(model: DistributedModelParallel, kjt: KeyedJaggedTensor, weight: Tensor) -> Tensor:
        out = model(kjt.to(device)).values()
        return (out * weight.to(device)).sum() / K

    initial = local_pieces(plain.state_dict())
    refused = ""
    for j, (kjt, weight) in enumerate(micro):
        if j < K - 1:
            with accumulating.no_sync():
                loss(accumulating, kjt, weight).backward()
            if j == 1:
                try:
                    accumulating.state_dict()
                except RuntimeError as e:
                    refused = str(e)
        else:
            loss(accumulating, kjt, weight).backward()
    loss(plain, join([m[0] for m in micro]), torch.cat([m[1] for m in micro])).backward()
    mine, theirs = local_pieces(accumulating.state_dict()), local_pieces(plain.state_dict())
    return {
        "refused": refused,
        "equal": {k: torch.equal(mine[k], theirs[k]) for k in mine},
        "same_keys": mine.keys() == theirs.keys(),
        "moved": any(not torch.equal(initial[k], theirs[k]) for k in theirs),
    }


def test_sgd_accumulation_under_no_sync_is_bit_exact_and_refuses_a_mid_window_state_dict() -> None:
    results = run_on_ranks(WORLD, _sgd_no_sync_is_exact)
    for result in results:
        assert result["same_keys"] and result["moved"]
        assert result["equal"] and all(result["equal"].values()), result["equal"]
        assert "not applied yet and would be lost" in result["refused"]


def test_bad_accumulate_grad_batches_is_refused() -> None:
    from embshard_dist.dmp.accumulation import check_accumulate_grad_batches

    for bad in (0, -2, 1.5, "4", True):
        with pytest.raises(ValueError, match="accumulate_grad_batches"):
            check_accumulate_grad_batches(bad, "TrainPipelineSparseDist")
    assert check_accumulate_grad_batches(4, "x") == 4


def _short_last_window(execute_all_batches: bool) -> dict[str, Any]:
    device = test_device()
    dmp = _ebc_dmp(OptimizerSpec.from_name("sgd", lr=0.5))
    micro = _micro_batches(6)

    def forward(batch: tuple[KeyedJaggedTensor, Tensor]) -> tuple[Tensor, None]:
        kjt, weight = batch
        return (dmp(kjt).values() * weight.to(device)).sum(), None

    pipeline = TrainPipelineSparseDist(
        dmp,
        dmp.optimizer(),
        device,
        execute_all_batches=execute_all_batches,
        custom_model_fwd=forward,
        sparse_of=lambda batch: batch[0],
        accumulate_grad_batches=K,
    )
    batches = iter(micro)
    ran = 0
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(batches)
            ran += 1
    return {"ran": ran, "pending": pending_micro_batches(dmp), "saved": len(dmp.state_dict())}


@pytest.mark.parametrize("execute_all_batches", [True, False])
def test_the_last_batch_the_pipeline_runs_completes_its_step(execute_all_batches: bool) -> None:
    results = run_on_ranks(WORLD, _short_last_window, execute_all_batches)
    for result in results:
        # 6 batches: one step of 4, then a short one of the rest
        assert result["ran"] == (6 if execute_all_batches else 5)
        assert result["pending"] == 0 and result["saved"] == 2


def _wrapper_equals_the_accumulating_pipeline(count: int) -> dict[str, Any]:
    """TorchRec's wrapper (num_steps=K, losses summed) around TrainPipelineSparseDist against
    TrainPipelineSparseDist(accumulate_grad_batches=K) on K times the loss (it divides by K):
    the same gradients, so the same step; ``count`` micro-batches (a short last cycle is
    completed at StopIteration)."""
    rank = dist.get_rank()
    device = test_device()
    spec = OptimizerSpec.from_name("sgd", lr=0.1)
    wrapped, reference = _sharded(spec), _sharded(spec)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    source = data()
    micro = [source.batch(j, rank, WORLD) for j in range(count)]

    def forward_of(dmp: DistributedModelParallel, scale: float) -> Any:
        def forward(batch: Batch) -> tuple[Tensor, Tensor]:
            logits = dmp(batch.dense, batch.sparse)
            return loss_fn(logits, batch.labels) * scale, logits.detach()

        return forward

    inner = TrainPipelineSparseDist(
        wrapped,
        wrapped.optimizer(),
        device,
        custom_model_fwd=forward_of(wrapped, 1.0),
        sparse_of=lambda batch: batch.sparse,
    )
    pipeline = GradientAccumulationWrapper(
        inner, wrapped.optimizer(), wrapped, GradientAccumulationConfig(num_steps=K)
    )
    tables_before = _tables_only(wrapped)
    moved_early = []
    batches: Iterator[Batch] = iter(micro)
    for _ in range(min(count, K) - 1):
        pipeline.progress(batches)
        now = _tables_only(wrapped)
        moved_early.append(any(not torch.equal(tables_before[k], v) for k, v in now.items()))
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(batches)

    accumulating = TrainPipelineSparseDist(
        reference,
        reference.optimizer(),
        device,
        custom_model_fwd=forward_of(reference, float(K)),
        sparse_of=lambda batch: batch.sparse,
        accumulate_grad_batches=K,
    )
    batches = iter(micro)
    with pytest.raises(StopIteration):
        while True:
            accumulating.progress(batches)
    tables = _tables_only(wrapped)
    ref_tables = _tables_only(reference)
    mine, theirs = _snapshot(wrapped), _snapshot(reference)
    return {
        "moved_early": moved_early,
        "tables_equal": all(torch.equal(tables[k], ref_tables[k]) for k in tables),
        "moved": any(not torch.equal(tables_before[k], v) for k, v in tables.items()),
        "worst": max((mine[k] - theirs[k]).abs().max().item() for k in mine if mine[k].numel()),
        "pending": pending_micro_batches(wrapped),
        "step": pipeline.current_step,
    }


@pytest.mark.parametrize("count", [K, 6])
def test_torchrec_gradient_accumulation_wrapper_accumulates_the_tables_too(count: int) -> None:
    results = run_on_ranks(WORLD, _wrapper_equals_the_accumulating_pipeline, count)
    for result in results:
        assert result["moved_early"] == [False] * (K - 1)  # fused tables wait for the cycle
        assert result["moved"] and result["tables_equal"] and result["pending"] == 0
        assert result["worst"] <= TOL  # dense: DDP synced the first micro-batch apart
        assert result["step"] == (2 * K if count > K else K)  # a short cycle counts as whole


def test_gradient_accumulation_wrapper_refusals() -> None:
    with pytest.raises(ValueError, match=r"num_steps must be an int >= 1"):
        GradientAccumulationConfig(num_steps=0)
    assert GradientAccumulationConfig(num_steps=3).is_enabled
