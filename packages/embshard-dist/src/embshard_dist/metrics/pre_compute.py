"""Pre-compute states: every metric's states summed over a process group, to load elsewhere.

What TorchRec's ``RecMetricModule.get_pre_compute_states`` / ``load_pre_compute_states`` carry.
The states nest ``{namespace: {task: {state: tensor}}}``: a rec metric's tables as
``{"ne": {"click": {"lifetime": table, "window": table}}}``, throughput's counters and rates as
``{"throughput": {"throughput": {"total_examples": scalar, ...}}}``. Every state is a sum over
the ranks (see :mod:`~embshard_dist.metrics.computation` and
:mod:`~embshard_dist.metrics.throughput`), so one all-reduce per state gives every rank the same
complete states, and a module whose metrics do not reduce again (built on one process, or on a
group of one rank, as TorchRec's CPU comms module) computes from them the job's values.
:func:`source_problems` checks a whole source against a module before anything loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from embshard_dist.metrics.metric_list import RecMetricList
from embshard_dist.metrics.reduce import sum_over_ranks
from embshard_dist.metrics.throughput import ThroughputMetric

THROUGHPUT_NAMESPACE = "throughput"

PreComputeStates = dict[str, dict[str, dict[str, torch.Tensor]]]
"""Metric namespace -> task -> state name -> tensor."""


class StateHolder(Protocol):
    """A metric part whose states copy out and in: a computation, or throughput."""

    def state_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def local_states(self) -> dict[str, torch.Tensor]: ...

    def load_states(self, states: Mapping[str, torch.Tensor]) -> None: ...


Holders = dict[str, dict[str, StateHolder]]


def state_holders(rec_metrics: RecMetricList, throughput: ThroughputMetric | None) -> Holders:
    """Namespace -> task -> the part holding its states, in the module's order."""
    out: Holders = {}
    for metric, task, computation in rec_metrics.computations():
        out.setdefault(metric.namespace, {})[task] = computation
    if throughput is not None:
        out.setdefault(THROUGHPUT_NAMESPACE, {})[THROUGHPUT_NAMESPACE] = throughput
    return out


def summed_states(holders: Holders, group: dist.ProcessGroup | None) -> PreComputeStates:
    """Every holder's states summed over ``group`` (a collective: one all-reduce per state,
    in the same order on every rank; outside a process group, copies of the local states)."""
    return {
        namespace: {
            task: {
                name: sum_over_ranks(value, group, f"metrics.pre_compute.{namespace}")
                for name, value in holder.local_states().items()
            }
            for task, holder in tasks.items()
        }
        for namespace, tasks in holders.items()
    }


def _key_problems(where: str, given: Any, expected: Sequence[str], what: str) -> list[str]:
    if not isinstance(given, Mapping):
        return [f"{where} must be a dict of {what}s {list(expected)}, got {type(given).__name__}"]
    unknown = sorted(str(k) for k in given if k not in expected)
    missing = [k for k in expected if k not in given]
    problems = [f"{where} has unknown {what}s {unknown}"] if unknown else []
    problems += [f"{where} lacks {what}s {missing}"] if missing else []
    if problems:
        problems[-1] += f" (this module's: {list(expected)})"
    return problems


def _value_problem(where: str, value: Any, shape: tuple[int, ...]) -> str | None:
    if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
        return None
    got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    return f"{where} must be a tensor of shape {shape}, got {got}"


def source_problems(holders: Holders, source: Any) -> list[str]:
    """Everything in ``source`` that does not fit ``holders`` (empty: it all loads): unknown or
    missing namespaces, tasks and states, and values that are not tensors of the state's shape."""
    problems = _key_problems("source", source, list(holders), "metric")
    if problems and not isinstance(source, Mapping):
        return problems
    for namespace, tasks in holders.items():
        if namespace not in source:
            continue
        per_task = source[namespace]
        found = _key_problems(f"source[{namespace!r}]", per_task, list(tasks), "task")
        problems += found
        if found and not isinstance(per_task, Mapping):
            continue
        for task, holder in tasks.items():
            if task not in per_task:
                continue
            where = f"source[{namespace!r}][{task!r}]"
            states, shapes = per_task[task], holder.state_shapes()
            found = _key_problems(where, states, list(shapes), "state")
            problems += found
            if found and not isinstance(states, Mapping):
                continue
            for name, shape in shapes.items():
                if name in states:
                    problem = _value_problem(f"{where}[{name!r}]", states[name], shape)
                    problems += [problem] if problem else []
    return problems


def load_source(holders: Holders, source: Mapping[str, Any]) -> None:
    """Load every holder's states from ``source`` (already checked by :func:`source_problems`)."""
    for namespace, tasks in holders.items():
        for task, holder in tasks.items():
            holder.load_states(source[namespace][task])
