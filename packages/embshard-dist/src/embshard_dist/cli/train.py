"""``embshard train``: train a small DLRM on Criteo-format clicks across local processes.

It spawns ``--nproc`` ranks (or joins torchrun), plans with the cost-based planner on rank 0,
shards with ``DistributedModelParallel`` and trains (pipelined by default) on Criteo-format days
(generated ones by default), evaluating on the held-out last day every ``--eval-every`` steps.
It logs to the console and to the run folder's ``train.log``, draws the train and eval curves
into ``metrics.png`` there and prints a summary; it can save and resume resharded checkpoints.

Guarantees: exit status 0 on success, 2 for bad options, a plan that does not fit or an
unfitting checkpoint, else the failing rank's code.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from embshard_dist.cli.options import non_negative_int, positive_int

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
PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"


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
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
        "step); none: the plain loop (same results)",
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


def run(argv: Sequence[str]) -> int:
    """Entry point of ``embshard train``."""
    config = parse_config(argv)
    from embshard_dist.cli.launch import default_backend, launch, launched_by_torchrun
    from embshard_dist.strategies.nodes import resolve_local_world_size

    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        local = resolve_local_world_size(world)
    else:
        world = local = config.nproc
    if config.device == "cuda":
        backend = "nccl"
    elif config.device == "cpu":
        backend = "gloo"
    else:
        backend = default_backend(local)
    refusal = refused_request(config, world, local)
    if refusal is not None:
        if os.environ.get("RANK", "0") == "0":
            print(f"embshard train: error: {refusal}", flush=True)
        return 2
    return launch(train_rank, (config,), nproc=config.nproc, backend=backend)


def refused_request(config: TrainConfig, world_size: int, local_world_size: int) -> str | None:
    """Why the ranks would refuse ``config``'s sharding request, checked before any starts.

    The planner's options for the pinned sharding types on the run's tables (a type a table's
    shape cannot take, a node-aware type without whole nodes), as rank 0 would plan them, so
    such an error prints once, with no launcher output about ranks. ``None``: nothing refused.
    """
    if config.plan_json is not None:
        return None  # a plan file is checked against the model by DMP on every rank
    from embshard_dist.models.demo import DemoDLRM
    from embshard_dist.planner.planner import EmbeddingShardingPlanner
    from embshard_dist.planner.topology import Topology
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder

    tables = job_tables(config)
    planner = EmbeddingShardingPlanner(
        Topology(world_size=world_size, local_world_size=local_world_size),
        constraints=_constraints(config, tables),
        batch_size=config.batch_size,
    )
    sharder = EmbeddingBagCollectionSharder(local_world_size=local_world_size)
    try:
        planner.check_options(DemoDLRM(list(tables.configs), device="meta"), [sharder])
    except ValueError as e:
        return str(e)
    return None


def train_rank(config: TrainConfig) -> int:
    """Build, shard and train the model on this rank; returns the exit code."""
    import torch
    import torch.distributed as dist

    from embshard_dist.cli.job_data import JobData, parse_data_spec
    from embshard_dist.cli.job_logging import close_logging, setup_logging
    from embshard_dist.dmp.model_parallel import DistributedModelParallel
    from embshard_dist.models.demo import DemoDLRM
    from embshard_dist.planner.auto import default_plan
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
    from embshard_dist.strategies.nodes import resolve_local_world_size
    from embshard_optim.specs import OptimizerSpec
    from embshard_types.env import ShardingEnv
    from embshard_types.plan import ShardingPlan

    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = "nccl" in str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    run_dir = _shared_run_dir(config, rank)
    logger = setup_logging(run_dir, rank)
    tables = job_tables(config)
    spec = OptimizerSpec.from_name(config.optimizer, lr=config.lr)
    data_spec = parse_data_spec(config.data)
    try:
        if data_spec.kind == "synthetic" and rank == 0:
            held_rows = max(8192, config.eval_batches * config.batch_size * world)
            JobData.write_synthetic(
                run_dir / "data", rows=config.synthetic_rows, held_out_rows=held_rows,
                seed=config.seed,
            )  # fmt: skip
        dist.barrier()
        data = JobData(
            data_spec,
            str(run_dir / "data"),
            tables.rows_per_feature(),
            tables.features,
            eval_needed=config.eval_every > 0,
        )
        torch.manual_seed(config.seed)
        model = DemoDLRM(list(tables.configs))
        # ranks per node from LOCAL_WORLD_SIZE, so the planner and node-aware types agree on nodes
        local = resolve_local_world_size(world)
        sharders: list[Any] = [
            EmbeddingBagCollectionSharder(optimizer=spec, local_world_size=local)
        ]
        group = dist.group.WORLD
        assert group is not None
        if config.plan_json is not None:  # --plan FILE: as given (DMP checks it fits)
            plan = ShardingPlan.from_json(config.plan_json)
        else:
            plan = default_plan(
                model,
                sharders,
                ShardingEnv.from_process_group(group),
                device.type,
                optimizer=spec,
                topology=config.topology,
                constraints=_constraints(config, tables),
                batch_size=config.batch_size,
            )
        dmp = DistributedModelParallel(
            model, device=device, plan=plan, sharders=sharders, optimizer=spec
        )
    except ValueError as e:
        _error(logger, rank, str(e))
        close_logging()
        return 2
    shape = (
        f"tables from {config.table_spec}"
        if config.table_spec
        else f"{config.tables} tables of {config.rows} x {config.dim}"
    )
    if rank == 0:
        logger.info(
            f"embshard train: {world} ranks ({world // local} node(s) x {local}) on "
            f"{device.type}, optimizer {config.optimizer}, {shape}, data {data_spec} "
            f"({data.where}), pipeline {config.pipeline}\nrun folder: {run_dir}\n\n{plan}\n"
        )
    start = _resume(dmp, config, rank, logger)
    if start < 0:
        close_logging()
        return 2
    if start >= config.steps:
        if rank == 0:
            logger.info(
                f"embshard train: the checkpoint is at step {start}; --steps {config.steps}"
            )
        close_logging()
        return 0
    try:
        return _train(config, dmp, data, device, run_dir, start, plan.to_dict(), logger)
    finally:
        close_logging()


def _train(
    config: TrainConfig,
    dmp: Any,
    data: Any,
    device: Any,
    run_dir: Path,
    start: int,
    plan: dict[str, Any],
    logger: Any,
) -> int:
    """The training loop with its evaluations, progress, plot and summary."""
    import torch
    import torch.distributed as dist

    from embshard_dist.cli.job_eval import ClickMetrics, evaluate
    from embshard_dist.cli.job_logging import LOG_FILE
    from embshard_dist.cli.job_report import History, plot_history, summary_lines
    from embshard_dist.cli.job_step import ClickForward, make_stepper
    from embshard_dist.cli.job_tensorboard import ScalarWriter
    from embshard_dist.cli.progress import Progress
    from embshard_dist.comm.collectives import all_gather_ints, all_reduce
    from embshard_dist.comm.timeouts import waited_seconds
    from embshard_dist.train_pipeline import move_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    forward = ClickForward(dmp)
    stepper = make_stepper(config.pipeline, dmp, forward, dmp.optimizer(), device)
    batches = islice(
        data.train_batches(config.batch_size, rank, world, start), config.steps - start
    )
    scalars = ScalarWriter(config.tensorboard if rank == 0 else None)
    progress = Progress(config.steps, start, logger, bar=None if rank == 0 else False)
    history, window_metrics = History(), ClickMetrics()
    width = len(str(config.steps))

    def run_eval(step: int) -> None:
        held_out = data.held_out_batches(config.batch_size, rank, world, config.eval_batches)
        values = evaluate(dmp, forward, (move_batch(b, device) for b in held_out))
        history.eval.append((step, values))
        scalars.add("eval", values, step)
        if rank == 0:
            progress.report(
                f"eval  {step:>{width}}/{config.steps} | held-out "
                + " | ".join(f"{k} {values[k]:.4f}" for k in ClickMetrics.NAMES)
            )

    if config.eval_every:
        run_eval(start)
    losses = torch.zeros(config.steps - start, dtype=torch.float64, device=device)
    window, busy, window_busy, first_step_s = config.window, 0.0, 0.0, 0.0
    window_wait = total_wait = 0.0
    for step in range(start, config.steps):
        began, waited = time.perf_counter(), waited_seconds()
        loss, logits, labels = stepper.progress(batches)
        losses[step - start] = loss
        window_metrics.update(logits, labels)
        spent = time.perf_counter() - began
        window_busy += spent
        window_wait += waited_seconds() - waited
        if step != start:
            total_wait += waited_seconds() - waited
        if step == start:
            first_step_s = spent
        else:
            busy += spent
        done = step + 1
        if rank == 0:
            progress.step(done)
        _checkpoint(dmp, config, rank, done, progress)
        if done % window == 0 or done == config.steps:
            lo = max(done - (done - 1) % window - 1, start)
            mean = all_reduce(
                losses[lo - start : done - start].sum().reshape(1), name="train.loss"
            ) / (world * (done - lo))
            values = window_metrics.compute()
            window_metrics.reset()
            values["loss"] = float(mean)
            history.train.append((done, values))
            scalars.add("train", {**values, "steps_per_s": (done - lo) / window_busy}, done)
            if rank == 0:
                progress.report(
                    f"step {done:>{width}}/{config.steps} | "
                    f"{(done - lo) / max(window_busy, 1e-9):7.1f} steps/s | loss {float(mean):.4f}"
                    f" | ne {values['ne']:.4f} | auc {values['auc']:.4f}"
                    f" | comm wait {1e3 * window_wait / (done - lo):.1f} ms/step"
                )
            window_busy = window_wait = 0.0
        due = config.eval_every and (done % config.eval_every == 0 or done == config.steps)
        if due and history.eval[-1][0] != done:
            run_eval(done)
    progress.close()
    scalars.close()
    if config.checkpoint_dir is not None:
        from embshard_dist.checkpoint.save import wait_for_pending_save

        wait_for_pending_save()
    all_reduce(losses, name="train.losses")
    curve = (losses / world).tolist()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peaks = [row[0] for row in all_gather_ints([peak_kib], name="train.peak_rss")]
    ran = config.steps - start
    timed_steps, seconds = (ran - 1, busy) if ran > 1 else (1, first_step_s)
    summary = {
        "world_size": world,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        "device": device.type,
        "steps": ran,
        "first_step": start,
        "batch_size_per_rank": config.batch_size,
        "seconds": seconds,
        "steps_per_s": timed_steps / max(seconds, 1e-9),
        # this rank's time blocked on embshard's collectives per timed step (DDP's not counted)
        "comm_wait_ms_per_step": 1e3 * total_wait / max(timed_steps if ran > 1 else 1, 1),
        "samples_per_s": timed_steps * config.batch_size * world / max(seconds, 1e-9),
        "window": window,
        "first_window_loss": sum(curve[:window]) / len(curve[:window]),
        "final_window_loss": sum(curve[-window:]) / len(curve[-window:]),
        "loss_curve": curve,
        "history": history.to_dict(),
        "eval": history.eval[-1][1] if history.eval else None,
        "peak_rss_mib": [kib / 1024 for kib in peaks],
        "data": config.data,
        "pipeline": config.pipeline,
        "run_dir": str(run_dir),
        "log": str(run_dir / LOG_FILE),
        "summary_json": str(run_dir / SUMMARY_FILE),
        "config": asdict(config),
        "plan": plan,
    }
    if rank == 0:
        title = (
            f"embshard train: {config.data} data, {world} ranks x {config.batch_size} samples "
            f"per step, {config.optimizer} lr {config.lr}"
        )
        summary["plot"] = str(plot_history(history, run_dir / PLOT_FILE, title))
        text = json.dumps(summary, indent=2)
        (run_dir / SUMMARY_FILE).write_text(text)
        if config.json_path:
            Path(config.json_path).write_text(text)
        logger.info("\n".join(summary_lines(summary)))
    return 0


def _shared_run_dir(config: TrainConfig, rank: int) -> Path:
    """The run folder, created by rank 0 (a new timestamped one under ./runs by default)."""
    import torch.distributed as dist

    chosen: list[str | None] = [None]
    if rank == 0:
        if config.run_dir is not None:
            folder = Path(config.run_dir)
            folder.mkdir(parents=True, exist_ok=True)
        else:
            folder = _new_run_dir(Path("runs"))
        chosen = [str(folder.resolve())]
    dist.broadcast_object_list(chosen, src=0)
    shared = chosen[0]
    assert shared is not None
    return Path(shared)


def _new_run_dir(parent: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        folder = parent / (f"train-{stamp}" if i == 0 else f"train-{stamp}-{i}")
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot make a new run folder under {parent}: 1000 exist for {stamp}")


def _error(logger: Any, rank: int, text: str) -> None:
    if rank == 0:
        logger.error(f"embshard train: error: {text}")


def _constraints(config: TrainConfig, tables: Any) -> dict[str, Any]:
    """Per table: its constraints, with the sharding type ``--sharding`` pins, if any."""
    from embshard_dist.cli.job_tables import planner_constraints
    from embshard_dist.planner.requests import AUTO, parse_sharding_type
    from embshard_types.vocab import ShardingType

    request = config.sharding
    pinned = {}
    for name in tables.names:
        raw = request.get(name, AUTO) if isinstance(request, dict) else (request or AUTO)
        kind = parse_sharding_type(raw, what="--sharding")
        if isinstance(kind, ShardingType):
            pinned[name] = kind
    return planner_constraints(tables, pinned)


def _resume(dmp: Any, config: TrainConfig, rank: int, logger: Any) -> int:
    """Load ``--resume``'s checkpoint; the step to start from (``-1``: refused, said why)."""
    if config.resume is None:
        return 0
    from embshard_dist.checkpoint.load import load_checkpoint

    try:
        result = load_checkpoint(dmp, config.resume)
    except ValueError as e:
        _error(logger, rank, str(e))
        return -1
    if rank == 0:
        logger.info(
            f"resumed from {result.path} at step {result.step} (saved by "
            f"{result.saved_world_size} processes)"
        )
    return result.step


def _checkpoint(dmp: Any, config: TrainConfig, rank: int, done: int, progress: Any) -> None:
    """Save after step ``done`` when ``--save-every`` says so."""
    if config.checkpoint_dir is None or done % config.save_every:
        return
    from embshard_dist.checkpoint.save import save_to_directory

    handle = save_to_directory(dmp, config.checkpoint_dir, step=done, async_save=config.async_save)
    how = "saving in the background to" if config.async_save else "saved"
    if rank == 0:
        progress.report(f"checkpoint: {how} {handle.path}")
