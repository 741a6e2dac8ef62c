"""``embshard train`` as a training job: Criteo-format data, evaluation, pipeline, logs, plot.

The jobs run on 2 real processes (gloo); evaluation is checked on real ranks against the state
gathered independently of the job (``_ckpt.full_state``).
"""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _ckpt import data, full_state, make_dmp, same, train
from _mp import run_on_ranks

from embshard_dist.cli import main
from embshard_dist.cli.job_data import JobBatch
from embshard_dist.cli.job_eval import evaluate
from embshard_dist.cli.job_step import ClickForward
from embshard_dist.cli.job_tensorboard import check_tensorboard
from embshard_dist.cli.progress import Progress
from embshard_dist.data.criteo_convert import preprocess_tsv
from embshard_dist.data.criteo_format import CriteoTransform
from embshard_dist.data.criteo_synth import write_synthetic_criteo

SMALL = ["--nproc", "2", "--device", "cpu", "--batch-size", "64", "--rows", "2000"]


def _train(tmp: Path, name: str, *argv: str) -> dict[str, Any]:
    summary = tmp / f"{name}.json"
    run_dir = tmp / name
    assert main(["train", *argv, "--run-dir", str(run_dir), "--json", str(summary)]) == 0
    result: dict[str, Any] = json.loads(summary.read_text())
    return result


# ---- the default job -----------------------------------------------------------------------


def test_default_job_learns_and_leaves_a_plot_and_a_log(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    summary = _train(tmp_path, "run")
    assert time.monotonic() - start < 60
    evals = summary["history"]["eval"]
    assert [e["step"] for e in evals] == [0, 25, 50, 75, 100]
    assert abs(evals[0]["auc"] - 0.5) < 0.1  # an untrained model ranks clicks at random
    assert evals[-1]["auc"] >= 0.70 and evals[-1]["ne"] < evals[0]["ne"]
    assert all(e["calibration"] > 0 and 0 <= e["accuracy"] <= 1 for e in evals)
    plot, log = Path(summary["plot"]), Path(summary["log"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    text = log.read_text()
    assert "step 100/100" in text and "eval  100/100 | held-out ne" in text
    out = capfd.readouterr().out
    assert f"plot: {plot}" in out and f"log: {log}" in out  # the summary names both
    assert "held-out: AUC" in out and "ETA" not in out  # not a terminal: plain lines, no bar
    assert (tmp_path / "run" / "data" / "day_0").is_file()  # the generated days, kept


# ---- evaluation leaves the model as it was -------------------------------------------------


def _evaluate_between_steps() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    source = data()
    held_out = [source.batch(step, rank, world) for step in range(100, 103)]
    batches = [JobBatch(b.dense, b.sparse, b.labels) for b in held_out]
    dmp = make_dmp("rowwise_adagrad", "mixed")
    train(dmp, range(2))
    before = full_state(dmp, "rowwise_adagrad")
    values = evaluate(dmp, ClickForward(dmp), batches)
    unchanged = same(before, full_state(dmp, "rowwise_adagrad"))
    training = dmp.training
    train(dmp, range(2, 4))
    straight = make_dmp("rowwise_adagrad", "mixed")
    train(straight, range(4))
    return {
        "changed": unchanged,
        "values": values,
        "training": training,
        "then_trains_alike": same(full_state(dmp, "rowwise_adagrad"), full_state(straight, "rowwise_adagrad")),
    }  # fmt: skip


def test_evaluation_changes_no_weight_and_no_optimizer_state() -> None:
    results = run_on_ranks(2, _evaluate_between_steps)
    for r in results:
        assert r["changed"] == []  # every table, its fused state, the dense layers and optimizer
        assert r["training"]  # train mode is back after evaluating
        assert r["then_trains_alike"] == []  # the next steps are those of a run without eval
    assert results[0]["values"] == results[1]["values"]  # reduced across ranks
    assert set(results[0]["values"]) == {"ne", "auc", "calibration", "accuracy", "loss"}


# ---- data sources and pipelines ------------------------------------------------------------


def test_tsv_and_npy_days_train_alike(tmp_path: Path) -> None:
    tsv, npy = tmp_path / "tsv", tmp_path / "npy"
    days = write_synthetic_criteo(tsv, days=2, rows_per_day=2048, seed=3)
    preprocess_tsv(days, npy, CriteoTransform.uniform(10_000))  # the job takes ids mod 2000
    argv = [*SMALL, "--steps", "6", "--eval-every", "3", "--eval-batches", "2"]
    from_tsv = _train(tmp_path, "tsv_run", *argv, "--data", f"criteo-tsv:{tsv}")
    from_npy = _train(tmp_path, "npy_run", *argv, "--data", f"criteo-npy:{npy}")
    assert from_tsv["loss_curve"] == from_npy["loss_curve"]  # the same batches, the same steps
    assert from_tsv["history"]["eval"] == from_npy["history"]["eval"]
    assert len(from_tsv["history"]["eval"]) == 3


def test_the_pipeline_gives_the_plain_loops_losses(tmp_path: Path) -> None:
    argv = [*SMALL, "--steps", "8", "--eval-every", "4", "--eval-batches", "2"]
    argv += ["--sharding", "t0=row_wise,t1=table_wise,t2=column_wise,t3=data_parallel"]
    argv += ["--synthetic-rows", "2048"]
    plain = _train(tmp_path, "plain", *argv, "--pipeline", "none")
    piped = _train(tmp_path, "piped", *argv, "--pipeline", "sparse-dist")
    assert piped["pipeline"] == "sparse-dist" and plain["pipeline"] == "none"
    assert piped["loss_curve"] == plain["loss_curve"]  # bit for bit, every step
    assert piped["history"]["eval"] == plain["history"]["eval"]


def test_a_table_spec_file_sets_the_tables(tmp_path: Path) -> None:
    spec = tmp_path / "tables.json"
    tables = [
        {"name": "ads", "rows": 3000, "dim": 8, "features": ["cat_0", "cat_1", "cat_2"]},
        {"name": "users", "rows": 500, "dim": 8, "features": ["cat_3"], "sharding_types": ["row_wise"]},
    ]  # fmt: skip
    spec.write_text(json.dumps({"tables": tables}))
    argv = [*SMALL, "--steps", "2", "--eval-every", "0", "--synthetic-rows", "1024"]
    summary = _train(tmp_path, "spec", *argv, "--tables", str(spec))
    chosen = summary["plan"]["modules"]["sparse_arch"]["tables"]
    assert set(chosen) == {"ads", "users"} and chosen["users"]["sharding_type"] == "row_wise"
    assert summary["history"]["eval"] == [] and summary["eval"] is None


def test_a_table_spec_with_an_unknown_feature_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "tables.json"
    spec.write_text(json.dumps({"tables": [{"name": "t", "rows": 9, "dim": 4, "features": ["x"]}]}))
    with pytest.raises(SystemExit) as info:
        main(["train", "--tables", str(spec)])
    assert info.value.code == 2
    assert "table 't' reads feature 'x', which the Criteo data lacks" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "parquet:/x"], "expected criteo-tsv:DIR, criteo-npy:DIR or synthetic"),
        (["--data", "criteo-tsv:/nonexistent"], "'/nonexistent' is not a folder"),
        (["--tables", "27"], "1 to 26 tables"),
        (["--tables", "nothing.json"], "no such file exists"),
        (["--pipeline", "semi"], "invalid choice: 'semi'"),
    ],
)
def test_bad_job_options_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_single_day_cannot_be_held_out(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    write_synthetic_criteo(tmp_path / "one", days=1, rows_per_day=256)
    argv = [*SMALL, "--steps", "1", "--data", f"criteo-tsv:{tmp_path / 'one'}"]
    assert main(["train", *argv, "--run-dir", str(tmp_path / "run")]) == 2
    assert "evaluation holds out the last day" in capfd.readouterr().out


def test_tensorboard_without_the_package_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if check_tensorboard() is None:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(SystemExit) as info:
        main(["train", "--tensorboard", "tb"])
    assert info.value.code == 2
    assert "--tensorboard needs the tensorboard package" in capsys.readouterr().err


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: synthetic)", "(default: sparse-dist)", "(default: 25)"):
        assert default in out


# ---- progress ------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_with_eta_on_a_terminal_only() -> None:
    logger = logging.getLogger("test_train_job.progress")
    logger.propagate = False
    lines = io.StringIO()
    logger.addHandler(logging.StreamHandler(lines))
    logger.setLevel(logging.INFO)
    terminal = _Terminal()
    bar = Progress(10, 0, logger, stream=terminal)
    bar.step(5)
    bar.report("step 5/10 | loss 0.5")
    bar.close()
    drawn = terminal.getvalue()
    assert "train [############............] 5/10" in drawn and "ETA" in drawn
    assert lines.getvalue() == "step 5/10 | loss 0.5\n"
    plain = io.StringIO()
    quiet = Progress(10, 0, logger, stream=plain)
    quiet.step(5)
    quiet.close()
    assert plain.getvalue() == ""  # not a terminal: no bar, only the report lines
