"""Synthetic click data for the main job, the tests and the benchmarks.

Guarantees: the global batch of a step depends only on the seed, the step and the shapes, and
the ranks' shares concatenate to it exactly; labels follow a hidden logistic model, so training
drives the loss down; ids follow a Zipf-like law and bags may be empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from embshard_types.configs import EmbeddingBagConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


@dataclass(frozen=True)
class Batch:
    """One rank's share of a training step."""

    dense: torch.Tensor
    """[batch, num_dense] float features."""
    sparse: KeyedJaggedTensor
    """One key per feature, ``batch`` samples per key."""
    labels: torch.Tensor
    """[batch] clicks in {0., 1.}."""


class SyntheticClicks:
    """Generates deterministic click batches for a set of tables.

    Args:
        tables: the tables whose features the batches carry (one key per feature name).
        batch_size: samples per rank per step.
        min_ids / max_ids: bounds of ids per bag (inclusive).
        zipf_alpha: skew of the id distribution (0 gives uniform ids).
        weighted: attach a per-id weight in (0, 1] to every id.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        *,
        num_dense: int = 13,
        batch_size: int = 256,
        min_ids: int = 1,
        max_ids: int = 20,
        zipf_alpha: float = 1.05,
        weighted: bool = False,
        seed: int = 0,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= min_ids <= max_ids:
            raise ValueError(f"need 0 <= min_ids <= max_ids, got {min_ids} and {max_ids}")
        self.features: list[tuple[str, int]] = [
            (f, t.num_embeddings) for t in tables for f in t.feature_names
        ]
        self.num_dense = num_dense
        self.batch_size = batch_size
        self.min_ids, self.max_ids = min_ids, max_ids
        self.zipf_alpha = zipf_alpha
        self.weighted = weighted
        self.seed = seed
        hidden = torch.Generator().manual_seed(seed + 1_000_003)
        self._dense_w = torch.randn(num_dense, generator=hidden)
        self._row_score = {t.name: torch.randn(t.num_embeddings, generator=hidden) for t in tables}
        self._table_of = {f: t.name for t in tables for f in t.feature_names}

    def _ids(self, gen: torch.Generator, count: int, rows: int) -> torch.Tensor:
        if self.zipf_alpha <= 0:
            return torch.randint(0, rows, (count,), generator=gen)
        # Inverse-CDF sampling of a power law, then a fixed scramble so hot rows spread over the table.
        u = torch.rand(count, generator=gen, dtype=torch.float64)
        a = 1.0 - self.zipf_alpha
        if abs(a) < 1e-9:
            x = torch.exp(u * torch.log(torch.tensor(rows + 1.0, dtype=torch.float64)))
        else:
            x = (1.0 + u * ((rows + 1.0) ** a - 1.0)) ** (1.0 / a)
        rank = (x.floor().long() - 1).clamp_(0, rows - 1)
        return (rank * 2_654_435_761 + 12_345) % rows

    def global_batch(self, step: int, world_size: int = 1) -> Batch:
        """The whole batch of ``step`` for ``world_size`` ranks (``world_size * batch_size`` samples)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n = self.batch_size * world_size
        dense = torch.randn(n, self.num_dense, generator=gen)
        logit = dense @ self._dense_w * 0.5
        lengths, values, weights = [], [], []
        for feature, rows in self.features:
            lens = torch.randint(self.min_ids, self.max_ids + 1, (n,), generator=gen)
            ids = self._ids(gen, int(lens.sum()), rows)
            w = torch.rand(ids.numel(), generator=gen) * 0.9 + 0.1
            bag = torch.repeat_interleave(torch.arange(n), lens)
            score = self._row_score[self._table_of[feature]][ids] * (w if self.weighted else 1.0)
            logit.index_add_(0, bag, score / max(1, self.max_ids) * 2.0)
            lengths.append(lens)
            values.append(ids)
            weights.append(w)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        sparse = KeyedJaggedTensor(
            keys=[f for f, _ in self.features],
            values=torch.cat(values) if values else torch.zeros(0, dtype=torch.long),
            lengths=torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.long),
            weights=torch.cat(weights) if (self.weighted and weights) else None,
            stride=n,
        )
        return Batch(dense=dense, sparse=sparse, labels=labels)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Rank ``rank``'s share of step ``step``'s global batch."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        whole = self.global_batch(step, world_size)
        if world_size == 1:
            return whole
        b = self.batch_size
        lo, hi = rank * b, (rank + 1) * b
        kjt = whole.sparse
        n = b * world_size
        lengths = kjt.lengths().view(len(self.features), n)
        offsets = kjt.offsets()
        starts = offsets[:-1].view(len(self.features), n)[:, lo]
        ends = offsets[1:].view(len(self.features), n)[:, hi - 1]
        keep = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(starts, ends, strict=True)])
        weights = kjt.weights_or_none()
        sparse = KeyedJaggedTensor(
            keys=list(kjt.keys()),
            values=kjt.values()[keep],
            lengths=lengths[:, lo:hi].reshape(-1),
            weights=None if weights is None else weights[keep],
            stride=b,
        )
        return Batch(dense=whole.dense[lo:hi], sparse=sparse, labels=whole.labels[lo:hi])
