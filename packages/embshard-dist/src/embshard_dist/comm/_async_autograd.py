"""Autograd for collectives that are started in one place and finished in another.

A differentiable collective (pooled all-to-all, reduce-scatter) is split in two autograd nodes
so that its communication overlaps with other work in both passes:

* forward: ``_Start`` issues the collective and returns an empty "token" tensor; later,
  ``_Finish`` (run by the awaitable's ``wait()``) waits and returns the output;
* backward: ``_Finish.backward`` issues the reverse collective of the output's gradient;
  ``_Start.backward``, run by autograd when it reaches the input, waits and returns the
  input's gradient.

An op object (:class:`SplitCollective`) holds the state of one call; it is used once.
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
    """The output of a started differentiable collective; ``wait()`` finishes it.

    Args:
        op: the call's op object.
        input: the tensor whose collective to start (autograd follows it to the output).
    """

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
