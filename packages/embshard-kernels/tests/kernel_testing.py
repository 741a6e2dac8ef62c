"""Helpers for embshard-kernels tests: random batches and plain-torch reference lookups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig, group_tables
from embshard_optim.specs import OptimizerSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, PoolingType


def table(
    name: str,
    rows: int,
    dim: int,
    features: Sequence[str] | None = None,
    *,
    pooling: PoolingType | str = PoolingType.SUM,
    kernel: ComputeKernel | str = ComputeKernel.FUSED,
    weighted: bool = False,
    optimizer: OptimizerSpec | None = None,
    **kwargs: object,
) -> ShardedTableConfig:
    params = FusedParams(optimizer=optimizer) if optimizer is not None else None
    return ShardedTableConfig(
        name=name,
        num_embeddings=rows,
        embedding_dim=dim,
        feature_names=tuple(features or (name,)),
        pooling=PoolingType.parse(pooling),
        compute_kernel=ComputeKernel.parse(kernel),
        is_weighted=weighted,
        fused_params=params,
        **kwargs,  # type: ignore[arg-type]
    )


def one_group(*tables: ShardedTableConfig) -> GroupedEmbeddingConfig:
    groups = group_tables(tables)
    assert len(groups) == 1, [g.table_names() for g in groups]
    return groups[0]


def random_kjt(
    features: Sequence[tuple[str, int]],
    batch: int,
    *,
    max_len: int = 4,
    weighted: bool = False,
    seed: int = 0,
    batch_sizes: Sequence[int] | None = None,
) -> KeyedJaggedTensor:
    """A batch with ``features`` = [(name, rows)], some empty bags, repeated ids likely."""
    g = torch.Generator().manual_seed(seed)
    sizes = list(batch_sizes) if batch_sizes is not None else [batch] * len(features)
    lengths = [torch.randint(0, max_len + 1, (b,), generator=g) for b in sizes]
    for lens in lengths:
        if lens.numel() > 1:
            lens[0] = 0  # always at least one empty bag
    values = [
        torch.randint(0, rows, (int(lens.sum()),), generator=g)
        for (_, rows), lens in zip(features, lengths, strict=True)
    ]
    all_values = torch.cat(values)
    weights = torch.rand(all_values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(
        [name for name, _ in features],
        all_values,
        weights=weights,
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[b] for b in sizes] if batch_sizes is not None else None,
    )


def reference_pooled(
    kjt: KeyedJaggedTensor,
    weights: Sequence[Tensor],
    pooling: PoolingType,
    *,
    weighted: bool = False,
    flat: bool = False,
) -> Tensor:
    """Per feature ``F.embedding_bag`` on ``weights[f]``, concatenated like a TBE output."""
    outs = []
    for f, key in enumerate(kjt.keys()):
        jt = kjt[key]
        mode = "sum" if pooling is PoolingType.SUM else "mean"
        out = F.embedding_bag(
            jt.values(),
            weights[f],
            jt.offsets(),
            mode=mode,
            per_sample_weights=jt.weights().to(weights[f].dtype) if weighted else None,
            include_last_offset=True,
        )
        outs.append(out.reshape(-1) if flat else out)
    return torch.cat(outs, dim=0 if flat else 1)


def reference_sequence(kjt: KeyedJaggedTensor, weights: Sequence[Tensor]) -> Tensor:
    """Per feature ``F.embedding`` on ``weights[f]``, rows concatenated."""
    return torch.cat([F.embedding(kjt[k].values(), weights[f]) for f, k in enumerate(kjt.keys())])


def feature_weights(config: GroupedEmbeddingConfig, tables: Sequence[Tensor]) -> list[Tensor]:
    """Per feature, its table's weight."""
    return [tables[t] for t in config.feature_table_map()]


def snapshot(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


def bit_identical(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """Same shapes, dtypes and bytes (so -0.0 differs from 0.0 and NaNs compare)."""

    def raw(t: Tensor) -> Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(raw(x), raw(y))
        for x, y in zip(a, b, strict=True)
    )


def assert_same_rows(a: Any, b: Any, tol: float = 1e-6) -> None:
    """Two fused kernels hold the same weights and row-wise momentum, within ``tol``."""
    for wa, wb in zip(a.split_embedding_weights(), b.split_embedding_weights(), strict=True):
        torch.testing.assert_close(wa, wb, atol=tol, rtol=tol)
    states = zip(
        a.emb_module.get_optimizer_state(), b.emb_module.get_optimizer_state(), strict=True
    )
    for sa, sb in states:
        torch.testing.assert_close(sa["momentum1"], sb["momentum1"], atol=tol, rtol=tol)
