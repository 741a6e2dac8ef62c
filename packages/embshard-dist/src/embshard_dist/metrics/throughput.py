"""Throughput across ranks: examples per second, lifetime and over a sliding time window.

``compute()`` sums the ranks' examples and takes the longest rank's elapsed time, so the value
is the job's rate even when ranks see different batch sizes. Keys follow TorchRec:
``throughput-throughput|total_examples``, ``|lifetime_throughput``, ``|window_throughput``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from embshard_dist.metrics.reduce import sum_over_ranks

DEFAULT_WINDOW_SECONDS = 100.0
_PREFIX = "throughput-throughput|"


class ThroughputMetric:
    """Counts examples; rates in examples per second.

    Args:
        batch_size: examples per ``update()`` on this rank when none are given.
        window_seconds: how far back the window reaches.
        group: the process group to reduce over (default: the default group, if any).
        clock: seconds, monotonic (a parameter for tests).
    """

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
                f"batch_size and window_seconds must be positive, got {batch_size}, {window_seconds}"
            )
        self.batch_size, self.window_seconds, self.group = batch_size, window_seconds, group
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Start counting again from now."""
        self._start = self._clock()
        self._total = 0
        self._window: deque[tuple[float, int]] = deque()

    def update(self, num_examples: int | None = None) -> None:
        """Count a step of ``num_examples`` (default ``batch_size``) on this rank."""
        n = self.batch_size if num_examples is None else num_examples
        if n < 0:
            raise ValueError(f"num_examples must be >= 0, got {n}")
        now = self._clock()
        self._total += n
        self._window.append((now, n))
        while self._window and self._window[0][0] < now - self.window_seconds:
            self._window.popleft()

    def compute(self) -> dict[str, torch.Tensor]:
        """Total examples and rates (a collective: every rank calls it together)."""
        now = self._clock()
        window = [(t, n) for t, n in self._window if t >= now - self.window_seconds]
        since = min((t for t, _ in window), default=now)
        counts = torch.tensor([self._total, sum(n for _, n in window)], dtype=torch.float64)
        spans = torch.tensor([now - self._start, now - since], dtype=torch.float64)
        counts = sum_over_ranks(counts, self.group, "throughput.examples")
        spans = sum_over_ranks(spans, self.group, "throughput.seconds", dist.ReduceOp.MAX)
        return {
            f"{_PREFIX}total_examples": counts[0],
            f"{_PREFIX}lifetime_throughput": counts[0] / spans[0].clamp_min(1e-9),
            f"{_PREFIX}window_throughput": counts[1] / spans[1].clamp_min(1e-9),
        }
