"""The calibration's multi-process part: what one rank measures while its peers do the same.

Every rank times the same probes round-robin, so each figure includes what ranks sharing a host
do to each other; per probe the slowest rank's median counts. :func:`fit_overheads` turns the
per-type steps into each type's ``ShardingOverhead``.

Guarantees: every rank reports or :func:`run_calibration_ranks` raises ``RuntimeError`` (a
rank's error, a dead process or a timeout, after which the processes are killed).
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from embshard_dist.planner.calibration.probes import CALIBRATION_REPS, round_robin

__all__ = ["MEDIUM", "TINY", "Case", "fit_overheads", "run_calibration_ranks"]


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


_A2A_ROWS, _A2A_DIM = 4096, 256


def _comms_probes(world: int) -> tuple[dict[str, Callable[[], object]], float]:
    """The collective probes and the bytes the big ones move (sent + received per rank)."""
    from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
    from embshard_dist.comm.reduce_scatter import PooledEmbeddingsReduceScatter

    a2a = PooledEmbeddingsAllToAll(None, [_A2A_DIM] * world)
    rs = PooledEmbeddingsReduceScatter(None)
    x = torch.randn(_A2A_ROWS * world, _A2A_DIM)
    tiny = torch.randn(world, 4)
    small = PooledEmbeddingsAllToAll(None, [4] * world)
    probes = {
        "comms.all_to_all": lambda: a2a(x).wait(),
        "comms.reduce_scatter": lambda: rs(x).wait(),
        "comms.tiny": lambda: small(tiny).wait(),
    }
    return probes, 2 * x.numel() * 4 * (world - 1) / world


@dataclass(frozen=True)
class Case:
    """A workload one sharding type's step is timed on (one feature per table, uniform ids)."""

    tables: int
    rows: int
    dim: int
    batch: int
    ids_per_bag: int

    def configs(self) -> list[Any]:
        """The tables as ``EmbeddingBagConfig``s ``t0``, ``t1``... read by ``f0``, ``f1``..."""
        from embshard_types.configs import EmbeddingBagConfig

        return [
            EmbeddingBagConfig(
                name=f"t{t}", num_embeddings=self.rows, embedding_dim=self.dim,
                feature_names=(f"f{t}",),
            )
            for t in range(self.tables)
        ]  # fmt: skip

    def plan(self, kind: Any, world: int) -> Any:
        """The plan of ``kind``: table-wise puts table ``t`` on rank ``t % world``."""
        from embshard_dist.strategies.layout import shard_specs
        from embshard_types.parameter_sharding import ParameterSharding
        from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
        from embshard_types.vocab import ComputeKernel, ShardingType

        out = {}
        for t in range(self.tables):
            ranks = [t % world] if kind is ShardingType.TABLE_WISE else list(range(world))
            specs = shard_specs(kind, self.rows, self.dim, ranks, "cpu", local_world_size=world)
            out[f"t{t}"] = ParameterSharding(
                kind, ComputeKernel.FUSED, tuple(ranks), tuple(specs) if specs else None
            )
        return ShardingPlan({MODULE: EmbeddingModuleShardingPlan(out)})


MODULE = "ebc"
"""The path of the collection in the calibration's models."""


TINY = (Case(2, 512, 32, 8, 1), Case(64, 512, 32, 8, 1))
"""2 and 64 tiny tables: steps that are nearly all fixed cost (per step, and per table). The
per-table cost is their difference, taken over enough tables that a latency-bound step's jitter
barely moves it between calibrations."""

MEDIUM = Case(4, 50_000, 64, 1024, 20)
"""A step with real lookups, updates and exchanges, for each type's compute scale."""


def _model_and_input(
    kind: Any, case: Case, world: int, rank: int
) -> tuple[nn.Module, tuple[Any, torch.Tensor]]:
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
    from embshard_kernels.collections import EmbeddingBagCollection
    from embshard_optim.specs import OptimizerSpec, OptimType
    from embshard_types.env import ShardingEnv
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    spec = OptimizerSpec(OptimType.ROWWISE_ADAGRAD)
    sharder = EmbeddingBagCollectionSharder(optimizer=spec, local_world_size=world)
    model = sharder.shard(
        EmbeddingBagCollection(case.configs(), device="meta", optimizer=spec),
        case.plan(kind, world)[MODULE],
        ShardingEnv.from_process_group(dist.distributed_c10d._get_default_group()),
        torch.device("cpu"),
        path=MODULE,
    )
    gen = torch.Generator().manual_seed(rank)
    bags = case.tables * case.batch
    kjt = KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(case.tables)],
        values=torch.randint(0, case.rows, (bags * case.ids_per_bag,), generator=gen),
        lengths=torch.full((bags,), case.ids_per_bag, dtype=torch.long),
    )
    weights = torch.randn(case.batch, case.tables * case.dim, generator=gen)
    return model, (kjt, weights)


def _type_probes(world: int, rank: int) -> dict[str, Callable[[], object]]:
    """``type.{sharding type}.{case}`` -> one step of that type on ``TINY`` and ``MEDIUM``."""
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder

    probes: dict[str, Callable[[], object]] = {}
    for kind in EmbeddingBagCollectionSharder().sharding_types("cpu"):
        for i, case in enumerate((*TINY, MEDIUM)):
            model, (kjt, weights) = _model_and_input(kind, case, world, rank)
            probes[f"type.{kind.value}.{i}"] = _stepper(model, kjt, weights)
    return probes


def _stepper(model: nn.Module, kjt: Any, weights: torch.Tensor) -> Callable[[], object]:
    return lambda: (model(kjt).values() * weights).sum().backward()


def _worker(
    rank: int,
    world: int,
    port: int,
    backend: str,
    threads: int,
    what: tuple[bool, bool, int],
    results: Any,
) -> None:
    import warnings

    from embshard_dist.planner.calibration.probes import KernelProbes, memory_probe

    torch.set_num_threads(threads)
    kernels_wanted, types_wanted, reps = what
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        with warnings.catch_warnings():
            # FBGEMM's dense CPU lookup warns about its autograd registration on every backward.
            warnings.simplefilter("ignore", UserWarning)
            probes, moved = _comms_probes(world)
            kernels = KernelProbes() if kernels_wanted else None
            if kernels is not None:
                copy, copied = memory_probe()
                probes["memory.copy"] = copy
                probes.update(kernels.probes())
            if types_wanted:
                probes.update(_type_probes(world, rank))
            medians = round_robin(probes, reps=reps, sync=dist.barrier)
            names = list(medians)
            t = dict(zip(names, _slowest([medians[n] for n in names]), strict=True))
        found: dict[str, Any] = {
            "all_to_all_bw": moved / t["comms.all_to_all"],
            "reduce_scatter_bw": moved / t["comms.reduce_scatter"],
            "latency_s": t["comms.tiny"],
            "type_steps": {},
        }
        if kernels is not None:
            found["memory_bw"] = copied / t["memory.copy"]
            found["kernels"] = kernels.throughputs(t, found["memory_bw"])
        for name, seconds in t.items():
            if name.startswith("type."):
                _, kind, case = name.split(".")
                found["type_steps"].setdefault(kind, [0.0] * (len(TINY) + 1))[int(case)] = seconds
        if rank == 0:
            results.put(("ok", found))
        dist.destroy_process_group()
    except Exception as e:
        results.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_calibration_ranks(
    backend: str = "gloo",
    *,
    world: int = 2,
    threads: int = 1,
    kernels: bool = True,
    overheads: bool = True,
    reps: int = CALIBRATION_REPS,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Measure on ``world`` local processes (see the module docstring).

    Args:
        kernels: measure memory bandwidth and kernel throughputs.
        overheads: time each sharding type's step on ``TINY`` and ``MEDIUM``.

    Returns:
        ``{"all_to_all_bw", "reduce_scatter_bw", "latency_s", "type_steps"}`` (``type_steps``:
        sharding type value -> step seconds on ``TINY`` then ``MEDIUM``), with ``"memory_bw"``
        and ``"kernels"`` when asked.

    Raises:
        RuntimeError: a rank failed (its error), or no answer within ``timeout_s``.
    """
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, port, backend, threads, (kernels, overheads, reps), results),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    answer: tuple[str, Any] | None = None
    try:
        while answer is None:
            try:
                answer = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    answer = ("error", f"a process exited with code {dead[0]} before answering")
                elif time.monotonic() > deadline:
                    answer = ("error", f"no answer from the {world} processes in {timeout_s:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if answer[0] != "ok":
        raise RuntimeError(f"calibration on {world} processes failed: {answer[1]}")
    found: dict[str, Any] = answer[1]
    return found


def _trial_times(topology: Any, value: str, overhead: Any, case: Case) -> list[float]:
    """Per-rank estimated seconds of ``case`` under type ``value`` with a trial overhead."""
    from dataclasses import replace

    from embshard_dist.planner.constraints import ParameterConstraints
    from embshard_dist.planner.cost_model import CostModel, load_tables
    from embshard_dist.planner.estimate import estimate_tables
    from embshard_dist.planner.tables import PlannerTable
    from embshard_optim.specs import OptimizerSpec, OptimType
    from embshard_types.vocab import ShardingType

    tables = [
        PlannerTable(c.name, c.num_embeddings, c.embedding_dim, MODULE, tuple(c.feature_names))
        for c in case.configs()
    ]
    constraints = {
        t.name: ParameterConstraints(pooling_factors=(case.ids_per_bag,)) for t in tables
    }
    loaded = load_tables(tables, constraints, case.batch)
    plan = case.plan(ShardingType.parse(value), topology.world_size)[MODULE]
    shardings = {f"{MODULE}.{k}": v for k, v in plan.items()}
    trial = replace(topology, sharding_overheads={**topology.sharding_overheads, value: overhead})
    model = CostModel.build(trial, OptimizerSpec(OptimType.ROWWISE_ADAGRAD))
    return [r.total_ms / 1e3 for r in estimate_tables(loaded, shardings, model).ranks]


def fit_overheads(
    topology: Any,
    type_steps: dict[str, list[float]],
    *,
    scale_bounds: tuple[float, float] = (0.25, 8.0),
) -> dict[str, Any]:
    """Each sharding type's ``ShardingOverhead`` from its timed steps.

    ``per_table_s`` is the increment per tiny table, ``step_s`` the tiny step less that;
    ``compute_scale`` (within ``scale_bounds``) makes the cost model of the calibrated
    ``topology`` give the ``MEDIUM`` step measured.
    """
    from embshard_dist.planner.topology import ShardingOverhead

    small, large = TINY
    lo, hi = scale_bounds
    out = {}
    for value, (t_small, t_large, t_medium) in type_steps.items():
        per_table = max(0.0, (t_large - t_small) / (large.tables - small.tables))
        step = max(0.0, t_small - small.tables * per_table)
        # the model is linear in the scale: time = rest + scale * compute, on every rank
        one = _trial_times(topology, value, ShardingOverhead(step, per_table, 1.0), MEDIUM)
        two = _trial_times(topology, value, ShardingOverhead(step, per_table, 2.0), MEDIUM)
        critical = max(range(len(one)), key=lambda r: one[r])
        compute = two[critical] - one[critical]
        rest = one[critical] - compute
        scale = (t_medium - rest) / compute if compute > 0 else 1.0
        out[value] = ShardingOverhead(step, per_table, min(hi, max(lo, scale)))
    return out
