"""Autograd for collectives started in one place and finished in another, in both passes.

``_Start`` issues the forward collective and returns an empty token; ``_Finish`` (run by the
awaitable's ``wait()``) waits and returns the output. In the backward, ``_Finish`` issues the
reverse collective of the output's gradient and ``_Start`` waits for it. One op object
(:class:`SplitCollective`) holds one call's state. Under ``torch.compile`` both run eagerly
(``timeouts.at_collective``), so a traced forward breaks its graph at the collective's start and
wait, and autograd records them as in eager mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from embshard_dist.comm.timeouts import at_collective
from embshard_types.awaitables import Awaitable

if TYPE_CHECKING:
    from embshard_dist.comm.placement import SharedOutput


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
        token = _start(op, input)
        self._token: Tensor | None = token
        self._output: Tensor | None = None

    def place(self, shared: SharedOutput, destinations: Sequence[int]) -> bool:
        """Have the collective write into ``shared`` (see ``comm.placement``), where its op can
        and nothing transforms the output on ``wait()``."""
        place = getattr(self._op, "place", None)
        if place is None or self._callbacks or self._token is None:
            return False
        place(shared, destinations)
        return True

    def _wait_impl(self) -> Tensor:
        if self._output is None:
            assert self._token is not None
            self._output = _finish(self._op, self._token)
            self._token = None
        return self._output


@at_collective
def _start(op: SplitCollective, input: Tensor) -> Tensor:
    token = _Start.apply(op, input)
    assert isinstance(token, Tensor)
    return token


@at_collective
def _finish(op: SplitCollective, token: Tensor) -> Tensor:
    output = _Finish.apply(op, token)
    assert isinstance(output, Tensor)
    return output
