"""Autograd for collectives started in one place and finished in another, in both passes.

``_Start`` issues the forward collective and returns an empty token; ``_Finish`` (run by the
awaitable's ``wait()``) waits and returns the output. In the backward, ``_Finish`` issues the
reverse collective of the output's gradient and ``_Start`` waits for it. One op object
(:class:`SplitCollective`) holds one call's state.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from embshard_types.awaitables import Awaitable


class SplitCollective(Protocol):
    """One call of a differentiable collective, in four steps."""

    def start_forward(self, input: Tensor) -> None:
        """Issue the forward collective of ``input``."""
        ...

    def finish_forward(self) -> Tensor:
        """Wait for the forward collective and return its output."""
        ...

    def start_backward(self, grad_output: Tensor) -> None:
        """Issue the reverse collective of the output's gradient."""
        ...

    def finish_backward(self) -> Tensor:
        """Wait for the reverse collective and return the input's gradient."""
        ...


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: SplitCollective, input: Tensor) -> Tensor:
        op.start_forward(input)
        ctx.op = op
        return input.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _token_grad: Tensor) -> tuple[None, Tensor]:
        return None, ctx.op.finish_backward()


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: SplitCollective, token: Tensor) -> Tensor:
        ctx.op = op
        ctx.token_dtype = token.dtype
        ctx.token_device = token.device
        return op.finish_forward()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, Tensor]:
        ctx.op.start_backward(grad_output.contiguous())
        return None, torch.empty(0, dtype=ctx.token_dtype, device=ctx.token_device)


class CollectiveAwaitable(Awaitable[Tensor]):
    """The output of a started differentiable collective of ``input`` (autograd follows it to
    the output) by the call's ``op``; ``wait()`` finishes it."""

    def __init__(self, op: SplitCollective, input: Tensor) -> None:
        super().__init__()
        self._op = op
        token = _Start.apply(op, input)
        assert isinstance(token, Tensor)
        self._token: Tensor | None = token
        self._output: Tensor | None = None

    def _wait_impl(self) -> Tensor:
        if self._output is None:
            assert self._token is not None
            output = _Finish.apply(self._op, self._token)
            assert isinstance(output, Tensor)
            self._output = output
            self._token = None
        return self._output
