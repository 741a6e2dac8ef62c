"""Short measurements of the machine at hand, saved as the planner's topology file.

:func:`calibrate` measures, in well under a minute on a 2-core host:

* memory bandwidth: copying a 64 MiB tensor (bytes read + written per second);
* per compute kernel, with embshard's own ``EmbeddingBagCollection`` on a small workload
  (2 tables of 50,000 x 64, 20 ids per bag): the forward's bytes (rows read + output written)
  per second, and the backward's (twice the forward's bytes plus optimizer state, as FBGEMM's
  benchmark counts it) per second: ``fused`` (RowWiseAdagrad in the backward), ``dense``
  (autograd gradient, less the dense-gradient pass the estimator counts at memory bandwidth),
  and embshard's plain-torch sparse update rule (``sparse_update``);
* collectives on the chosen backend between 2 local processes: embshard's pooled all-to-all
  and reduce-scatter (``sent + received`` bytes per second per rank: ``intra_node_bw`` and
  ``reduce_scatter_bw``) and the latency of a tiny all-to-all.

Cross-node bandwidth cannot be measured on one host: the file keeps the fallback's value, capped
at the measured intra-node bandwidth. Quantized and CUDA-only kernels keep their fallback
figures. Measurements use ``threads`` torch threads per process (1 by default, as the
benchmarks run each rank).

Guarantees: every measurement is the median of several timed repetitions after warm-up; the
result is a valid :class:`~embshard_dist.planner.topology.Topology` whose ``source`` names the
host and date; a failed collective measurement (e.g. no free port) falls back to the defaults
for comms and says so in ``source`` rather than failing the calibration.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from embshard_dist.planner.topology import (
    SPARSE_UPDATE,
    KernelThroughput,
    Topology,
    default_topology,
)
from embshard_types.vocab import ComputeKernel

__all__ = ["calibrate", "measure_comms", "measure_kernels", "measure_memory_bw"]

_ROWS, _DIM, _TABLES, _POOLING = 50_000, 64, 2, 20


def _median_s(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_memory_bw(reps: int = 7) -> float:
    """Bytes per second copied (read + written) by one ``Tensor.copy_`` of 64 MiB."""
    src = torch.ones(16 * 1024 * 1024)
    dst = torch.empty_like(src)
    seconds = _median_s(lambda: dst.copy_(src), reps)
    return 2 * src.numel() * 4 / seconds


def _workload(batch: int) -> tuple[Any, list[Any]]:
    from embshard_types.configs import EmbeddingBagConfig
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(0)
    configs = [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=_ROWS, embedding_dim=_DIM, feature_names=(f"f{t}",)
        )
        for t in range(_TABLES)
    ]
    ids = torch.randint(0, _ROWS, (_TABLES * batch * _POOLING,), generator=gen)
    lengths = torch.full((_TABLES * batch,), _POOLING, dtype=torch.long)
    kjt = KeyedJaggedTensor(keys=[f"f{t}" for t in range(_TABLES)], values=ids, lengths=lengths)
    return kjt, configs


def measure_kernels(
    memory_bw: float, *, batch: int = 1024, reps: int = 5
) -> dict[str, KernelThroughput]:
    """Throughput of the fused and dense kernels and of the sparse update rule on the CPU.

    Args:
        memory_bw: the measured memory bandwidth (to take the dense gradient pass out).
        batch: samples per step.
        reps: timed repetitions per figure.
    """
    from embshard_kernels.collections import EmbeddingBagCollection
    from embshard_optim.sparse_rules import rule_for
    from embshard_optim.specs import OptimizerSpec, OptimType

    kjt, configs = _workload(batch)
    ids, bags = _TABLES * batch * _POOLING, _TABLES * batch
    fwd_bytes = (ids + bags) * _DIM * 4
    touched = _TABLES * _ROWS * -torch.expm1(torch.tensor(-ids / _TABLES / _ROWS)).item()
    spec = OptimizerSpec(OptimType.ROWWISE_ADAGRAD)
    out: dict[str, KernelThroughput] = {}

    fused = EmbeddingBagCollection(configs, optimizer=spec)
    grad = torch.randn(batch, _TABLES * _DIM)
    t_fwd = _median_s(lambda: _no_grad(lambda: fused(kjt)), reps)
    t_step = _median_s(lambda: fused(kjt).values().backward(grad), reps)
    bwd_bytes = 2 * fwd_bytes + 2 * touched * 4
    out[ComputeKernel.FUSED.value] = KernelThroughput(
        fwd_bytes / t_fwd, bwd_bytes / max(t_step - t_fwd, 0.1 * t_step)
    )

    dense = EmbeddingBagCollection(configs)
    t_fwd_d = _median_s(lambda: _no_grad(lambda: dense(kjt)), reps)

    def dense_step() -> None:
        dense.zero_grad(set_to_none=True)
        dense(kjt).values().backward(grad)

    t_step_d = _median_s(dense_step, reps)
    grad_pass = _TABLES * _ROWS * _DIM * 4 * 2 / memory_bw
    t_bwd_d = max(t_step_d - t_fwd_d - grad_pass, 0.1 * (t_step_d - t_fwd_d))
    out[ComputeKernel.DENSE.value] = KernelThroughput(fwd_bytes / t_fwd_d, 2 * fwd_bytes / t_bwd_d)

    rule = rule_for(spec)
    weight = torch.zeros(_ROWS, _DIM)
    state = rule.init_state(_ROWS, _DIM)
    rows = torch.unique(kjt.values()[: ids // _TABLES])
    rows_grad = torch.randn(rows.numel(), _DIM)
    t_update = _median_s(lambda: rule.apply(weight, state, rows, rows_grad, 1), reps)
    update_bytes = rows.numel() * (_DIM * (2 * 4 + 4) + 2 * 4)
    out[SPARSE_UPDATE] = KernelThroughput(fwd_bytes / t_fwd_d, update_bytes / t_update)
    return out


def _no_grad(fn: Callable[[], Any]) -> None:
    with torch.no_grad():
        fn()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _comms_worker(
    rank: int, world: int, port: int, backend: str, threads: int, results: Any
) -> None:
    import torch.distributed as dist

    from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
    from embshard_dist.comm.reduce_scatter import PooledEmbeddingsReduceScatter

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=30),
        )
        rows, dim = 4096, 256
        a2a = PooledEmbeddingsAllToAll(None, [dim] * world)
        rs = PooledEmbeddingsReduceScatter(None)
        x = torch.randn(rows * world, dim)
        tiny = torch.randn(world, 4)
        small = PooledEmbeddingsAllToAll(None, [4] * world)
        t_a2a = _median_s(lambda: a2a(x).wait(), 7)
        t_rs = _median_s(lambda: rs(x).wait(), 7)
        t_tiny = _median_s(lambda: small(tiny).wait(), 15)
        timings = torch.tensor([t_a2a, t_rs, t_tiny], dtype=torch.float64)
        dist.all_reduce(timings, op=dist.ReduceOp.MAX)
        moved = 2 * x.numel() * 4 * (world - 1) / world  # sent + received per rank
        if rank == 0:
            results.put(
                ("ok", moved / timings[0].item(), moved / timings[1].item(), timings[2].item())
            )
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent, which falls back to defaults
        results.put(("error", f"{type(e).__name__}: {e}"))


def measure_comms(
    backend: str = "gloo", *, world: int = 2, threads: int = 1, timeout_s: float = 45.0
) -> tuple[float, float, float]:
    """(all-to-all bandwidth, reduce-scatter bandwidth, latency s) between local processes.

    Raises:
        RuntimeError: the processes failed or did not answer within ``timeout_s``.
    """
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_comms_worker, args=(r, world, port, backend, threads, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        answer = results.get(timeout=timeout_s)
    except queue.Empty:
        answer = ("error", f"no answer from the {world} processes within {timeout_s:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if answer[0] != "ok":
        raise RuntimeError(f"comms calibration failed: {answer[1]}")
    return float(answer[1]), float(answer[2]), float(answer[3])


def calibrate(
    *,
    world_size: int = 2,
    local_world_size: int | None = None,
    backend: str = "gloo",
    threads: int = 1,
    comms: bool = True,
) -> Topology:
    """Measure this machine and return its topology (CPU).

    Args:
        world_size: ranks the topology is for (the speeds do not depend on it).
        local_world_size: ranks per node (default: ``world_size``).
        backend: the process-group backend whose collectives are measured.
        threads: torch threads per process while measuring.
        comms: measure collectives (``False``: keep the fallback's comms figures).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            # FBGEMM's dense CPU lookup warns about its autograd registration on every backward.
            warnings.simplefilter("ignore", UserWarning)
            memory_bw = measure_memory_bw()
            kernels = measure_kernels(memory_bw)
    finally:
        torch.set_num_threads(previous)
    base = default_topology(world_size, local_world_size=local_world_size)
    merged = {**base.kernels, **kernels}
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    note = f"calibrated on {platform.node() or 'this host'} ({os.cpu_count()} cpus, {threads} thread(s)/rank) {stamp}"
    topo = replace(base, memory_bw=memory_bw, kernels=merged, source=note)
    if not comms:
        return replace(topo, source=note + "; comms: defaults (not measured)")
    try:
        a2a_bw, rs_bw, latency = measure_comms(backend, threads=threads)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0][:200]
        return replace(topo, source=f"{note}; comms: defaults ({reason})")
    return replace(
        topo,
        intra_node_bw=a2a_bw,
        reduce_scatter_bw=rs_bw,
        inter_node_bw=min(base.inter_node_bw, a2a_bw),
        collective_latency_s=latency,
        source=f"{note}; {backend} all-to-all {a2a_bw / 1e9:.2f} GB/s, reduce-scatter "
        f"{rs_bw / 1e9:.2f} GB/s, latency {latency * 1e3:.3f} ms",
    )
