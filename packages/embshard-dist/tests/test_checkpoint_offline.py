"""The offline checkpoint tools (one process, no process group): export, import, inspect, CLI.

* Export streams: on a model of nine 8 MiB tables (72 MiB, 9x the largest table) the
  exporting process's peak resident memory (``VmHWM`` of ``/proc/self/status``, reset through
  ``/proc/self/clear_refs`` after a warm-up export) grows by one to two tables, not nine;
  the figure is printed (``pytest -s``) and recorded as a test property.
* Import round trips bit-exactly: a state dict saved from an ``EmbeddingBagCollection`` (keys
  ``embedding_bags.{table}.weight``, TorchRec's names) imports, exports back equal; an export
  imports and exports again equal.
* Bad inputs are refused with a ``ValueError`` saying what is wrong, and nothing is written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from embshard_dist.checkpoint.export import export_checkpoint, read_export
from embshard_dist.checkpoint.format import CheckpointMetadata, read_metadata
from embshard_dist.checkpoint.import_ import import_state_dict
from embshard_dist.checkpoint.inspect import format_inspection, inspect_checkpoint
from embshard_dist.cli import main
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.configs import EmbeddingBagConfig

ROWS, DIM, TABLES = 16384, 128, 9
TABLE_BYTES = ROWS * DIM * 4

_MEASURE = textwrap.dedent(
    """
    import json, re, sys, tempfile
    from pathlib import Path
    import torch
    from embshard_dist.checkpoint.export import export_checkpoint
    from embshard_dist.checkpoint.import_ import import_state_dict

    def status():
        text = open("/proc/self/status").read()
        return {k: int(re.search(k + r":\\s+(\\d+) kB", text).group(1)) * 1024
                for k in ("VmRSS", "VmHWM")}

    with tempfile.TemporaryDirectory() as tmp:  # warm up: the same code on a tiny checkpoint
        torch.save({"embedding_bags.w.weight": torch.zeros(4, 4)}, Path(tmp, "w.pt"))
        import_state_dict(Path(tmp, "w.pt"), Path(tmp, "ckpt"))
        export_checkpoint(Path(tmp, "ckpt"), Path(tmp, "out"))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident size
        reset = True
    except OSError:
        reset = False
    before = status()
    export_checkpoint(sys.argv[1], sys.argv[2])
    after = status()
    base = before["VmRSS"] if reset else before["VmHWM"]
    print(json.dumps({"growth": after["VmHWM"] - base, "reset": reset}))
    """
)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint imported from a state dict of nine 8 MiB tables."""
    root = tmp_path_factory.mktemp("offline")
    gen = torch.Generator().manual_seed(0)
    state = {
        f"embedding_bags.t{i}.weight": torch.randn(ROWS, DIM, generator=gen) for i in range(TABLES)
    }
    torch.save(state, root / "ebc.pt")
    import_state_dict(root / "ebc.pt", root / "ckpt")
    return root, state


def _ebc_state(path: Path) -> dict[str, torch.Tensor]:
    """An embshard EmbeddingBagCollection's state dict saved to ``path`` (TorchRec's keys)."""
    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name="small", num_embeddings=10, embedding_dim=4),
            EmbeddingBagConfig(name="big", num_embeddings=30, embedding_dim=8),
        ]
    )
    state = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
    torch.save(ebc.state_dict(), path)
    return state


def test_export_streams_one_table_at_a_time(
    big: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    record_property: Any,
) -> None:
    root, state = big
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert total >= 8 * TABLE_BYTES
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(root / "ckpt"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])["growth"]
    ratio = growth / TABLE_BYTES
    record_property("export_peak_rss_growth_mib", growth / 2**20)
    record_property("export_peak_rss_growth_over_largest_table", ratio)
    print(
        f"\nexport of {total / 2**20:.0f} MiB ({TABLES} tables of {TABLE_BYTES / 2**20:.0f} MiB): "
        f"peak RSS grew {growth / 2**20:.1f} MiB = {ratio:.2f}x the largest table"
    )
    # one table being read, plus at most about one more that the C allocator may keep from
    # the table before (glibc raises its mmap threshold after a large free)
    assert ratio <= 2.25, f"peak RSS grew {ratio:.2f}x the largest table"
    exported = read_export(tmp_path / "out")
    for key, tensor in state.items():
        assert torch.equal(exported[f"model/{key}"], tensor), key


def test_import_round_trips_bit_exactly(tmp_path: Path) -> None:
    state = _ebc_state(tmp_path / "ebc.pt")
    meta = import_state_dict(tmp_path / "ebc.pt", tmp_path / "ckpt", prefix="sparse_arch", step=7)
    assert {t.key for t in meta.tables} == {
        "sparse_arch.embedding_bags.small.weight",
        "sparse_arch.embedding_bags.big.weight",
    }
    assert meta.step == 7 and not meta.has_optimizer and meta.world_size == 1
    assert read_metadata(tmp_path / "ckpt") == meta
    export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    first = read_export(tmp_path / "export")
    assert set(first) == {f"model/sparse_arch.{k}" for k in state}
    for key, tensor in state.items():
        assert torch.equal(first[f"model/sparse_arch.{key}"], tensor), key
    import_state_dict(tmp_path / "export", tmp_path / "again")
    assert read_metadata(tmp_path / "again").step == 7
    export_checkpoint(tmp_path / "again", tmp_path / "export2")
    second = read_export(tmp_path / "export2")
    assert set(second) == set(first)
    for key in first:
        assert torch.equal(first[key], second[key]), key


def _write(path: Path, value: Any) -> Path:
    torch.save(value, path)
    return path


def test_bad_imports_are_refused_and_write_nothing(tmp_path: Path) -> None:
    table = {"embedding_bags.t.weight": torch.zeros(4, 4)}
    cases = [
        (tmp_path / "absent.pt", "no such file"),
        (_write(tmp_path / "list.pt", [torch.zeros(2)]), "not a state dict"),
        (_write(tmp_path / "mixed.pt", {**table, "extra": 3}), "entries ['extra'] are not tensors"),
        (_write(tmp_path / "dense.pt", {"linear.weight": torch.zeros(2, 2)}), "no embedding table"),
        (_write(tmp_path / "flat.pt", {"embedding_bags.t.weight": torch.zeros(4)}), "1-D"),
        (
            _write(tmp_path / "ints.pt", {"embedding_bags.t.weight": torch.zeros(4, 4).long()}),
            "int64",
        ),
        (tmp_path / "garbage.pt", "torch.load failed"),
    ]
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    for index, (source, words) in enumerate(cases):
        out = tmp_path / f"out{index}"
        with pytest.raises(ValueError) as info:
            import_state_dict(source, out)
        assert words in str(info.value), (source, str(info.value))
        assert not out.exists() and not list(tmp_path.glob(f".out{index}.tmp-*"))
    good = _write(tmp_path / "good.pt", table)
    import_state_dict(good, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="the path exists"):
        import_state_dict(good, tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    with pytest.raises(ValueError, match="prefix applies to a state-dict file"):
        import_state_dict(tmp_path / "export", tmp_path / "x", prefix="model")


def _damaged(tmp_path: Path) -> dict[str, Path]:
    """Checkpoints damaged one way each (and one that is fine)."""
    source = _write(tmp_path / "src.pt", {"embedding_bags.t.weight": torch.randn(64, 8)})
    out = {}
    for name in ("fine", "truncated", "missing", "newer"):
        out[name] = tmp_path / name
        import_state_dict(source, out[name])
    shard = out["truncated"] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    (out["missing"] / "__0_0.distcp").unlink()
    meta = out["newer"] / "embshard.json"
    content = json.loads(meta.read_text())
    content["version"] = 2
    meta.write_text(json.dumps(content))
    out["not a checkpoint"] = tmp_path / "src.pt"
    out["empty"] = tmp_path / "empty"
    out["empty"].mkdir()
    return out


def test_bad_checkpoints_are_refused_by_export_and_flagged_by_inspect(tmp_path: Path) -> None:
    paths = _damaged(tmp_path)
    expected = {
        "truncated": "were written: it was truncated",
        "missing": "'__0_0.distcp' is missing",
        "newer": "format version 2, newer",
        "not a checkpoint": "not a directory",
        "empty": "holds neither embshard.json",
    }
    for name, words in expected.items():
        out = tmp_path / f"export-{name.replace(' ', '-')}"
        with pytest.raises(ValueError) as info:
            export_checkpoint(paths[name], out)
        assert words in str(info.value), (name, str(info.value))
        assert not out.exists()
    with pytest.raises(ValueError, match="the path exists"):
        export_checkpoint(paths["fine"], paths["missing"])
    assert inspect_checkpoint(paths["fine"])["problems"] == []
    problems = inspect_checkpoint(paths["truncated"])["problems"]
    assert len(problems) == 1 and "truncated" in problems[0]
    assert "PROBLEMS" in format_inspection(inspect_checkpoint(paths["missing"]))


def test_cli_inspect_export_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _ebc_state(tmp_path / "ebc.pt")
    assert main(["checkpoint", "import", str(tmp_path / "ebc.pt"), str(tmp_path / "ckpt")]) == 0
    assert "imported 2 tables and 0 dense tensors" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 0
    text = capsys.readouterr().out
    assert "embedding_bags.big.weight" in text and "unsharded" in text
    assert re.search(r"big\.weight +\| +30 \| +8 \| float32 ", text)  # numbers right-aligned
    assert main(["checkpoint", "inspect", "--json", str(tmp_path / "ckpt")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 0 and info["world_size"] == 1 and len(info["tables"]) == 2
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert "exported 2 tensors" in capsys.readouterr().out
    exported = read_export(tmp_path / "out")
    assert all(torch.equal(exported[f"model/{k}"], v) for k, v in state.items())
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "embshard checkpoint export: error:" in capsys.readouterr().err
    (tmp_path / "ckpt" / "__0_0.distcp").unlink()
    assert main(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 1
    assert "is missing" in capsys.readouterr().out


def test_metadata_json_round_trip(big: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, _ = big
    meta = read_metadata(root / "ckpt")
    assert CheckpointMetadata.from_json(meta.to_json(), where="test") == meta
    with pytest.raises(ValueError, match="not valid JSON"):
        CheckpointMetadata.from_json("{", where="x")
    with pytest.raises(ValueError, match="malformed"):
        CheckpointMetadata.from_json(
            json.dumps({"format": "embshard-checkpoint", "version": 1}), where="x"
        )
