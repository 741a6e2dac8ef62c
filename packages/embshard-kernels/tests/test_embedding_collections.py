"""EmbeddingBagCollection and EmbeddingCollection: outputs, state dicts, meta construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import random_kjt

from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_kernels.dense import BatchedDenseEmbeddingBag
from embshard_kernels.fused import BatchedFusedEmbeddingBag
from embshard_kernels.slices import TableBatchedEmbeddingSlice
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

BAG_TABLES = [
    EmbeddingBagConfig(name="t1", num_embeddings=20, embedding_dim=8, feature_names=("f1", "f2")),
    EmbeddingBagConfig(
        name="t2", num_embeddings=10, embedding_dim=4, feature_names=("f3",), pooling="mean"
    ),
    EmbeddingBagConfig(name="t3", num_embeddings=15, embedding_dim=12, feature_names=("f4",)),
]
ROWS = {"f1": 20, "f2": 20, "f3": 10, "f4": 15}
SEQ_TABLES = [
    EmbeddingConfig(name="s1", num_embeddings=20, embedding_dim=8, feature_names=("a",)),
    EmbeddingConfig(name="s2", num_embeddings=10, embedding_dim=4, feature_names=("b", "c")),
]
SEQ_ROWS = {"a": 20, "b": 10, "c": 10}
OPTIMIZERS = {
    "dense": None,
    "fbgemm": OptimizerSpec.from_name("rowwise_adagrad", lr=0.1),
    "torch": OptimizerSpec.from_name("adam", lr=0.01),
}


def _bag_reference(ebc: EmbeddingBagCollection, kjt: KeyedJaggedTensor) -> torch.Tensor:
    state = ebc.state_dict()
    outs = []
    for cfg in BAG_TABLES:
        for f in cfg.feature_names:
            jt = kjt[f]
            outs.append(
                F.embedding_bag(
                    jt.values(),
                    state[f"embedding_bags.{cfg.name}.weight"],
                    jt.offsets(),
                    mode=cfg.pooling.value,
                    include_last_offset=True,
                )
            )
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bag_collection_output_follows_the_configs(name: str) -> None:
    ebc = EmbeddingBagCollection(BAG_TABLES, optimizer=OPTIMIZERS[name])
    # t1 and t3 (SUM) share a kernel, t2 (MEAN) has its own: kernel order is f1 f2 f4 | f3.
    assert [k.config.table_names() for k in ebc.kernels()] == [["t1", "t3"], ["t2"]]
    kjt = random_kjt([("f4", 15), ("f3", 10), ("f2", 20), ("f1", 20), ("extra", 3)], 5, seed=1)
    out = ebc(kjt)
    assert out.keys() == ["f1", "f2", "f3", "f4"]
    assert out.length_per_key() == [8, 8, 4, 12]
    torch.testing.assert_close(out.values(), _bag_reference(ebc, kjt), rtol=1e-6, atol=1e-6)
    assert torch.equal(out["f3"], out.values()[:, 16:20])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bag_collection_state_dict_round_trip(name: str) -> None:
    torch.manual_seed(0)
    source = EmbeddingBagCollection(BAG_TABLES, optimizer=OPTIMIZERS[name])
    target = EmbeddingBagCollection(BAG_TABLES, optimizer=OPTIMIZERS[name])
    state = source.state_dict()
    assert list(state) == [f"embedding_bags.{t}.weight" for t in ("t1", "t2", "t3")]
    assert [n for n, _ in source.named_parameters()] == list(state)
    assert not all(torch.equal(state[k], target.state_dict()[k]) for k in state)
    result = target.load_state_dict({k: v.clone() for k, v in state.items()})
    assert not result.missing_keys and not result.unexpected_keys
    kjt = random_kjt([(f, r) for f, r in ROWS.items()], 4, seed=3)
    assert torch.equal(target(kjt).values(), source(kjt).values())  # loaded into the kernels
    for key, value in target.state_dict().items():
        assert torch.equal(value, state[key])
        assert isinstance(dict(target.named_parameters())[key], TableBatchedEmbeddingSlice)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_meta_collection_materialises_like_a_direct_one(name: str) -> None:
    torch.manual_seed(7)
    direct = EmbeddingBagCollection(BAG_TABLES, optimizer=OPTIMIZERS[name])
    torch.manual_seed(7)
    meta = EmbeddingBagCollection(BAG_TABLES, device="meta", optimizer=OPTIMIZERS[name])
    assert all(p.is_meta for p in meta.parameters())
    assert list(meta.state_dict()) == list(direct.state_dict())
    with pytest.raises(RuntimeError, match="meta device"):
        meta(random_kjt([(f, r) for f, r in ROWS.items()], 2))
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    for key, value in direct.state_dict().items():
        assert torch.equal(meta.state_dict()[key], value), key
    kjt = random_kjt([(f, r) for f, r in ROWS.items()], 4, seed=5)
    assert torch.equal(meta(kjt).values(), direct(kjt).values())
    kinds = {type(k) for k in meta.kernels()}
    assert kinds == ({BatchedDenseEmbeddingBag} if name == "dense" else {BatchedFusedEmbeddingBag})


def test_fused_collection_trains_in_backward_and_exposes_state() -> None:
    ebc = EmbeddingBagCollection(BAG_TABLES, optimizer=OPTIMIZERS["fbgemm"])
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    kjt = random_kjt([(f, r) for f, r in ROWS.items()], 4, seed=3)
    ebc(kjt).values().sum().backward()
    assert all(not torch.equal(before[k], v) for k, v in ebc.state_dict().items())
    state = ebc.fused_optimizer.state_dict()["state"]
    assert sorted(state) == [f"embedding_bags.{t}.weight" for t in ("t1", "t2", "t3")]
    assert sorted(state["embedding_bags.t1.weight"]) == ["t1.momentum1"]
    assert state["embedding_bags.t1.weight"]["t1.momentum1"].shape == (20,)


def test_dense_collection_trains_with_a_torch_optimizer() -> None:
    ebc = EmbeddingBagCollection(BAG_TABLES)
    optimizer = torch.optim.Adagrad(ebc.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    ebc(random_kjt([(f, r) for f, r in ROWS.items()], 4, seed=3)).values().sum().backward()
    optimizer.step()
    assert all(not torch.equal(before[k], v) for k, v in ebc.state_dict().items())


def test_moving_to_the_same_device_keeps_the_kernels() -> None:
    ebc = EmbeddingBagCollection(BAG_TABLES, optimizer=OPTIMIZERS["fbgemm"])
    kernels = ebc.kernels()
    ebc.to("cpu")
    assert all(a is b for a, b in zip(kernels, ebc.kernels(), strict=True))


def test_bag_collection_input_errors() -> None:
    ebc = EmbeddingBagCollection(BAG_TABLES)
    missing = random_kjt([("f1", 20), ("f2", 20), ("f4", 15)], 3)
    with pytest.raises(ValueError, match=r"feature 'f3' \(table 't2'\) is missing"):
        ebc(missing)
    variable = random_kjt([(f, r) for f, r in ROWS.items()], 3, batch_sizes=[3, 2, 3, 3])
    with pytest.raises(ValueError, match="one batch size"):
        ebc(variable)


def test_bag_collection_config_errors() -> None:
    with pytest.raises(ValueError, match="feature 'f1' is read by tables"):
        EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="a", num_embeddings=4, embedding_dim=4, feature_names=("f1",)
                ),
                EmbeddingBagConfig(
                    name="b", num_embeddings=4, embedding_dim=4, feature_names=("f1",)
                ),
            ]
        )
    with pytest.raises(TypeError, match="EmbeddingBagConfig"):
        EmbeddingBagCollection(SEQ_TABLES)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of 4"):
        EmbeddingBagCollection(
            [EmbeddingBagConfig(name="a", num_embeddings=4, embedding_dim=6)],
            optimizer=OPTIMIZERS["fbgemm"],
        )


def test_weighted_bag_collection() -> None:
    tables = [
        EmbeddingBagConfig(name="w", num_embeddings=10, embedding_dim=4, feature_names=("x", "y"))
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=True, optimizer=OPTIMIZERS["fbgemm"])
    kjt = random_kjt([("x", 10), ("y", 10)], 3, weighted=True, seed=4)
    weight = ebc.state_dict()["embedding_bags.w.weight"]
    ref = torch.cat(
        [
            F.embedding_bag(
                kjt[f].values(),
                weight,
                kjt[f].offsets(),
                mode="sum",
                per_sample_weights=kjt[f].weights(),
                include_last_offset=True,
            )
            for f in ("x", "y")
        ],
        dim=1,
    )
    torch.testing.assert_close(ebc(kjt).values(), ref)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sequence_collection(name: str) -> None:
    torch.manual_seed(1)
    ec = EmbeddingCollection(SEQ_TABLES, optimizer=OPTIMIZERS[name])
    kjt = random_kjt([("c", 10), ("a", 20), ("b", 10)], 4, seed=6)
    out = ec(kjt)
    assert list(out) == ["a", "b", "c"]
    state = ec.state_dict()
    assert list(state) == ["embeddings.s1.weight", "embeddings.s2.weight"]
    for feature, table in (("a", "s1"), ("b", "s2"), ("c", "s2")):
        jt = out[feature]
        assert torch.equal(jt.lengths(), kjt[feature].lengths())
        torch.testing.assert_close(
            jt.values(), F.embedding(kjt[feature].values(), state[f"embeddings.{table}.weight"])
        )

    torch.manual_seed(1)
    meta = EmbeddingCollection(SEQ_TABLES, device="meta", optimizer=OPTIMIZERS[name])
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert all(torch.equal(meta.state_dict()[k], v) for k, v in state.items())
    other = EmbeddingCollection(SEQ_TABLES, optimizer=OPTIMIZERS[name])
    other.load_state_dict({k: v.clone() for k, v in state.items()})
    assert torch.equal(other(kjt)["b"].values(), out["b"].values())


def test_state_dict_flushes_and_load_purges_the_kernel_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ebc = EmbeddingBagCollection(BAG_TABLES, optimizer=OPTIMIZERS["fbgemm"])
    calls: list[str] = []
    for kernel in ebc.kernels():
        tbe = kernel.emb_module
        monkeypatch.setattr(tbe, "flush", lambda: calls.append("flush"))
        monkeypatch.setattr(tbe, "reset_cache_states", lambda: calls.append("purge"))
    state = ebc.state_dict()
    assert calls == ["flush", "flush"]
    ebc.load_state_dict(state)
    assert calls[2:] == ["purge", "purge"]


@pytest.mark.parametrize("kind", ["bag", "sequence"])
def test_collections_refuse_a_dict_with_a_type_error(kind: str) -> None:
    if kind == "bag":
        module: torch.nn.Module = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=8, feature_names=("f",))]
        )
    else:
        module = EmbeddingCollection(
            [EmbeddingConfig(name="t", num_embeddings=10, embedding_dim=8, feature_names=("f",))]
        )
    with pytest.raises(TypeError, match="takes a KeyedJaggedTensor, got dict"):
        module({"f": torch.tensor([1, 2])})
