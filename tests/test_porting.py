"""A TorchRec training script runs on embshard with only its import lines changed.

``train_script`` is written in TorchRec's idiom: table configs with TorchRec's fields, a planner
with constraints and ``collective_plan``, ``DistributedModelParallel`` with TorchRec's keyword
arguments, the embedding optimizer declared with ``apply_optimizer_in_backward`` (Adagrad at
lr 0.5, not the default), ``KeyedOptimizerWrapper`` over ``in_backward_optimizer_filter`` for the
dense part, ``CombinedOptimizer``, and ``torch.distributed.checkpoint`` save and load of
``model.state_dict()``. Only the block of imports marked below differs from the TorchRec script.
On 2 gloo ranks the trained weights equal a plain-torch model stepped on the global batch by
torch's own in-backward Adagrad at that rate, and the loaded model equals the saved one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _mp import run_on_ranks
from torch import Tensor, nn

# ---- The only lines that differ from the TorchRec script ----------------------------------
# torchrec: from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
# torchrec: from torchrec.distributed import DistributedModelParallel
# torchrec: from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
# torchrec: from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
# torchrec: from torchrec.distributed.planner.types import ParameterConstraints
# torchrec: from torchrec.distributed.types import ShardingType
# torchrec: from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
# torchrec: from torchrec.optim.optimizers import in_backward_optimizer_filter
# torchrec: from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from embshard_dist import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)
from embshard_kernels import EmbeddingBagCollection
from embshard_optim import (
    CombinedOptimizer,
    KeyedOptimizerWrapper,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)
from embshard_types import EmbeddingBagConfig, KeyedJaggedTensor, ShardingType

# --------------------------------------------------------------------------------------------

NUM_DENSE = 4
DIM = 8
ROWS = {"t_user": 40, "t_item": 60, "t_cat": 24, "t_geo": 30}
FEATURES = {t: t.replace("t_", "f_") for t in ROWS}
SHARDING = {
    "t_user": ShardingType.TABLE_WISE.value,
    "t_item": ShardingType.ROW_WISE.value,
    "t_cat": ShardingType.COLUMN_WISE.value,
    "t_geo": ShardingType.DATA_PARALLEL.value,
}
BATCH = 4
STEPS = 3
EMB_LR = 0.5
DENSE_LR = 0.1
TOL = 1e-5


class SparseNN(nn.Module):
    """DLRM-like: a dense MLP, pooled embeddings, and an over-arch on their concatenation."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        self.dense_arch = nn.Sequential(nn.Linear(NUM_DENSE, DIM), nn.ReLU())
        self.sparse_arch = embedding_bag_collection
        self.over_arch = nn.Linear(DIM * (len(ROWS) + 1), 1)

    def forward(self, dense_features: Tensor, sparse_features: KeyedJaggedTensor) -> Tensor:
        pooled = self.sparse_arch(sparse_features).values()
        return self.over_arch(torch.cat([self.dense_arch(dense_features), pooled], dim=1))


def make_batch(step: int, rank: int) -> tuple[Tensor, KeyedJaggedTensor, Tensor]:
    """Rank ``rank``'s (dense, sparse, labels) at ``step``; any process can make any rank's."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    dense = torch.randn(BATCH, NUM_DENSE, generator=g)
    lengths = torch.randint(0, 3, (len(ROWS) * BATCH,), generator=g)
    values = []
    for i, rows in enumerate(ROWS.values()):
        count = int(lengths[i * BATCH : (i + 1) * BATCH].sum())
        values.append(torch.randint(0, rows, (count,), generator=g))
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=list(FEATURES.values()), values=torch.cat(values), lengths=lengths
    )
    labels = torch.randint(0, 2, (BATCH,), generator=g).float()
    return dense, sparse, labels


def build_model(seed: int) -> SparseNN:
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=table,
            embedding_dim=DIM,
            num_embeddings=rows,
            feature_names=[FEATURES[table]],
            weight_init_min=-0.1,
            weight_init_max=0.1,
        )
        for table, rows in ROWS.items()
    ]
    return SparseNN(EmbeddingBagCollection(tables=tables, device=torch.device("cpu")))


def shard(model: SparseNN) -> DistributedModelParallel:
    """TorchRec's idiom: declare the sparse optimizer, plan with constraints, wrap in DMP."""
    apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": EMB_LR})
    world_size = dist.get_world_size()
    constraints = {
        table: ParameterConstraints(sharding_types=[kind]) for table, kind in SHARDING.items()
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints=constraints,
        batch_size=BATCH,
    )
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(
        module=model, device=torch.device("cpu"), plan=plan, sharders=sharders
    )


def train_script(checkpoint: str) -> dict[str, Any]:
    """The TorchRec-style script: train, save with DCP, load into a fresh model."""
    rank = dist.get_rank()
    model = shard(build_model(seed=0))
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=DENSE_LR),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_optimizer])
    loss_fn = nn.BCEWithLogitsLoss()
    for step in range(STEPS):
        dense, sparse, labels = make_batch(step, rank)
        loss = loss_fn(model(dense, sparse).squeeze(1), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    dcp.save(model.state_dict(), checkpoint_id=checkpoint)
    restored = shard(build_model(seed=1))
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    restored.load_state_dict(state)

    probe_dense, probe_sparse, _ = make_batch(STEPS, rank)
    with torch.no_grad():
        trained_out = model(probe_dense, probe_sparse)
        restored_out = restored(probe_dense, probe_sparse)
    return {
        "plan": {t: s.sharding_type.value for t, s in model.plan["sparse_arch"].items()},
        "dense_params": sorted(dense_optimizer.params),
        "weights": whole_weights(model.state_dict()),
        "restored": whole_weights(restored.state_dict()),
        "trained_out": trained_out,
        "restored_out": restored_out,
    }


def whole_weights(state: dict[str, Any]) -> dict[str, Tensor]:
    """Every weight whole (sharded tables summed from their disjoint shards on all ranks)."""
    out: dict[str, Tensor] = {}
    for key in sorted(state):  # the ranks' state dicts may list keys in different orders
        value = state[key]
        if hasattr(value, "local_shards"):
            full = torch.zeros(value.size())
            for shard_ in value.local_shards():
                (r0, c0), t = shard_.metadata.shard_offsets, shard_.tensor
                full[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t.detach()
            dist.all_reduce(full)
            out[key] = full
        else:
            out[key] = value.detach().clone()
    return out


class PlainSparseNN(nn.Module):
    """``SparseNN`` in plain torch, from its weights (``nn.EmbeddingBag`` per table)."""

    def __init__(self, source: SparseNN) -> None:
        super().__init__()
        self.dense_arch = nn.Sequential(nn.Linear(NUM_DENSE, DIM), nn.ReLU())
        self.dense_arch.load_state_dict(source.dense_arch.state_dict())
        self.bags = nn.ModuleDict(
            {
                t: nn.EmbeddingBag.from_pretrained(
                    source.sparse_arch.embedding_bags[t].weight.detach().clone(),
                    freeze=False,
                    mode="sum",
                )
                for t in ROWS
            }
        )
        self.over_arch = nn.Linear(DIM * (len(ROWS) + 1), 1)
        self.over_arch.load_state_dict(source.over_arch.state_dict())

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        per_feature = sparse.to_dict()
        pooled = [
            self.bags[t](per_feature[f].values(), per_feature[f].offsets()[:-1])
            for t, f in FEATURES.items()
        ]
        return self.over_arch(torch.cat([self.dense_arch(dense), *pooled], dim=1))


def reference(world: int) -> dict[str, Tensor]:
    """Plain torch on the global batch (mean of the ranks' losses): torch's own in-backward
    Adagrad at ``EMB_LR`` on the tables, SGD on the rest."""
    model = PlainSparseNN(build_model(seed=0))
    apply_optimizer_in_backward(torch.optim.Adagrad, model.bags.parameters(), {"lr": EMB_LR})
    dense = torch.optim.SGD(
        [*model.dense_arch.parameters(), *model.over_arch.parameters()], lr=DENSE_LR
    )
    loss_fn = nn.BCEWithLogitsLoss()
    for step in range(STEPS):
        losses = []
        for rank in range(world):
            d, s, labels = make_batch(step, rank)
            losses.append(loss_fn(model(d, s).squeeze(1), labels))
        (sum(losses) / world).backward()  # type: ignore[union-attr]
        dense.step()
        dense.zero_grad()
    out = {f"sparse_arch.embedding_bags.{t}.weight": model.bags[t].weight for t in ROWS}
    for arch in ("dense_arch", "over_arch"):
        for key, value in getattr(model, arch).state_dict().items():
            out[f"{arch}.{key}"] = value
    return {k: v.detach() for k, v in out.items()}


def test_torchrec_script_trains_saves_and_loads(tmp_path: Path) -> None:
    results = run_on_ranks(2, train_script, str(tmp_path / "ckpt"))
    expected = reference(world=2)
    start = whole_start()
    for result in results:
        assert result["plan"] == SHARDING
        assert result["dense_params"] == sorted(
            k for k in expected if not k.startswith("sparse_arch")
        )
        assert sorted(result["weights"]) == sorted(expected)
        for key, value in expected.items():
            torch.testing.assert_close(result["weights"][key], value, atol=TOL, rtol=0)
            torch.testing.assert_close(result["restored"][key], value, atol=TOL, rtol=0)
        torch.testing.assert_close(result["restored_out"], result["trained_out"])
        for table in ROWS:
            key = f"sparse_arch.embedding_bags.{table}.weight"
            # Adagrad at 0.5 moves a touched row by ~0.5 in its first step; SGD at 0.01 cannot.
            assert float((result["weights"][key] - start[key]).abs().max()) > 0.3, table


def whole_start() -> dict[str, Tensor]:
    model = build_model(seed=0)
    return {f"sparse_arch.{k}": v.detach() for k, v in model.sparse_arch.state_dict().items()}


def test_every_embshard_import_of_the_porting_table_exists() -> None:
    """Each ``from X import A, B`` in the embshard column of docs/porting.md imports."""
    import importlib
    import re

    doc = Path(__file__).parents[1] / "docs" / "porting.md"
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| ")][2:]
    imported = 0
    for row in rows:
        embshard_cell = row.split(" | ")[1]
        for module, names in re.findall(r"`from ([\w.]+) import ([\w, ]+)`", embshard_cell):
            loaded = importlib.import_module(module)
            for name in names.split(","):
                assert hasattr(loaded, name.strip()), (module, name)
                imported += 1
    assert imported >= 40
    text = doc.read_text()
    for used in (
        "apply_optimizer_in_backward",
        "in_backward_optimizer_filter",
        "KeyedOptimizerWrapper",
        "CombinedOptimizer",
        "EmbeddingShardingPlanner",
        "ParameterConstraints",
        "Topology",
        "DistributedModelParallel",
        "EmbeddingBagCollectionSharder",
        "EmbeddingBagCollection",
        "EmbeddingBagConfig",
        "KeyedJaggedTensor",
        "ShardingType",
        "torch.distributed.checkpoint",
    ):
        assert used in text, used
