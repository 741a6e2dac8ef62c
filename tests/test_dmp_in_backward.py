"""DistributedModelParallel fuses the optimizer declared with apply_optimizer_in_backward.

Two real ranks (gloo): tables declared with ``torch.optim.Adagrad`` at lr 0.5 (not DMP's default
SGD at 0.01), sharded table-wise, row-wise, column-wise and data-parallel, take three steps on
their local batches. An unsharded copy, whose tables torch's own in-backward Adagrad steps,
takes the same steps on the global batch with the mean loss. Tables and dense parameters must
agree to 1e-5, which only that class at that rate gives. Declarations that cannot be honoured
are refused on every rank, naming the class, module and table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks
from torch import Tensor, nn

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.sharded.plan_helpers import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim import (
    KeyedOptimizerWrapper,
    OptimizerSpec,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.plan import ShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

ROWS = {"t0": 20, "t1": 30, "t2": 40, "t3": 25}
DIM = 8
LR = 0.5
DENSE_LR = 0.1
STEPS = 3
TOL = 1e-5
MIXED = {"t0": "table_wise", "t1": "row_wise", "t2": "column_wise", "t3": "data_parallel"}


class Model(nn.Module):
    """Pooled tables, then a linear layer; the loss is the sum of squared outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(num_embeddings=n, embedding_dim=DIM, name=t)
                for t, n in ROWS.items()
            ]
        )
        self.over = nn.Linear(DIM * len(ROWS), 1)

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        return self.over(self.ebc(features).values()).pow(2).sum()


def batch(step: int, rank: int, size: int = 4) -> KeyedJaggedTensor:
    """Rank ``rank``'s batch of step ``step`` (any process can make any rank's)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (len(ROWS) * size,), generator=g)
    values = []
    for i, rows in enumerate(ROWS.values()):
        n = int(lengths[i * size : (i + 1) * size].sum())
        values.append(torch.randint(0, rows, (n,), generator=g))
    return KeyedJaggedTensor.from_lengths_sync(list(ROWS), torch.cat(values), lengths)


def global_batch(step: int, world: int) -> list[KeyedJaggedTensor]:
    return [batch(step, r) for r in range(world)]


def sharding_plan(model: Model, kinds: dict[str, str], world: int) -> ShardingPlan:
    helpers = {
        "table_wise": lambda: table_wise(rank=world - 1),
        "row_wise": row_wise,
        "column_wise": lambda: column_wise(ranks=list(range(world))),
        "data_parallel": data_parallel,
    }
    per_table = {t: helpers[kinds[t]]() for t in ROWS}
    module_plan = construct_module_sharding_plan(
        model.ebc, per_table, world_size=world, local_size=world, device_type="cpu"
    )
    return ShardingPlan({"ebc": module_plan})


def full_tables(state: dict[str, Any]) -> dict[str, Tensor]:
    """Every table whole on every rank (sharded ones summed from their disjoint shards)."""
    out = {}
    for table, rows in ROWS.items():
        value = state[f"ebc.embedding_bags.{table}.weight"]
        if hasattr(value, "local_shards"):
            full = torch.zeros(rows, DIM)
            for shard in value.local_shards():
                (r0, c0), t = shard.metadata.shard_offsets, shard.tensor
                full[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t.detach()
            dist.all_reduce(full)
            out[table] = full
        else:
            out[table] = value.detach().clone()
    return out


class PlainModel(nn.Module):
    """``Model`` in plain torch (``nn.EmbeddingBag`` per table), from ``Model``'s weights."""

    def __init__(self, source: Model) -> None:
        super().__init__()
        self.bags = nn.ModuleDict(
            {
                t: nn.EmbeddingBag.from_pretrained(
                    source.ebc.embedding_bags[t].weight.detach().clone(), freeze=False, mode="sum"
                )
                for t in ROWS
            }
        )
        self.over = nn.Linear(DIM * len(ROWS), 1)
        self.over.load_state_dict(source.over.state_dict())

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        per_table = features.to_dict()
        pooled = [self.bags[t](per_table[t].values(), per_table[t].offsets()[:-1]) for t in ROWS]
        return self.over(torch.cat(pooled, dim=1)).pow(2).sum()


def reference(world: int) -> dict[str, Tensor]:
    """The unsharded model stepped on the global batch with the mean loss: torch's own
    in-backward Adagrad on the tables, SGD on the dense layer."""
    torch.manual_seed(0)
    model = PlainModel(Model())
    apply_optimizer_in_backward(torch.optim.Adagrad, model.bags.parameters(), {"lr": LR})
    dense = torch.optim.SGD(model.over.parameters(), lr=DENSE_LR)
    for step in range(STEPS):
        loss = sum(model(kjt) for kjt in global_batch(step, world)) / world
        assert isinstance(loss, Tensor)
        loss.backward()
        dense.step()
        dense.zero_grad()
    out = {t: model.bags[t].weight.detach().clone() for t in ROWS}
    out.update({f"over.{k}": v.detach().clone() for k, v in model.over.state_dict().items()})
    return out


def train_declared(kinds: dict[str, str]) -> dict[str, float]:
    """Per rank: the largest difference to the reference and how far the tables moved."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model()
    start = {t: model.ebc.embedding_bags[t].weight.detach().clone() for t in ROWS}
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": LR})
    dmp = DistributedModelParallel(model, plan=sharding_plan(model, kinds, world))
    assert dmp.optimizer_spec == OptimizerSpec.from_torch(torch.optim.Adagrad, lr=LR)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=DENSE_LR),
    )
    assert sorted(dense.params) == ["over.bias", "over.weight"]
    for step in range(STEPS):
        dmp(batch(step, rank)).backward()
        dense.step()
        dense.zero_grad()
    state = dmp.state_dict()
    mine = full_tables(state)
    mine.update({k: v.detach() for k, v in state.items() if k.startswith("over.")})
    expected = reference(world)
    worst = max(float((mine[k] - v).abs().max()) for k, v in expected.items())
    moved = min(float((mine[t] - start[t]).abs().max()) for t in ROWS)
    return {"worst": worst, "moved": moved}


@pytest.mark.parametrize(
    "kinds",
    [MIXED, dict.fromkeys(ROWS, "row_wise")],
    ids=["mixed", "row_wise"],
)
def test_declared_adagrad_trains_like_the_unsharded_model(kinds: dict[str, str]) -> None:
    for result in run_on_ranks(2, train_declared, kinds):
        assert result["worst"] <= TOL, result
        # Adagrad at 0.5 moves every table by about 0.5; SGD at 0.01 would move it ~100x less.
        assert result["moved"] > 0.1, result


class _Partial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Model()


def refusals() -> dict[str, str]:
    """Each case's error on this rank."""

    def attempt(case: str) -> str:
        torch.manual_seed(0)
        model = Model()
        params = dict(model.ebc.named_parameters())
        kwargs: dict[str, Any] = {}
        if case == "rmsprop":
            apply_optimizer_in_backward(torch.optim.RMSprop, params.values(), {"lr": LR})
        elif case == "disagrees":
            apply_optimizer_in_backward(torch.optim.Adagrad, params.values(), {"lr": LR})
            kwargs["optimizer"] = "sgd"
        elif case == "mixed":
            names = sorted(params)
            apply_optimizer_in_backward(torch.optim.Adagrad, [params[names[0]]], {"lr": LR})
            apply_optimizer_in_backward(torch.optim.SGD, [params[n] for n in names[1:]], {"lr": LR})
        elif case == "partial":
            apply_optimizer_in_backward(torch.optim.Adagrad, list(params.values())[:1], {"lr": LR})
        elif case == "sharder":
            apply_optimizer_in_backward(torch.optim.Adagrad, params.values(), {"lr": LR})
            kwargs["sharders"] = [EmbeddingBagCollectionSharder(optimizer=OptimizerSpec("sgd"))]
        try:
            DistributedModelParallel(model, **kwargs)
        except ValueError as e:
            return str(e)
        return "accepted"

    return {case: attempt(case) for case in ("rmsprop", "disagrees", "mixed", "partial", "sharder")}


def test_undeclarable_optimizers_are_refused_on_every_rank() -> None:
    results = run_on_ranks(2, refusals)
    assert results[0] == results[1]
    errors = results[0]
    assert "module 'ebc', table 't0'" in errors["rmsprop"]
    assert "torch.optim.rmsprop.RMSprop" in errors["rmsprop"]
    assert "Use one of torch.optim.SGD" in errors["rmsprop"]
    assert "declare adagrad (lr=0.5)" in errors["disagrees"]
    assert "DistributedModelParallel's optimizer= is sgd" in errors["disagrees"]
    assert "declare different in-backward optimizers" in errors["mixed"]
    assert "separate collections" in errors["mixed"]
    assert "do not, and embshard fuses one optimizer per collection" in errors["partial"]
    assert "passed in sharders= runs sgd" in errors["sharder"]
