"""``embshard train --accumulate-grad-batches K``: one optimizer step every K batches.

Two real ranks (gloo). The pipelined and the plain loop give the same losses bit for bit with
accumulation too (a short last window and an evaluation inside a window included); that a step
equals one on the concatenated batches is ``test_grad_accumulation_dist``'s. A checkpoint
interval that would fall inside an optimizer step and a K below 1 are refused before any rank
starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from embshard_dist.cli import main

ARGV = [
    *("--nproc", "2", "--device", "cpu", "--batch-size", "32", "--rows", "500"),
    *("--eval-batches", "1", "--synthetic-rows", "1024"),
    *("--sharding", "t0=row_wise,t1=table_wise,t2=column_wise,t3=data_parallel"),
]


def _train(tmp: Path, name: str, *argv: str) -> dict[str, Any]:
    summary = tmp / f"{name}.json"
    assert main(["train", *argv, "--run-dir", str(tmp / name), "--json", str(summary)]) == 0
    result: dict[str, Any] = json.loads(summary.read_text())
    return result


def test_accumulation_runs_alike_in_the_pipeline_and_the_plain_loop(tmp_path: Path) -> None:
    k2 = [*ARGV, "--accumulate-grad-batches", "2", "--steps", "5", "--eval-every", "3"]
    piped = _train(tmp_path, "piped", *k2, "--pipeline", "sparse-dist")
    plain = _train(tmp_path, "plain", *k2, "--pipeline", "none")
    assert len(piped["loss_curve"]) == 5  # steps count batches
    assert piped["loss_curve"] == plain["loss_curve"]  # bit for bit, every batch
    assert piped["history"]["eval"] == plain["history"]["eval"]
    assert piped["final_window_loss"] == plain["final_window_loss"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--accumulate-grad-batches", "4", "--checkpoint-dir", "ck", "--save-every", "6"],
            "--save-every 6 is not a multiple of --accumulate-grad-batches 4",
        ),
        (["--accumulate-grad-batches", "0"], "expected a positive integer, got 0"),
        (["--accumulate-grad-batches", "two"], "expected a positive integer, got 'two'"),
    ],
)
def test_bad_accumulation_options_exit_2(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", *options])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
