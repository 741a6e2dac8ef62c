"""The benchmark workloads of ``shared/benchmarks.md``, built deterministically from a seed.

K1 (single process): 4 tables of 100,000 x 64, 20 ids per bag, batch 2,048.
Every builder returns plain tensors so each contender (embshard, FBGEMM, torch) sees the same
ids, offsets, initial weights and output gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class K1:
    num_tables: int = 4
    rows: int = 100_000
    dim: int = 64
    ids_per_bag: int = 20
    batch: int = 2_048
    lr: float = 0.01
    eps: float = 1e-8
    seed: int = 0

    def tensors(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Initial weights per table, ids per table ``[T, B*L]`` and the output gradient."""
        gen = torch.Generator().manual_seed(self.seed)
        bound = (1.0 / self.rows) ** 0.5
        weights = [
            torch.empty(self.rows, self.dim).uniform_(-bound, bound, generator=gen)
            for _ in range(self.num_tables)
        ]
        ids = torch.randint(
            0, self.rows, (self.num_tables, self.batch * self.ids_per_bag), generator=gen
        )
        grad = torch.randn(self.batch, self.num_tables * self.dim, generator=gen)
        return weights, ids, grad

    def bytes_moved(self, *, backward: bool) -> int:
        """Bytes of rows read plus output written (backward counted as twice the forward)."""
        forward = (
            4
            * self.dim
            * (self.num_tables * self.batch * self.ids_per_bag + self.num_tables * self.batch)
        )
        return forward * (3 if backward else 1)
