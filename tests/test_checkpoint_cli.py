"""The checkpoint commands on real sharded checkpoints: ``embshard train --resume``, export, import.

* ``embshard train --save-every 2 --checkpoint-dir DIR --async-save`` for 6 steps keeps the
  last two checkpoints; ``--resume DIR/step-00000004`` up to 6 steps gives steps 5 and 6 exactly the
  losses of the first run.
* ``embshard checkpoint export`` of a checkpoint two ranks saved under the mixed plan gives
  every table's whole weight and optimizer state, the dense tensors and the dense optimizer
  state, bit-identical to what the ranks held.
* ``embshard checkpoint import --prefix sparse_arch`` of an ``EmbeddingBagCollection``'s state
  dict (TorchRec's key names) loads into a sharded model with ``optimizer=False,
  dense=False``: the tables take the saved weights, the rest stays as it was; without those
  flags the load is refused, saying which flag to use.
* Bad checkpoint options exit with status 2 and a message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt import full_state, make_dmp, same, tables, train
from _mp import run_on_ranks

from embshard_dist.checkpoint.export import read_export
from embshard_dist.checkpoint.load import load_checkpoint
from embshard_dist.checkpoint.save import save_checkpoint
from embshard_dist.cli import main
from embshard_kernels.collections import EmbeddingBagCollection

TRAIN = [
    "train", "--nproc", "2", "--rows", "200", "--batch-size", "16", "--device", "cpu",
    "--optimizer", "adam", "--sharding", "t0=row_wise,t1=column_wise,t2=data_parallel",
    # small data and evaluations: 6 steps read 192 rows (no second epoch), as with the default
    "--synthetic-rows", "1024", "--eval-batches", "2",
]  # fmt: skip


def test_train_resumes_exactly(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    first = [*TRAIN, "--steps", "6", "--save-every", "2", "--checkpoint-dir", str(ckpts)]
    first.append("--async-save")
    assert main([*first, "--json", str(tmp_path / "first.json")]) == 0
    assert (ckpts / "latest").read_text().strip() == "step-00000006"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000004", "step-00000006"]
    resume = [*TRAIN, "--steps", "6", "--resume", str(ckpts / "step-00000004")]
    assert main([*resume, "--json", str(tmp_path / "resumed.json")]) == 0
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    straight = json.loads((tmp_path / "first.json").read_text())
    assert resumed["first_step"] == 4 and resumed["steps"] == 2
    assert resumed["loss_curve"] == straight["loss_curve"][4:]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--save-every", "2"], "--checkpoint-dir and --save-every go together"),
        (["--checkpoint-dir", "somewhere"], "--checkpoint-dir and --save-every go together"),
        (["--async-save"], "--async-save needs --checkpoint-dir"),
        (["--save-every", "0", "--checkpoint-dir", "x"], "expected a positive integer"),
    ],
)
def test_checkpoint_options_are_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_resume_from_no_checkpoint_exits_2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--nproc", "1", "--rows", "64", "--steps", "2", "--device", "cpu"]
    assert main([*argv, "--resume", str(tmp_path)]) == 2
    assert "embshard train: error: checkpoint load from" in capfd.readouterr().out


def _save_mixed(path: str) -> dict[str, torch.Tensor]:
    dmp = make_dmp("partial_rowwise_adam", "mixed")
    train(dmp, range(2))
    save_checkpoint(dmp, path, step=2)
    return full_state(dmp, "partial_rowwise_adam")


def test_export_of_a_sharded_checkpoint_is_the_whole_state(tmp_path: Path) -> None:
    state = run_on_ranks(2, _save_mixed, str(tmp_path / "ckpt"))[0]
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    exported = read_export(tmp_path / "out")
    renamed = {}
    for key, value in exported.items():
        kind, _, rest = key.partition("/")
        renamed[{"model": rest, "optim": rest, "dense_optim": f"dense:{rest}"}[kind]] = value
    assert same(state, renamed) == []


def _load_imported(path: str, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    dmp = make_dmp("rowwise_adagrad", "mixed", seed=9)
    train(dmp, range(1))
    before = full_state(dmp, "rowwise_adagrad")
    try:
        load_checkpoint(dmp, path)
        refused = ""
    except ValueError as e:
        refused = str(e)
    result = load_checkpoint(dmp, path, optimizer=False, dense=False)
    after = full_state(dmp, "rowwise_adagrad")
    tables_now = {k: v for k, v in after.items() if k.endswith(".weight") and "/" not in k}
    return {
        "refused": refused,
        "step": result.step,
        "rest_changed": same(
            {k: v for k, v in before.items() if k not in weights},
            {k: v for k, v in after.items() if k not in weights},
        ),
        "tables": same({k: v for k, v in tables_now.items() if k in weights}, weights),
    }


def test_an_imported_embedding_collection_loads_into_a_sharded_model(tmp_path: Path) -> None:
    torch.manual_seed(21)
    ebc = EmbeddingBagCollection(tables())
    torch.save(ebc.state_dict(), tmp_path / "ebc.pt")
    weights = {f"sparse_arch.{k}": v.detach().clone() for k, v in ebc.state_dict().items()}
    command = ["checkpoint", "import", str(tmp_path / "ebc.pt"), str(tmp_path / "ckpt")]
    assert main([*command, "--prefix", "sparse_arch"]) == 0
    for found in run_on_ranks(2, _load_imported, str(tmp_path / "ckpt"), weights):
        assert "optimizer=False" in found["refused"] and "dense=False" in found["refused"]
        assert found["step"] == 0
        assert found["tables"] == [] and found["rest_changed"] == []
