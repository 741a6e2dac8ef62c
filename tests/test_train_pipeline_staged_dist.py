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

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import require_devices, run_on_ranks, test_device
from test_train_pipeline import (
    OPTIMIZERS,
    WORLD,
    Batch,
    check_equal,
    compare_models,
    make_batch,
)
from test_train_pipeline import build as build_model

from embshard_dist.train_pipeline.batch import move_batch
from embshard_dist.train_pipeline.staged import (
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
)

EPOCHS = (10, 2)


def build(plan_name: str) -> Any:
    """``tests/test_train_pipeline.py``'s model and plan, with RowWiseAdagrad."""
    return build_model(OPTIMIZERS["rowwise_adagrad"], plan_name)


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
