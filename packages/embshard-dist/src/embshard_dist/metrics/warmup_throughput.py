"""Throughput that leaves its first ``warmup_steps`` updates out of the rates (TorchRec's warm-up).

The first ``warmup_steps`` updates of an attempt (since construction, ``reset``, or a restart
from a checkpoint) only count examples; the rate clock starts at the last of them, so the
lifetime, attempt and window rates cover the updates after warm-up over the time after
warm-up, as TorchRec's ``ThroughputMetric``. ``total_examples`` counts every example, warm-up
included. Until a rank is past warm-up its rates are 0, so a job whose ranks are all in
warm-up reports ``total_examples`` and ``attempt_examples`` only (every rank still takes part in
the reduction). Everything else is
:class:`~embshard_dist.metrics.throughput.ThroughputMetric`'s: states summed over the ranks,
three counters checkpointed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from embshard_dist.metrics.throughput import DEFAULT_WINDOW_SECONDS, ThroughputMetric


class WarmupThroughputMetric(ThroughputMetric):
    """:class:`ThroughputMetric` with a warm-up (see the module doc).

    Args:
        batch_size: examples per ``update()`` on this rank when none are given.
        warmup_steps: updates left out of the rates (0: none).
        window_seconds, group, clock: as :class:`ThroughputMetric`.
    """

    def __init__(
        self,
        batch_size: int,
        *,
        warmup_steps: int = 0,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            batch_size,
            window_seconds=window_seconds,
            warmup_steps=warmup_steps,
            group=group,
            clock=clock,
        )
