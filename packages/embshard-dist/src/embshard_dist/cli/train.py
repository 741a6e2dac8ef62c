"""``embshard train``: train a small DLRM on synthetic clicks across local processes.

It spawns ``--nproc`` ranks (or joins torchrun), plans with the cost-based planner on rank 0,
shards with ``DistributedModelParallel`` and trains on a deterministic global batch, printing
the plan, progress and a summary; it can save and resume resharded checkpoints.

Guarantees: exit status 0 on success, 2 for bad options, a plan that does not fit or an
unfitting checkpoint, else the failing rank's code.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class TrainConfig:
    """The options of one training run (picklable: sent to every rank)."""

    nproc: int = 2
    tables: int = 4
    rows: int = 10_000
    dim: int = 16
    batch_size: int = 256
    steps: int = 100
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
    def table_names(self) -> list[str]:
        """``t0``, ``t1``... (one feature each: ``f0``, ``f1``...)."""
        return [f"t{i}" for i in range(self.tables)]

    @property
    def window(self) -> int:
        """Steps per progress line and per loss window."""
        return self.log_every or max(1, self.steps // 10)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``embshard train``."""
    p = argparse.ArgumentParser(
        prog="embshard train",
        description="Train a small DLRM on synthetic clicks, sharded across local processes.",
    )
    p.add_argument("--nproc", type=positive_int, default=2, help="processes to start (default 2)")
    p.add_argument("--tables", type=positive_int, default=4, help="embedding tables (default 4)")
    p.add_argument("--rows", type=positive_int, default=10_000, help="rows per table")
    p.add_argument("--dim", type=positive_int, default=16, help="embedding dimension (default 16)")
    p.add_argument("--batch-size", type=positive_int, default=256, help="samples per rank per step")
    p.add_argument("--steps", type=positive_int, default=100, help="training steps (default 100)")
    p.add_argument(
        "--sharding",
        default=None,
        help="sharding types the planner must use: one type for all tables (table_wise, "
        "row_wise, column_wise, data_parallel, ...), per table 't0=row_wise,t1=auto', or auto "
        "(default: the cost-based planner chooses every table's type and placement)",
    )
    p.add_argument(
        "--plan",
        default="auto",
        help="auto (default: the cost-based planner plans on the first rank, every rank gets "
        "the plan), or a ShardingPlan JSON file to train with as it is (e.g. written by "
        "`embshard plan`; checked against the model before any collective)",
    )
    p.add_argument(
        "--topology",
        default=None,
        help="topology file written by `embshard calibrate` (measured speeds for the planner; "
        "default: built-in figures)",
    )
    p.add_argument(
        "--optimizer",
        default="rowwise_adagrad",
        help=f"embedding optimizer: {', '.join(_OPTIMIZERS)} (default rowwise_adagrad); the "
        "dense layers use the torch optimizer of the same kind",
    )
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the model and data (default 0)"
    )
    p.add_argument("--log-every", type=positive_int, default=None, help="steps per progress line")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--json", dest="json_path", default=None, help="write the summary here")
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
    from embshard_dist.planner.requests import parse_sharding_request, parse_sharding_type
    from embshard_optim.specs import OptimizerSpec

    try:
        sharding = None if args.sharding is None else parse_sharding_request(args.sharding)
        kinds = (
            []
            if sharding is None
            else (list(sharding.values()) if isinstance(sharding, dict) else [sharding])
        )
        for kind in kinds:
            parse_sharding_type(kind, what="--sharding")
        if isinstance(sharding, dict):
            names = [f"t{i}" for i in range(args.tables)]
            unknown = sorted(set(sharding) - set(names))
            if unknown:
                raise ValueError(
                    f"--sharding names tables {unknown}, but the model has {names} "
                    f"(--tables {args.tables})"
                )
        OptimizerSpec.from_name(args.optimizer, lr=args.lr)
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
        tables=args.tables,
        rows=args.rows,
        dim=args.dim,
        batch_size=args.batch_size,
        steps=args.steps,
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
    from embshard_dist.data.synthetic import SyntheticClicks
    from embshard_dist.models.demo import DemoDLRM
    from embshard_dist.planner.planner import EmbeddingShardingPlanner
    from embshard_dist.planner.topology import Topology
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder

    tables = _table_configs(config)
    data = SyntheticClicks(tables, batch_size=config.batch_size, seed=config.seed)
    planner = EmbeddingShardingPlanner(
        Topology(world_size=world_size, local_world_size=local_world_size),
        constraints=_constraints(config, data),
        batch_size=config.batch_size,
    )
    sharder = EmbeddingBagCollectionSharder(local_world_size=local_world_size)
    try:
        planner.check_options(DemoDLRM(tables, device="meta"), [sharder])
    except ValueError as e:
        return str(e)
    return None


def _table_configs(config: TrainConfig) -> list[Any]:
    """The model's tables: ``t0``, ``t1``... read by features ``f0``, ``f1``..."""
    from embshard_types.configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=name,
            num_embeddings=config.rows,
            embedding_dim=config.dim,
            feature_names=(f"f{i}",),
        )
        for i, name in enumerate(config.table_names)
    ]


def _say(rank: int, text: str, *, end: str = "\n") -> None:
    if rank == 0:
        print(text, end=end, flush=True)


def train_rank(config: TrainConfig) -> int:
    """Build, shard and train the model on this rank; returns the exit code."""
    import torch
    import torch.distributed as dist

    from embshard_dist.comm.collectives import all_gather_ints, all_reduce
    from embshard_dist.data.synthetic import SyntheticClicks
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
    tables = _table_configs(config)
    spec = OptimizerSpec.from_name(config.optimizer, lr=config.lr)
    torch.manual_seed(config.seed)
    model = DemoDLRM(tables)
    data = SyntheticClicks(tables, batch_size=config.batch_size, seed=config.seed)
    try:
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
                constraints=_constraints(config, data),
                batch_size=config.batch_size,
            )
        dmp = DistributedModelParallel(
            model, device=device, plan=plan, sharders=sharders, optimizer=spec
        )
    except ValueError as e:
        _say(rank, f"embshard train: error: {e}")
        return 2
    _say(
        rank,
        f"embshard train: {world} ranks ({world // local} node(s) x {local}) on {device.type}, "
        f"optimizer {config.optimizer}, "
        f"{config.tables} tables of {config.rows} x {config.dim}\n\n{plan}\n",
    )
    optimizer = dmp.optimizer()
    start = _resume(dmp, config, rank)
    if start < 0:
        return 2
    if start >= config.steps:
        _say(rank, f"embshard train: the checkpoint is at step {start}; --steps {config.steps}")
        return 0
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = torch.zeros(config.steps - start, dtype=torch.float64, device=device)
    window, started, last = config.window, time.perf_counter(), time.perf_counter()
    after_first = started
    for step in range(start, config.steps):
        batch = data.batch(step, rank, world)
        logits = dmp(batch.dense.to(device), batch.sparse.to(device))
        loss = loss_fn(logits, batch.labels.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step - start] = loss.detach()
        if step == start:
            after_first = time.perf_counter()
        done = step + 1
        _checkpoint(dmp, config, rank, done)
        if done % window == 0 or done == config.steps:
            lo = max(done - (done - 1) % window - 1, start)
            mean = all_reduce(
                losses[lo - start : done - start].sum().reshape(1), name="train.loss"
            ) / (world * (done - lo))
            now = time.perf_counter()
            rate = (done - lo) / max(now - last, 1e-9)
            last = now
            _say(
                rank,
                f"step {done:>{len(str(config.steps))}}/{config.steps} | "
                f"{rate:7.1f} steps/s | loss {float(mean):.4f}",
            )
    elapsed = time.perf_counter() - after_first
    if config.checkpoint_dir is not None:
        from embshard_dist.checkpoint.save import wait_for_pending_save

        wait_for_pending_save()
    all_reduce(losses, name="train.losses")
    curve = (losses / world).tolist()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peaks = [row[0] for row in all_gather_ints([peak_kib], name="train.peak_rss")]
    ran = config.steps - start
    timed_steps = ran - 1 if ran > 1 else 1
    if ran == 1:
        elapsed = after_first - started
    summary = {
        "world_size": world,
        "local_world_size": local,
        "device": device.type,
        "steps": ran,
        "first_step": start,
        "batch_size_per_rank": config.batch_size,
        "seconds": elapsed,
        "steps_per_s": timed_steps / max(elapsed, 1e-9),
        "samples_per_s": timed_steps * config.batch_size * world / max(elapsed, 1e-9),
        "first_window_loss": sum(curve[:window]) / len(curve[:window]),
        "final_window_loss": sum(curve[-window:]) / len(curve[-window:]),
        "loss_curve": curve,
        "peak_rss_mib": [kib / 1024 for kib in peaks],
        "config": asdict(config),
        "plan": plan.to_dict(),
    }
    if rank == 0:
        _print_summary(summary, window)
        if config.json_path:
            with open(config.json_path, "w") as f:
                json.dump(summary, f, indent=2)
    return 0


def _constraints(config: TrainConfig, data: Any) -> dict[str, Any]:
    """Per table: the traffic of the synthetic data, and the sharding type pinned, if any."""
    from embshard_dist.planner.constraints import ParameterConstraints
    from embshard_dist.planner.requests import AUTO, parse_sharding_type
    from embshard_types.vocab import ShardingType

    request = config.sharding
    out = {}
    for name in config.table_names:
        raw = request.get(name, AUTO) if isinstance(request, dict) else (request or AUTO)
        kind = parse_sharding_type(raw, what="--sharding")
        out[name] = ParameterConstraints(
            sharding_types=(kind,) if isinstance(kind, ShardingType) else None,
            pooling_factors=((data.min_ids + data.max_ids) / 2,),
            zipf_exponent=data.zipf_alpha,
        )
    return out


def _resume(dmp: Any, config: TrainConfig, rank: int) -> int:
    """Load ``--resume``'s checkpoint; the step to start from (``-1``: refused, said why)."""
    if config.resume is None:
        return 0
    from embshard_dist.checkpoint.load import load_checkpoint

    try:
        result = load_checkpoint(dmp, config.resume)
    except ValueError as e:
        _say(rank, f"embshard train: error: {e}")
        return -1
    _say(
        rank,
        f"resumed from {result.path} at step {result.step} (saved by "
        f"{result.saved_world_size} processes)",
    )
    return result.step


def _checkpoint(dmp: Any, config: TrainConfig, rank: int, done: int) -> None:
    """Save after step ``done`` when ``--save-every`` says so."""
    if config.checkpoint_dir is None or done % config.save_every:
        return
    from embshard_dist.checkpoint.save import save_to_directory

    handle = save_to_directory(dmp, config.checkpoint_dir, step=done, async_save=config.async_save)
    how = "saving in the background to" if config.async_save else "saved"
    _say(rank, f"checkpoint: {how} {handle.path}")


def _print_summary(s: dict[str, Any], window: int) -> None:
    first, final = s["first_window_loss"], s["final_window_loss"]
    change = (final - first) / first * 100 if first else 0.0
    memory = ", ".join(f"rank {r} {m:.0f} MiB" for r, m in enumerate(s["peak_rss_mib"]))
    print(
        f"\ndone: {s['steps']} steps, {s['steps_per_s']:.1f} steps/s, "
        f"{s['samples_per_s']:,.0f} samples/s ({s['world_size']} ranks x "
        f"{s['batch_size_per_rank']} samples, timed after the first step)\n"
        f"loss: first {window} steps {first:.4f} -> last {window} steps {final:.4f} "
        f"({change:+.1f}%)\n"
        f"peak memory (RSS): {memory}",
        flush=True,
    )
    sys.stdout.flush()
