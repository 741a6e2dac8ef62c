"""Shared pieces of the checkpoint tests: a small DLRM, plans, training, and the full state.

``full_state(dmp)`` gathers, independently of the checkpoint code, every table's whole weight
and fused optimizer state (a row-wise state as ``[rows]``: the copy of column block 0, after
checking that every column block holds the same values), the dense tensors and the dense
optimizer's state, on every rank. It reads the live state-dict entries (``ShardedTensor`` /
plain tensors) and sums zero-filled tensors over the ranks, each element coming from exactly
one rank, so the result is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.data.synthetic import SyntheticClicks
from embshard_dist.dmp.dense import default_dense_optimizer
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.models.demo import DemoConfig as DLRMConfig
from embshard_dist.models.demo import DemoDLRM as DLRM
from embshard_dist.planner.simple import SimplePlanner
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.keyed import KeyedOptimizerWrapper
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig

ROWS = (40, 50, 60, 30, 20)
DIM = 8
CONFIG = DLRMConfig(num_dense=4, bottom_mlp=(8,), top_mlp=(8,))
PLANS: dict[str, Any] = {
    "table_wise": "table_wise",
    "row_wise": "row_wise",
    "column_wise": "column_wise",
    "mixed": {
        "t0": "table_wise",
        "t1": "row_wise",
        "t2": "column_wise",
        "t3": "data_parallel",
        "t4": "row_wise",
    },
}
LR = 0.1


def tables(rows: tuple[int, ...] = ROWS, dim: int = DIM) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=dim)
        for i, n in enumerate(rows)
    ]


def data() -> SyntheticClicks:
    return SyntheticClicks(tables(), num_dense=4, batch_size=8, max_ids=5, seed=1)


def make_dmp(
    optimizer: str,
    plan: str,
    seed: int = 0,
    rows: tuple[int, ...] = ROWS,
    dim: int = DIM,
    output_dtensor: bool = False,
) -> DistributedModelParallel:
    """The small DLRM (seeded: the same on every rank) sharded under ``PLANS[plan]``."""
    spec = OptimizerSpec.from_name(optimizer, lr=LR)
    torch.manual_seed(seed)
    model = DLRM(tables(rows, dim), CONFIG)
    sharders: list[Any] = [EmbeddingBagCollectionSharder(optimizer=spec)]
    sharding = PLANS[plan]
    if isinstance(sharding, dict):
        sharding = {t: k for t, k in sharding.items() if int(t[1:]) < len(rows)}
    planned = SimplePlanner(dist.get_world_size(), sharding=sharding, optimizer=spec).plan(
        model, sharders
    )
    return DistributedModelParallel(
        model, plan=planned, sharders=sharders, optimizer=spec, output_dtensor=output_dtensor
    )


def train(dmp: DistributedModelParallel, steps: range) -> None:
    """Train on the synthetic global batches of ``steps`` (each rank its share)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    source = SyntheticClicks(_configs(dmp), num_dense=4, batch_size=8, max_ids=5, seed=1)
    opt = dmp.optimizer()
    for step in steps:
        batch = source.batch(step, rank, world)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            dmp(batch.dense, batch.sparse), batch.labels
        )
        loss.backward()
        opt.step()
        opt.zero_grad()


def _configs(dmp: DistributedModelParallel) -> list[EmbeddingBagConfig]:
    configs: list[EmbeddingBagConfig] = dmp.sharded_modules["sparse_arch"].embedding_bag_configs()
    return configs


def pieces(t: Any) -> Iterator[tuple[tuple[int, ...], Tensor]]:
    """(offsets, local tensor) of each piece of ``t`` this rank holds."""
    if hasattr(t, "local_shards"):  # ShardedTensor
        for shard in t.local_shards():
            yield tuple(shard.metadata.shard_offsets), shard.tensor
    elif hasattr(t, "to_local"):  # DTensor over local shards
        local = t.to_local()
        for offsets, tensor in zip(local.local_offsets(), local.local_shards(), strict=False):
            yield tuple(offsets), tensor
    else:
        yield (0,) * t.dim(), t


def _replicated(t: Any) -> bool:
    return not hasattr(t, "local_shards") and not hasattr(t, "to_local")


def _all_reduce_many(tensors: list[Tensor], op: Any = dist.ReduceOp.SUM) -> None:
    """All-reduce several tensors in place with one collective."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=op)
    at = 0
    for t in tensors:
        t.copy_(flat[at : at + t.numel()].view_as(t))
        at += t.numel()


def full_state(dmp: DistributedModelParallel, optimizer: str) -> dict[str, Tensor]:
    """Every tensor of the training state, whole, on every rank (see the module docstring)."""
    rank = dist.get_rank()
    spec = OptimizerSpec.from_name(optimizer, lr=LR)
    out: dict[str, Tensor] = {}
    copies: list[tuple[str, Tensor, Tensor]] = []  # row-wise: (key, max, min) of other blocks
    sd = dmp.state_dict()
    fused = dmp.fused_optimizer.state_dict()["state"]
    for config in _configs(dmp):
        key = f"sparse_arch.embedding_bags.{config.name}.weight"
        rows, dim = config.num_embeddings, config.embedding_dim
        value = sd[key]
        replicated = _replicated(value)
        full = torch.zeros(rows, dim)
        if rank == 0 or not replicated:
            for (r, c), local in pieces(value):
                full[r : r + local.shape[0], c : c + local.shape[1]] = local
        out[key] = full
        for name in spec.state_names():
            state = fused.get(key, {}).get(f"{config.name}.{name}")
            rowwise = spec.state_is_rowwise(name)
            full = torch.zeros(rows) if rowwise else torch.zeros(rows, dim)
            hi = torch.full((rows,), -float("inf"))
            lo = torch.full((rows,), float("inf"))
            if state is not None and (rank == 0 or not replicated):
                for offsets, local in pieces(state):
                    if rowwise:
                        start = offsets[0] % rows
                        if offsets[0] < rows:
                            full[start : start + local.shape[0]] = local
                        else:  # another column block's copy
                            hi[start : start + local.shape[0]] = local
                            lo[start : start + local.shape[0]] = local
                    else:
                        r, c = offsets
                        full[r : r + local.shape[0], c : c + local.shape[1]] = local
            out[f"{key}/{name}"] = full
            if rowwise:
                copies.append((f"{key}/{name}", hi, lo))
    _all_reduce_many(list(out.values()))
    _all_reduce_many([hi for _, hi, _ in copies], dist.ReduceOp.MAX)
    _all_reduce_many([lo for _, _, lo in copies], dist.ReduceOp.MIN)
    for key, hi, lo in copies:
        seen = torch.isfinite(hi)
        agree = torch.equal(hi[seen], out[key][seen]) and torch.equal(lo[seen], out[key][seen])
        assert agree, f"{key}: column blocks hold different row-wise states"
    for key, value in sd.items():
        if not key.startswith("sparse_arch."):
            out[key] = value.detach().clone()
    for param, states in dmp.dense_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            out[f"dense:{param}/{name}"] = value.detach().clone()
    return out


def reference_step(saved: dict[str, Tensor], optimizer: str, step: int) -> dict[str, Tensor]:
    """The unsharded model loaded from ``saved`` (a :func:`full_state`), stepped once on the
    global batch of ``step`` with the mean loss; its state in :func:`full_state`'s keys."""
    world = dist.get_world_size()
    spec = OptimizerSpec.from_name(optimizer, lr=LR)
    torch.manual_seed(0)
    model = DLRM(tables(), CONFIG)
    model.sparse_arch = EmbeddingBagCollection(tables(), optimizer=spec)
    model.load_state_dict({k: v for k, v in saved.items() if "/" not in k and ":" not in k})
    fused = model.sparse_arch.fused_optimizer
    live = fused.state_dict()["state"]
    with torch.no_grad():
        for config in tables():
            for name in spec.state_names():
                key = f"sparse_arch.embedding_bags.{config.name}.weight"
                target = live[f"embedding_bags.{config.name}.weight"][f"{config.name}.{name}"]
                target.copy_(saved[f"{key}/{name}"])
    fused.set_optimizer_step(step)  # type: ignore[attr-defined]
    cls, kwargs = default_dense_optimizer(spec)
    params = {n: p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")}
    dense = KeyedOptimizerWrapper(params, lambda ps: cls(ps, **kwargs))
    dense.init_state()
    with torch.no_grad():
        for param, states in dense.state_dict()["state"].items():
            for name, value in states.items():
                value.copy_(saved[f"dense:{param}/{name}"])
    batch = data().global_batch(step, world)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        model(batch.dense, batch.sparse), batch.labels
    )
    loss.backward()
    dense.step()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    live = fused.state_dict()["state"]
    for config in tables():
        for name in spec.state_names():
            key = f"sparse_arch.embedding_bags.{config.name}.weight"
            out[f"{key}/{name}"] = live[f"embedding_bags.{config.name}.weight"][
                f"{config.name}.{name}"
            ].clone()
    for param, states in dense.state_dict()["state"].items():
        for name, value in states.items():
            out[f"dense:{param}/{name}"] = value.detach().clone()
    return out


def largest_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> tuple[float, str]:
    """The largest element-wise difference over the keys of ``a`` (and its key)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    worst = max((float((a[k].float() - b[k].float()).abs().max()), k) for k in a)
    return worst


def same(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """Keys whose tensors are not bit-identical (or present in only one)."""
    bad = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        if a[key].dtype != b[key].dtype or not torch.equal(
            a[key].view(-1).view(torch.int32) if a[key].dtype == torch.float32 else a[key],
            b[key].view(-1).view(torch.int32) if b[key].dtype == torch.float32 else b[key],
        ):
            bad.append(key)
    return bad
