"""``torch.compile`` of a DLRM whose collection ``DistributedModelParallel`` shards.

On two real gloo ranks, for table-, row- and column-wise plans of the fused kernel (FBGEMM's
path): every graph break dynamo records while compiling the inference forward (no gradients)
and the training forward is at a collective (its reason names
``timeouts.COMPILE_BREAK_REASON``) or at DDP's own handling of the dense part, and
``torch.compile(backend="aot_eager")`` gives the eager outputs bit for bit on two batches of
different sizes (inference) and on one (training). FBGEMM's fused CPU op has no fake kernel, so
the fused kernel's *training* forward also breaks at that op: the one other break allowed.

On one rank, a row-wise plan of the dense kernel: ``torch._dynamo.explain`` finds breaks only
at collectives (at most ``MAX_BREAKS``) in both forwards, and the compiled training step gives
eager mode's gradients.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from torch import Tensor, nn
from torch._dynamo.utils import counters

from embshard_dist.comm.timeouts import COMPILE_BREAK_REASON
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.models.dlrm import DLRM
from embshard_dist.sharded.plan_helpers import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.plan import ShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

ROWS = {"t0": 40, "t1": 50, "t2": 60}
DIM = 8
NUM_DENSE = 4
BATCHES = (6, 3)
MAX_BREAKS = 10
"""Most graph breaks a forward may have: one or two per collective start or wait."""
TIMEOUT_S = 240.0
"""Compiling is slow on a small shared CPU; a hang still ends in a collective's timeout."""
FUSED_OP = "fbgemm.split_embedding_codegen_forward"
EBC = "sparse_arch.embedding_bag_collection"
PLANS: dict[str, Callable[[int, str | None], ParameterShardingGenerator]] = {
    "table_wise": lambda i, kernel: table_wise(
        rank=i % dist.get_world_size(), compute_kernel=kernel
    ),
    "row_wise": lambda i, kernel: row_wise(compute_kernel=kernel),
    "column_wise": lambda i, kernel: column_wise(
        ranks=list(range(dist.get_world_size())), compute_kernel=kernel
    ),
}


def _model(plan: str, kernel: str | None) -> nn.Module:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=t, num_embeddings=r, embedding_dim=DIM, feature_names=(f"f{i}",))
        for i, (t, r) in enumerate(ROWS.items())
    ]
    model = DLRM(EmbeddingBagCollection(tables), NUM_DENSE, [16, DIM], [16, 1])
    per_table = {t: PLANS[plan](i, kernel) for i, t in enumerate(ROWS)}
    world = dist.get_world_size()
    device = test_device()
    module_plan = construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection,
        per_table,
        world_size=world,
        local_size=world,
        device_type=device.type,
    )
    return DistributedModelParallel(model, plan=ShardingPlan({EBC: module_plan}), device=device)


def _batch(size: int, seed: int) -> tuple[Tensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(ROWS) * size,), generator=g)
    rows = torch.tensor(list(ROWS.values())).repeat_interleave(size)
    ids = torch.cat(
        [
            torch.randint(0, int(r), (int(n),), generator=g)
            for r, n in zip(rows, lengths, strict=True)
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(len(ROWS))], ids, lengths)
    device = test_device()
    return torch.rand(size, NUM_DENSE, generator=g).to(device), kjt.to(device)


def _kind(reason: str) -> str:
    """What a graph break's reason says broke the graph."""
    if COMPILE_BREAK_REASON in reason:
        return "collective"
    if "DistributedDataParallel" in reason or "set_runtime_stats_and_log" in reason:
        return "ddp"  # torch's data-parallel wrapper of the dense part, at its all-reduce
    if FUSED_OP in reason:
        return "fused op"
    return "other"


def _reasons(found: dict[str, int]) -> dict[str, object]:
    kinds = {"collective": 0, "ddp": 0, "fused op": 0}
    other = []
    for reason, count in found.items():
        kind = _kind(reason)
        if kind == "other":
            other.append(reason)
        else:
            kinds[kind] += count
    return {**kinds, "other": other}


def _explained(model: nn.Module, batch: tuple[Tensor, KeyedJaggedTensor]) -> dict[str, object]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*batch)
    found = _reasons({str(r.reason): 1 for r in explained.break_reasons})
    return {**found, "count": explained.graph_break_count}


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _fbgemm_model(plan: str, kernel: str | None) -> nn.Module:
    saved = os.environ.get("EMBSHARD_FUSED_PATH")
    os.environ["EMBSHARD_FUSED_PATH"] = "fbgemm"  # restored: later tests share this process
    try:
        return _model(plan, kernel)
    finally:
        if saved is None:
            del os.environ["EMBSHARD_FUSED_PATH"]
        else:
            os.environ["EMBSHARD_FUSED_PATH"] = saved


def _compile_report(plan: str, kernel: str | None, explain: bool) -> dict[str, object]:
    """This rank's graph breaks (dynamo's counters: every compiled frame's reasons) and
    compiled-vs-eager comparisons: inference on two batch sizes, training on one."""
    model = _fbgemm_model(plan, kernel)
    rank = dist.get_rank()
    batches = [_batch(size, 10 * rank + i) for i, size in enumerate(BATCHES)]
    report: dict[str, object] = {}
    if explain:
        with torch.no_grad():
            report["explained inference"] = _explained(model, batches[0])
        report["explained training"] = _explained(model, batches[0])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    same: list[bool] = []
    with torch.no_grad():
        for batch in batches:
            same.append(torch.equal(compiled(*batch), model(*batch)))
    report["inference"] = _reasons(dict(counters["graph_break"]))
    counters.clear()
    batch = batches[0]
    same.append(torch.equal(compiled(*batch), model(*batch)))
    if kernel == "dense":  # no update in the backward: the gradients must agree too
        model.zero_grad()
        model(*batch).sum().backward()
        eager = _grads(model)
        model.zero_grad()
        compiled(*batch).sum().backward()
        traced = _grads(model)
        same.append(eager.keys() == traced.keys() and len(eager) > 0)
        same += [torch.allclose(eager[k], traced[k], rtol=1e-6, atol=1e-7) for k in eager]
    report["training"] = _reasons(dict(counters["graph_break"]))
    report["compiled equals eager"] = same
    torch._dynamo.reset()
    return report


def _check(report: dict[str, object], kernel: str | None) -> None:
    for mode in ("inference", "training", "explained inference", "explained training"):
        found = report.get(mode)
        if found is None:
            continue
        assert isinstance(found, dict)
        assert found["other"] == [], (mode, found)
        assert found["collective"] > 0, (mode, found)
        fused_op_allowed = mode.endswith("training") and kernel is None
        assert fused_op_allowed or found["fused op"] == 0, (mode, found)
        assert found.get("count", 0) <= MAX_BREAKS, (mode, found)
    same = report["compiled equals eager"]
    assert isinstance(same, list) and all(same), report


# Column-wise runs the same collectives and checks as table-wise (a routed all-to-all).
@pytest.mark.parametrize("plan", ["table_wise", "row_wise"])
def test_compiled_fused_dlrm_breaks_only_at_collectives(plan: str) -> None:
    for report in run_on_ranks(2, _compile_report, plan, None, False, timeout_s=TIMEOUT_S):
        _check(report, None)


def test_one_rank_dense_kernel_explained_and_gradients() -> None:
    (report,) = run_on_ranks(1, _compile_report, "row_wise", "dense", True, timeout_s=TIMEOUT_S)
    _check(report, "dense")
