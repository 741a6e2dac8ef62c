"""The data of ``embshard train``: where it comes from, the held-out day, and per-rank batches.

``--data`` is ``criteo-tsv:DIR`` (``day_N`` TSV files), ``criteo-npy:DIR``
(``day_N_{dense,sparse,labels}.npy``) or ``synthetic`` (Criteo-format TSV days written by
``embshard data synth``'s generator into the run folder: a training day and a held-out day whose
clicks follow a hidden model of the features). The last day is held out for evaluation; the
other days are trained on, epoch after epoch.

Guarantees: each rank gets its own rows (``CriteoIterDataset``'s partition); training batches
are all full (``drop_last``), so step ``s`` reads the same rows whatever came before, and a
resumed run continues with step ``s``'s batch; batches carry TorchRec's ``Batch`` field names
(``dense_features``, ``sparse_features``, ``labels``) with the model's features in its order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from embshard_dist.data.criteo_convert import count_lines
from embshard_dist.data.criteo_dataset import CriteoIterDataset
from embshard_dist.data.criteo_format import DEFAULT_CAT_NAMES, CriteoTransform
from embshard_dist.data.criteo_npy import NpySource, find_npy_days
from embshard_dist.data.criteo_rows import RowSource
from embshard_dist.data.criteo_synth import write_synthetic_criteo
from embshard_dist.data.criteo_tsv import TsvSource, find_tsv_days
from embshard_dist.data.synthetic import Batch
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

__all__ = ["DataSpec", "JobBatch", "JobData", "parse_data_spec"]

KINDS = ("criteo-tsv", "criteo-npy", "synthetic")
T = TypeVar("T")


@dataclass(frozen=True)
class DataSpec:
    """A parsed ``--data`` value."""

    kind: str
    folder: str | None = None

    def __str__(self) -> str:
        return self.kind if self.folder is None else f"{self.kind}:{self.folder}"


def parse_data_spec(text: str) -> DataSpec:
    """Parse ``criteo-tsv:DIR``, ``criteo-npy:DIR`` or ``synthetic``.

    Raises:
        ValueError: another kind, a missing folder, or a folder without days of that format.
    """
    kind, sep, folder = text.partition(":")
    if kind == "synthetic" and not sep:
        return DataSpec("synthetic")
    if kind not in KINDS[:2] or not folder:
        raise ValueError(f"--data {text!r}: expected criteo-tsv:DIR, criteo-npy:DIR or synthetic")
    if not Path(folder).is_dir():
        raise ValueError(f"--data {text!r}: {folder!r} is not a folder")
    days = find_tsv_days(folder) if kind == "criteo-tsv" else find_npy_days(folder)
    if not days:
        pattern = "day_N" if kind == "criteo-tsv" else "day_N_{dense,sparse,labels}.npy"
        raise ValueError(f"--data {text!r}: no {pattern} files in {folder!r}")
    return DataSpec(kind, folder)


@dataclass(frozen=True)
class JobBatch:
    """One rank's batch, with TorchRec's ``Batch`` field names (what the pipeline reads)."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor


class JobData:
    """The training days and the held-out day of one source, with table sizes applied.

    Args:
        spec: the ``--data`` source (``synthetic``: the days must already be written, see
            :meth:`write_synthetic`).
        folder: where the synthetic days are (ignored for the other kinds).
        rows_per_feature: the table size of each of the 26 features (ids are taken modulo it).
        features: the features the model reads, in its order.
        eval_needed: hold the last day out for evaluation.

    Raises:
        ValueError: fewer than two days (nothing to hold out) when ``eval_needed``.
    """

    def __init__(
        self,
        spec: DataSpec,
        folder: str,
        rows_per_feature: Sequence[int],
        features: Sequence[str],
        *,
        eval_needed: bool,
    ) -> None:
        self.spec = spec
        where = spec.folder if spec.folder is not None else folder
        self.where = where
        self._order = [DEFAULT_CAT_NAMES.index(f) for f in features]
        sizes = tuple(rows_per_feature)
        self.held_out: RowSource | None = None
        if spec.kind == "criteo-npy":
            npy_train, npy_eval = _hold_out(find_npy_days(where), spec, where, eval_needed)
            npy = NpySource(where, days=npy_train, num_embeddings_per_feature=sizes)
            self.train: RowSource = npy
            self.train_rows = npy.num_rows
            if npy_eval:
                self.held_out = NpySource(where, days=npy_eval, num_embeddings_per_feature=sizes)
        else:
            transform = CriteoTransform(sizes)
            tsv_train, tsv_eval = _hold_out(find_tsv_days(where), spec, where, eval_needed)
            self.train = TsvSource(tsv_train, transform)
            self.train_rows = sum(count_lines(p) for p in tsv_train)
            if tsv_eval:
                self.held_out = TsvSource(tsv_eval, transform)

    @staticmethod
    def write_synthetic(folder: str | Path, *, rows: int, held_out_rows: int, seed: int) -> None:
        """Write the synthetic training day (``day_0``) and held-out day (``day_1``)."""
        write_synthetic_criteo(folder, days=1, rows_per_day=rows, seed=seed)
        held = Path(folder, "held_out")
        write_synthetic_criteo(held, days=2, rows_per_day=held_out_rows, seed=seed)
        # the generator draws each day from (seed, day): day 1 of a short run is a new day
        Path(held, "day_1").replace(Path(folder, "day_1"))
        Path(held, "day_0").unlink()
        held.rmdir()

    def train_batches(
        self, batch_size: int, rank: int, world_size: int, first_step: int
    ) -> Iterator[JobBatch]:
        """Training batches from step ``first_step`` on, endlessly (epoch after epoch).

        Raises:
            ValueError: the training days hold less than one global batch.
        """
        global_rows = batch_size * world_size
        per_epoch = self.train_rows // global_rows
        if per_epoch == 0:
            raise ValueError(
                f"--data {self.spec}: the training days hold {self.train_rows} rows, fewer than "
                f"one step's {global_rows} ({world_size} ranks x --batch-size {batch_size})"
            )
        dataset = CriteoIterDataset(
            self.train, batch_size, rank=rank, world_size=world_size, drop_last=True
        )
        epoch, skip = divmod(first_step, per_epoch)
        position = {"rows_consumed": skip * global_rows, "epoch": epoch}
        dataset.load_state_dict(dataset.state_dict() | position)
        while True:
            yield from (self._batch(b) for b in dataset)

    def held_out_batches(
        self, batch_size: int, rank: int, world_size: int, limit: int
    ) -> Iterator[JobBatch]:
        """The held-out day's batches (at most ``limit`` per rank; 0: all of them)."""
        if self.held_out is None:
            return
        dataset = CriteoIterDataset(self.held_out, batch_size, rank=rank, world_size=world_size)
        for i, batch in enumerate(dataset):
            if limit and i >= limit:
                return
            yield self._batch(batch)

    def _batch(self, batch: Batch) -> JobBatch:
        return JobBatch(
            dense_features=batch.dense,
            sparse_features=batch.sparse.permute(self._order),
            labels=batch.labels,
        )


def _hold_out(
    days: list[T], spec: DataSpec, where: str, eval_needed: bool
) -> tuple[list[T], list[T]]:
    """The training days and the held-out (last) day.

    Raises:
        ValueError: fewer than two days while evaluation needs one held out.
    """
    if eval_needed and len(days) < 2:
        raise ValueError(
            f"--data {spec}: {len(days)} day(s) in {where!r}; evaluation holds out the last "
            "day, so give at least two (or --eval-every 0 to train without evaluation)"
        )
    return (days[:-1], days[-1:]) if eval_needed else (days, [])
