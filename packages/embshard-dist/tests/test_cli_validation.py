"""The ``embshard`` command refuses bad options and specs with one clear message and exit
status 2, before any planning, measuring or process start."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from embshard_dist.cli import main
from embshard_dist.planner.calibration.calibrate import calibrate
from embshard_dist.planner.spec import parse_table_spec
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan


def _refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``embshard argv``; it must exit 2 through argparse with ``message`` on stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert re.search(message, err), err
    assert "Traceback" not in err
    return err


def _spec(tmp_path: Path, tables: list[dict[str, object]], **top: object) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"tables": tables, **top}))
    return str(path)


# ---- embshard plan -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--world-size", "0"], "argument --world-size: expected a positive integer, got 0"),
        (["--world-size", "two"], "argument --world-size: expected a positive integer, got 'two'"),
        (["--local-world-size", "-1"], "argument --local-world-size: expected a positive integer"),
        (
            ["--world-size", "4", "--local-world-size", "3"],
            "--local-world-size 3 must divide --world-size 4",
        ),
        (["--batch-size", "0"], "argument --batch-size: expected a positive integer, got 0"),
        (["--reserve", "1.5"], r"argument --reserve: expected a number in \[0, 1\), got 1.5"),
        (["--reserve", "nan"], r"argument --reserve: expected a number in \[0, 1\)"),
        (["--search", "random"], "argument --search: invalid choice: 'random'"),
    ],
)
def test_plan_refuses_bad_numbers(
    options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, [{"name": "t", "rows": 100, "dim": 8}])
    out = tmp_path / "plan.json"
    _refused(["plan", "--tables", spec, "--out", str(out), *options], message, capsys)
    assert not out.exists()


def test_plan_refuses_an_output_folder_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, [{"name": "t", "rows": 100, "dim": 8}])
    out = tmp_path / "missing" / "plan.json"
    _refused(["plan", "--tables", spec, "--out", str(out)], "--out: folder .*missing", capsys)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"features": "user_id"},
            "table 't': field 'features' must be a list of feature names, got the string "
            "'user_id'; write \\['user_id'\\]",
        ),
        (
            {"features": ["a", 3]},
            "table 't': field 'features' must be a list of feature names, but it holds 3",
        ),
        ({"ranks": "01"}, "table 't': field 'ranks' must be a list of integers, got the string"),
        ({"sharding_types": "row_wise"}, "table 't': field 'sharding_types' must be a list"),
        (
            {"pooling_factors": 4},
            "table 't': field 'pooling_factors' must be a list of numbers, got 4",
        ),
        (
            {"batch_sizes": [64, 1.5]},
            "table 't': field 'batch_sizes' must be a list of integers, but it holds 1.5",
        ),
        ({"rows": "100"}, "table 't': field 'rows' must be an integer, got '100'"),
        ({"dim": True}, "table 't': field 'dim' must be an integer, got True"),
        ({"weighted": "yes"}, "table 't': field 'weighted' must be true or false, got 'yes'"),
        ({"pooling_factor": "many"}, "table 't': field 'pooling_factor' must be a number"),
    ],
)
def test_spec_fields_of_the_wrong_kind_are_refused_naming_table_and_field(
    table: dict[str, object], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, [{"name": "ok", "rows": 10, "dim": 8}, {"name": "t", "rows": 100, "dim": 8, **table}])  # fmt: skip
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", spec, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.startswith(f"embshard plan: table spec {spec!r}")
    assert not out.exists()


def test_spec_with_a_list_of_features_keeps_them() -> None:
    spec = parse_table_spec({"tables": [{"name": "t", "rows": 10, "dim": 8, "features": ["user_id"]}]})  # fmt: skip
    assert spec.tables[0].features == ("user_id",)
    with pytest.raises(ValueError, match="'optimizer' must be an optimizer name"):
        parse_table_spec({"optimizer": 5, "tables": [{"name": "t", "rows": 10, "dim": 8}]})


def test_plan_refuses_a_pinned_type_the_table_cannot_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(
        tmp_path,
        [
            {"name": "fine", "rows": 100, "dim": 16},
            {"name": "odd", "rows": 100, "dim": 10, "sharding_types": ["column_wise"]},
        ],
        module="ebc",
    )
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", spec, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "module 'ebc': table 'odd' has no sharding option" in err
    assert "column_wise cannot cut dim 10 into column blocks" in err and "multiple of 4" in err
    assert not out.exists()


def test_plan_writes_column_wise_plans_the_sharders_accept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kinds = ["table_wise", "table_wise", "column_wise", "data_parallel"]
    tables = [
        {"name": f"t{i}", "rows": 10_000, "dim": 16, "sharding_types": [k], "pooling_factor": 5}
        for i, k in enumerate(kinds)
    ]
    out = tmp_path / "plan.json"
    spec = _spec(tmp_path, tables)
    assert main(["plan", "--tables", spec, "--out", str(out), "--world-size", "3"]) == 0
    assert f"plan written to {out}" in capsys.readouterr().out
    module_plan = ShardingPlan.from_json(out.read_text())[""]
    assert isinstance(module_plan, EmbeddingModuleShardingPlan)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=10_000, embedding_dim=16) for i in range(4)
    ]
    ebc = EmbeddingBagCollection(configs, device="meta")
    EmbeddingBagCollectionSharder().check_plan(ebc, module_plan, ShardingEnv.from_local(3, 0), "cpu")  # fmt: skip


# ---- embshard calibrate --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--reps", "0"], "argument --reps: expected a positive integer, got 0"),
        (["--backend", "bogus"], "argument --backend: invalid choice: 'bogus'"),
        (["--world-size", "0"], "argument --world-size: expected a positive integer, got 0"),
        (["--threads", "0"], "argument --threads: expected a positive integer, got 0"),
        (
            ["--world-size", "4", "--local-world-size", "3"],
            "--local-world-size 3 must divide --world-size 4",
        ),
    ],
)
def test_calibrate_refuses_bad_options_before_measuring(
    options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "topo.json"
    _refused(["calibrate", "--out", str(out), "--no-comms", *options], message, capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reps": 0}, "calibrate: reps must be a positive int, got 0"),
        ({"threads": 0}, "calibrate: threads must be a positive int, got 0"),
        ({"backend": "bogus"}, "calibrate: unknown backend 'bogus'"),
        ({"world_size": 0}, "world_size must be a positive int"),
    ],
)
def test_calibrate_function_refuses_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        calibrate(comms=False, **kwargs)  # type: ignore[arg-type]


# ---- embshard train ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
        (["--resume", "/nonexistent/ckpt"], "--resume: '/nonexistent/ckpt' does not exist"),
        (["--rows", "0"], "argument --rows: expected a positive integer, got 0"),
    ],
)
def test_train_refuses_bad_options(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(["train", *options], message, capsys)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--dim", "12", "--sharding", "t1=column_wise", "--nproc", "4"], None),
        (["--dim", "10", "--sharding", "t1=column_wise"], "table 't1' has no sharding option"),
        (["--dim", "10", "--sharding", "data_parallel"], "table 't0' has no sharding option"),
    ],
)
def test_train_refuses_a_table_the_sharders_cannot_take_before_starting_ranks(
    options: list[str], message: str | None, capfd: pytest.CaptureFixture[str]
) -> None:
    from embshard_dist.cli.train import parse_config, refused_request

    if message is None:  # dim 12 on 4 ranks: column-wise in 3 blocks of 4, accepted
        assert refused_request(parse_config(options), 4, 4) is None
        return
    assert main(["train", *options]) == 2
    captured = capfd.readouterr()
    assert captured.out.count(f"embshard train: error: module 'sparse_arch': {message}") == 1
    assert "multiple of 4" in captured.out and "dim 10" in captured.out.replace("dim is", "dim")
    assert "rank" not in captured.err  # no launcher output about ranks: none was started
