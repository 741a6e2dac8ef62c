"""``RecMetric``: lifetime and sliding-window values of one metric for one or more tasks.

A subclass says how a batch becomes a state (``batch_state``), how states merge (``merge``), how
a state is reduced over the ranks (``reduce``) and how a reduced state becomes the value
(``value``). The window holds the latest updates whose samples (on this rank) add up to at
most ``window_size``, and always the latest update. ``compute()`` is a collective: every rank
of the group calls it together.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from typing import ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist

DEFAULT_TASK = "DefaultTask"
DEFAULT_WINDOW_SIZE = 10_000_000

S = TypeVar("S")
Preds = torch.Tensor | Mapping[str, torch.Tensor]


class RecMetric(ABC, Generic[S]):
    """One metric over ``tasks``, lifetime and windowed.

    Args:
        tasks: task names; ``update`` takes a tensor per task (a mapping) or, for one task, a tensor.
        window_size: samples (on this rank) the window covers.
        group: the process group to reduce over (default: the default group, if any).
    """

    namespace: ClassVar[str]
    metric_name: ClassVar[str]

    def __init__(
        self,
        tasks: Sequence[str] = (DEFAULT_TASK,),
        *,
        window_size: int = DEFAULT_WINDOW_SIZE,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(f"{self.namespace}: need distinct task names, got {list(tasks)}")
        if window_size <= 0:
            raise ValueError(f"{self.namespace}: window_size must be positive, got {window_size}")
        self.tasks = list(tasks)
        self.window_size = window_size
        self.group = group
        self.reset()

    def reset(self) -> None:
        """Forget every update."""
        self._lifetime: dict[str, S] = {t: self.empty() for t in self.tasks}
        self._window: dict[str, deque[tuple[int, S]]] = {t: deque() for t in self.tasks}

    def _per_task(self, x: Preds | None, what: str) -> dict[str, torch.Tensor | None]:
        if x is None:
            return dict.fromkeys(self.tasks)
        if isinstance(x, torch.Tensor):
            if len(self.tasks) != 1:
                raise ValueError(
                    f"{self.namespace}: {what} is one tensor but the metric has tasks "
                    f"{self.tasks}; pass a mapping task -> tensor"
                )
            return {self.tasks[0]: x}
        missing = [t for t in self.tasks if t not in x]
        if missing:
            raise ValueError(f"{self.namespace}: {what} lacks tasks {missing}")
        return {t: x[t] for t in self.tasks}

    @torch.no_grad()
    def update(self, predictions: Preds, labels: Preds, weights: Preds | None = None) -> None:
        """Add a batch: predicted probabilities, labels in [0, 1], optional sample weights."""
        preds, labs = self._per_task(predictions, "predictions"), self._per_task(labels, "labels")
        ws = self._per_task(weights, "weights")
        for task in self.tasks:
            p, y, w = preds[task], labs[task], ws[task]
            assert p is not None and y is not None
            p, y = p.detach().reshape(-1).double(), y.detach().reshape(-1).double()
            w = torch.ones_like(p) if w is None else w.detach().reshape(-1).double()
            if not p.shape == y.shape == w.shape:
                raise ValueError(
                    f"{self.namespace}, task {task!r}: predictions {tuple(p.shape)}, labels "
                    f"{tuple(y.shape)} and weights {tuple(w.shape)} must have one value per sample"
                )
            state = self.batch_state(p, y, w)
            self._lifetime[task] = self.merge([self._lifetime[task], state])
            window = self._window[task]
            window.append((p.numel(), state))
            total = sum(n for n, _ in window)
            while len(window) > 1 and total > self.window_size:
                total -= window.popleft()[0]

    def compute(self) -> dict[str, torch.Tensor]:
        """``{namespace}-{task}|lifetime_{name}`` and ``..|window_{name}`` for every task."""
        out: dict[str, torch.Tensor] = {}
        for task in self.tasks:
            window = self.merge([s for _, s in self._window[task]] or [self.empty()])
            for prefix, state in (("lifetime", self._lifetime[task]), ("window", window)):
                reduced = self.reduce(state, f"{self.namespace}.{task}.{prefix}")
                out[f"{self.namespace}-{task}|{prefix}_{self.metric_name}"] = self.value(reduced)
        return out

    @abstractmethod
    def empty(self) -> S:
        """The state of no samples."""

    @abstractmethod
    def batch_state(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> S:
        """The state of one batch (float64 predictions, labels, weights)."""

    @abstractmethod
    def merge(self, states: list[S]) -> S:
        """One state for the samples of ``states``."""

    @abstractmethod
    def reduce(self, state: S, name: str) -> S:
        """The state of every rank's samples (a collective)."""

    @abstractmethod
    def value(self, state: S) -> torch.Tensor:
        """The metric of a (reduced) state."""
