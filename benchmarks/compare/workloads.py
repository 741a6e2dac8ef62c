"""The distributed workloads W1 and W2 of ``shared/benchmarks.md`` and the heterogeneous W4,
built from fixed seeds.

Everything here is plain torch, so both contenders are fed from the same tensors:

* tables: W1 is 4 tables of 100,000 x 64; W2 is 26 tables x 128 with Criteo's 26 categorical
  hash sizes (the Kaggle display-advertising set) capped at 200,000 rows; W4 is 13 tables of
  mixed shapes (:data:`W4_TABLES`): dims 8 to 256, rows 10 to 4,000,000, about 1.1 GB of fp32
  weights in all (small enough for both libraries' data-parallel copies on 2 ranks of one
  host); every dim is a multiple of 8, so each column-wise or grid plan of 2 ranks cuts it into
  blocks of a multiple of 4 (what the fused kernels take);
* batches: a global batch of ``world_size * batch_per_rank`` samples is drawn from the seed and
  rank ``r`` takes samples ``[r * b, (r + 1) * b)``; every feature's bag lengths are uniform in
  its table's range (W1, W2: one range for all; W4: from one id per bag for the 10-row table
  to 20-60 for a 256-wide one); W1's ids are uniform, W2's and W4's follow a Zipf law
  (exponent 1.05) whose hot ranks are scattered over the table by a fixed permutation (hashed
  ids, as in real traffic); W4 has 2,048 samples per rank;
* initial weights: table ``i`` is drawn uniformly from ``+-sqrt(1/rows)`` by a generator seeded
  with ``seed + 1000 + i`` (one table at a time, so a rank never holds two full copies);
* loss weights: a fixed ``[b, dim]`` random tensor per feature and rank; the loss of a step is
  ``sum_f sum(pooled_f * R_f) / b`` (an embedding-only step, as benchmarks.md's figures are).

Guarantees: the same (workload, seed, rank, world size) gives bit-identical tensors in any
process; nothing here imports embshard or TorchRec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Criteo Kaggle (DAC) categorical cardinalities, C1..C26.
CRITEO_HASH_SIZES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
W2_ROW_CAP = 200_000


@dataclass(frozen=True)
class Table:
    """One table: ``name`` is read by the single feature ``feature``; ``bag_lengths``, when
    given, replaces the workload's range of ids per bag for this feature."""

    name: str
    feature: str
    rows: int
    dim: int
    bag_lengths: tuple[int, int] | None = None


@dataclass(frozen=True)
class Batch:
    """One rank's local batch, in key order: ``lengths`` is ``[F * b]``, ``values`` the ids."""

    keys: tuple[str, ...]
    lengths: torch.Tensor
    values: torch.Tensor
    batch_size: int


@dataclass(frozen=True)
class Workload:
    """A distributed benchmark workload.

    Args:
        name: ``"W1"``, ``"W2"`` or ``"W4"``.
        tables: the tables, in config order.
        batch_per_rank: samples per rank and step.
        bag_lengths: inclusive range of ids per bag (of the tables that give none).
        zipf: Zipf exponent of the ids (``None``: uniform ids).
        seed: the seed every tensor is drawn from.
    """

    name: str
    tables: tuple[Table, ...]
    batch_per_rank: int
    bag_lengths: tuple[int, int]
    zipf: float | None = None
    seed: int = 0

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(t.feature for t in self.tables)

    def bag_range(self, index: int) -> tuple[int, int]:
        """The inclusive range of ids per bag of table ``index``'s feature."""
        return self.tables[index].bag_lengths or self.bag_lengths

    def initial_weight(self, index: int) -> torch.Tensor:
        """The full initial weight of table ``index`` (draw it, copy what you need, drop it)."""
        table = self.tables[index]
        gen = torch.Generator().manual_seed(self.seed + 1000 + index)
        bound = (1.0 / table.rows) ** 0.5
        return torch.empty(table.rows, table.dim).uniform_(-bound, bound, generator=gen)

    def batches(self, rank: int, world_size: int, count: int) -> list[Batch]:
        """``count`` local batches of ``rank`` (the same global batches on every rank)."""
        _check_rank(rank, world_size)
        gen = torch.Generator().manual_seed(self.seed)
        samplers = [self._sampler(i) for i in range(len(self.tables))]
        b = self.batch_per_rank
        ranges = [self.bag_range(i) for i in range(len(self.tables))]
        out = []
        for _ in range(count):
            lengths, values = [], []
            for sample, (lo, hi) in zip(samplers, ranges, strict=True):
                glob = torch.randint(lo, hi + 1, (world_size * b,), generator=gen)
                ids = sample(int(glob.sum()), gen)
                starts = torch.cumsum(glob, 0) - glob
                first, last = (
                    int(starts[rank * b]),
                    int(starts[rank * b] + glob[rank * b : (rank + 1) * b].sum()),
                )
                lengths.append(glob[rank * b : (rank + 1) * b])
                values.append(ids[first:last])
            out.append(Batch(self.keys, torch.cat(lengths), torch.cat(values), b))
        return out

    def loss_weights(self, rank: int) -> dict[str, torch.Tensor]:
        """Feature -> the fixed ``[batch_per_rank, dim]`` weights of this rank's loss."""
        gen = torch.Generator().manual_seed(self.seed + 7 + rank)
        return {
            t.feature: torch.randn(self.batch_per_rank, t.dim, generator=gen) for t in self.tables
        }

    def _sampler(self, index: int) -> Callable[[int, torch.Generator], torch.Tensor]:
        rows = self.tables[index].rows
        if self.zipf is None:

            def uniform(n: int, gen: torch.Generator) -> torch.Tensor:
                return torch.randint(0, rows, (n,), generator=gen)

            return uniform
        perm_gen = torch.Generator().manual_seed(self.seed + 500 + index)
        perm = torch.randperm(rows, generator=perm_gen)
        probs = torch.arange(1, rows + 1, dtype=torch.float64).pow_(-self.zipf)
        probs /= probs.sum()
        cdf = torch.cumsum(probs, 0)

        def sample(n: int, gen: torch.Generator) -> torch.Tensor:
            u = torch.rand(n, generator=gen, dtype=torch.float64)
            ranks = torch.searchsorted(cdf, u).clamp_(max=rows - 1)
            return perm[ranks]

        return sample


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")


def w1(seed: int = 0) -> Workload:
    """W1: 4 tables of 100,000 x 64, 10-30 uniform ids per bag, 1,024 samples per rank."""
    tables = tuple(Table(f"t{i}", f"f{i}", 100_000, 64) for i in range(4))
    return Workload("W1", tables, 1_024, (10, 30), None, seed)


def w2(seed: int = 0) -> Workload:
    """W2: 26 Criteo-like tables (capped at 200,000 rows) x 128, 1-40 Zipf ids, 512 per rank."""
    tables = tuple(
        Table(f"t{i}", f"f{i}", min(rows, W2_ROW_CAP), 128)
        for i, rows in enumerate(CRITEO_HASH_SIZES)
    )
    return Workload("W2", tables, 512, (1, 40), 1.05, seed)


# W4's tables: (rows, dim, ids per bag), from a one-hot 10-row table to 4,000,000 rows.
W4_TABLES = (
    (10, 8, (1, 1)),
    (100, 16, (1, 3)),
    (1_000, 32, (1, 10)),
    (10_000, 64, (5, 20)),
    (50_000, 128, (10, 30)),
    (100_000, 256, (5, 20)),
    (20_000, 256, (20, 60)),
    (300_000, 128, (5, 15)),
    (500_000, 64, (1, 5)),
    (1_000_000, 32, (1, 20)),
    (2_000_000, 16, (1, 10)),
    (4_000_000, 8, (1, 3)),
    (1_500_000, 48, (2, 8)),
)


def w4(seed: int = 0) -> Workload:
    """W4: 13 heterogeneous tables (:data:`W4_TABLES`), mixed bag lengths, Zipf ids, 2,048 per
    rank."""
    tables = tuple(
        Table(f"t{i}", f"f{i}", rows, dim, bags) for i, (rows, dim, bags) in enumerate(W4_TABLES)
    )
    return Workload("W4", tables, 2_048, (1, 60), 1.05, seed)


WORKLOADS = {"W1": w1, "W2": w2, "W4": w4}


def get(name: str, seed: int = 0) -> Workload:
    """The workload called ``name`` (``W1``, ``W2`` or ``W4``)."""
    try:
        return WORKLOADS[name.upper()](seed)
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; expected one of {sorted(WORKLOADS)}"
        ) from None
