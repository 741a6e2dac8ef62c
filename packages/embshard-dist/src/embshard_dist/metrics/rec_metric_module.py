"""``RecMetricModule``: a training job's rec metrics, throughput and state metrics, TorchRec's way.

A training loop calls ``update(model_out)`` after each forward, and ``compute()`` when
``should_compute()``, as with ``torchrec.metrics.metric_module.RecMetricModule``. ``update``
reads every task's labels, predictions and weights from ``model_out`` by the names in its
``RecTaskInfo``, checks them all before any metric changes, and counts a step of throughput.
``compute()`` is a collective over the metrics' process group returning TorchRec's keys
(``ne-DefaultTask|lifetime_ne``, ``throughput-throughput|total_examples``,
``optimizers-optimizers|...``). ``state_dict()`` holds this rank's lifetime table of every metric
and task and throughput's counters (total and warm-up examples, seconds after warm-up), as
TorchRec's; windows are not saved. ``load_state_dict`` checks everything before loading any of
it, and a loaded metric starts with an empty window. ``sync()`` / ``unsync()`` swap the rec
metrics' states for their sums over the ranks and back (torchmetrics'); update and compute are
refused in between. ``get_pre_compute_states`` / ``load_pre_compute_states`` carry the summed
states to another module (:mod:`~embshard_dist.metrics.pre_compute`). Nothing runs in the
background: ``async_compute`` is refused and ``shutdown`` has nothing to stop, as in TorchRec's
``RecMetricModule``. A metric task without a ``RecTaskInfo`` is an error at construction
(TorchRec skips its updates silently).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from embshard_dist.metrics.computation import RecMetricComputation
from embshard_dist.metrics.deferrable_metrics import DeferrableMetrics
from embshard_dist.metrics.metric_list import RecMetricList
from embshard_dist.metrics.metrics_config import RecTaskInfo
from embshard_dist.metrics.model_outputs import read_task_outputs
from embshard_dist.metrics.pre_compute import (
    Holders,
    PreComputeStates,
    load_source,
    source_problems,
    state_holders,
    summed_states,
)
from embshard_dist.metrics.reduce import sum_over_ranks
from embshard_dist.metrics.throughput import ThroughputMetric

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys

MetricValue = torch.Tensor | float
logger = logging.getLogger(__name__)


class RecMetricException(RuntimeError):
    """A metric module operation that cannot run (TorchRec's ``RecMetricException``)."""


@runtime_checkable
class StateMetric(Protocol):
    """A component reporting metrics of its own (an optimizer's learning rate, ...)."""

    def get_metrics(self) -> Mapping[str, MetricValue]:
        """Metric name -> value."""
        ...


def _target_seconds(low: float, high: float) -> float:
    """The compute interval to aim at inside ``[low, high]``, with a second's margin for the
    spread of step times where one bound is open."""
    if math.isinf(high):
        return low + 1.0
    if low == 0.0:
        return high - 1.0 if high > 1.0 else high
    return (low + high) / 2


def distinct_tasks(groups: Sequence[Sequence[RecTaskInfo]], where: str) -> list[RecTaskInfo]:
    """The tasks of ``groups``, each name once; a name given two definitions raises."""
    by_name: dict[str, RecTaskInfo] = {}
    for task in (t for group in groups for t in group):
        if by_name.setdefault(task.name, task) != task:
            raise ValueError(
                f"{where}: task {task.name!r} is defined twice, differently: "
                f"{by_name[task.name]} and {task}"
            )
    return list(by_name.values())


class RecMetricModule(nn.Module):
    """Rec metrics, throughput and state metrics of a training job (see the module doc).

    Args:
        batch_size: samples per update on this rank.
        world_size: ranks of the job.
        rec_tasks: every task a rec metric computes, by name.
        rec_metrics: the rec metrics.
        throughput_metric: counts a step of ``batch_size`` examples per update.
        state_metrics: key prefix (``optimizers-optimizers``) -> component.
        compute_interval_steps: ``should_compute()`` is true every this many updates.
        min_compute_interval, max_compute_interval: seconds; either set, the interval in steps
            is adjusted once at the second ``compute()`` (the largest over the ranks).
        clock: seconds, monotonic (a parameter for tests).
    """

    def __init__(
        self,
        batch_size: int,
        world_size: int,
        rec_tasks: Sequence[RecTaskInfo] | None = None,
        rec_metrics: RecMetricList | None = None,
        throughput_metric: ThroughputMetric | None = None,
        state_metrics: Mapping[str, StateMetric] | None = None,
        compute_interval_steps: int = 100,
        min_compute_interval: float = 0.0,
        max_compute_interval: float = float("inf"),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if batch_size <= 0 or world_size <= 0 or compute_interval_steps <= 0:
            raise ValueError(
                "RecMetricModule: batch_size, world_size and compute_interval_steps must be "
                f"positive, got {batch_size}, {world_size}, {compute_interval_steps}"
            )
        if max_compute_interval <= 0.0 or min_compute_interval < 0.0:
            raise ValueError(
                "RecMetricModule: need min_compute_interval >= 0 and max_compute_interval > 0, "
                f"got {min_compute_interval} and {max_compute_interval}"
            )
        self.batch_size, self.world_size = batch_size, world_size
        self.rec_tasks = list(rec_tasks or [])
        self.rec_metrics = rec_metrics if rec_metrics is not None else RecMetricList([])
        self.throughput_metric = throughput_metric
        self.state_metrics = dict(state_metrics or {})
        self.trained_batches = 0
        self.compute_count = 0
        self.compute_interval_steps = compute_interval_steps
        adjust = min_compute_interval > 0.0 or not math.isinf(max_compute_interval)
        self.min_compute_interval = min_compute_interval if adjust else -1.0
        self.max_compute_interval = max_compute_interval if adjust else -1.0
        self.last_compute_time = -1.0
        self._clock = clock
        self._read_tasks = self._tasks_to_read()
        for _, _, computation in self.rec_metrics.computations():
            computation._persistent["lifetime"] = True  # checkpointed, as TorchRec's states
        self._register_load_state_dict_pre_hook(self._check_and_prepare_load)

    def _tasks_to_read(self) -> list[RecTaskInfo]:
        by_name = {t.name: t for t in distinct_tasks([self.rec_tasks], "RecMetricModule")}
        needed: dict[str, RecTaskInfo] = {}
        for metric, name, _ in self.rec_metrics.computations():
            info = by_name.get(name)
            if info is None:
                raise ValueError(
                    f"RecMetricModule: metric {metric.namespace!r} has task {name!r}, but "
                    f"rec_tasks has no RecTaskInfo of that name (it has {sorted(by_name)}); "
                    "add one saying where the task's tensors are in the model output"
                )
            if not info.label_name or not info.prediction_name:
                raise ValueError(
                    f"RecMetricModule: task {name!r} of metric {metric.namespace!r} needs a "
                    f"label_name and a prediction_name, got {info}"
                )
            needed[name] = info
        return list(needed.values())

    def _group(self) -> dist.ProcessGroup | None:
        metrics = self.rec_metrics.metrics()
        if metrics:
            return metrics[0].group
        return None if self.throughput_metric is None else self.throughput_metric.group

    def get_required_inputs(self) -> list[str] | None:
        """Model outputs the metrics need besides labels, predictions and weights: none."""
        return self.rec_metrics.get_required_inputs()

    def update(self, model_out: Mapping[str, Any]) -> None:
        """Add a batch from the model's output dict; count a step of throughput.

        Raises:
            ValueError: a task's tensor is missing or not one value per sample, or a value is out
                of range; nothing is updated then.
            RuntimeError: the metrics are synced (``sync()`` without ``unsync()``).
        """
        self._refuse_while_synced("update")
        labels, predictions, weights = read_task_outputs(self._read_tasks, model_out)
        self.rec_metrics.update(predictions=predictions, labels=labels, weights=weights)
        if self.throughput_metric is not None:
            self.throughput_metric.update()
        self.trained_batches += 1

    def should_compute(self) -> bool:
        """Whether this update count is a multiple of ``compute_interval_steps``."""
        return self.trained_batches % self.compute_interval_steps == 0

    def _adjust_compute_interval(self) -> None:
        now = self._clock()
        if self.min_compute_interval >= 0 and self.last_compute_time >= 0:
            elapsed = now - self.last_compute_time
            steps = self.compute_interval_steps
            if not self.min_compute_interval <= elapsed <= self.max_compute_interval:
                per_step = elapsed / steps
                target = _target_seconds(self.min_compute_interval, self.max_compute_interval)
                steps = max(1, int(target / per_step)) if per_step > 0 else steps
            agreed = sum_over_ranks(
                torch.tensor(steps), self._group(), "metrics.interval", op=dist.ReduceOp.MAX
            )
            self.compute_interval_steps = int(agreed)
            self.min_compute_interval = self.max_compute_interval = -1.0
        self.last_compute_time = now

    def compute(self) -> DeferrableMetrics:
        """Every metric's values over the ranks (a collective: every rank calls it together),
        as TorchRec's ``DeferrableMetrics`` (a dict, already resolved).

        Raises:
            RuntimeError: the metrics are synced (``sync()`` without ``unsync()``).
        """
        self._refuse_while_synced("compute")
        self.compute_count += 1
        out = DeferrableMetrics()
        if len(self.rec_metrics):
            self._adjust_compute_interval()
            out.update(self.rec_metrics.compute())
        if self.throughput_metric is not None:
            out.update(self.throughput_metric.compute())
        for prefix, component in self.state_metrics.items():
            out.update({f"{prefix}|{k}": v for k, v in component.get_metrics().items()})
        return out

    def local_compute(self) -> DeferrableMetrics:
        """This rank's rec metric values alone (no communication; ``|local_lifetime_..`` keys)."""
        self._refuse_while_synced("local_compute")
        return DeferrableMetrics(self.rec_metrics.local_compute())

    def reset(self) -> None:
        """Forget every rec metric update (throughput keeps counting, as in TorchRec)."""
        self.rec_metrics.reset()

    def _synced(self) -> bool:
        return any(c.is_synced for _, _, c in self.rec_metrics.computations())

    def _refuse_while_synced(self, what: str) -> None:
        if self._synced():
            raise RuntimeError(
                f"RecMetricModule.{what}: the rec metrics hold their sums over the ranks since "
                "sync(); call unsync() first"
            )

    def sync(self) -> None:
        """Replace every rec metric's states by their sums over its process group (a
        collective), as torchmetrics' ``Metric.sync``: ``state_dict()`` then holds the job's
        tables, and ``unsync()`` gives this rank's back. Throughput is not synced (nor in
        TorchRec). Outside a process group the states stay as they are.

        Raises:
            RuntimeError: already synced; nothing changes.
        """
        if self._synced():
            raise RuntimeError("RecMetricModule.sync: already synced; call unsync() first")
        for _, _, computation in self.rec_metrics.computations():
            computation.sync(dist_sync_fn=computation.dist_sync_fn)

    def unsync(self) -> None:
        """Give every synced rec metric its own rank's states back (no-op where not synced)."""
        for _, _, computation in self.rec_metrics.computations():
            if computation.is_synced:
                computation.unsync()

    def _holders(self) -> Holders:
        return state_holders(self.rec_metrics, self.throughput_metric)

    def get_pre_compute_states(
        self, pg: dist.ProcessGroup | DeviceMesh | None = None
    ) -> PreComputeStates:
        """Every metric's states summed over ``pg``: ``{namespace: {task: {state: tensor}}}``,
        the same on every rank (a collective over ``pg``), for ``load_pre_compute_states`` of a
        module that does not reduce again (see :mod:`~embshard_dist.metrics.pre_compute`).

        Args:
            pg: the group to sum over, or a ``DeviceMesh`` (its ``"shard"`` dimension, as
                TorchRec); default: the group the metrics reduce over (TorchRec: the world,
                the same unless the metrics were built on a subgroup).

        Raises:
            RuntimeError: the metrics are synced (their states are sums already).
            ValueError: a ``DeviceMesh`` without a ``"shard"`` dimension.
        """
        self._refuse_while_synced("get_pre_compute_states")
        if isinstance(pg, DeviceMesh):
            names = pg.mesh_dim_names or ()
            if "shard" not in names:
                raise ValueError(
                    "RecMetricModule.get_pre_compute_states: the DeviceMesh has dimensions "
                    f"{list(names)}, none named 'shard'; pass the process group to sum over"
                )
            pg = pg.get_group(mesh_dim="shard")
        return summed_states(self._holders(), pg if pg is not None else self._group())

    def load_pre_compute_states(self, source: Mapping[str, Any]) -> None:
        """Replace every metric's states by ``source``'s (from ``get_pre_compute_states``; no
        communication). Each rec metric's loaded window stands until its next update. The
        module should not reduce again (one process, or metrics on a group of one rank):
        ``compute()`` would sum the loaded states over the ranks once more.

        Raises:
            ValueError: ``source`` has unknown or missing metrics, tasks or states, or a value
                that is not a tensor of the state's shape; nothing is loaded then.
        """
        holders = self._holders()
        problems = source_problems(holders, source)
        if problems:
            raise ValueError(
                "RecMetricModule.load_pre_compute_states: nothing loaded, the source does not "
                f"fit these metrics ({'; '.join(problems)})"
            )
        load_source(holders, source)

    def async_compute(self) -> dict[str, MetricValue]:
        """Refused, as by TorchRec's ``RecMetricModule`` (only its CPU-offloaded module computes
        in the background): call ``compute()``.

        Raises:
            RecMetricException: always; nothing changes.
        """
        raise RecMetricException(
            "RecMetricModule.async_compute is not supported (nor by TorchRec's "
            "RecMetricModule; only its CPUOffloadedRecMetricModule computes in the background); "
            "call compute()"
        )

    def shutdown(self) -> None:
        """Nothing runs in the background, so nothing to stop (TorchRec's ``RecMetricModule``
        only logs): the module keeps working, and calling this again is harmless."""
        logger.debug("RecMetricModule.shutdown: no background work to stop")

    def _checkpointed(self, prefix: str) -> dict[str, RecMetricComputation]:
        """State-dict key -> the computation whose lifetime table it holds."""
        return {
            f"{prefix}{name}.lifetime": module
            for name, module in self.rec_metrics.named_modules(prefix="rec_metrics")
            if isinstance(module, RecMetricComputation)
        }

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load the lifetime tables of a ``state_dict()``; with ``strict``, a missing or extra
        key raises before anything loads. Each loaded metric starts with an empty window."""
        if strict:
            own = set(self.state_dict())
            missing, unexpected = sorted(own - set(state_dict)), sorted(set(state_dict) - own)
            if missing or unexpected:
                raise RuntimeError(
                    "RecMetricModule.load_state_dict: nothing loaded, the state dict does not "
                    f"fit these metrics (missing keys {missing}, unexpected keys {unexpected})"
                )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _check_and_prepare_load(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Runs before anything in this module loads (also inside a larger model): a table of
        the wrong shape, or a throughput counter that is not one value, raises; a missing table
        is reported missing; each present one resets its
        computation and is replaced by a float64 copy on the computation's device (torchmetrics
        would otherwise adopt the caller's tensor itself)."""
        expected = self._checkpointed(prefix)
        problems = []
        if self.throughput_metric is not None:
            problems += self.throughput_metric.checkpoint_problems(
                state_dict, f"{prefix}throughput_metric."
            )
        for key, computation in expected.items():
            value = state_dict.get(key)
            if value is None:
                missing_keys.append(key)
            elif not isinstance(value, torch.Tensor) or value.shape != computation.lifetime.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                problems.append(f"{key}: want shape {tuple(computation.lifetime.shape)}, got {got}")
        if problems:
            raise RuntimeError(
                "RecMetricModule.load_state_dict: nothing loaded, the state dict does not fit "
                f"these metrics ({'; '.join(problems)})"
            )
        for key, computation in expected.items():
            if key in state_dict:
                computation.reset()
                state_dict[key] = (
                    state_dict[key]
                    .detach()
                    .to(device=computation.lifetime.device, dtype=torch.float64, copy=True)
                )
