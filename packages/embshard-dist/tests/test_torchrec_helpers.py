"""TorchRec's small distributed helpers: ``get_module``'s family on a model tree,
``get_module_to_default_sharders``, and ``get_local_size`` / ``get_local_rank`` from the
launcher's environment (and without it)."""

from __future__ import annotations

import pytest
from test_train_pipeline_unit import one_rank_group as one_rank_group  # autouse fixture
from test_train_pipeline_unit import sharded
from torch import nn

import embshard_dist
from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection


def test_unsharded_module_names_are_the_dense_siblings_of_sharded_ones() -> None:
    dmp = sharded()
    model = dmp.module
    assert embshard_dist.get_unwrapped_module(dmp) is model
    assert sorted(embshard_dist.get_unsharded_module_names(model)) == ["top"]
    tower = nn.Module()
    tower.sharded = model  # one level deeper: "inner.top" beside "inner.sparse"
    outer = nn.Module()
    outer.inner = tower
    outer.head = nn.Linear(1, 1)
    assert sorted(embshard_dist.get_unsharded_module_names(outer)) == ["head", "inner.sharded.top"]
    assert embshard_dist.get_unsharded_module_names(nn.Linear(1, 1)) == []


def test_module_to_default_sharders() -> None:
    by_type = embshard_dist.get_module_to_default_sharders()
    assert isinstance(by_type[EmbeddingCollection], EmbeddingCollectionSharder)
    assert EmbeddingBagCollection in by_type
    assert all(sharder.module_type is kind for kind, sharder in by_type.items())


def test_local_size_and_rank_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID"):
        monkeypatch.delenv(name, raising=False)
    assert embshard_dist.get_local_size(8) == 8  # no launcher: one node
    assert embshard_dist.get_local_rank(8, rank=5) == 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert embshard_dist.get_local_size(8) == 4
    assert embshard_dist.get_local_rank(8, rank=7) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # does not divide 8: one node
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("MPI_LOCALRANKID", "9")  # out of the node: rank % local size
    assert embshard_dist.get_local_size(8) == 8
    assert embshard_dist.get_local_rank(8, rank=6) == 6
    assert embshard_dist.get_local_size() == 1  # the one-rank group
