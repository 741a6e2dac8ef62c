"""Bad checkpoints are refused on every rank, with an error naming what differs, model untouched.

Two ranks save a good checkpoint, then try to load damaged or unsuitable ones into a model
that trained differently: tables that differ (a missing table, other rows, another dim),
another optimizer, a missing shard file, a truncated one, one whose bytes are corrupt but
whose size is right (caught by the read, which goes into fresh buffers), a newer format
version, a directory that is no checkpoint. Each load must raise ``ValueError`` on both ranks
with the expected words, and the model's whole state (weights, optimizer state, dense
tensors, dense optimizer state) must be bit-identical before and after. A save over an
existing checkpoint is refused too, and ``optimizer=False`` loads the weights of a checkpoint
saved with another optimizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _ckpt import DIM, ROWS, full_state, make_dmp, same, train
from _mp import run_on_ranks

from embshard_dist.checkpoint.load import load_checkpoint
from embshard_dist.checkpoint.save import save_checkpoint
from embshard_dist.comm.collectives import barrier

OPTIMIZER = "rowwise_adagrad"


def _damage(good: Path, root: Path) -> dict[str, Path]:
    """Rank 0: copies of ``good``, each damaged one way."""
    out = {}
    for case in ("missing", "truncated", "corrupt", "newer"):
        out[case] = root / case
        shutil.copytree(good, out[case])
    (out["missing"] / "__1_0.distcp").unlink()
    shard = out["truncated"] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    shard = out["corrupt"] / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(64)
    shard.write_bytes(bytes(data))
    meta = out["newer"] / "embshard.json"
    content = json.loads(meta.read_text())
    content["version"] = 99
    meta.write_text(json.dumps(content))
    out["empty"] = root / "empty"
    out["empty"].mkdir()
    return out


CASES: list[tuple[str, dict[str, Any], str, list[str]]] = [
    ("good", {"rows": ROWS[:4]}, "rowwise_adagrad", ["t4.weight' of the checkpoint is not in"]),
    ("good", {"rows": (40, 50, 61, 30, 20)}, "rowwise_adagrad", ["61 x 8", "60 x 8"]),
    ("good", {"dim": 12}, "rowwise_adagrad", ["40 x 8", "40 x 12"]),
    ("good", {}, "adam", ["optimizer keeps states", "optimizer=False"]),
    ("missing", {}, "rowwise_adagrad", ["'__1_0.distcp' is missing"]),
    ("truncated", {}, "rowwise_adagrad", ["'__0_0.distcp' has", "truncated"]),
    ("corrupt", {}, "rowwise_adagrad", ["failed"]),
    ("newer", {}, "rowwise_adagrad", ["format version 99", "upgrade embshard"]),
    ("empty", {}, "rowwise_adagrad", ["no checkpoint at"]),
]


def _refusals(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    dmp = make_dmp(OPTIMIZER, "mixed")
    train(dmp, range(2))
    good = Path(root, "good")
    save_checkpoint(dmp, good, step=2)
    saved = full_state(dmp, OPTIMIZER)
    paths = _damage(good, Path(root)) if rank == 0 else {}
    barrier()
    paths = {c: Path(root, c) for c in ("missing", "truncated", "corrupt", "newer", "empty")}
    paths["good"] = good
    out: dict[str, Any] = {}
    for index, (case, shape, optimizer, _) in enumerate(CASES):
        model = make_dmp(optimizer, "mixed", seed=3, **shape)
        train(model, range(1))
        before = full_state(model, optimizer)
        try:
            load_checkpoint(model, paths[case])
            error = ""
        except ValueError as e:
            error = str(e)
        out[f"{index}:{case}"] = {
            "error": error,
            "changed": same(before, full_state(model, optimizer)),
        }
    try:
        save_checkpoint(dmp, good, step=9)
        out["save over"] = ""
    except ValueError as e:
        out["save over"] = str(e)
    model = make_dmp("adam", "row_wise", seed=3)
    load_checkpoint(model, good, optimizer=False)
    loaded = full_state(model, "adam")
    out["weights only"] = [
        k for k in loaded if ":" not in k and "/" not in k and not _bits_equal(loaded[k], saved[k])
    ]
    return out


def _bits_equal(a: Any, b: Any) -> bool:
    return bool((a == b).all())


def test_bad_checkpoints_are_refused_with_the_model_unchanged(tmp_path: Path) -> None:
    results = run_on_ranks(2, _refusals, str(tmp_path), timeout_s=120)
    for rank, found in enumerate(results):
        for index, (case, shape, optimizer, words) in enumerate(CASES):
            what = f"rank {rank}, {case} checkpoint into {shape or 'the same model'} ({optimizer})"
            result = found[f"{index}:{case}"]
            assert result["error"], f"{what}: was loaded"
            for word in words:
                assert word in result["error"], f"{what}: {word!r} not in {result['error']}"
            assert result["changed"] == [], f"{what}: the model changed in {result['changed']}"
        assert "exists" in found["save over"], found["save over"]
        assert found["weights only"] == []
    assert DIM == 8
