"""Short measurements of the machine at hand, saved as the planner's topology file.

:func:`calibrate` measures memory bandwidth, kernel throughputs, collectives and each sharding
type's overheads on ``processes`` local processes at once, timed round-robin in the same
rounds. Cross-node bandwidth and CUDA-only kernels keep their fallback figures.

Guarantees: every figure is a median of timed rounds after warm-up; the result is a valid
``Topology`` whose ``source`` names the host and date. When the processes fail,
:class:`CalibrationError` is raised with their error, unless ``allow_defaults``: then kernels are
measured in this process, comms keep the defaults, ``source`` says so and a
:class:`CalibrationWarning` is issued.
"""

from __future__ import annotations

import datetime
import os
import platform
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from embshard_dist.planner.calibration.probes import (
    CALIBRATION_REPS,
    KernelProbes,
    memory_probe,
    round_robin,
)
from embshard_dist.planner.topology import KernelThroughput, Topology, default_topology

__all__ = [
    "CALIBRATION_BACKENDS",
    "CalibrationError",
    "CalibrationWarning",
    "calibrate",
    "measure_comms",
    "measure_kernels",
    "measure_memory_bw",
]

CALIBRATION_BACKENDS = ("gloo",)
"""Process-group backends the calibration runs on (its probes are CPU tensors)."""


class CalibrationError(RuntimeError):
    """The multi-process measurement failed; nothing was measured in its place."""


class CalibrationWarning(UserWarning):
    """The multi-process measurement failed and its figures were replaced by defaults."""


def measure_memory_bw(reps: int = 7, sync: Callable[[], object] | None = None) -> float:
    """Bytes per second copied (read + written) by one ``Tensor.copy_``.

    Args:
        sync: called before each repetition (e.g. a barrier, so processes measure together).
    """
    probe, nbytes = memory_probe()
    return nbytes / round_robin({"copy": probe}, reps=reps, sync=sync)["copy"]


def measure_kernels(
    memory_bw: float, *, reps: int = 9, sync: Callable[[], object] | None = None
) -> dict[str, KernelThroughput]:
    """Throughput of the fused and dense kernels and of the sparse update rule on the CPU.

    Args:
        memory_bw: the measured memory bandwidth (to take the dense gradient pass out).
        sync: called before each timed call (a barrier when processes measure together).
    """
    kernels = KernelProbes()
    return kernels.throughputs(round_robin(kernels.probes(), reps=reps, sync=sync), memory_bw)


def measure_comms(
    backend: str = "gloo", *, world: int = 2, threads: int = 1, timeout_s: float = 60.0
) -> tuple[float, float, float]:
    """(all-to-all bandwidth, reduce-scatter bandwidth, latency s) between local processes.

    Raises:
        RuntimeError: the processes failed or did not answer within ``timeout_s``.
    """
    from embshard_dist.planner.calibration.ranks import run_calibration_ranks

    found = run_calibration_ranks(
        backend, world=world, threads=threads, kernels=False, overheads=False, timeout_s=timeout_s
    )
    return found["all_to_all_bw"], found["reduce_scatter_bw"], found["latency_s"]


def _single_process(threads: int) -> tuple[float, dict[str, KernelThroughput]]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            # FBGEMM's dense CPU lookup warns about its autograd registration on every backward.
            warnings.simplefilter("ignore", UserWarning)
            memory_bw = measure_memory_bw()
            return memory_bw, measure_kernels(memory_bw)
    finally:
        torch.set_num_threads(previous)


def calibrate(
    *,
    world_size: int = 2,
    local_world_size: int | None = None,
    backend: str = "gloo",
    threads: int = 1,
    comms: bool = True,
    processes: int = 2,
    reps: int = CALIBRATION_REPS,
    allow_defaults: bool = False,
) -> Topology:
    """Measure this machine and return its topology (CPU).

    Args:
        world_size: ranks the topology is for (the speeds do not depend on it).
        comms: measure on ``processes`` processes (``False``: kernels in this process only;
            comms and sharding overheads keep the fallback's figures).
        processes: local processes measuring together (at least 2).
        reps: timed rounds of the probes (more: steadier figures on a busy host).
        allow_defaults: when the processes fail, keep the fallback's comms and overhead
            figures (with a :class:`CalibrationWarning`) instead of raising.

    Raises:
        ValueError: a count below 1, an unknown backend, or a node size not dividing
            ``world_size``, before anything is measured.
        CalibrationError: the processes failed (their error, and how to go on), unless
            ``allow_defaults``.
    """
    for name, value in (("threads", threads), ("processes", processes), ("reps", reps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"calibrate: {name} must be a positive int, got {value!r}")
    if backend not in CALIBRATION_BACKENDS:
        raise ValueError(
            f"calibrate: unknown backend {backend!r}; the calibration runs on "
            f"{list(CALIBRATION_BACKENDS)} (its probes are CPU tensors)"
        )
    base = default_topology(world_size, local_world_size=local_world_size)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    host = platform.node() or "this host"
    note = f"calibrated on {host} ({os.cpu_count()} cpus, {threads} thread(s)/rank) {stamp}"
    reason = "not measured"
    if comms:
        from embshard_dist.planner.calibration.ranks import fit_overheads, run_calibration_ranks

        world = max(2, processes)
        try:
            found = run_calibration_ranks(backend, world=world, threads=threads, reps=reps)
        except (RuntimeError, OSError) as e:
            reason = str(e).strip().splitlines()[0][:200] or type(e).__name__
            advice = (
                f"the collective measurement on {world} {backend} processes failed: {reason}. "
                "Fix the cause and run again; or measure the kernels only (--no-comms / "
                "comms=False); or keep the default comms and overhead figures "
                "(--allow-defaults / allow_defaults=True)"
            )
            if not allow_defaults:
                raise CalibrationError(advice) from e
            warnings.warn(
                f"{advice}; comms and sharding overheads keep their defaults",
                CalibrationWarning,
                stacklevel=2,
            )
        else:
            a2a_bw, rs_bw = found["all_to_all_bw"], found["reduce_scatter_bw"]
            topo = replace(
                base,
                memory_bw=found["memory_bw"],
                kernels={**base.kernels, **found["kernels"]},
                intra_node_bw=a2a_bw,
                reduce_scatter_bw=rs_bw,
                inter_node_bw=min(base.inter_node_bw, a2a_bw),
                collective_latency_s=found["latency_s"],
                source=f"{note} on {world} processes; {backend} all-to-all "
                f"{a2a_bw / 1e9:.2f} GB/s, reduce-scatter {rs_bw / 1e9:.2f} GB/s, latency "
                f"{found['latency_s'] * 1e3:.3f} ms",
            )
            overheads = fit_overheads(topo.with_world(world), found["type_steps"])
            return replace(topo, sharding_overheads=overheads)
    memory_bw, kernels = _single_process(threads)
    return replace(
        base,
        memory_bw=memory_bw,
        kernels={**base.kernels, **kernels},
        source=f"{note} in one process; comms and sharding overheads: defaults ({reason})",
    )
