"""``embshard train`` end to end, its options, and the launcher behind it (real processes)."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from _default_job import default_job
from _mp import require_devices, selected_backend

from embshard_dist.cli import main
from embshard_dist.cli.launch import default_backend, launch
from embshard_dist.comm.collectives import barrier
from embshard_types.vocab import ShardingType

ROOT = Path(__file__).resolve().parents[1]

# ---- the launcher ------------------------------------------------------------------------


def _report(folder: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    barrier()
    Path(folder, f"rank{rank}").write_text(
        f"{world} {dist.get_backend()} {os.environ['LOCAL_RANK']} {os.environ['MASTER_PORT']}"
    )
    return 0


def _rank1_fails(how: str, folder: str) -> int:
    if dist.get_rank() == 1:
        barrier()  # rank 0 has written its pid
        if how == "raise":
            raise ValueError("rank one gives up")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(how))
    Path(folder, "rank0.pid").write_text(str(os.getpid()))
    barrier()
    time.sleep(120)  # rank 0 never notices: the launcher must stop it
    return 0


def test_launch_runs_every_rank_in_one_group(tmp_path: Path) -> None:
    require_devices(2)
    backend = selected_backend()
    assert launch(_report, (str(tmp_path),), nproc=2, backend=backend, threads=1) == 0
    first, second = (tmp_path / "rank0").read_text(), (tmp_path / "rank1").read_text()
    assert first.split()[:2] == ["2", backend] and first.split()[2] == "0"
    assert second.split()[2] == "1" and first.split()[3] == second.split()[3]


@pytest.mark.parametrize(("how", "code"), [("raise", 1), ("3", 3), ("kill", 128 + signal.SIGKILL)])
def test_launch_propagates_a_failing_rank(
    how: str, code: int, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    others = set(multiprocessing.active_children())  # e.g. a pool of ranks other tests keep
    start = time.monotonic()
    args = (how, str(tmp_path))
    result = launch(_rank1_fails, args, nproc=2, backend="gloo", grace_s=1.0, threads=1)
    assert result == code  # 128 + S for a rank killed by signal S
    assert time.monotonic() - start < 60  # rank 0 was stopped, not waited for
    err = capfd.readouterr().err
    assert f"embshard: rank 1 failed with exit code {code}" in err
    assert "embshard: stopped ranks [0]" in err
    if how == "raise":
        assert "[rank 1] ValueError: rank one gives up" in err
        assert "[rank 1] Traceback (most recent call last):" in err
    # no leftovers: every rank is reaped, rank 0 (sleeping when rank 1 failed) included
    assert set(multiprocessing.active_children()) <= others
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "rank0.pid").read_text()), 0)


def test_launch_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nproc must be a positive int"):
        launch(_report, ("x",), nproc=0)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        launch(_report, ("x",), nproc=1, backend="mpi")


# ---- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sharding", "sideways"], "unknown ShardingType 'sideways'"),
        (["--sharding", "t7=row_wise"], r"--sharding names tables \['t7'\]"),
        (["--sharding", "t0=row_wise,t0=tw"], "names table 't0' twice"),
        (["--optimizer", "rmsprop"], "unknown optimizer name 'rmsprop'"),
        (["--nproc", "0"], "expected a positive integer"),
        (["--lr", "-1"], "learning_rate must be finite and >= 0.0"),
        (["--topology", "/nonexistent/topo.json"], "--topology: cannot read"),
        (["--plan", "/nonexistent/plan.json"], "--plan: cannot read"),
        (["--plan", "plan.json", "--sharding", "row_wise"], "--plan FILE and --sharding"),
    ],
)
def test_bad_options_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def _run(
    command: list[str], env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own session; on timeout kill the whole session (its ranks too)."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{command[:6]} did not finish in {timeout_s} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


# ---- the main job ------------------------------------------------------------------------


def test_default_run_trains_and_reports(tmp_path_factory: pytest.TempPathFactory) -> None:
    job = default_job(tmp_path_factory)  # `embshard train --json FILE`, shared with test_train_job
    assert job.code == 0, job.out[-3000:]
    assert job.seconds < 50
    out = job.out
    assert "param | sharding type | compute kernel | ranks" in out  # the plan, as a table
    device = "cuda" if default_backend(2) == "nccl" else "cpu"  # what --device auto picks
    summary = job.summary
    kinds = {t["sharding_type"] for t in summary["plan"]["modules"]["sparse_arch"]["tables"].values()}  # fmt: skip
    assert kinds and kinds <= {kind.value for kind in ShardingType}  # the cost-based planner's
    assert all(kind in out for kind in kinds)
    assert kinds == {"data_parallel"} or f"rank:1/{device}" in out
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(progress) == 10 and "steps/s | loss" in progress[-1]
    assert "samples/s" in out and "peak memory (RSS): rank 0" in out and "rank 1" in out
    assert summary["world_size"] == 2 and summary["steps"] == 100
    assert len(summary["loss_curve"]) == 100 and len(summary["peak_rss_mib"]) == 2
    assert summary["samples_per_s"] > 0
    assert summary["final_window_loss"] < summary["first_window_loss"]


def test_runs_under_torchrun(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    embshard = Path(sys.executable).with_name("embshard")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--no-python", str(embshard), "train",
        "--steps", "4", "--rows", "500", "--batch-size", "32", "--device", "cpu",
        "--synthetic-rows", "1024", "--eval-batches", "2",  # 4 steps read 256 rows
        "--sharding", "t0=row_wise,t1=data_parallel,t2=auto", "--optimizer", "adam",
        "--json", str(summary_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = _run(command, env, timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    kinds = {
        name: table["sharding_type"]
        for name, table in summary["plan"]["modules"]["sparse_arch"]["tables"].items()
    }
    # t0 and t1 pinned; t2 ("auto") and t3 (not named) chosen by the cost-based planner
    assert kinds["t0"] == "row_wise" and kinds["t1"] == "data_parallel"
    assert {kinds["t2"], kinds["t3"]} <= {kind.value for kind in ShardingType}
    assert done.stdout.count("module: sparse_arch") == 1  # only rank 0 prints


def test_a_plan_the_sharder_refuses_exits_2(capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--steps", "1", "--rows", "64", "--dim", "6", "--sharding", "column_wise"]
    assert main(argv) == 2
    captured = capfd.readouterr()
    assert captured.out.count("embshard train: error: module 'sparse_arch': table 't0'") == 1
    assert "multiple of 4" in captured.out and "Traceback" not in captured.err


def test_a_plan_file_is_used_as_it_is(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from embshard_types.parameter_sharding import ParameterSharding
    from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan

    tables = {
        "t0": ParameterSharding(ShardingType.ROW_WISE, "fused"),
        "t1": ParameterSharding(ShardingType.TABLE_WISE, "fused", ranks=[1]),
    }
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(
        ShardingPlan({"sparse_arch": EmbeddingModuleShardingPlan(tables)}).to_json()
    )
    summary_path = tmp_path / "summary.json"
    argv = ["train", "--tables", "2", "--steps", "3", "--plan", str(plan_path)]
    argv += ["--synthetic-rows", "2048", "--eval-batches", "2"]  # 3 steps read 1536 rows
    assert main([*argv, "--json", str(summary_path)]) == 0
    chosen = json.loads(summary_path.read_text())["plan"]["modules"]["sparse_arch"]["tables"]
    assert chosen["t0"]["sharding_type"] == "row_wise"
    assert chosen["t1"]["sharding_type"] == "table_wise" and chosen["t1"]["ranks"] == [1]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as info:
        main(["train", "--plan", str(bad)])
    assert info.value.code == 2 and "is not a ShardingPlan JSON" in capfd.readouterr().err
