"""The unsharded collections draw their weights as TorchRec's do: ``init_fn`` if the config has
one, else uniform in ``[weight_init_min, weight_init_max]``."""

from __future__ import annotations

import functools

import pytest
import torch

from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig


@pytest.mark.parametrize("optimizer", [None, "rowwise_adagrad"])
def test_weight_init_bounds_are_honoured(optimizer: str | None) -> None:
    from embshard_optim.specs import OptimizerSpec

    spec = None if optimizer is None else OptimizerSpec.from_name(optimizer)
    tables = [
        EmbeddingBagConfig(200, 8, "t0", weight_init_min=2.0, weight_init_max=3.0),
        EmbeddingBagConfig(300, 4, "t1", weight_init_min=-0.5, weight_init_max=-0.25),
    ]
    ebc = EmbeddingBagCollection(tables, optimizer=spec)
    sd = ebc.state_dict()
    w0, w1 = sd["embedding_bags.t0.weight"], sd["embedding_bags.t1.weight"]
    assert w0.min() >= 2.0 and w0.max() <= 3.0 and w0.std() > 0.1
    assert w1.min() >= -0.5 and w1.max() <= -0.25


def test_draws_follow_torchrec_order() -> None:
    """As TorchRec's modules: an EmbeddingBagCollection fills every table with the normal init of
    ``nn.EmbeddingBag`` first, then applies each config's init (uniform here) in config order; an
    EmbeddingCollection does both table by table."""
    bags = [
        EmbeddingBagConfig(50, 4, "a", weight_init_min=-1.0, weight_init_max=1.0),
        EmbeddingBagConfig(60, 8, "b"),
    ]
    torch.manual_seed(7)
    ebc = EmbeddingBagCollection(bags)
    torch.manual_seed(7)
    torch.empty(50, 4).normal_(), torch.empty(60, 8).normal_()
    expected_a = torch.empty(50, 4).uniform_(-1.0, 1.0)
    bound = (1.0 / 60) ** 0.5
    expected_b = torch.empty(60, 8).uniform_(-bound, bound)
    sd = ebc.state_dict()
    torch.testing.assert_close(sd["embedding_bags.a.weight"], expected_a)
    torch.testing.assert_close(sd["embedding_bags.b.weight"], expected_b)

    seqs = [EmbeddingConfig(50, 8, "a"), EmbeddingConfig(60, 8, "b")]
    torch.manual_seed(7)
    ec = EmbeddingCollection(seqs)
    torch.manual_seed(7)
    expected = []
    for rows in (50, 60):
        torch.empty(rows, 8).normal_()
        bound = (1.0 / rows) ** 0.5
        expected.append(torch.empty(rows, 8).uniform_(-bound, bound))
    sd = ec.state_dict()
    torch.testing.assert_close(sd["embeddings.a.weight"], expected[0])
    torch.testing.assert_close(sd["embeddings.b.weight"], expected[1])


def test_init_fn_fills_the_weight_in_place() -> None:
    tables = [
        EmbeddingConfig(
            40, 8, "seq", init_fn=functools.partial(torch.nn.init.constant_, val=0.125)
        ),
        EmbeddingConfig(30, 8, "other", weight_init_min=1.0, weight_init_max=1.0),
    ]
    ec = EmbeddingCollection(tables)
    sd = ec.state_dict()
    assert torch.equal(sd["embeddings.seq.weight"], torch.full((40, 8), 0.125))
    assert torch.equal(sd["embeddings.other.weight"], torch.ones(30, 8))


def test_init_fn_result_reaches_the_forward() -> None:
    def arange_rows(weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        return torch.arange(rows, dtype=weight.dtype)[:, None].expand(rows, cols).clone()

    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    ebc = EmbeddingBagCollection([EmbeddingBagConfig(10, 4, "t", init_fn=arange_rows)])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["t"], values=torch.tensor([1, 2, 7]), lengths=torch.tensor([2, 1])
    )
    out = ebc(kjt).values()
    torch.testing.assert_close(out, torch.tensor([[3.0] * 4, [7.0] * 4]))


def test_reset_parameters_on_meta_then_materialised_uses_init_fn() -> None:
    tables = [
        EmbeddingBagConfig(20, 4, "t", init_fn=functools.partial(torch.nn.init.constant_, val=-2.0))
    ]
    ebc = EmbeddingBagCollection(tables, device="meta")
    ebc.to_empty(device="cpu")
    ebc.reset_parameters()
    assert torch.equal(ebc.state_dict()["embedding_bags.t.weight"], torch.full((20, 4), -2.0))


def test_init_fn_of_wrong_shape_is_refused() -> None:
    tables = [EmbeddingBagConfig(20, 4, "t", init_fn=lambda w: torch.zeros(3, 3))]
    with pytest.raises(ValueError, match="table 't': init_fn returned a tensor of shape"):
        EmbeddingBagCollection(tables)
