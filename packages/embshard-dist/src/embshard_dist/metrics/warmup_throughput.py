"""Throughput that leaves its first ``warmup_steps`` updates out of the rates (TorchRec's warm-up).

The first ``warmup_steps`` updates on a rank only count examples; the rate clock starts at the
last of them, so the lifetime and window rates cover the updates after warm-up over the time
after warm-up, as TorchRec's ``ThroughputMetric``. ``total_examples`` counts every example,
warm-up included. Until a rank is past warm-up its ``compute()`` reports ``total_examples``
only (it still takes part in the reduction). Everything else is
:class:`~embshard_dist.metrics.throughput.ThroughputMetric`'s: states summed over the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from embshard_dist.metrics.throughput import DEFAULT_WINDOW_SECONDS, ThroughputMetric

TOTAL_EXAMPLES_KEY = "throughput-throughput|total_examples"


class WarmupThroughputMetric(ThroughputMetric):
    """:class:`ThroughputMetric` with a warm-up (see the module doc).

    Args:
        batch_size: examples per ``update()`` on this rank when none are given.
        warmup_steps: updates left out of the rates (0: none).
        window_seconds, group, clock: as :class:`ThroughputMetric`.
    """

    warmup_examples: torch.Tensor

    def __init__(
        self,
        batch_size: int,
        *,
        warmup_steps: int = 0,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(batch_size, window_seconds=window_seconds, group=group, clock=clock)
        if warmup_steps < 0:
            raise ValueError(f"throughput: warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.add_state(
            "warmup_examples", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, num_examples: int | None = None) -> None:
        """Count a step of ``num_examples`` (default ``batch_size``) on this rank."""
        if self.steps >= self.warmup_steps:
            super().update(num_examples)
            self.steps += 1
            return
        n = self.batch_size if num_examples is None else int(num_examples)
        if n < 0:
            raise ValueError(f"throughput: num_examples must be >= 0, got {n}")
        self.warmup_examples += n
        self.steps += 1
        if self.steps == self.warmup_steps:
            self._start = self._clock()  # the rates count from the end of warm-up

    def compute(self) -> dict[str, torch.Tensor]:
        """Total examples and, past warm-up, the rates, of every rank (a collective)."""
        values = super().compute()
        values[TOTAL_EXAMPLES_KEY] = values[TOTAL_EXAMPLES_KEY] + self.warmup_examples
        if self.steps <= self.warmup_steps:
            return {TOTAL_EXAMPLES_KEY: values[TOTAL_EXAMPLES_KEY]}
        return values

    def reset(self) -> None:
        """Start again from now, warm-up included."""
        super().reset()
        self.steps = 0
