"""``embshard train`` as a training job: Criteo-format data, evaluation, pipeline, logs, plot.

The jobs run on 2 real processes (gloo); evaluation is checked on real ranks against the state
gathered independently of the job (``_ckpt.full_state``).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _ckpt import data, full_state, make_dmp, same, train
from _default_job import default_job
from _mp import run_on_ranks

from embshard_dist.cli import main
from embshard_dist.cli.job_data import JobBatch
from embshard_dist.cli.job_eval import evaluate
from embshard_dist.cli.job_step import ClickForward
from embshard_dist.cli.progress import Progress
from embshard_dist.data.criteo_convert import preprocess_tsv
from embshard_dist.data.criteo_format import CriteoTransform
from embshard_dist.data.criteo_synth import write_synthetic_criteo
from embshard_dist.train_pipeline import EvalPipelineSparseDist

SMALL = ["--nproc", "2", "--device", "cpu", "--batch-size", "64", "--rows", "2000"]


def _train(tmp: Path, name: str, *argv: str) -> dict[str, Any]:
    summary = tmp / f"{name}.json"
    run_dir = tmp / name
    assert main(["train", *argv, "--run-dir", str(run_dir), "--json", str(summary)]) == 0
    result: dict[str, Any] = json.loads(summary.read_text())
    return result


# ---- the default job -----------------------------------------------------------------------


def test_default_job_learns_and_leaves_a_plot_and_a_log(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    job = default_job(tmp_path_factory)  # `embshard train --json FILE`, shared with test_train_cli
    assert job.code == 0, job.out[-3000:]
    assert job.seconds < 60
    summary = job.summary
    evals = summary["history"]["eval"]
    assert [e["step"] for e in evals] == [0, 25, 50, 75, 100]
    assert abs(evals[0]["auc"] - 0.5) < 0.1  # an untrained model ranks clicks at random
    assert evals[-1]["auc"] >= 0.70 and evals[-1]["ne"] < evals[0]["ne"]
    assert all(e["calibration"] > 0 and 0 <= e["accuracy"] <= 1 for e in evals)
    plot, log = Path(summary["plot"]), Path(summary["log"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    text = log.read_text()
    assert "step 100/100" in text and "eval  100/100 | held-out ne" in text
    out = job.out
    assert f"plot: {plot}" in out and f"log: {log}" in out  # the summary names both
    assert "held-out: AUC" in out and "ETA" not in out  # not a terminal: plain lines, no bar
    run_dir = Path(summary["run_dir"])
    assert run_dir.parent == (job.cwd / "runs").resolve()  # the default: a new folder in ./runs
    assert (run_dir / "data" / "day_0").is_file()  # the generated days, kept


# ---- evaluation leaves the model as it was -------------------------------------------------


def _evaluate_between_steps() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    source = data()
    held_out = [source.batch(step, rank, world) for step in range(100, 103)]
    batches = [JobBatch(b.dense, b.sparse, b.labels) for b in held_out]
    dmp = make_dmp("rowwise_adagrad", "mixed")
    train(dmp, range(2))
    before = full_state(dmp, "rowwise_adagrad")
    forward = ClickForward(dmp)
    values = evaluate(dmp, forward, batches)
    pipeline = EvalPipelineSparseDist(dmp, dmp.optimizer(), "cpu", custom_model_fwd=forward)
    pipelined = [evaluate(dmp, forward, batches, pipeline) for _ in range(2)]  # reused
    unchanged = same(before, full_state(dmp, "rowwise_adagrad"))
    training = dmp.training
    train(dmp, range(2, 4))
    straight = make_dmp("rowwise_adagrad", "mixed")
    train(straight, range(4))
    return {
        "changed": unchanged,
        "values": values,
        "pipelined": pipelined,
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
    for r in results:  # the eval pipeline gives the plain forwards' metrics, each time
        assert r["pipelined"] == [r["values"], r["values"]]
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
    # Semi-synchronous from batch 4: batch 5 is the first looked up before the previous
    # backward, so the losses of steps 0-4 are the plain loop's and the later ones are not.
    semi = _train(
        tmp_path, "semi", *argv, "--pipeline", "semi-sync", "--semi-sync-start-batch", "4"
    )
    assert semi["pipeline"] == "semi-sync"
    assert semi["loss_curve"][:5] == plain["loss_curve"][:5]
    assert semi["loss_curve"][5:] != plain["loss_curve"][5:]


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
        (
            ["--pipeline", "semi-sync", "--accumulate-grad-batches", "2"],
            "--accumulate-grad-batches needs --pipeline sparse-dist or none",
        ),
        (["--semi-sync-start-batch", "3"], "applies to --pipeline semi-sync only"),
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
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for module in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)  # the package, as if not installed
    with pytest.raises(SystemExit) as info:
        main(["train", "--tensorboard", "tb"])
    assert info.value.code == 2
    assert "--tensorboard needs the tensorboard package" in capsys.readouterr().err


# ---- one small job: TensorBoard scalars, and the table style of what the commands print -----

TB_STEPS, TB_WINDOW, TB_EVAL_EVERY = 4, 2, 2


@pytest.fixture(scope="module")
def small_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data-parallel-only job's folder, with ``tb/`` and a checkpoint in ``ckpt/``."""
    root = tmp_path_factory.mktemp("small_job")
    argv = [*SMALL, "--steps", str(TB_STEPS), "--log-every", str(TB_WINDOW)]
    argv += ["--eval-every", str(TB_EVAL_EVERY), "--eval-batches", "2", "--synthetic-rows", "1024"]
    argv += ["--sharding", "data_parallel", "--tensorboard", str(root / "tb")]
    argv += ["--checkpoint-dir", str(root / "ckpt"), "--save-every", str(TB_STEPS)]
    _train(root, "run", *argv)
    return root


def test_tensorboard_gets_the_train_and_eval_scalars(small_job: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(small_job / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    summary = json.loads((small_job / "run.json").read_text())
    for phase, steps, history in (
        ("train", list(range(TB_WINDOW, TB_STEPS + 1, TB_WINDOW)), summary["history"]["train"]),
        ("eval", list(range(0, TB_STEPS + 1, TB_EVAL_EVERY)), summary["history"]["eval"]),
    ):
        for name in ("loss", "ne", "auc"):
            scalars = events.Scalars(f"{phase}/{name}")
            assert f"{phase}/{name}" in tags and [e.step for e in scalars] == steps
            # the values the job reports (float32 in the event file)
            assert [e.value for e in scalars] == pytest.approx([h[name] for h in history])


def _table_layouts(text: str) -> list[list[int]]:
    """The column widths of each table in ``text``, checking each one's style on the way.

    The style: a header line, a rule of dashes per column joined by ``" | "``, then rows whose
    ``" | "`` separators stand exactly where the rule's do.
    """
    lines = text.splitlines()
    layouts = []
    for i, line in enumerate(lines):
        if not re.fullmatch(r"-+( \| -+)*", line):
            continue
        widths = [len(part) for part in line.split(" | ")]
        seps = [sum(widths[: j + 1]) + 3 * j for j in range(len(widths) - 1)]
        body = list(itertools.takewhile(bool, lines[i + 1 :]))
        assert body, f"a table without rows:\n{lines[i - 1]}\n{line}"
        for row in [lines[i - 1], *body]:
            assert all(row[p : p + 3] == " | " for p in seps), f"misaligned: {row!r}"
        layouts.append(widths)
    return layouts


def test_train_plan_and_inspect_print_tables_in_one_style(
    small_job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trained = (small_job / "run" / "train.log").read_text()  # what the console showed
    assert _table_layouts(trained)  # the plan
    assert "no sharded tables: every table is data-parallel" in trained
    assert "shard offsets" not in trained  # a data-parallel-only plan: no empty shard table

    spec = small_job / "tables.json"
    tables = [
        {"name": f"t{i}", "rows": 2000, "dim": 16, "features": [f"cat_{i}"],
         "sharding_types": ["data_parallel"]}
        for i in range(4)
    ]  # fmt: skip
    spec.write_text(json.dumps({"tables": tables}))
    assert main(["plan", "--tables", str(spec), "--out", str(small_job / "plan.json")]) == 0
    planned = capsys.readouterr().out
    assert len(_table_layouts(planned)) == 2  # per rank, per table
    assert re.search(r"\n {3}0 \| ", planned)  # numbers right-aligned: the rank column

    assert main(["checkpoint", "inspect", str(small_job / "ckpt")]) == 0
    inspected = capsys.readouterr().out
    assert len(_table_layouts(inspected)) == 2  # the tables, the plan they were saved with
    assert re.search(r"\.t0\.weight +\| 2000 \|  16 \| float32 ", inspected)  # right-aligned


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
