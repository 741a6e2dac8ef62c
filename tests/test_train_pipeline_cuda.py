"""TrainPipelineSparseDist on CUDA at world 1 (NCCL): equal to the plain loop, on its side streams.
TrainPipelineFusedSparseDist likewise; TrainPipelineSemiSync: equal to its definition written out
as a loop.

Runs under ``EMBSHARD_TEST_BACKEND=nccl`` (``nox -s gpu_tests``) on one GPU and skips elsewhere.
A ``DLRMTrain(DLRM(...))`` with a table-wise, a row-wise and a column-wise table is trained for
12 steps by the pipeline from host batches (copied on the pipeline's copy stream) and by the
plain loop; outputs, weights and optimizer states must agree within 1e-6. Every input dist the
pipeline starts must run on a stream other than the default one (its input-dist stream); the
first batch's runs inside its forward, while the pipeline learns where the inputs live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, selected_backend, test_device
from torch import Tensor

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.models.dlrm import DLRM, DLRMTrain
from embshard_dist.train_pipeline import (
    TrainPipelineFusedSparseDist,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
)
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ShardingType

DIM = 8
NUM_DENSE = 5
BATCH = 6
STEPS = 12
TABLES = [
    EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f])
    for i, (rows, f) in enumerate([(23, "f_a"), (13, "f_b"), (9, "f_c")])
]
FEATURES = [f for t in TABLES for f in t.feature_names]
MODULE = "model.sparse_arch.embedding_bag_collection"
SPEC = OptimizerSpec.from_name("rowwise_adagrad", lr=0.2, eps=1e-3)


@dataclass(frozen=True)
class Batch:
    dense_features: Tensor
    sparse_features: KeyedJaggedTensor
    labels: Tensor


def make_batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(77 + step)
    lengths = torch.randint(0, 4, (len(FEATURES) * BATCH,), generator=g)
    ids = [
        torch.randint(0, t.num_embeddings, (int(n),), generator=g)
        for t, n in zip(TABLES, lengths.view(len(FEATURES), -1).sum(1), strict=True)
    ]
    return Batch(
        torch.randn(BATCH, NUM_DENSE, generator=g),
        KeyedJaggedTensor(FEATURES, torch.cat(ids), lengths=lengths),
        torch.randint(0, 2, (BATCH,), generator=g).float(),
    )


def build() -> DistributedModelParallel:
    torch.manual_seed(9)
    kinds = [ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE]
    plan = ShardingPlan(
        {
            MODULE: EmbeddingModuleShardingPlan(
                {
                    t.name: ParameterSharding(k, "fused", ranks=[0])
                    for t, k in zip(TABLES, kinds, strict=True)
                }
            )
        }
    )
    model = DLRMTrain(
        DLRM(EmbeddingBagCollection(TABLES, optimizer=SPEC), NUM_DENSE, [6, DIM], [6, 1])
    )
    return DistributedModelParallel(model, plan=plan, optimizer=SPEC, device=test_device())


def drain(pipeline: Any, batches: list[Batch]) -> list[Any]:
    """Every output of ``pipeline`` over ``batches``, until ``StopIteration``."""
    loader, outputs = iter(batches), []
    while True:
        try:
            outputs.append(pipeline.progress(loader))
        except StopIteration:
            return outputs


def local_tensors(value: Any) -> list[Tensor]:
    if hasattr(value, "local_shards"):
        return [s.tensor for s in value.local_shards()]
    if hasattr(value, "to_local"):
        return [value.to_local()]
    return [value] if isinstance(value, Tensor) else []


def close(a: Tensor, b: Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{what} differs")


def run(fused: bool = False) -> dict[str, int]:
    device = test_device()
    assert device.type == "cuda" and dist.get_world_size() == 1
    piped, plain = build(), build()
    kind = TrainPipelineFusedSparseDist if fused else TrainPipelineSparseDist
    pipeline = kind(piped, piped.optimizer(), device)
    module = pipeline.pipelined_modules[MODULE]
    streams: list[bool] = []
    own_input_dist = module.input_dist

    def recording_input_dist(*args: Any, **kwargs: Any) -> Any:
        streams.append(torch.cuda.current_stream(device) != torch.cuda.default_stream(device))
        return own_input_dist(*args, **kwargs)

    module.input_dist = recording_input_dist  # type: ignore[method-assign]
    batches = [make_batch(step) for step in range(STEPS)]
    outputs = drain(pipeline, batches)
    del module.input_dist  # the instance attribute: the module's own method is back
    optimizer = plain.optimizer()
    compared = 0
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        loss, out = plain(
            Batch(
                batch.dense_features.to(device),
                batch.sparse_features.to(device),
                batch.labels.to(device),
            )
        )
        loss.backward()
        optimizer.step()
        for got, want in zip(outputs[step], out, strict=True):
            close(got, want, f"output of step {step}")
    torch.cuda.synchronize(device)
    ref = plain.state_dict()
    for key, value in piped.state_dict().items():
        for a, b in zip(local_tensors(value), local_tensors(ref[key]), strict=True):
            close(a, b, key)
            compared += 1
    states, ref_states = piped.optimizer().state_dict()["state"], optimizer.state_dict()["state"]
    for param, state in states.items():
        for name, value in state.items():
            for a, b in zip(
                local_tensors(value), local_tensors(ref_states[param][name]), strict=True
            ):
                close(a, b, f"optimizer state {param}/{name}")
                compared += 1
    return {
        "steps": len(outputs),
        "input_dists": len(streams),
        "on_side_stream": sum(streams),
        "compared": compared,
    }


def test_pipeline_on_cuda_equals_plain_loop() -> None:
    if selected_backend() != "nccl" or not torch.cuda.is_available():
        pytest.skip("needs CUDA: run under EMBSHARD_TEST_BACKEND=nccl (nox -s gpu_tests)")
    (result,) = run_on_ranks(1, run, timeout_s=240)
    assert result["steps"] == STEPS
    assert result["input_dists"] == STEPS
    # batch 0 runs as the plain loop while the pipeline learns where its inputs live
    assert result["on_side_stream"] == STEPS - 1, result
    assert result["compared"] > 0


def test_fused_pipeline_on_cuda_equals_plain_loop() -> None:
    if selected_backend() != "nccl" or not torch.cuda.is_available():
        pytest.skip("needs CUDA: run under EMBSHARD_TEST_BACKEND=nccl (nox -s gpu_tests)")
    (result,) = run_on_ranks(1, run, True, timeout_s=240)
    assert result["steps"] == STEPS and result["on_side_stream"] == STEPS - 1, result
    assert result["compared"] > 0


def run_semi_sync() -> int:
    """12 steps semi-synchronous from batch 3 against ``semi_sync_reference``."""
    from test_train_pipeline_semi_sync import semi_sync_reference

    device = test_device()
    piped, reference = build(), build()
    pipeline = TrainPipelineSemiSync(piped, piped.optimizer(), device, start_batch=3)
    batches = [make_batch(step) for step in range(STEPS)]
    outputs = drain(pipeline, batches)
    on_device = [
        Batch(b.dense_features.to(device), b.sparse_features.to(device), b.labels.to(device))
        for b in batches
    ]
    sparse = reference.module.model.sparse_arch.embedding_bag_collection
    expected = semi_sync_reference(reference, on_device, 3, sparse=sparse)
    compared = 0
    for step, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        for a, b in zip(got, want, strict=True):
            close(a, b, f"semi-sync output of step {step}")
            compared += 1
    torch.cuda.synchronize(device)
    ref = reference.state_dict()
    for key, value in piped.state_dict().items():
        for a, b in zip(local_tensors(value), local_tensors(ref[key]), strict=True):
            close(a, b, f"semi-sync {key}")
            compared += 1
    return compared


def test_semi_sync_pipeline_on_cuda_is_its_definition() -> None:
    if selected_backend() != "nccl" or not torch.cuda.is_available():
        pytest.skip("needs CUDA: run under EMBSHARD_TEST_BACKEND=nccl (nox -s gpu_tests)")
    (compared,) = run_on_ranks(1, run_semi_sync, timeout_s=240)
    assert compared > STEPS
