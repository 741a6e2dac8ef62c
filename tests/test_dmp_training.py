"""DistributedModelParallel trains exactly like the unsharded model on the global batch.

Two real ranks (gloo): a DLRM sharded under a mixed plan (table-wise, row-wise, column-wise,
data-parallel) takes three steps on its local batches; an unsharded copy takes the same steps
on the concatenated global batch with the mean loss (the 1/N rule). Dense parameters, table
weights, the embedding optimizer's state and the dense optimizer's state must agree to 1e-5.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from torch import Tensor

from embshard_dist.comm.collectives import all_gather_ints
from embshard_dist.data.synthetic import SyntheticClicks
from embshard_dist.dmp.dense import default_dense_optimizer
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.dmp.weights import tensor_checksum
from embshard_dist.models.demo import DemoConfig as DLRMConfig
from embshard_dist.models.demo import DemoDLRM as DLRM
from embshard_dist.planner.auto import runtime_topology
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.simple import SimplePlanner
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.keyed import KeyedOptimizerWrapper
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.vocab import ShardingType

WORLD = 2
TOL = 1e-5
ROWS = (40, 50, 60, 30, 20)
MIXED = {
    "t0": "table_wise",
    "t1": "table_wise",
    "t2": "row_wise",
    "t3": "column_wise",
    "t4": "data_parallel",
}
CONFIG = DLRMConfig(num_dense=4, bottom_mlp=(8,), top_mlp=(8,))


def tables() -> list[EmbeddingBagConfig]:
    """Five small tables of one dimension (DLRM's dot interaction needs one)."""
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=8)
        for i, rows in enumerate(ROWS)
    ]


def data(batch_size: int = 8) -> SyntheticClicks:
    return SyntheticClicks(tables(), num_dense=4, batch_size=batch_size, max_ids=5, seed=1)


def build_model(seed: int = 0, device: str | None = None) -> DLRM:
    """The same DLRM on every rank (seeded)."""
    torch.manual_seed(seed)
    return DLRM(tables(), CONFIG, device=device)


def pieces(t: Any) -> Iterator[tuple[tuple[int, ...], Tensor]]:
    """(offsets, local tensor) of each piece of ``t`` this rank holds."""
    if hasattr(t, "local_shards"):  # ShardedTensor
        for shard in t.local_shards():
            yield tuple(shard.metadata.shard_offsets), shard.tensor
    elif hasattr(t, "to_local"):  # DTensor over local shards
        local = t.to_local()
        if hasattr(local, "local_shards"):
            yield from zip(map(tuple, local.local_offsets()), local.local_shards(), strict=True)
        else:
            yield (0,) * t.dim(), local
    else:
        yield (0,) * t.dim(), t


def compare(sharded: Any, whole: Tensor) -> tuple[float, int]:
    """Largest difference between the pieces of ``sharded`` here and ``whole``, and how many
    elements were compared.

    A row-wise state of a column-split table holds one copy per column block, laid end to end
    (offset ``block * rows + row``); each copy is compared with the whole table's state.
    """
    worst, count = 0.0, 0
    for offsets, local in pieces(sharded):
        if local.numel() == 0:
            continue
        index = tuple(
            slice(o % whole.shape[d], o % whole.shape[d] + n)
            for d, (o, n) in enumerate(zip(offsets, local.shape, strict=True))
        )
        ref = whole.detach()[index]
        worst = max(worst, (local.detach().cpu().float() - ref.cpu().float()).abs().max().item())
        count += local.numel()
    return worst, count


def flat_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """state name -> tensor, over every parameter of an optimizer state dict."""
    out = {}
    for param, states in state_dict["state"].items():
        for name, value in states.items():
            if name != "step" and (isinstance(value, Tensor) or hasattr(value, "local_shards")):
                out[name if "." in name else f"{param}/{name}"] = value
    return out


def _reference(model: DLRM, spec: OptimizerSpec) -> tuple[DLRM, KeyedOptimizerWrapper]:
    ref = copy.deepcopy(model)
    ebc = EmbeddingBagCollection(tables(), optimizer=spec)
    ebc.load_state_dict(ref.sparse_arch.state_dict())
    ref.sparse_arch = ebc
    cls, kwargs = default_dense_optimizer(spec)
    dense = {n: p for n, p in ref.named_parameters() if not n.startswith("sparse_arch.")}
    return ref, KeyedOptimizerWrapper(dense, lambda ps: cls(ps, **kwargs))


def _train_and_compare(optimizer: str, sharding: Any, steps: int) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = OptimizerSpec.from_name(optimizer, lr=0.1)
    model = build_model()
    ref, ref_dense = _reference(model, spec)
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    sharders: list[Any] = [EmbeddingBagCollectionSharder(optimizer=spec)]
    device = test_device()
    planner = SimplePlanner(world, device_type=device.type, sharding=sharding, optimizer=spec)
    plan = planner.plan(model, sharders)
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders, optimizer=spec)
    opt = dmp.optimizer()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    source = data()
    for step in range(steps):
        local = source.batch(step, rank, world)
        out = dmp(local.dense.to(device), local.sparse.to(device))
        loss_fn(out, local.labels.to(device)).backward()
        opt.step()
        opt.zero_grad()
        whole = source.global_batch(step, world)
        loss_fn(ref(whole.dense, whole.sparse), whole.labels).backward()
        ref_dense.step()
        ref_dense.zero_grad()

    # name -> (largest difference here, elements compared here, elements in the reference)
    out: dict[str, tuple[float, int, int]] = {}
    ref_state = ref.state_dict()
    for key, value in dmp.state_dict().items():
        out[key] = (*compare(value, ref_state[key]), ref_state[key].numel())
    for prefix, mine, theirs in [
        (
            "fused",
            flat_state(dmp.fused_optimizer.state_dict()),
            flat_state(ref.sparse_arch.fused_optimizer.state_dict()),
        ),
        ("dense", flat_state(dmp.dense_optimizer.state_dict()), flat_state(ref_dense.state_dict())),
    ]:
        # A rank's fused optimizer holds the state of the tables it holds a shard of.
        assert set(mine) <= set(theirs), (prefix, sorted(mine), sorted(theirs))
        for name, whole in theirs.items():
            found = compare(mine[name], whole) if name in mine else (0.0, 0)
            out[f"{prefix}:{name}"] = (*found, whole.numel())
    moved = [
        (ref_state[k] - initial[k]).abs().max().item() for k in initial if k.startswith("sparse")
    ]
    out["tables moved"] = (0.0, int(min(moved) > 1e-4), 1)
    return out


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd", "adam"])
def test_mixed_plan_matches_unsharded_training(optimizer: str) -> None:
    results = run_on_ranks(WORLD, _train_and_compare, optimizer, MIXED, 3)
    assert results[0].keys() == results[1].keys()
    names = results[0].keys()
    assert {k for k in names if k.startswith("sparse_arch.")} == {
        f"sparse_arch.embedding_bags.t{i}.weight" for i in range(len(ROWS))
    }
    states = {k for k in names if k.startswith("fused:")}
    assert len(states) == {"sgd": 0, "rowwise_adagrad": 5, "adam": 10}[optimizer]
    for name in names:
        worst = max(r[name][0] for r in results)
        assert worst <= TOL, f"{name}: sharded and unsharded differ by {worst}"
        # every element of the reference was compared on some rank
        assert sum(r[name][1] for r in results) >= results[0][name][2], name


def _meta_default_plan() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(device="meta")
    dmp = DistributedModelParallel(model, optimizer="rowwise_adagrad")
    # the default plan is the cost-based planner's, for this run's ranks and memory
    planner = EmbeddingShardingPlanner(
        runtime_topology(world, test_device().type), optimizer=dmp.optimizer_spec
    )
    sharders = [EmbeddingBagCollectionSharder(optimizer=dmp.optimizer_spec)]
    expected = planner.plan(build_model(device="meta"), sharders)
    kinds = {ps.sharding_type for mp in dmp.plan.values() for ps in mp.values()}  # type: ignore[attr-defined]
    in_range = all(
        ((local >= -((1 / rows) ** 0.5) - 1e-7) & (local <= (1 / rows) ** 0.5 + 1e-7)).all().item()
        for (i, rows) in enumerate(ROWS)
        for _, local in pieces(dmp.state_dict()[f"sparse_arch.embedding_bags.t{i}.weight"])
    )
    dense = [p for n, p in dmp.named_parameters() if not n.startswith("sparse_arch.")]
    sums = [v for p in dense for v in tensor_checksum(p)]
    same_dense = len({tuple(r) for r in all_gather_ints(sums)}) == 1
    opt = dmp.optimizer()
    source = data()
    losses = []
    device = test_device()
    for step in range(2):
        b = source.batch(step, rank, world)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            dmp(b.dense.to(device), b.sparse.to(device)), b.labels.to(device)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "plan": dmp.plan.to_json(),
        "planner_plan": expected.to_json(),
        "kinds": kinds,
        "in_range": in_range,
        "same_dense": same_dense,
        "finite": all(torch.isfinite(torch.tensor(losses))),
        "meta_left": [n for n, p in dmp.named_parameters() if p.is_meta],
    }


def test_meta_model_with_the_default_plan() -> None:
    results = run_on_ranks(WORLD, _meta_default_plan)
    assert len({r["plan"] for r in results}) == 1  # planned on rank 0, received by all
    for result in results:
        assert result["plan"] == result["planner_plan"]
        # tables of at most 60 rows: replicas cost less than any all-to-all
        assert result["kinds"] == {ShardingType.DATA_PARALLEL}
        assert result["in_range"] and result["same_dense"] and result["finite"]
        assert result["meta_left"] == []


def _state_dict_round_trip(output_dtensor: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = OptimizerSpec.from_name("rowwise_adagrad", lr=0.1)
    sharders: list[Any] = [EmbeddingBagCollectionSharder(optimizer=spec)]

    device = test_device()

    def make(seed: int) -> DistributedModelParallel:
        model = build_model(seed)
        planner = SimplePlanner(world, device_type=device.type, sharding=MIXED, optimizer=spec)
        plan = planner.plan(model, sharders)
        return DistributedModelParallel(
            model, plan=plan, sharders=sharders, optimizer=spec, output_dtensor=output_dtensor
        )

    first, second = make(0), make(5)
    local = data().batch(0, rank, world)
    b = replace(local, dense=local.dense.to(device), sparse=local.sparse.to(device))
    saved = first.state_dict()
    kinds = {k: type(v).__name__ for k, v in saved.items() if k.startswith("sparse_arch.")}
    state_kinds = {
        type(v).__name__ for v in flat_state(first.fused_optimizer.state_dict()).values()
    }
    before = second(b.dense, b.sparse).detach().clone()
    second.load_state_dict(saved)
    second.fused_optimizer.load_state_dict(first.fused_optimizer.state_dict())
    same = torch.equal(first(b.dense, b.sparse), second(b.dense, b.sparse))
    changed = not torch.equal(before, second(b.dense, b.sparse))
    try:
        second.load_state_dict({k: v for k, v in saved.items() if "t1" not in k})
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {
        "kinds": kinds,
        "state_kinds": state_kinds,
        "same": same,
        "changed": changed,
        "refused": refused,
        "keys": sorted(saved),
    }


@pytest.mark.parametrize("output_dtensor", [False, True])
def test_state_dict_round_trip(output_dtensor: bool) -> None:
    sharded_type = "DTensor" if output_dtensor else "ShardedTensor"
    for result in run_on_ranks(WORLD, _state_dict_round_trip, output_dtensor):
        kinds = result["kinds"]
        assert kinds["sparse_arch.embedding_bags.t2.weight"] == sharded_type
        assert kinds["sparse_arch.embedding_bags.t4.weight"] in ("Tensor", "Parameter")
        assert result["state_kinds"] <= {sharded_type, "Tensor"}
        assert result["same"] and result["changed"]
        assert "missing keys ['sparse_arch.embedding_bags.t1.weight']" in result["refused"]
        assert "dense_arch.0.weight" in result["keys"]
        assert not any(k.startswith(("module.", "_dmp")) for k in result["keys"])


def _optimizer_defaults() -> list[tuple[str, str, float]]:
    adam = OptimizerSpec.from_name("adam", lr=0.003)
    out = []
    for dense_optimizer in (None, torch.optim.SGD, lambda ps: torch.optim.Adagrad(ps, lr=0.5)):
        model = build_model()
        model.sparse_arch = EmbeddingBagCollection(tables(), optimizer=adam)
        dmp = DistributedModelParallel(model, dense_optimizer=dense_optimizer)
        dense = dmp.dense_optimizer
        assert isinstance(dense, KeyedOptimizerWrapper)
        assert not any(name.startswith("sparse_arch.") for name in dense.params)
        lr = dense.optimizer.param_groups[0]["lr"]
        out.append((dmp.optimizer_spec.optim_type.value, type(dense.optimizer).__name__, lr))
    return out


def test_optimizer_defaults_follow_the_model() -> None:
    for result in run_on_ranks(WORLD, _optimizer_defaults):
        assert result == [("adam", "Adam", 0.003), ("adam", "SGD", 0.003), ("adam", "Adagrad", 0.5)]
