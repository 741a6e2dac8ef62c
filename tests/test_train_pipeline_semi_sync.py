"""TrainPipelineSemiSync on real ranks against its definition, written out as a plain loop.

The reference trains a second ``DistributedModelParallel`` (same seed, same plan) by the rule
TorchRec defines: batch ``i+1``'s embeddings are looked up (the sharded module's own forward)
after batch ``i``'s forward but before its backward, so from ``start_batch`` on every batch
trains on embeddings that miss the previous batch's update; the forward gets the looked-up
embeddings detached, and their gradient is sent into the lookup's graph after the dense
backward. Outputs, weights and optimizer state must equal the reference bit for bit (CPU) for
table-wise, row-wise, data-parallel, column-wise and a mixed plan, over a 20-batch epoch, a
7-batch one and a 4-batch one; and differ from the plain loop once semi-synchronous (the
staleness is real). Before ``start_batch`` the pipeline equals the plain loop bit for bit. Also:
``stash_gradients`` (dense update one step behind) and ``execute_all_batches=False``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _mp import require_devices, run_on_ranks, test_device
from test_train_pipeline import (
    OPTIMIZERS,
    STEPS,
    WORLD,
    Batch,
    build,
    check_equal,
    compare_models,
    host_batches,
    on_device,
    piped_steps,
    plain_steps,
)
from torch import Tensor

from embshard_dist.train_pipeline import TrainPipelineSemiSync
from embshard_types.awaitables import LazyAwaitable
from embshard_types.sparse.keyed_tensor import KeyedTensor


def _look_up(sparse: Any, batch: Batch) -> KeyedTensor:
    out = sparse(batch.sparse_features)
    return out.wait() if isinstance(out, LazyAwaitable) else out


def _swap(model: Any, stash: dict[str, Tensor]) -> None:
    for name, param in model.named_parameters():
        previous = stash.pop(name, None)
        if param.grad is not None:
            stash[name] = param.grad.clone()
        param.grad = previous


def semi_sync_reference(
    dmp: Any,
    batches: list[Batch],
    start_batch: int,
    first_index: int = 0,
    stash: dict[str, Tensor] | None = None,
    sparse: Any = None,
) -> list[Any]:
    """The semi-synchronous schedule on ``dmp``, one epoch whose first batch is the
    ``first_index``-th of the run; ``stash`` (kept across epochs): dense gradients one step
    behind; ``sparse``: the sharded module (default ``dmp.module.sparse``)."""
    sparse = dmp.module.sparse if sparse is None else sparse
    optimizer = dmp.optimizer()
    looked = {0: _look_up(sparse, batches[0])}
    outputs = []
    for i, batch in enumerate(batches):
        index = first_index + i
        semi = index >= start_batch
        optimizer.zero_grad()
        pooled = looked.pop(i)
        leaf = pooled.values().detach().requires_grad_()
        sparse.forward = lambda _kjt, kt=pooled, leaf=leaf: KeyedTensor(
            kt.keys(), kt.length_per_key(), leaf
        )
        try:
            loss, out = dmp(batch)
        finally:
            del sparse.forward
        has_next = i + 1 < len(batches)
        if semi and has_next:
            looked[i + 1] = _look_up(sparse, batches[i + 1])
        loss.backward()
        pooled.values().backward(leaf.grad)
        if semi and stash is not None:
            _swap(dmp, stash)
        if not (stash is not None and index == start_batch):
            optimizer.step()
        if not semi and has_next:
            looked[i + 1] = _look_up(sparse, batches[i + 1])
        outputs.append(out)
    return outputs


def _epochs(
    pipeline: TrainPipelineSemiSync[Any, Any],
    reference: Callable[[list[Batch], int], list[Tensor]],
    piped: Any,
    ref_model: Any,
    what: str,
) -> tuple[int, int]:
    """Three epochs (20, 7, 4 batches) through the pipeline and the reference, outputs and
    models compared after each; the number of pieces compared, and of batches run."""
    compared, start = 0, 0
    for count in (STEPS, 7, 4):
        batches = host_batches(count, start)
        outputs = piped_steps(pipeline, iter(batches))
        expected = reference([on_device(b) for b in batches], start)
        assert len(outputs) == count, f"{what}: {len(outputs)} steps for {count} batches"
        for step, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
            check_equal(out, ref, f"{what}: output of step {start + step}")
        start += count
        compared += compare_models(piped, ref_model, f"{what} after {start} steps")
    return compared, start


def run_semi_sync(plan_name: str, optimizer: str, stash: bool) -> list[int]:
    """Against the reference from batch 3 on; then the plain loop differs from it."""
    torch.set_num_threads(1)
    spec = OPTIMIZERS[optimizer]
    piped, ref_model, plain = (build(spec, plan_name) for _ in range(3))
    start_batch = 3
    pipeline = TrainPipelineSemiSync(
        piped, piped.optimizer(), test_device(), start_batch=start_batch, stash_gradients=stash
    )
    stashed: dict[str, Tensor] | None = {} if stash else None
    what = f"semi-sync {plan_name}/{optimizer}{' stash' if stash else ''}"
    compared, _ = _epochs(
        pipeline,
        lambda batches, first: semi_sync_reference(ref_model, batches, start_batch, first, stashed),
        piped,
        ref_model,
        what,
    )
    # Staleness is real: the plain loop on the same batches ends elsewhere.
    batches = [on_device(b) for b in host_batches(STEPS)]
    plain_out = plain_steps(plain, batches)
    fresh = build(spec, plan_name)
    piped_out = piped_steps(
        TrainPipelineSemiSync(fresh, fresh.optimizer(), test_device(), start_batch=start_batch),
        iter(host_batches(STEPS)),
    )
    for step in range(start_batch + 1):  # the first lookup that misses an update is step 4's
        check_equal(piped_out[step], plain_out[step], f"{what}: synchronous step {step}")
    differing = sum(
        not torch.equal(a, b)
        for a, b in zip(piped_out[start_batch + 1 :], plain_out[start_batch + 1 :], strict=True)
    )
    return [compared, differing]


def run_synchronous_and_early_stop() -> list[int]:
    """``start_batch`` past the run: the plain loop bit for bit; ``execute_all_batches=False``
    stops with two batches in flight and equals the reference on the batches it ran."""
    torch.set_num_threads(1)
    spec = OPTIMIZERS["rowwise_adagrad"]
    piped, plain = build(spec, "mixed"), build(spec, "mixed")
    pipeline = TrainPipelineSemiSync(piped, piped.optimizer(), test_device(), start_batch=10_000)
    batches = host_batches(STEPS)
    outputs = piped_steps(pipeline, iter(batches))
    expected = plain_steps(plain, [on_device(b) for b in batches])
    for step, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        check_equal(out, ref, f"synchronous semi-sync pipeline: output of step {step}")
    synchronous = compare_models(piped, plain, "synchronous semi-sync pipeline")

    stopped, ref_model = build(spec, "rw"), build(spec, "rw")
    pipeline = TrainPipelineSemiSync(
        stopped, stopped.optimizer(), test_device(), execute_all_batches=False, start_batch=0
    )
    batches = host_batches(7)
    outputs = piped_steps(pipeline, iter(batches))
    # The iterator ends after batch 4's step: batch 5 (looked up) and 6 (distributed) drop.
    assert len(outputs) == 5
    expected = semi_sync_reference(ref_model, [on_device(b) for b in batches[:5]], 0)
    for out, ref in zip(outputs, expected, strict=True):
        check_equal(out, ref, "execute_all_batches=False output")
    return [synchronous, compare_models(stopped, ref_model, "execute_all_batches=False")]


@pytest.mark.parametrize(
    ("plan_name", "optimizer", "stash"),
    [
        ("tw", "sgd", False),
        ("rw", "rowwise_adagrad", False),
        ("dp", "sgd", False),
        ("cw", "rowwise_adagrad", False),
        ("mixed", "sgd", False),
        ("mixed", "rowwise_adagrad", True),
    ],
)
def test_semi_sync_pipeline_is_one_step_stale(plan_name: str, optimizer: str, stash: bool) -> None:
    require_devices(WORLD)
    results = run_on_ranks(WORLD, run_semi_sync, plan_name, optimizer, stash, timeout_s=240)
    for compared, differing in results:
        assert compared > 0
        assert differing > 0, "the semi-synchronous outputs equal the plain loop's: no staleness"


def test_semi_sync_before_start_batch_and_early_stop() -> None:
    require_devices(WORLD)
    results = run_on_ranks(WORLD, run_synchronous_and_early_stop, timeout_s=240)
    assert all(n > 0 for per_rank in results for n in per_rank)
