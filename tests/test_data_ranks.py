"""The per-rank Criteo dataset on 1, 2 and 3 gloo ranks: every line of generated TSV days (with
missing values) is read by exactly one rank, except the stated remainder, and the ranks yield
the same number of batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from _mp import run_on_ranks

from embshard_dist.data.criteo_dataset import CriteoIterDataset
from embshard_dist.data.criteo_format import CriteoTransform
from embshard_dist.data.criteo_synth import HiddenClickModel, format_rows
from embshard_dist.data.criteo_tsv import TsvSource

ROWS = [301, 250]  # 551 lines in two days
BATCH = 16


def write_numbered_days(folder: Path) -> list[str]:
    model = HiddenClickModel.from_seed(11, 40)
    paths, first = [], 0
    for day, n in enumerate(ROWS):
        labels, ints, im, cats, cm, _ = model.sample_day(11, day, n, missing_rate=0.25)
        cats[:, 0], cm[:, 0] = np.arange(first, first + n), False  # cat_0: the line's number
        path = folder / f"day_{day}"
        path.write_text("".join(format_rows(labels, ints, im, cats, cm)))
        paths.append(str(path))
        first += n
    return paths


def _lines_of_rank(paths: list[str]) -> list[list[int]]:
    ds = CriteoIterDataset(TsvSource(paths, CriteoTransform.uniform(1 << 32)), BATCH)
    assert ds.rank == dist.get_rank()
    return [b.sparse.values()[: b.labels.numel()].tolist() for b in ds]


def _check(world: int, per_rank: list[list[list[int]]]) -> None:
    total = sum(ROWS)
    full, m = divmod(total, BATCH * world)
    remainder = m % world
    assert len({len(r) for r in per_rank}) == 1  # the same number of batches everywhere
    read = [i for rank in per_rank for batch in rank for i in batch]
    assert len(read) == len(set(read))  # no line twice
    assert sorted(read) == list(range(total - remainder))  # only the last m % world lines dropped
    assert all(len(b) == BATCH for rank in per_rank for b in rank[:full])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_line_is_read_once_across_ranks(tmp_path: Path, world: int) -> None:
    paths = write_numbered_days(tmp_path)
    if world == 1:
        ds = CriteoIterDataset(TsvSource(paths, CriteoTransform.uniform(1 << 32)), BATCH)
        per_rank = [[b.sparse.values()[: b.labels.numel()].tolist() for b in ds]]
    else:
        per_rank = run_on_ranks(world, _lines_of_rank, paths)
    _check(world, per_rank)
