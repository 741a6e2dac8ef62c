"""Criteo readers, converter, synthetic generator, RandomRecDataset and ``embshard data``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embshard_dist.cli.data import run as data_cli
from embshard_dist.data.criteo_convert import preprocess_tsv
from embshard_dist.data.criteo_dataset import CriteoIterDataset
from embshard_dist.data.criteo_format import CriteoTransform, parse_lines
from embshard_dist.data.criteo_npy import NpySource
from embshard_dist.data.criteo_synth import HiddenClickModel, format_rows, write_synthetic_criteo
from embshard_dist.data.criteo_tsv import TsvSource, find_tsv_days
from embshard_dist.data.random_rec import RandomRecDataset

IDENTITY = CriteoTransform.uniform(1 << 32)  # cat_0 keeps the raw value: the line's number


def write_numbered_days(folder: Path, rows: list[int], seed: int = 3) -> list[Path]:
    """Synthetic days whose cat_0 is the line's global number; other fields may be missing."""
    model = HiddenClickModel.from_seed(seed, 50)
    paths, first = [], 0
    for day, n in enumerate(rows):
        labels, ints, im, cats, cm, _ = model.sample_day(seed, day, n, missing_rate=0.2)
        cats[:, 0], cm[:, 0] = np.arange(first, first + n), False
        path = folder / f"day_{day}"
        path.write_text("".join(format_rows(labels, ints, im, cats, cm)))
        paths.append(path)
        first += n
    return paths


def all_batches(ds: CriteoIterDataset) -> list:
    return list(ds)


def line_ids(batch) -> list[int]:
    return batch.sparse.values()[: batch.labels.numel()].tolist()  # cat_0's values come first


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.dense, y.dense, rtol=0, atol=0)
        torch.testing.assert_close(x.labels, y.labels, rtol=0, atol=0)
        assert x.sparse.keys() == y.sparse.keys()
        assert torch.equal(x.sparse.values(), y.sparse.values())
        assert torch.equal(x.sparse.lengths(), y.sparse.lengths())


def test_synth_is_deterministic_has_missing_fields_and_learnable_labels(tmp_path: Path) -> None:
    a = write_synthetic_criteo(tmp_path / "a", days=2, rows_per_day=3000, seed=7)
    b = write_synthetic_criteo(tmp_path / "b", days=1, rows_per_day=3000, seed=7)
    c = write_synthetic_criteo(tmp_path / "c", days=1, rows_per_day=3000, seed=8)
    assert a[0].read_bytes() == b[0].read_bytes()
    assert a[0].read_bytes() != c[0].read_bytes()
    lines = a[0].read_text().splitlines()
    assert len(lines) == 3000 and all(len(x.split("\t")) == 40 for x in lines)
    assert any("\t\t" in x for x in lines)
    labels, *_, prob = HiddenClickModel.from_seed(7, 1000).sample_day(7, 0, 3000, 0.05)
    raw = parse_lines(lines)
    assert np.array_equal(raw.labels, labels)
    pos, neg = prob[labels == 1], prob[labels == 0]
    auc = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        len(pos) * len(neg)
    )
    assert auc > 0.8  # the hidden model explains the clicks


def test_missing_fields_read_as_zero_and_transforms(tmp_path: Path) -> None:
    line = "\t".join(["1", "", "-3", "4"] + [""] * 10 + ["ff"] + [""] * 25) + "\n"
    raw = parse_lines([line])
    assert raw.labels.tolist() == [1]
    assert raw.ints[0, :3].tolist() == [0, -3, 4] and raw.ints[0, 3:].sum() == 0
    assert raw.cats[0, 0] == 255 and raw.cats[0, 1:].sum() == 0
    t = CriteoTransform.uniform(10)
    assert np.allclose(t.dense(raw.ints)[0, :3], np.log1p([0, 0, 4]))
    assert t.sparse(raw.cats)[0, 0] == 5
    hashed = CriteoTransform.uniform(10, hash_mode="hash").sparse(raw.cats)
    assert hashed.min() >= 0 and hashed.max() < 10


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "day_0"
    good = "0" + "\t" * 39 + "\n"
    path.write_text(good * 3 + "0\t1\n")
    with pytest.raises(ValueError, match=r"day_0, line 4: expected 40"):
        list(CriteoIterDataset(TsvSource([path], IDENTITY), batch_size=2))


def test_single_rank_reads_every_line_once_in_order(tmp_path: Path) -> None:
    paths = write_numbered_days(tmp_path, [7, 6])  # 13 rows: batches of 4 cut across files
    batches = all_batches(CriteoIterDataset(TsvSource(paths, IDENTITY), batch_size=4))
    assert [len(b.labels) for b in batches] == [4, 4, 4, 1]
    assert [i for b in batches for i in line_ids(b)] == list(range(13))
    dropped = all_batches(
        CriteoIterDataset(TsvSource(paths, IDENTITY), batch_size=4, drop_last=True)
    )
    assert [len(b.labels) for b in dropped] == [4, 4, 4]


def test_partition_of_two_ranks_with_remainder(tmp_path: Path) -> None:
    paths = write_numbered_days(
        tmp_path, [11]
    )  # global batch 6: one full, then 5 -> 2 + 2, 1 dropped
    got = [
        all_batches(CriteoIterDataset(TsvSource(paths, IDENTITY), 3, rank=r, world_size=2))
        for r in range(2)
    ]
    assert [line_ids(b) for b in got[0]] == [[0, 1, 2], [6, 7]]
    assert [line_ids(b) for b in got[1]] == [[3, 4, 5], [8, 9]]


@pytest.mark.parametrize("hash_mode", ["mod", "hash"])
@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2), (2, 3)])
def test_npy_path_gives_the_tsv_batches(
    tmp_path: Path, hash_mode: str, rank: int, world_size: int
) -> None:
    paths = write_synthetic_criteo(
        tmp_path / "tsv", days=2, rows_per_day=250, seed=1, missing_rate=0.1
    )
    sizes = tuple(50 + 7 * j for j in range(26))
    transform = CriteoTransform(sizes, hash_mode=hash_mode)  # type: ignore[arg-type]
    preprocess_tsv(paths, tmp_path / "npy", transform, chunk_rows=64)
    kw = {"rank": rank, "world_size": world_size}
    from_tsv = all_batches(CriteoIterDataset(TsvSource(paths, transform), 32, **kw))
    from_npy = all_batches(CriteoIterDataset(NpySource(tmp_path / "npy"), 32, **kw))
    assert len(from_tsv) == -(-500 // (32 * world_size)) or len(from_tsv) == 500 // (
        32 * world_size
    )
    assert_same_batches(from_tsv, from_npy)
    assert all(b.sparse.keys()[0] == "cat_0" and b.dense.dtype == torch.float32 for b in from_npy)


def test_npy_files_have_torchrec_layout(tmp_path: Path) -> None:
    paths = write_synthetic_criteo(tmp_path / "tsv", days=1, rows_per_day=100, seed=2)
    ((dense, sparse, labels),) = preprocess_tsv(
        paths, tmp_path / "npy", CriteoTransform.uniform(1000)
    )
    assert np.load(dense).shape == (100, 13) and np.load(dense).dtype == np.float32
    assert np.load(sparse).shape == (100, 26) and np.load(sparse).max() < 1000
    assert np.load(labels).shape == (100, 1) and set(np.unique(np.load(labels))) <= {0, 1}


def test_frequency_threshold_sends_rare_ids_to_row_zero(tmp_path: Path) -> None:
    paths = write_synthetic_criteo(
        tmp_path / "tsv", days=2, rows_per_day=400, seed=4, vocab_size=300
    )
    transform = CriteoTransform.uniform(5000)
    preprocess_tsv(paths, tmp_path / "plain", transform)
    preprocess_tsv(paths, tmp_path / "cut", transform, frequency_threshold=3)
    plain = np.concatenate([np.load(tmp_path / "plain" / f"day_{d}_sparse.npy") for d in (0, 1)])
    cut = np.concatenate([np.load(tmp_path / "cut" / f"day_{d}_sparse.npy") for d in (0, 1)])
    for j in range(26):
        ids, counts = np.unique(plain[:, j], return_counts=True)
        rare = set(ids[counts < 3].tolist())
        expect = np.where(np.isin(plain[:, j], list(rare)), 0, plain[:, j])
        assert np.array_equal(cut[:, j], expect), f"feature cat_{j}"
    assert (cut == 0).sum() > (plain == 0).sum()


@pytest.mark.parametrize("kind", ["tsv", "npy"])
def test_resume_continues_with_the_next_batch(tmp_path: Path, kind: str) -> None:
    paths = write_synthetic_criteo(tmp_path / "tsv", days=2, rows_per_day=130, seed=5)
    transform = CriteoTransform.uniform(97)
    preprocess_tsv(paths, tmp_path / "npy", transform)

    def make() -> CriteoIterDataset:
        src = TsvSource(paths, transform) if kind == "tsv" else NpySource(tmp_path / "npy")
        return CriteoIterDataset(src, 16, rank=1, world_size=2)

    whole = all_batches(make())
    first = make()
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    assert state["rows_consumed"] == 3 * 32
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), whole[3:])
    with pytest.raises(ValueError, match="version"):
        resumed.load_state_dict({"version": 99, "rows_consumed": 0, "epoch": 0})


def test_resume_past_the_data_is_refused(tmp_path: Path) -> None:
    paths = write_synthetic_criteo(tmp_path, days=1, rows_per_day=10, seed=6)
    ds = CriteoIterDataset(TsvSource(paths, IDENTITY), 4)
    ds.load_state_dict({"version": 1, "rows_consumed": 50, "epoch": 0})
    with pytest.raises(ValueError, match="hold only 10 rows"):
        list(ds)


def test_random_rec_dataset_follows_torchrec_arguments() -> None:
    kw = {
        "hash_sizes": [10, 1000],
        "ids_per_features": [3, 5],
        "num_dense": 4,
        "manual_seed": 1,
        "min_ids_per_features": [0, 5],
    }
    # TorchRec's positional order: keys, batch_size, hash_size, hash_sizes, ids_per_feature,
    # ids_per_features, num_dense, manual_seed, num_batches, num_generated_batches
    batches = list(
        RandomRecDataset(
            ["a", "b"], 8, 7, [10, 1000], 2, [3, 5], 4, 1, 5, 2, min_ids_per_features=[0, 5]
        )
    )
    assert len(batches) == 5 and batches[0] is batches[2] and batches[1] is not batches[0]
    b = batches[1]
    assert b.dense.shape == (8, 4) and b.labels.shape == (8,)
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    lengths = b.sparse.lengths().view(2, 8)
    assert lengths[0].max() <= 3 and bool((lengths[1] == 5).all())
    values = b.sparse.values()
    assert values[: int(lengths[0].sum())].max() < 10 and values.max() < 1000  # lists win
    again = list(RandomRecDataset(["a", "b"], 8, num_batches=1, num_generated_batches=2, **kw))
    assert torch.equal(again[0].sparse.values(), batches[0].sparse.values())
    fresh = list(RandomRecDataset(["a"], 4, num_batches=3, num_generated_batches=-1, manual_seed=0))
    assert not torch.equal(fresh[0].dense, fresh[1].dense)
    assert bool((fresh[0].sparse.lengths() == 2).all()) and fresh[0].sparse.values().max() < 100
    with pytest.raises(ValueError, match="hash_sizes has 1 entries for 2 keys"):
        RandomRecDataset(["a", "b"], 8, hash_sizes=[10])


def test_cli_synth_then_preprocess(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        data_cli(["synth", "--out", str(tmp_path / "raw"), "--days", "2", "--rows-per-day", "50"])
        == 0
    )
    assert [p.name for p in find_tsv_days(tmp_path / "raw")] == ["day_0", "day_1"]
    code = data_cli(
        [
            "preprocess",
            "--in",
            str(tmp_path / "raw"),
            "--out",
            str(tmp_path / "npy"),
            "--num-embeddings",
            "64",
            "--hash",
            "hash",
        ]
    )
    assert code == 0
    assert NpySource(tmp_path / "npy").num_rows == 100
    assert data_cli(["preprocess", "--in", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no day_N files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        data_cli(["preprocess", "--in", "a", "--out", "b", "--num-embeddings", "1,2"])
