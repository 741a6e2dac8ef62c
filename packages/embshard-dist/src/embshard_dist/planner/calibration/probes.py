"""The calibration's probes: small timed steps, run round-robin, and the speeds their times give.

:func:`round_robin` times probes in rounds, one call of each per round, so a change of load on a
shared host hits every probe alike. :class:`KernelProbes` turns the kernel probes' medians into
``KernelThroughput`` figures, telling per-distinct-row costs from per-id ones with a second
workload whose ids hit few rows.

Guarantees: the probes' tables are allocated once; the figures are positive; when noise hides
the update from the backward, ``update_bytes_per_s`` is ``None``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from embshard_dist.planner.topology import SPARSE_UPDATE, KernelThroughput
from embshard_types.vocab import ComputeKernel

CALIBRATION_REPS = 21
"""Timed rounds of every probe by default: enough that each type's compute scale, a median of
``MEDIUM`` steps, is stable between calibrations on a busy host, at a longer calibration."""

__all__ = ["CALIBRATION_REPS", "KernelProbes", "Probe", "memory_probe", "round_robin"]

Probe = Callable[[], object]
"""One timed call."""

_ROWS, _DIM, _TABLES, _POOLING, _HOT_ROWS = 50_000, 64, 2, 20, 2_000
_FUSED_BATCH, _DENSE_BATCH = 4096, 1024
_COPY_ELEMENTS = 16 * 1024 * 1024


def round_robin(
    probes: Mapping[str, Probe],
    *,
    reps: int,
    warmup: int = 2,
    sync: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median seconds of each probe, timed in ``warmup + reps`` rounds of one call each.

    Odd rounds run the probes in reverse order, so no probe always follows the same one.

    Args:
        sync: called before each timed call (a barrier, so that processes measure together).
    """
    times: dict[str, list[float]] = {name: [] for name in probes}
    order = list(probes.items())
    for i in range(warmup + reps):
        for name, probe in order if i % 2 == 0 else reversed(order):
            if sync is not None:
                sync()
            start = time.perf_counter()
            probe()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def memory_probe() -> tuple[Probe, int]:
    """A ``Tensor.copy_``, and the bytes it moves (read + written)."""
    src = torch.ones(_COPY_ELEMENTS)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * _COPY_ELEMENTS * 4


def _no_grad(fn: Callable[[], Any]) -> None:
    with torch.no_grad():
        fn()


def _workload(batch: int, hot_rows: int | None = None) -> tuple[Any, list[Any], int]:
    """Two tables' KJT (ids over all rows, or the first ``hot_rows``), configs and distinct rows."""
    from embshard_types.configs import EmbeddingBagConfig
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(0)
    configs = [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=_ROWS, embedding_dim=_DIM, feature_names=(f"f{t}",)
        )
        for t in range(_TABLES)
    ]
    ids = torch.randint(0, hot_rows or _ROWS, (_TABLES, batch * _POOLING), generator=gen)
    touched = sum(int(ids[t].unique().numel()) for t in range(_TABLES))
    lengths = torch.full((_TABLES * batch,), _POOLING, dtype=torch.long)
    kjt = KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(_TABLES)], values=ids.reshape(-1), lengths=lengths
    )
    return kjt, configs, touched


def _fwd_bytes(batch: int) -> int:
    ids, bags = _TABLES * batch * _POOLING, _TABLES * batch
    return (ids + bags) * _DIM * 4


class KernelProbes:
    """The kernel probes and the throughputs their times give (see the module docstring)."""

    def __init__(self) -> None:
        from embshard_kernels.collections import EmbeddingBagCollection
        from embshard_optim.sparse_rules import rule_for
        from embshard_optim.specs import OptimizerSpec, OptimType

        spec = OptimizerSpec(OptimType.ROWWISE_ADAGRAD)
        self._fused = []
        for hot in (None, _HOT_ROWS):
            kjt, configs, touched = _workload(_FUSED_BATCH, hot)
            self._fused.append((EmbeddingBagCollection(configs, optimizer=spec), kjt, touched))
        self._fused_grad = torch.randn(_FUSED_BATCH, _TABLES * _DIM)
        kjt, configs, _ = _workload(_DENSE_BATCH)
        self._dense = (EmbeddingBagCollection(configs), kjt)
        self._dense_grad = torch.randn(_DENSE_BATCH, _TABLES * _DIM)
        self._rule = rule_for(spec)
        self._weight = torch.zeros(_ROWS, _DIM)
        self._state = self._rule.init_state(_ROWS, _DIM)
        self._rows = torch.unique(kjt.values()[: _DENSE_BATCH * _POOLING])
        self._rows_grad = torch.randn(self._rows.numel(), _DIM)

    def probes(self) -> dict[str, Probe]:
        """Name -> probe (names start with ``kernel.``)."""
        (spread, s_kjt, _), (hot, h_kjt, _) = self._fused
        dense, d_kjt = self._dense
        fg, dg = self._fused_grad, self._dense_grad

        def dense_step() -> None:
            dense.zero_grad(set_to_none=True)
            dense(d_kjt).values().backward(dg)

        return {
            "kernel.fused_fwd": lambda: _no_grad(lambda: spread(s_kjt)),
            "kernel.fused_fwd_hot": lambda: _no_grad(lambda: hot(h_kjt)),
            "kernel.fused_step": lambda: spread(s_kjt).values().backward(fg),
            "kernel.fused_step_hot": lambda: hot(h_kjt).values().backward(fg),
            "kernel.dense_fwd": lambda: _no_grad(lambda: dense(d_kjt)),
            "kernel.dense_step": dense_step,
            "kernel.rule": lambda: self._rule.apply(
                self._weight, self._state, self._rows, self._rows_grad, 1
            ),
        }

    def throughputs(self, t: Mapping[str, float], memory_bw: float) -> dict[str, KernelThroughput]:
        """The figures from the probes' median seconds ``t``.

        Args:
            memory_bw: the memory bandwidth (to take the dense gradient pass out).
        """
        out = {ComputeKernel.FUSED.value: self._fused_throughput(t)}
        fwd_bytes = _fwd_bytes(_DENSE_BATCH)
        t_fwd, t_step = t["kernel.dense_fwd"], t["kernel.dense_step"]
        grad_pass = _TABLES * _ROWS * _DIM * 4 * 2 / memory_bw
        t_bwd = max(t_step - t_fwd - grad_pass, 0.1 * (t_step - t_fwd))
        out[ComputeKernel.DENSE.value] = KernelThroughput(fwd_bytes / t_fwd, 2 * fwd_bytes / t_bwd)
        update_bytes = self._rows.numel() * (_DIM * (2 * 4 + 4) + 2 * 4)
        out[SPARSE_UPDATE] = KernelThroughput(fwd_bytes / t_fwd, update_bytes / t["kernel.rule"])
        return out

    def _fused_throughput(self, t: Mapping[str, float]) -> KernelThroughput:
        fwd_bytes = _fwd_bytes(_FUSED_BATCH)
        per_row = _DIM * 16 + 2 * 4  # weights, gradient read + written; row-wise state
        row_bytes = _DIM * 4
        (_, _, u_spread), (_, _, u_hot) = self._fused
        f_spread, f_hot = t["kernel.fused_fwd"], t["kernel.fused_fwd_hot"]
        s_spread, s_hot = t["kernel.fused_step"], t["kernel.fused_step_hot"]
        # forward: the same bytes in both workloads; the spread one reads more distinct rows
        fwd, miss = fwd_bytes / f_spread, None
        if f_spread > f_hot and u_spread > u_hot:
            candidate = (u_spread - u_hot) * row_bytes / (f_spread - f_hot)
            hit_s = f_hot - u_hot * row_bytes / candidate
            if hit_s > 0.1 * f_hot:
                fwd, miss = fwd_bytes / hit_s, candidate
        # backward + update: the same ids; the spread workload updates more distinct rows
        b_spread = max(s_spread - f_spread, 0.1 * s_spread)
        b_hot = max(s_hot - f_hot, 0.1 * s_hot)
        extra = b_spread - b_hot
        if extra > 0 and u_spread > u_hot:
            update = (u_spread - u_hot) * per_row / extra
            rest = b_hot - u_hot * per_row / update
            if rest > 0.1 * b_hot:
                return KernelThroughput(fwd, 2 * fwd_bytes / rest, update, miss)
        return KernelThroughput(fwd, (2 * fwd_bytes + 2 * u_spread * 4) / b_spread, None, miss)
