"""Metrics whose state is a vector of weighted sums: merged by adding, reduced by all-reduce."""

from __future__ import annotations

import torch

from embshard_dist.metrics.base import RecMetric
from embshard_dist.metrics.reduce import sum_over_ranks


class SumsMetric(RecMetric[torch.Tensor]):
    """A ``RecMetric`` whose state is ``num_sums`` float64 sums."""

    num_sums: int

    def empty(self) -> torch.Tensor:
        return torch.zeros(self.num_sums, dtype=torch.float64)

    def merge(self, states: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(states).sum(dim=0)

    def reduce(self, state: torch.Tensor, name: str) -> torch.Tensor:
        return sum_over_ranks(state, self.group, name)
