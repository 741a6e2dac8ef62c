"""The options of ``embshard train``: its command line and the ``TrainConfig`` it parses into."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embshard_dist.cli.options import DefaultsHelpFormatter, non_negative_int, positive_int

_OPTIMIZERS = (
    "rowwise_adagrad",
    "adagrad",
    "sgd",
    "adam",
    "adamw",
    "partial_rowwise_adam",
    "lamb",
    "partial_rowwise_lamb",
    "lars_sgd",
)


@dataclass(frozen=True)
class TrainConfig:
    """The options of one training run (picklable: sent to every rank)."""

    nproc: int = 2
    tables: int = 4
    table_spec: str | None = None
    rows: int = 10_000
    dim: int = 16
    batch_size: int = 256
    steps: int = 100
    data: str = "synthetic"
    synthetic_rows: int = 51_200
    eval_every: int = 25
    eval_batches: int = 16
    pipeline: str = "sparse-dist"
    semi_sync_start_batch: int = 900
    run_dir: str | None = None
    tensorboard: str | None = None
    sharding: str | dict[str, str] | None = None
    topology: str | None = None
    plan_json: str | None = None
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.05
    seed: int = 0
    log_every: int = 0
    device: str = "auto"
    json_path: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    async_save: bool = False
    resume: str | None = None
    accumulate_grad_batches: int = 1

    @property
    def window(self) -> int:
        """Steps per progress line and per loss window."""
        return self.log_every or max(1, self.steps // 10)


def job_tables(config: TrainConfig) -> Any:
    """The model's tables (a ``JobTables``): from ``--tables SPEC`` or generated."""
    from embshard_dist.cli.job_tables import generated_tables, tables_from_spec

    if config.table_spec is not None:
        return tables_from_spec(config.table_spec)
    return generated_tables(config.tables, config.rows, config.dim)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``embshard train``."""
    from embshard_dist.cli.job_step import PIPELINES

    p = argparse.ArgumentParser(
        prog="embshard train",
        description="Train a small DLRM on Criteo-format clicks, sharded across local "
        "processes, evaluating on a held-out day.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=positive_int, default=2, help="processes to start")
    p.add_argument(
        "--data",
        default="synthetic",
        help="criteo-tsv:DIR (day_N TSV files), criteo-npy:DIR (day_N_{dense,sparse,labels}.npy, "
        "as `embshard data preprocess` writes) or synthetic (Criteo-format days generated into "
        "the run folder, clicks from a hidden model of the features); the last day is held out "
        "for evaluation",
    )
    p.add_argument(
        "--tables",
        default="4",
        help="the embedding tables: a number N (tables t0..tN-1 of --rows x --dim sharing the 26 "
        "Criteo features round-robin) or a table spec file (JSON / YAML, the one `embshard plan` "
        "reads; features named cat_0..cat_25, its constraints go to the planner)",
    )
    p.add_argument("--rows", type=positive_int, default=10_000, help="rows per generated table")
    p.add_argument("--dim", type=positive_int, default=16, help="embedding dimension")
    p.add_argument("--batch-size", type=positive_int, default=256, help="samples per rank per step")
    p.add_argument("--steps", type=positive_int, default=100, help="training steps")
    p.add_argument(
        "--eval-every",
        type=non_negative_int,
        default=25,
        help="steps between evaluations on the held-out day (also before the first step and "
        "after the last; 0: no evaluation)",
    )
    p.add_argument(
        "--eval-batches",
        type=non_negative_int,
        default=16,
        help="held-out batches per rank per evaluation (0: the whole held-out day)",
    )
    p.add_argument(
        "--synthetic-rows",
        type=positive_int,
        default=51_200,
        help="rows of the generated training day (--data synthetic; the held-out day has "
        "--eval-batches x --batch-size x ranks rows, at least 8192)",
    )
    p.add_argument(
        "--pipeline",
        choices=PIPELINES,
        default="sparse-dist",
        help="sparse-dist: TrainPipelineSparseDist (the next batch's input dist overlaps this "
        "step; results equal the plain loop's); semi-sync: TrainPipelineSemiSync (also the next "
        "batch's lookup and output dist overlap this backward, one step stale: not equal to the "
        "plain loop); none: the plain loop. Evaluations use EvalPipelineSparseDist unless none",
    )
    p.add_argument(
        "--semi-sync-start-batch",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="--pipeline semi-sync: the first batch (counted from step 0, also on --resume) "
        "trained semi-synchronously; the batches before it train synchronously (default: 900, "
        "TorchRec's)",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="folder for train.log, metrics.png, summary.json and generated data (default: a new "
        "timestamped folder under ./runs)",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        help="write TensorBoard scalars here (needs the tensorboard package)",
    )
    p.add_argument(
        "--sharding",
        default=None,
        help="sharding types the planner must use: one type for all tables (table_wise, "
        "row_wise, column_wise, data_parallel, ...), per table 't0=row_wise,t1=auto', or auto "
        "(None: the cost-based planner chooses every table's type and placement)",
    )
    p.add_argument(
        "--plan",
        default="auto",
        help="auto (the cost-based planner plans on the first rank, every rank gets the plan), "
        "or a ShardingPlan JSON file to train with as it is (e.g. written by `embshard plan`; "
        "checked against the model before any collective)",
    )
    p.add_argument(
        "--topology",
        default=None,
        help="topology file written by `embshard calibrate` (measured speeds for the planner; "
        "None: built-in figures)",
    )
    p.add_argument(
        "--optimizer",
        default="rowwise_adagrad",
        help=f"embedding optimizer: {', '.join(_OPTIMIZERS)}; the dense layers use the torch "
        "optimizer of the same kind",
    )
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument(
        "--accumulate-grad-batches",
        type=positive_int,
        default=1,
        metavar="K",
        help="batches per optimizer step (gradient accumulation): the tables and dense layers "
        "are updated once every K batches, as one step on the K batches together with the mean "
        "loss; --steps, --eval-every, --log-every and --save-every still count batches",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the model and data")
    p.add_argument(
        "--log-every",
        type=positive_int,
        default=None,
        help="steps per progress line (None: a tenth of --steps)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device")
    p.add_argument("--json", dest="json_path", default=None, help="also write the summary here")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints into this directory")
    p.add_argument(
        "--save-every", type=positive_int, default=None, help="steps between checkpoints"
    )
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--resume", default=None, help="resume from this checkpoint (or its latest)")
    return p


def parse_config(argv: Sequence[str]) -> TrainConfig:
    """Parse and check the options (exits with status 2 and a message on bad ones)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from embshard_dist.cli.job_data import parse_data_spec
    from embshard_dist.cli.job_tensorboard import check_tensorboard
    from embshard_dist.planner.requests import parse_sharding_request, parse_sharding_type
    from embshard_optim.specs import OptimizerSpec

    try:
        count, spec_path = _tables_option(args.tables)
        config_tables = job_tables(
            TrainConfig(tables=count, table_spec=spec_path, rows=args.rows, dim=args.dim)
        )
        sharding = None if args.sharding is None else parse_sharding_request(args.sharding)
        kinds = (
            []
            if sharding is None
            else (list(sharding.values()) if isinstance(sharding, dict) else [sharding])
        )
        for kind in kinds:
            parse_sharding_type(kind, what="--sharding")
        if isinstance(sharding, dict):
            names = config_tables.names
            unknown = sorted(set(sharding) - set(names))
            if unknown:
                raise ValueError(
                    f"--sharding names tables {unknown}, but the model has {names} "
                    f"(--tables {args.tables})"
                )
        OptimizerSpec.from_name(args.optimizer, lr=args.lr)
        parse_data_spec(args.data)
        if args.tensorboard is not None and (why := check_tensorboard()) is not None:
            raise ValueError(why)
        if args.run_dir is not None and Path(args.run_dir).is_file():
            raise ValueError(f"--run-dir: {args.run_dir!r} is a file, not a folder")
        if (args.checkpoint_dir is None) != (args.save_every is None):
            raise ValueError("--checkpoint-dir and --save-every go together: give both or neither")
        k = args.accumulate_grad_batches
        if args.save_every is not None and args.save_every % k:
            raise ValueError(
                f"--save-every {args.save_every} is not a multiple of --accumulate-grad-batches "
                f"{k}: a checkpoint must fall between optimizer steps, not inside one"
            )
        if args.pipeline == "semi-sync" and k > 1:
            raise ValueError(
                "--accumulate-grad-batches needs --pipeline sparse-dist or none: the "
                "semi-synchronous pipeline steps once per batch (as TorchRec's)"
            )
        if args.semi_sync_start_batch is not None and args.pipeline != "semi-sync":
            raise ValueError(
                f"--semi-sync-start-batch applies to --pipeline semi-sync only, not "
                f"--pipeline {args.pipeline}"
            )
        if args.async_save and args.checkpoint_dir is None:
            raise ValueError("--async-save needs --checkpoint-dir and --save-every")
        plan_json = None
        if args.plan != "auto":
            if args.sharding is not None:
                raise ValueError("--plan FILE and --sharding exclude each other: the file decides")
            from embshard_types.plan import ShardingPlan

            try:
                plan_json = Path(args.plan).read_text()
                ShardingPlan.from_json(plan_json)
            except OSError as e:
                raise ValueError(f"--plan: cannot read {args.plan!r}: {e}") from None
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--plan: {args.plan!r} is not a ShardingPlan JSON: {e}") from None
        if args.topology is not None:
            from embshard_dist.planner.topology import Topology

            try:
                Topology.load(args.topology)
            except OSError as e:
                raise ValueError(f"--topology: cannot read {args.topology!r}: {e}") from None
        if args.resume is not None and not Path(args.resume).exists():
            raise ValueError(f"--resume: {args.resume!r} does not exist; give a checkpoint folder")
        if args.checkpoint_dir is not None and Path(args.checkpoint_dir).is_file():
            raise ValueError(f"--checkpoint-dir: {args.checkpoint_dir!r} is a file, not a folder")
    except ValueError as e:
        parser.error(str(e))
    return TrainConfig(
        nproc=args.nproc,
        tables=count,
        table_spec=spec_path,
        rows=args.rows,
        dim=args.dim,
        batch_size=args.batch_size,
        steps=args.steps,
        data=args.data,
        synthetic_rows=args.synthetic_rows,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        pipeline=args.pipeline,
        semi_sync_start_batch=(
            900 if args.semi_sync_start_batch is None else args.semi_sync_start_batch
        ),
        run_dir=args.run_dir,
        tensorboard=args.tensorboard,
        sharding=sharding,
        topology=args.topology,
        plan_json=plan_json,
        optimizer=args.optimizer,
        lr=args.lr,
        seed=args.seed,
        log_every=args.log_every or 0,
        device=args.device,
        json_path=args.json_path,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every or 0,
        async_save=args.async_save,
        resume=args.resume,
        accumulate_grad_batches=args.accumulate_grad_batches,
    )


def _tables_option(text: str) -> tuple[int, str | None]:
    """``--tables``: a count (``(N, None)``) or a spec file (``(0, path)``)."""
    if text.strip().isdigit():
        return int(text), None
    if not Path(text).is_file():
        raise ValueError(
            f"--tables {text!r}: expected a number of tables or a table spec file, and no "
            "such file exists"
        )
    return 0, text
