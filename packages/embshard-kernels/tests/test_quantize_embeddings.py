"""quantize_embeddings: a float model's collections become IntNBit inference collections.

The error bound is derived from each row's stored fp16 scale ``s`` and bias ``b``: FBGEMM rounds
``(x - b) / s`` to the nearest level, so an element is off by at most ``s / 2``, plus the fp16
rounding of the scale (at most ``2^-11`` relative, times up to ``2^bits - 1`` levels) and of the
bias (``2^-11`` relative); we allow ``2^-10`` for both. A pooled bag's column is off by at most the
sum over its ids of ``|weight| x`` that row's bound, plus fp32 summation slack.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_kernels.quantize import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    quantize_embeddings,
)
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

BITS = {"int8": 8, "int4": 4}
FEATURES = {"f1": 50, "f2": 50, "f3": 30}


def _bag_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="t1", embedding_dim=16, num_embeddings=50, feature_names=["f1", "f2"]
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=32, num_embeddings=30, feature_names=["f3"]),
    ]


def _kjt(batch: int, seed: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (len(FEATURES) * batch,), generator=g)
    rows = torch.tensor(list(FEATURES.values())).repeat_interleave(batch)
    ids = torch.cat(
        [
            torch.randint(0, int(r), (int(n),), generator=g)
            for r, n in zip(rows, lengths, strict=True)
        ]
    )
    weights = torch.rand(ids.numel(), generator=g) * 2 - 1 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(list(FEATURES), ids, lengths, weights=weights)


class _Model(nn.Module):
    def __init__(self, weighted: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sparse = nn.ModuleDict(
            {"ebc": EmbeddingBagCollection(_bag_tables(), is_weighted=weighted)}
        )
        self.over = nn.Linear(16 + 16 + 32, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        return self.sparse["ebc"](kjt).values()


def _row_bounds(quant: nn.Module, bits: int) -> dict[str, Tensor]:
    """Per table, each row's largest element error, from its stored scale and bias."""
    bounds = {}
    for kernel in quant.kernels:  # type: ignore[union-attr]
        for t in kernel.config.embedding_tables:
            holder = kernel.table_weight(t.name)
            scale_bias = holder.weight_qscaleshift.view(torch.float16).float()
            scale, bias = scale_bias[:, 0], scale_bias[:, 1]
            bounds[t.name] = scale / 2 + (2**bits - 1) * scale * 2.0**-10 + bias.abs() * 2.0**-10
    return bounds


def _pooled_bound(
    kjt: KeyedJaggedTensor, row_bounds: dict[str, Tensor], dims: dict[str, int]
) -> Tensor:
    """``[batch, sum of dims]``: per bag, the sum over its ids of |weight| x the row's bound."""
    table_of = {"f1": "t1", "f2": "t1", "f3": "t2"}
    columns = []
    for feature, jt in kjt.to_dict().items():
        per_id = row_bounds[table_of[feature]][jt.values()]
        weights = jt.weights_or_none()
        if weights is not None:
            per_id = per_id * weights.abs()
        bag = torch.repeat_interleave(torch.arange(jt.lengths().numel()), jt.lengths())
        per_bag = torch.zeros(jt.lengths().numel()).index_add_(0, bag, per_id)
        columns.append(per_bag.unsqueeze(1).expand(-1, dims[feature]))
    return torch.cat(columns, dim=1)


@pytest.mark.parametrize("data_type", ["int8", "int4"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_outputs_within_rowwise_quantization_error(data_type: str, weighted: bool) -> None:
    model = _Model(weighted)
    kjt = _kjt(batch=12, seed=3, weighted=weighted)
    expected = model(kjt).detach()
    quantize_embeddings(model, data_type)
    quant = model.sparse["ebc"]
    assert isinstance(quant, QuantEmbeddingBagCollection)
    got = model(kjt)
    assert got.shape == expected.shape and got.dtype == torch.float32
    bound = _pooled_bound(kjt, _row_bounds(quant, BITS[data_type]), {"f1": 16, "f2": 16, "f3": 32})
    slack = 1e-5 * expected.abs() + 1e-6
    error = (got - expected).abs()
    assert bool((error <= bound + slack).all()), float((error - bound - slack).max())
    # The bound is tight enough to mean something: the error is a visible part of it.
    assert float(error.max()) > 0.05 * float(bound.max())


def test_sequence_rows_within_rowwise_quantization_error() -> None:
    torch.manual_seed(1)
    tables = [
        EmbeddingConfig(name="t1", embedding_dim=16, num_embeddings=50, feature_names=["f1", "f2"]),
        EmbeddingConfig(name="t2", embedding_dim=16, num_embeddings=30, feature_names=["f3"]),
    ]
    ec = EmbeddingCollection(tables)
    kjt = _kjt(batch=8, seed=5, weighted=False)
    expected = ec(kjt)
    quant = quantize_embeddings(ec, "int8")
    assert isinstance(quant, QuantEmbeddingCollection)
    got = quant(kjt)
    bounds = _row_bounds(quant, 8)
    table_of = {"f1": "t1", "f2": "t1", "f3": "t2"}
    assert list(got) == list(expected) == ["f1", "f2", "f3"]
    for feature, jt in got.items():
        ids = kjt[feature].values()
        assert torch.equal(jt.lengths(), expected[feature].lengths())
        error = (jt.values() - expected[feature].values()).abs()
        assert bool((error <= bounds[table_of[feature]][ids].unsqueeze(1) + 1e-6).all()), feature


def test_int8_tables_take_well_under_a_third_of_fp32_memory() -> None:
    model = _Model(weighted=False)
    fp32 = sum(p.numel() * p.element_size() for p in model.sparse["ebc"].parameters())
    quantize_embeddings(model, "int8")
    quant = model.sparse["ebc"]
    int8 = sum(
        h.weight.nbytes + h.weight_qscaleshift.nbytes
        for k in quant.kernels
        for h in (k.table_weight(t.name) for t in k.config.embedding_tables)
    )
    # 16 and 32 columns: (d + 4) bytes per row against 4 d.
    assert int8 == 50 * (16 + 4) + 30 * (32 + 4)
    assert fp32 == 4 * (50 * 16 + 30 * 32)
    assert int8 <= 0.3 * fp32
    assert not any(isinstance(m, EmbeddingBagCollection) for m in model.modules())


def test_fp16_and_not_in_place() -> None:
    model = _Model(weighted=False)
    kjt = _kjt(batch=4, seed=7, weighted=False)
    quant_model = quantize_embeddings(model, torch.float16, inplace=False)
    assert isinstance(model.sparse["ebc"], EmbeddingBagCollection)
    expected = model(kjt)
    torch.testing.assert_close(quant_model(kjt), expected, rtol=2e-3, atol=2e-3)


def test_unknown_dtype_is_named() -> None:
    with pytest.raises(ValueError, match=r"bf16"):
        quantize_embeddings(_Model(weighted=False), "bf16")
