"""``RecMetricComputation``: one metric of one task as a ``torchmetrics.Metric`` of summed tables.

A metric's statistics are a fixed-size float64 table of weighted sums (``[rows, cols]``: one row
for NE, calibration and accuracy, a row per score cell for AUC). A batch adds a few rows
(:meth:`RecMetricComputation.batch_stats`). Two states hold the table: ``lifetime``, every batch
since ``reset``, and ``window``, the latest batches whose samples on this rank add up to at most
``window_size`` (always the latest batch). Both are ``dist_reduce_fx="sum"`` states synced by
:func:`~embshard_dist.metrics.reduce.all_reduce_states` over ``process_group``: ``compute()``
is a collective that gives every rank the value of all ranks' samples, and the ranks exchange
the tables only, never predictions.

The window table is rebuilt from the retained batch rows right before the states sync, so it
is the exact sum of the batches in the window (no running subtraction that could drift).
Rows ride to the table's device, so ``.to(device)`` may be called at any time.
``local_states`` / ``load_states`` copy both tables out and in (a loaded window stands as one
retained entry until the next batch).
"""

from __future__ import annotations

from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric

from embshard_dist.metrics.inputs import prepare_batch
from embshard_dist.metrics.reduce import all_reduce_states

Rows = tuple[torch.Tensor, torch.Tensor]
"""A batch's part of a table: row indices ``[k]`` (int64) and the sums to add ``[k, cols]``."""


def one_row(*sums: torch.Tensor) -> Rows:
    """The rows of a one-row table: ``sums`` added to row 0."""
    values = torch.stack(sums).reshape(1, -1)
    return torch.zeros(1, dtype=torch.int64, device=values.device), values


class RecMetricComputation(Metric):
    """Lifetime and window tables of one metric (see the module doc).

    Args:
        rows, cols: the table's shape.
        window_size: samples on this rank the window covers.
        process_group: the group ``compute()`` reduces over (default: the default group).
        name: what errors call the metric (e.g. ``"ne-DefaultTask"``).
    """

    is_differentiable = False
    full_state_update = False
    lifetime: torch.Tensor
    window: torch.Tensor

    def __init__(
        self,
        rows: int,
        cols: int,
        *,
        window_size: int,
        process_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ) -> None:
        # No cached result: every compute() reduces, so a rank without new samples still joins
        # the all-reduce the other ranks are in.
        super().__init__(
            process_group=process_group,
            dist_sync_fn=all_reduce_states,
            compute_with_cache=False,
        )
        self.name = type(self).__name__ if name is None else name
        if window_size <= 0:
            raise ValueError(f"{self.name}: window_size must be positive, got {window_size}")
        self.window_size = window_size
        for state in ("lifetime", "window"):
            self.add_state(
                state, default=torch.zeros(rows, cols, dtype=torch.float64), dist_reduce_fx="sum"
            )
        self._retained: deque[tuple[int, Rows]] = deque()
        self._retained_samples = 0

    @abstractmethod
    def batch_stats(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Rows:
        """A batch's rows (checked flat float64 predictions, labels, weights)."""

    @abstractmethod
    def value(self, table: torch.Tensor) -> torch.Tensor:
        """The metric of a (reduced) table."""

    def update(
        self,
        predictions: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add a batch: probabilities and labels in [0, 1], optional weights >= 0."""
        p, y, w = prepare_batch(
            predictions, labels, weights, where=self.name, device=self.lifetime.device
        )
        rows, values = self.batch_stats(p, y, w)
        self.lifetime.index_add_(0, rows, values)
        self._retained.append((p.numel(), (rows, values)))
        self._retained_samples += p.numel()
        while len(self._retained) > 1 and self._retained_samples > self.window_size:
            self._retained_samples -= self._retained.popleft()[0]

    def compute(self) -> dict[str, torch.Tensor]:
        """``{"lifetime": value, "window": value}`` of every rank's samples (a collective)."""
        return {"lifetime": self.value(self.lifetime), "window": self.value(self.window)}

    @property
    def is_synced(self) -> bool:
        """Whether the states hold the sums over the ranks (between ``sync`` and ``unsync``)."""
        return bool(self._is_synced)

    def window_table(self) -> torch.Tensor:
        """This rank's window table: the sum of the retained batches' rows (a new tensor)."""
        table = torch.zeros_like(self.lifetime)
        if self._retained:
            device = table.device
            rows = torch.cat([r.to(device) for _, (r, _) in self._retained])
            values = torch.cat([v.to(device) for _, (_, v) in self._retained])
            table.index_add_(0, rows, values)
        return table

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each table, by state name."""
        shape = tuple(self.lifetime.shape)
        return {"lifetime": shape, "window": shape}

    def local_states(self) -> dict[str, torch.Tensor]:
        """Copies of this rank's tables: ``lifetime`` and ``window``."""
        return {"lifetime": self.lifetime.detach().clone(), "window": self.window_table()}

    def load_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Forget every batch, then hold float64 copies of ``states["lifetime"]`` and
        ``states["window"]`` (tables of this computation's shape, checked by the caller). The
        loaded window stands until the next ``update``, which starts the window afresh."""
        device = self.lifetime.device
        lifetime, window = (
            states[name].detach().to(device=device, dtype=torch.float64, copy=True)
            for name in ("lifetime", "window")
        )
        self.reset()
        self.lifetime = lifetime
        rows = torch.nonzero((window != 0).any(dim=1)).reshape(-1)
        self._retained.append((self.window_size, (rows, window[rows])))
        self._retained_samples = self.window_size

    def sync(
        self,
        dist_sync_fn: Callable[..., Any] | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable[..., Any] | None = None,
    ) -> None:
        """Rebuild the window table from the retained batches, then sync as torchmetrics does
        (``compute()`` always calls this first, on one process too)."""
        if not self._is_synced:
            self.window = self.window_table()
        super().sync(dist_sync_fn, process_group, should_sync, distributed_available)

    def reset(self) -> None:
        """Forget every batch."""
        super().reset()
        self._retained.clear()
        self._retained_samples = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{self.name}: call update() per batch and compute() for the values; forward() "
            "would reset the window this metric keeps"
        )
