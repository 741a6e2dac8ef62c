"""Throughput across ranks: examples per second, lifetime and over a sliding time window.

``ThroughputMetric`` is a ``torchmetrics.Metric`` whose states are all sums over the ranks: the
examples, and each rank's rates. A rank's lifetime rate is its examples over the seconds from
``reset`` (or construction) to its latest ``update``; its window rate counts the updates of the
last ``window_seconds`` before its latest one, over that span (shorter while the job is
younger). The job's rate is the sum of its ranks' rates, so it holds with unequal batch sizes.
Keys follow TorchRec: ``throughput-throughput|total_examples``, ``|lifetime_throughput``,
``|window_throughput``; ``compute()`` is a collective over ``group``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric

from embshard_dist.metrics.reduce import all_reduce_states

DEFAULT_WINDOW_SECONDS = 100.0
_PREFIX = "throughput-throughput|"


class ThroughputMetric(Metric):
    """Counts examples; rates in examples per second.

    Args:
        batch_size: examples per ``update()`` on this rank when none are given.
        window_seconds: how far back the window reaches.
        group: the process group to reduce over (default: the default group, if any).
        clock: seconds, monotonic (a parameter for tests).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    examples: torch.Tensor
    rate: torch.Tensor
    window_rate: torch.Tensor

    def __init__(
        self,
        batch_size: int,
        *,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if batch_size <= 0 or window_seconds <= 0:
            raise ValueError(
                f"throughput: batch_size and window_seconds must be positive, got {batch_size}, "
                f"{window_seconds}"
            )
        # No cached result: every compute() reduces on every rank (see RecMetricComputation).
        super().__init__(
            process_group=group, dist_sync_fn=all_reduce_states, compute_with_cache=False
        )
        self.batch_size, self.window_seconds, self.group = batch_size, window_seconds, group
        self._clock = clock
        for state in ("examples", "rate", "window_rate"):
            self.add_state(state, torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self._window: deque[tuple[float, int]] = deque()
        self._window_examples = 0
        self._start = self._clock()

    def reset(self) -> None:
        """Start counting again from now."""
        super().reset()
        self._window.clear()
        self._window_examples = 0
        self._start = self._clock()

    def update(self, num_examples: int | None = None) -> None:
        """Count a step of ``num_examples`` (default ``batch_size``) on this rank."""
        n = self.batch_size if num_examples is None else int(num_examples)
        if n < 0:
            raise ValueError(f"throughput: num_examples must be >= 0, got {n}")
        now = self._clock()
        self._window.append((now, n))
        self._window_examples += n
        while self._window[0][0] <= now - self.window_seconds:
            self._window_examples -= self._window.popleft()[1]
        elapsed = now - self._start
        span = min(self.window_seconds, elapsed)
        self.examples += n
        self.rate.fill_(float(self.examples) / elapsed if elapsed > 0 else 0.0)
        self.window_rate.fill_(self._window_examples / span if span > 0 else 0.0)

    def compute(self) -> dict[str, torch.Tensor]:
        """Total examples and rates of every rank (a collective)."""
        return {
            f"{_PREFIX}total_examples": self.examples,
            f"{_PREFIX}lifetime_throughput": self.rate,
            f"{_PREFIX}window_throughput": self.window_rate,
        }

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "throughput: call update() per step and compute() for the values; forward() would "
            "restart the clock"
        )
