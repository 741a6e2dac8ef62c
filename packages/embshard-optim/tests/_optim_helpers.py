"""Test helpers: a minimal fused kernel, and a free port for multi-process tests."""

from __future__ import annotations

import socket

from torch import Tensor


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``init_process_group``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeKernel:
    """Fits ``FusedKernelLike``: returns its tensors as they are and records learning rates."""

    def __init__(self, weights: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        self.weights = weights
        self.states = states
        self.learning_rates: list[float] = []
        self.optimizer_step: int | None = None

    def set_learning_rate(self, lr: float) -> None:
        self.learning_rates.append(lr)

    def get_optimizer_state(self) -> list[dict[str, Tensor]]:
        return self.states

    def split_embedding_weights(self) -> list[Tensor]:
        return self.weights

    def set_optimizer_step(self, step: int) -> None:
        self.optimizer_step = step
