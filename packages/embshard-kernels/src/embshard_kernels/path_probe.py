"""Which fused path is faster on this machine: FBGEMM's CPU TBE or embshard's fast pooled path.

Which of the two wins depends on the CPU (its vector units, its caches), so it is measured, not
assumed: :func:`probe_fused_path` times training steps (forward, backward, fused update) of both
on a small representative group, alternating, once per optimizer and thread count per process,
and caches the answer. It runs when the first kernel needs it, never at import, takes a few
milliseconds, and leaves the caller's random state and grad mode as they were. Unless the fast
path wins clearly (:func:`faster_path`), the answer is FBGEMM, so noise does not flip it. Setting
``EMBSHARD_FUSED_PATH`` (:func:`fused_path_override`) skips the probe; ranks that must agree
on the path, or runs that must be repeatable to the bit, should set it.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig, group_tables
from embshard_optim.specs import OptimizerSpec, OptimType

logger = logging.getLogger(__name__)

ENV_VAR = "EMBSHARD_FUSED_PATH"
"""The environment variable that overrides the probe: ``auto``, ``fbgemm`` or ``torch``."""

MARGIN = 1.2
"""The fast path is chosen only when it is this many times faster than FBGEMM (see
:func:`faster_path`)."""


class FusedPath(Enum):
    """Where a group's fused update runs."""

    FBGEMM = "fbgemm"
    """FBGEMM's TBE."""
    TORCH_FAST = "torch_fast"
    """``TorchFusedTBE`` on its fast pooled path (``embshard_kernels.fast_pooled``)."""
    TORCH = "torch"
    """``TorchFusedTBE`` on its general path (the sparse update rules, table by table)."""


TrainingTBE = Callable[[Tensor, Tensor], Tensor]
"""A fused TBE called as ``tbe(indices, offsets)``, its backward applying the update."""

Build = Callable[[GroupedEmbeddingConfig, FusedParams, FusedPath], TrainingTBE]
"""Builds the CPU TBE of a path for a group (the probe asks for ``FBGEMM`` and ``TORCH_FAST``)."""


@dataclass(frozen=True)
class ProbeShape:
    """The group the probe trains: ``tables`` tables of ``rows`` x ``dim``, ``batch`` bags of
    ``ids_per_bag`` ids each (uniform ids, a fixed seed)."""

    tables: int = 2
    rows: int = 2048
    dim: int = 64
    batch: int = 128
    ids_per_bag: int = 8
    warmup: int = 1
    steps: int = 5


@dataclass(frozen=True)
class ProbeResult:
    """One probe: each path's timed steps (seconds, in order) and the path chosen."""

    optim_type: OptimType
    threads: int
    fbgemm_steps: tuple[float, ...]
    torch_fast_steps: tuple[float, ...]
    chosen: FusedPath

    @property
    def fbgemm_s(self) -> float:
        """FBGEMM's fastest step (s)."""
        return min(self.fbgemm_steps)

    @property
    def torch_fast_s(self) -> float:
        """The fast pooled path's fastest step (s)."""
        return min(self.torch_fast_steps)


def faster_path(fbgemm: Sequence[float], torch_fast: Sequence[float]) -> FusedPath:
    """``TORCH_FAST`` when its fastest and its median step are both :data:`MARGIN` times
    faster than FBGEMM's, else ``FBGEMM``: the fallback whenever timings disagree or are close
    (a busy host slows steps at random, which can only hide a win, not fake one twice)."""
    fastest = min(torch_fast) * MARGIN <= min(fbgemm)
    typical = statistics.median(torch_fast) * MARGIN <= statistics.median(fbgemm)
    return FusedPath.TORCH_FAST if fastest and typical else FusedPath.FBGEMM


_cache: dict[tuple[OptimType, int], ProbeResult] = {}
_lock = threading.Lock()


def fused_path_override() -> FusedPath | None:
    """The path ``EMBSHARD_FUSED_PATH`` asks for: ``FBGEMM``, ``TORCH_FAST`` or ``None`` (auto).

    ``torch`` means the torch TBE (its fast pooled path wherever that fits).

    Raises:
        ValueError: the variable holds anything but ``auto``, ``fbgemm``, ``torch`` (any case).
    """
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    choices = {"auto": None, "": None, "fbgemm": FusedPath.FBGEMM, "torch": FusedPath.TORCH_FAST}
    if value not in choices:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a fused path; set it to 'auto' (measure "
            "which is faster on this machine), 'fbgemm' or 'torch', or unset it"
        )
    return choices[value]


def probe_fused_path(
    optim_type: OptimType, build: Build, shape: ProbeShape | None = None
) -> ProbeResult:
    """The faster of FBGEMM and the fast pooled path for ``optim_type`` on this CPU (cached).

    Args:
        optim_type: an optimizer both paths run (SGD, RowWiseAdagrad).
        build: makes each path's TBE for the probe's group (see :data:`Build`).
        shape: the probe's group; ``None`` is :class:`ProbeShape`'s default. Only the first call
            per ``(optim_type, torch.get_num_threads())`` measures; later calls return its result.
    """
    key = (optim_type, torch.get_num_threads())
    with _lock:
        if key not in _cache:
            _cache[key] = _measure(optim_type, build, shape or ProbeShape())
            logger.info("fused path for %s: %s", optim_type.name, _cache[key])
        return _cache[key]


def cached_probes() -> list[ProbeResult]:
    """The probes this process has measured, oldest first."""
    with _lock:
        return list(_cache.values())


def clear_probe_cache() -> None:
    """Forget every probe result (the next auto choice measures again)."""
    with _lock:
        _cache.clear()


def _measure(optim_type: OptimType, build: Build, shape: ProbeShape) -> ProbeResult:
    spec = OptimizerSpec(optim_type=optim_type)
    params = FusedParams(optimizer=spec)
    config = _probe_group(shape, params)
    count = shape.tables * shape.batch * shape.ids_per_bag
    paths = (FusedPath.FBGEMM, FusedPath.TORCH_FAST)
    samples: dict[FusedPath, list[float]] = {path: [] for path in paths}
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        gen = torch.Generator().manual_seed(0)
        indices = torch.randint(0, shape.rows, (count,), generator=gen)  # rows of each table
        offsets = torch.arange(0, count + 1, shape.ids_per_bag)
        grad = torch.randn(shape.batch, shape.tables * shape.dim, generator=gen)
        tbes = {path: build(config, params, path) for path in paths}
        for step in range(shape.warmup + shape.steps):
            for path in paths:
                start = time.perf_counter()
                tbes[path](indices, offsets).backward(grad)
                if step >= shape.warmup:
                    samples[path].append(time.perf_counter() - start)
    fbgemm, torch_fast = samples[FusedPath.FBGEMM], samples[FusedPath.TORCH_FAST]
    return ProbeResult(
        optim_type,
        torch.get_num_threads(),
        tuple(fbgemm),
        tuple(torch_fast),
        faster_path(fbgemm, torch_fast),
    )


def _probe_group(shape: ProbeShape, params: FusedParams) -> GroupedEmbeddingConfig:
    tables = [
        ShardedTableConfig(
            name=f"probe_{t}",
            num_embeddings=shape.rows,
            embedding_dim=shape.dim,
            feature_names=(f"probe_{t}",),
            fused_params=params,
        )
        for t in range(shape.tables)
    ]
    (group,) = group_tables(tables)
    return group
