"""Checkpoints verified by checksum: a changed file or ``.metadata`` is refused everywhere, by name.

Two ranks save; copies are then changed in place without changing any size (bytes of rank 1's
shard file flipped; ``.metadata`` overwritten with noise). Loading either must raise
``ValueError`` on both ranks naming the file (and, for a shard file, a table it holds) with the
model bit-identical; ``embshard checkpoint inspect --verify`` must exit 1 and ``export`` exit 2,
each naming the file. A checkpoint from before checksums (its digests removed) still loads.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _ckpt import full_state, make_dmp, same, train
from _mp import run_on_ranks

from embshard_dist.checkpoint import load_checkpoint, save_checkpoint
from embshard_dist.cli import main

OPTIMIZER = "rowwise_adagrad"


def _flip_middle(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    file.write_bytes(bytes(data))


def _damage(good: Path, root: Path) -> None:
    shutil.copytree(good, root / "changed")
    _flip_middle(root / "changed" / "__1_0.distcp")
    shutil.copytree(good, root / "index")
    index = root / "index" / ".metadata"
    index.write_bytes(
        bytes(range(256)) * (index.stat().st_size // 256) + b"x" * (index.stat().st_size % 256)
    )
    shutil.copytree(good, root / "old")
    meta = root / "old" / "embshard.json"
    content = json.loads(meta.read_text())
    del content["checksums"]
    meta.write_text(json.dumps(content))


def _verify(root: str) -> dict[str, Any]:
    dmp = make_dmp(OPTIMIZER, "mixed")
    train(dmp, range(2))
    good = Path(root, "good")
    save_checkpoint(dmp, good, step=2)
    saved = full_state(dmp, OPTIMIZER)
    if dist.get_rank() == 0:
        _damage(good, Path(root))
    dist.barrier()
    out: dict[str, Any] = {}
    for case in ("changed", "index"):
        model = make_dmp(OPTIMIZER, "mixed", seed=3)
        before = full_state(model, OPTIMIZER)
        try:
            load_checkpoint(model, Path(root, case))
            out[case] = ""
        except ValueError as e:
            out[case] = str(e)
        out[f"{case} changed"] = same(before, full_state(model, OPTIMIZER))
    model = make_dmp(OPTIMIZER, "mixed", seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(model, Path(root, "old"))
    out["old differs"] = same(saved, full_state(model, OPTIMIZER))
    out["old warned"] = [str(w.message) for w in caught if "checksums" in str(w.message)]
    return out


def test_changed_files_are_refused_by_load_inspect_and_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = run_on_ranks(2, _verify, str(tmp_path), timeout_s=120)
    for rank, found in enumerate(results):
        assert "'__1_0.distcp' failed its checksum" in found["changed"], found["changed"]
        assert "table '" in found["changed"], found["changed"]
        assert "'.metadata'" in found["index"], found["index"]
        assert found["changed changed"] == [] and found["index changed"] == []
        assert found["old differs"] == [], f"rank {rank}: the old checkpoint loaded differently"
        assert len(found["old warned"]) == (1 if rank == 0 else 0), found["old warned"]

    assert main(["checkpoint", "inspect", "--verify", str(tmp_path / "good")]) == 0
    assert "verified: checksums (all match)" in capsys.readouterr().out
    for case, file in (("changed", "'__1_0.distcp'"), ("index", "'.metadata'")):
        assert main(["checkpoint", "inspect", "--verify", str(tmp_path / case)]) == 1
        assert file in capsys.readouterr().out
        out = tmp_path / f"export-{case}"
        assert main(["checkpoint", "export", str(tmp_path / case), str(out)]) == 2
        assert file in capsys.readouterr().err
        assert not out.exists()
