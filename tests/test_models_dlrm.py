"""TorchRec's DLRM family on embshard: shapes, ``DLRMTrain``'s outputs, and sharded = unsharded.

The distributed tests run two real gloo ranks: ``DLRMTrain(DLRM(...))`` (and ``DLRM_DCN``) under
``DistributedModelParallel`` with a table-wise or row-wise plan must give the unsharded model's
forward on each rank's batch, then take three SGD steps on local batches while an unsharded copy
takes them on the global batch; losses, dense parameters and the forward afterwards must agree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from math import comb

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from torch import Tensor, nn

from embshard_dist.data.synthetic import SyntheticClicks
from embshard_dist.dmp.dense import default_dense_optimizer
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.models.dlrm import (
    DLRM,
    DLRM_DCN,
    DLRMTrain,
    InteractionArch,
    SparseArch,
)
from embshard_dist.models.mlp import MLP
from embshard_dist.planner.simple import SimplePlanner
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.keyed import KeyedOptimizerWrapper
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

WORLD = 2
DIM = 8
NUM_DENSE = 4
ROWS = (40, 50, 60)
TOL = 1e-5
STEPS = 3


@dataclass(frozen=True)
class ClickBatch:
    """A batch with TorchRec's field names (``torchrec.datasets.utils.Batch``)."""

    dense_features: Tensor
    sparse_features: KeyedJaggedTensor
    labels: Tensor


def tables(dims: tuple[int, ...] = (DIM,) * len(ROWS)) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"]
        )
        for i, (rows, dim) in enumerate(zip(ROWS, dims, strict=True))
    ]


def data(batch_size: int = 6) -> SyntheticClicks:
    return SyntheticClicks(tables(), num_dense=NUM_DENSE, batch_size=batch_size, max_ids=4, seed=3)


def click_batch(source: SyntheticClicks, step: int, rank: int = 0, world: int = 1) -> ClickBatch:
    """Rank ``rank``'s share of step ``step`` (``world == 1``: the whole batch)."""
    b = source.batch(step, rank, world)
    return ClickBatch(b.dense, b.sparse, b.labels)


def build(kind: str, seed: int = 0, optimizer: OptimizerSpec | None = None) -> DLRM:
    """A seeded DLRM (``dlrm``) or DLRM_DCN (``dcn``): the same on every rank."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables(), optimizer=optimizer)
    if kind == "dcn":
        return DLRM_DCN(ebc, NUM_DENSE, [16, DIM], [16, 1], dcn_num_layers=2, dcn_low_rank_dim=3)
    return DLRM(ebc, NUM_DENSE, [16, DIM], [16, 1])


# ---- shapes and the training wrapper (one process) ------------------------------------------


def test_arches_and_logits_have_torchrec_shapes() -> None:
    batch = click_batch(data(), 0)
    model = build("dlrm")
    f = len(ROWS)
    assert isinstance(model.sparse_arch, SparseArch)
    assert model.sparse_arch.sparse_feature_names == ["f0", "f1", "f2"]
    sparse = model.sparse_arch(batch.sparse_features)
    assert sparse.shape == (6, f, DIM)
    dense = model.dense_arch(batch.dense_features)
    assert dense.shape == (6, DIM)
    assert isinstance(model.inter_arch, InteractionArch)
    assert model.inter_arch(dense, sparse).shape == (6, DIM + comb(f + 1, 2))
    assert model(batch.dense_features, batch.sparse_features).shape == (6, 1)
    dcn = build("dcn")
    assert dcn.inter_arch(dense, sparse).shape == (6, (f + 1) * DIM)
    assert dcn(batch.dense_features, batch.sparse_features).shape == (6, 1)
    torch.manual_seed(0)
    wide = DLRM(EmbeddingBagCollection(tables()), NUM_DENSE, [DIM], [16, 8, 3])
    assert wide(batch.dense_features, batch.sparse_features).shape == (6, 3)


def test_parameter_names_follow_torchrec() -> None:
    names = [n for n, _ in build("dcn").named_parameters()]
    assert names == [
        *(f"sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight" for i in range(3)),
        "dense_arch.model._mlp.0._linear.weight",
        "dense_arch.model._mlp.0._linear.bias",
        "dense_arch.model._mlp.1._linear.weight",
        "dense_arch.model._mlp.1._linear.bias",
        "inter_arch.crossnet.W_kernels.0",
        "inter_arch.crossnet.W_kernels.1",
        "inter_arch.crossnet.V_kernels.0",
        "inter_arch.crossnet.V_kernels.1",
        "inter_arch.crossnet.bias.0",
        "inter_arch.crossnet.bias.1",
        "over_arch.model.0._mlp.0._linear.weight",
        "over_arch.model.0._mlp.0._linear.bias",
        "over_arch.model.1.weight",
        "over_arch.model.1.bias",
    ]
    # the interaction's pair indices are not state (TorchRec registers them non-persistent)
    assert not any("triu" in k for k in build("dlrm").state_dict())


def test_same_seed_gives_the_same_model() -> None:
    a, b = build("dcn", seed=4).state_dict(), build("dcn", seed=4).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = build("dcn", seed=5).state_dict()
    assert not torch.equal(a["over_arch.model.1.weight"], c["over_arch.model.1.weight"])


def test_dlrm_train_returns_loss_and_detached_outputs() -> None:
    batch = click_batch(data(), 1)
    train = DLRMTrain(build("dlrm"))
    loss, (loss_d, logits, labels) = train(batch)
    expected_logits = train.model(batch.dense_features, batch.sparse_features).squeeze(-1)
    assert logits.shape == (6,)
    torch.testing.assert_close(logits, expected_logits.detach(), rtol=0, atol=0)
    expected = nn.functional.binary_cross_entropy_with_logits(expected_logits, batch.labels)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert loss.requires_grad
    assert not (loss_d.requires_grad or logits.requires_grad or labels.requires_grad)
    assert torch.equal(loss_d, loss.detach())
    assert torch.equal(labels, batch.labels)
    loss.backward()
    grad = train.model.over_arch.model[1].weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_bad_arguments_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"'t1' \(4\)"):
        DLRM(EmbeddingBagCollection(tables((DIM, 4, DIM))), NUM_DENSE, [DIM], [4, 1])
    with pytest.raises(ValueError, match="embedding dim 8"):
        DLRM(EmbeddingBagCollection(tables()), NUM_DENSE, [16, 4], [4, 1])
    with pytest.raises(ValueError, match="at least two layer sizes"):
        DLRM(EmbeddingBagCollection(tables()), NUM_DENSE, [DIM], [1])


def test_mlp_activations() -> None:
    x = torch.randn(5, 4)
    torch.manual_seed(0)
    plain = MLP(4, [3, 2], activation="relu", activation_on_last=False)
    torch.manual_seed(0)
    moduled = MLP(4, [3, 2], activation=nn.ReLU, activation_on_last=False)
    torch.testing.assert_close(plain(x), moduled(x), rtol=0, atol=0)
    assert (plain(x) < 0).any()  # no ReLU after the last layer
    assert (MLP(4, [3, 2], activation="sigmoid")(x) > 0).all()
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        MLP(4, [3], activation="tanh")


# ---- sharded vs unsharded on two gloo ranks ------------------------------------------------


def _dense_params(model: nn.Module) -> dict[str, Tensor]:
    return {
        n.removeprefix("module."): p
        for n, p in model.named_parameters()
        if "embedding_bag_collection" not in n
    }


def _sharded_like_unsharded(kind: str, sharding: str) -> dict[str, float]:
    """Largest differences between the sharded and the unsharded model on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = test_device()
    spec = OptimizerSpec.from_name("sgd", lr=0.1)
    model = DLRMTrain(build(kind))
    ref = copy.deepcopy(model)
    ref.model.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(
        tables(), optimizer=spec
    )
    ref.model.sparse_arch.embedding_bag_collection.load_state_dict(
        model.model.sparse_arch.embedding_bag_collection.state_dict()
    )
    cls, kwargs = default_dense_optimizer(spec)
    ref_dense = KeyedOptimizerWrapper(_dense_params(ref), lambda ps: cls(ps, **kwargs))

    sharders = [EmbeddingBagCollectionSharder(optimizer=spec)]
    planner = SimplePlanner(world, device_type=device.type, sharding=sharding, optimizer=spec)
    plan = planner.plan(model, sharders)
    kinds = {p.sharding_type.value for m in plan.plan.values() for p in m.values()}
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders, optimizer=spec)
    opt = dmp.optimizer()
    source = data()
    out = {"plan is " + sharding: float(kinds != {sharding})}

    def to(b: ClickBatch) -> ClickBatch:
        return ClickBatch(b.dense_features.to(device), b.sparse_features.to(device), b.labels)

    local = click_batch(source, 0, rank, world)
    with torch.no_grad():
        _, (_, logits, _) = dmp(to(local))
        _, (_, ref_logits, _) = ref(local)
    out["forward before training"] = (logits.cpu() - ref_logits).abs().max().item()
    before = ref_logits.clone()
    worst_loss = 0.0
    for step in range(STEPS):
        local = click_batch(source, step, rank, world)
        loss, _ = dmp(to(local))
        loss.backward()
        opt.step()
        opt.zero_grad()
        g = source.global_batch(step, world)
        whole = ClickBatch(g.dense, g.sparse, g.labels)
        ref_loss, _ = ref(whole)
        ref_loss.backward()
        ref_dense.step()
        ref_dense.zero_grad()
        mean = loss.detach().cpu().clone()
        dist.all_reduce(mean)
        worst_loss = max(worst_loss, abs(mean.item() / world - ref_loss.item()))
    out["global loss per step"] = worst_loss
    mine, theirs = _dense_params(dmp), _dense_params(ref)
    out["dense parameter names"] = float(mine.keys() != theirs.keys())
    out["dense parameters after training"] = max(
        (mine[k].detach().cpu() - theirs[k].detach()).abs().max().item() for k in theirs
    )
    local = click_batch(source, 0, rank, world)
    with torch.no_grad():
        _, (_, logits, _) = dmp(to(local))
        _, (_, ref_logits, _) = ref(local)
    out["forward after training"] = (logits.cpu() - ref_logits).abs().max().item()
    # training must have moved the model, or the comparison above proves nothing
    out["model did not move"] = float((ref_logits - before).abs().max().item() < 1e-4)
    return out


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_sharded_dlrm_matches_unsharded(kind: str, sharding: str) -> None:
    results = run_on_ranks(WORLD, _sharded_like_unsharded, kind, sharding)
    for rank, result in enumerate(results):
        assert result["forward before training"] <= 1e-6, (rank, result)
        for name, worst in result.items():
            assert worst <= TOL, f"rank {rank}: {name}: {worst} (all: {result})"
