"""Writes small Criteo-format TSV days whose labels follow a hidden model of the features.

The hidden model is logistic: a weight per (log of a) dense feature and per category value of
most categorical features, so a model trained on the files can learn the clicks (the true
probabilities' AUC is well above 0.5). Everything follows from ``seed``: the hidden model, and
per day the rows, so day ``N`` is the same whatever the number of days written. Missing fields
(empty) appear with probability ``missing_rate`` and count as 0 in the hidden model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from embshard_dist.data.criteo_format import CAT_FEATURE_COUNT, INT_FEATURE_COUNT


@dataclass(frozen=True)
class HiddenClickModel:
    """The model the labels are drawn from (exposed so tests can score it)."""

    dense_mu: npt.NDArray[np.float64]
    dense_w: npt.NDArray[np.float64]
    vocab: list[npt.NDArray[np.int64]]
    """Per categorical feature, its raw 32-bit category values."""
    cat_w: list[npt.NDArray[np.float64]]
    cat_p: list[npt.NDArray[np.float64]]
    bias: float

    @classmethod
    def from_seed(cls, seed: int, vocab_size: int) -> HiddenClickModel:
        rng = np.random.default_rng([seed, 0])
        vocab, cat_w, cat_p = [], [], []
        for j in range(CAT_FEATURE_COUNT):
            size = max(2, vocab_size >> (j % 4))
            vocab.append(rng.choice(1 << 32, size=size, replace=False).astype(np.int64))
            scale = 0.0 if j % 3 == 2 else 0.6  # a third of the features carry no signal
            cat_w.append(rng.normal(0.0, scale, size))
            p = 1.0 / np.arange(1, size + 1) ** 1.05
            cat_p.append(p / p.sum())
        return cls(
            dense_mu=rng.uniform(0.0, 3.0, INT_FEATURE_COUNT),
            dense_w=rng.normal(0.0, 0.35, INT_FEATURE_COUNT),
            vocab=vocab,
            cat_w=cat_w,
            cat_p=cat_p,
            bias=-1.2,
        )

    def sample_day(
        self, seed: int, day: int, rows: int, missing_rate: float
    ) -> tuple[
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
        npt.NDArray[np.bool_],
        npt.NDArray[np.int64],
        npt.NDArray[np.bool_],
        npt.NDArray[np.float64],
    ]:
        """labels, ints, ints missing, cats, cats missing, click probabilities of one day."""
        rng = np.random.default_rng([seed, 1, day])
        ints = np.floor(rng.lognormal(self.dense_mu, 1.0, (rows, INT_FEATURE_COUNT))).astype(
            np.int64
        )
        ints[:, 1] -= rng.integers(0, 2, rows) * 2  # the second feature goes negative, as Criteo's
        int_miss = rng.random((rows, INT_FEATURE_COUNT)) < missing_rate
        logx = np.log1p(np.maximum(np.where(int_miss, 0, ints), 0))
        logit = self.bias + ((logx - self.dense_mu) * self.dense_w).sum(axis=1)
        cats = np.zeros((rows, CAT_FEATURE_COUNT), dtype=np.int64)
        cat_miss = rng.random((rows, CAT_FEATURE_COUNT)) < missing_rate
        for j in range(CAT_FEATURE_COUNT):
            idx = rng.choice(len(self.vocab[j]), size=rows, p=self.cat_p[j])
            cats[:, j] = self.vocab[j][idx]
            logit += np.where(cat_miss[:, j], 0.0, self.cat_w[j][idx])
        prob = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(rows) < prob).astype(np.int64)
        return labels, ints, int_miss, cats, cat_miss, prob


def format_rows(
    labels: npt.NDArray[np.int64],
    ints: npt.NDArray[np.int64],
    int_miss: npt.NDArray[np.bool_],
    cats: npt.NDArray[np.int64],
    cat_miss: npt.NDArray[np.bool_],
) -> list[str]:
    """Criteo TSV lines (with newlines); missing fields are empty."""
    lines = []
    for i in range(len(labels)):
        fields = [str(int(labels[i]))]
        fields += ["" if m else str(int(v)) for v, m in zip(ints[i], int_miss[i], strict=True)]
        fields += ["" if m else f"{int(v):08x}" for v, m in zip(cats[i], cat_miss[i], strict=True)]
        lines.append("\t".join(fields) + "\n")
    return lines


def write_synthetic_criteo(
    out_dir: str | Path,
    *,
    days: int = 2,
    rows_per_day: int = 10_000,
    seed: int = 0,
    missing_rate: float = 0.05,
    vocab_size: int = 1000,
) -> list[Path]:
    """Write ``day_0`` .. ``day_{days-1}`` into ``out_dir``; returns their paths.

    Raises:
        ValueError: non-positive sizes or a missing rate outside [0, 1).
    """
    if days <= 0 or rows_per_day <= 0 or vocab_size < 2:
        raise ValueError(
            f"need days > 0, rows_per_day > 0 and vocab_size >= 2; got {days}, {rows_per_day}, "
            f"{vocab_size}"
        )
    if not 0.0 <= missing_rate < 1.0:
        raise ValueError(f"missing_rate must be in [0, 1), got {missing_rate}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = HiddenClickModel.from_seed(seed, vocab_size)
    paths = []
    for day in range(days):
        labels, ints, int_miss, cats, cat_miss, _ = model.sample_day(
            seed, day, rows_per_day, missing_rate
        )
        path = out / f"day_{day}"
        with open(path, "w", encoding="ascii", newline="\n") as f:
            f.writelines(format_rows(labels, ints, int_miss, cats, cat_miss))
        paths.append(path)
    return paths
