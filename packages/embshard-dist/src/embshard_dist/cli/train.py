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

import json
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Any

from embshard_dist.cli.train_options import TrainConfig, job_tables, parse_config

PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"


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
    from embshard_dist.train_pipeline import EvalPipelineSparseDist, move_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    forward = ClickForward(dmp)
    stepper = make_stepper(
        config.pipeline,
        dmp,
        forward,
        dmp.optimizer(),
        device,
        config.accumulate_grad_batches,
        # counted from step 0: a resumed run turns semi-synchronous at the same step
        semi_sync_start_batch=max(0, config.semi_sync_start_batch - start),
    )
    batches = islice(
        data.train_batches(config.batch_size, rank, world, start), config.steps - start
    )
    eval_pipeline = (
        EvalPipelineSparseDist(dmp, dmp.optimizer(), device, custom_model_fwd=forward)
        if config.pipeline != "none"
        else None
    )
    scalars = ScalarWriter(config.tensorboard if rank == 0 else None)
    progress = Progress(config.steps, start, logger, bar=None if rank == 0 else False)
    history, window_metrics = History(), ClickMetrics()
    width = len(str(config.steps))

    def run_eval(step: int) -> None:
        held_out = data.held_out_batches(config.batch_size, rank, world, config.eval_batches)
        values = evaluate(dmp, forward, (move_batch(b, device) for b in held_out), eval_pipeline)
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
