"""``RandomRecDataset``: random batches with TorchRec's arguments, for smoke tests and benchmarks.

Same signature as ``torchrec.datasets.random.RandomRecDataset``: ``num_generated_batches``
batches are generated up front (from ``manual_seed``) and cycled (negative: a new batch each
time); ``num_batches`` bounds the iteration (``None``: endless). Per-feature lists
(``hash_sizes``, ``ids_per_features``) win over the single values, as in TorchRec. A bag of feature ``k`` holds between ``min_ids_per_features[k]``
and ``ids_per_features[k]`` ids (both default to ``ids_per_features[k]``, a fixed length), drawn
uniformly from ``[0, hash_sizes[k])``. Dense features are standard normal, labels uniform in {0, 1}: there is nothing to learn.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import IterableDataset

from embshard_dist.data.synthetic import Batch
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


def _per_key(
    name: str, one: int | None, many: Sequence[int] | None, keys: Sequence[str]
) -> list[int] | None:
    """``many`` when given (it wins over ``one``, as in TorchRec), else ``one`` for every key."""
    if many is not None:
        if len(many) != len(keys):
            raise ValueError(f"{name}s has {len(many)} entries for {len(keys)} keys {list(keys)}")
        return list(many)
    return None if one is None else [one] * len(keys)


class RandomRecDataset(IterableDataset[Batch]):
    """Random ``Batch`` es of ``keys`` (see the module doc for the arguments)."""

    def __init__(
        self,
        keys: list[str],
        batch_size: int,
        hash_size: int | None = 100,
        hash_sizes: list[int] | None = None,
        ids_per_feature: int | None = 2,
        ids_per_features: list[int] | None = None,
        num_dense: int = 50,
        manual_seed: int | None = None,
        num_batches: int | None = None,
        num_generated_batches: int = 10,
        *,
        min_ids_per_feature: int | None = None,
        min_ids_per_features: list[int] | None = None,
    ) -> None:
        if batch_size <= 0 or num_generated_batches == 0:
            raise ValueError(
                f"batch_size must be positive and num_generated_batches non-zero (negative: "
                f"generate on the fly), got {batch_size} and {num_generated_batches}"
            )
        self.keys = list(keys)
        sizes = _per_key("hash_size", hash_size or 100, hash_sizes, keys)
        most = _per_key("ids_per_feature", ids_per_feature or 2, ids_per_features, keys)
        least = _per_key("min_ids_per_feature", min_ids_per_feature, min_ids_per_features, keys)
        assert sizes is not None and most is not None
        least = most if least is None else least
        for k, s, lo, hi in zip(keys, sizes, least, most, strict=True):
            if s <= 0 or not 0 <= lo <= hi:
                raise ValueError(
                    f"feature {k!r}: need hash size > 0 and 0 <= min ids <= ids, got {s}, {lo}, {hi}"
                )
        self.hash_sizes, self.min_ids, self.max_ids = sizes, least, most
        self.batch_size, self.num_dense = batch_size, num_dense
        self.num_batches = num_batches
        self._gen = torch.Generator()
        if manual_seed is not None:
            self._gen.manual_seed(manual_seed)
        else:
            self._gen.seed()
        self._batches = [self._generate(self._gen) for _ in range(max(num_generated_batches, 0))]

    def _generate(self, gen: torch.Generator) -> Batch:
        lengths, values = [], []
        for size, lo, hi in zip(self.hash_sizes, self.min_ids, self.max_ids, strict=True):
            lens = torch.randint(lo, hi + 1, (self.batch_size,), generator=gen)
            lengths.append(lens)
            values.append(torch.randint(0, size, (int(lens.sum()),), generator=gen))
        return Batch(
            dense=torch.randn(self.batch_size, self.num_dense, generator=gen),
            sparse=KeyedJaggedTensor(
                keys=self.keys,
                values=torch.cat(values) if values else torch.zeros(0, dtype=torch.long),
                lengths=torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.long),
                stride=self.batch_size,
            ),
            labels=torch.randint(0, 2, (self.batch_size,), generator=gen).float(),
        )

    def __iter__(self) -> Iterator[Batch]:
        i = 0
        while self.num_batches is None or i < self.num_batches:
            yield (
                self._batches[i % len(self._batches)]
                if self._batches
                else self._generate(self._gen)
            )
            i += 1
