"""Several output dists filling the columns of one ``[batch, width]`` output, one copy each way.

A collection whose strategies' outputs interleave in its key order would copy every column
once more to put them side by side. Instead, a collective that can (the pooled all-to-all)
is *placed*: it writes its received blocks straight into their columns of a
:class:`SharedOutput` and returns a token, and in the backward cuts its blocks straight out of
the whole output's gradient. :func:`gather_columns` makes the output differentiable: it copies
the outputs of the strategies that could not be placed into their columns and hands the
gradient on, to the placed collectives through the shared output. Exact: values are moved,
never combined.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from embshard_dist.comm.columns import ColumnAssembly
from embshard_types.awaitables import Awaitable

__all__ = ["Placeable", "PlacedAssembly", "SharedOutput", "gather_columns"]


class SharedOutput:
    """The ``[batch, width]`` output that placed collectives write into, and its gradient.

    Args:
        width: the output's columns.
    """

    def __init__(self, width: int) -> None:
        self.width = int(width)
        self._values: Tensor | None = None
        self._grad: Tensor | None = None

    def values(self, like: Tensor, batch: int) -> Tensor:
        """The output, made on first use with ``like``'s dtype and device (parts of another
        dtype are cast as they are copied in, as ``ColumnAssembly`` does)."""
        if self._values is None:
            self._values = like.new_empty(batch, self.width)
        elif self._values.shape[0] != batch:
            raise ValueError(
                f"SharedOutput: a block of {batch} rows does not fit the output "
                f"{tuple(self._values.shape)}"
            )
        return self._values

    def filled(self) -> Tensor | None:
        """The output if a placed collective has written it, else ``None``."""
        return self._values

    @property
    def grad(self) -> Tensor:
        """The whole output's gradient (set by the backward of :func:`gather_columns`)."""
        if self._grad is None:
            raise RuntimeError("SharedOutput: the output's gradient is not known yet")
        return self._grad

    def set_grad(self, grad: Tensor) -> None:
        self._grad = grad


@runtime_checkable
class Placeable(Protocol):
    """An output awaitable whose collective can write into a :class:`SharedOutput`."""

    def place(self, shared: SharedOutput, destinations: Sequence[int]) -> bool:
        """Write output column ``j`` to column ``destinations[j]`` of ``shared`` (``wait()``
        then returns a token for :func:`gather_columns`); ``False`` where it cannot, and the
        awaitable is unchanged."""
        ...


class PlacedAssembly:
    """``assembly`` (the strategies' outputs side by side, reordered) applied to awaited
    outputs, placing every collective that can be placed before waiting for it.

    Args:
        assembly: the assembly of the outputs, one part per awaitable.
    """

    def __init__(self, assembly: ColumnAssembly) -> None:
        self.assembly = assembly
        destinations: list[list[int]] = [[0] * w for w in assembly.widths]
        for p, src, dst, w in assembly.runs:
            destinations[p][src : src + w] = range(dst, dst + w)
        self._destinations = destinations
        self._rest: dict[tuple[bool, ...], ColumnAssembly | None] = {}

    def __call__(self, pending: Sequence[Awaitable[Tensor]]) -> Tensor:
        """The assembled output, differentiable in every part; waits in ``pending``'s order.

        One output (nothing to interleave) and traced calls are assembled as they are."""
        if len(pending) != len(self._destinations):
            raise ValueError(
                f"PlacedAssembly: {len(pending)} outputs for {len(self._destinations)} parts"
            )
        if len(pending) == 1 or torch.compiler.is_compiling():
            return self.assembly([a.wait() for a in pending])
        shared = SharedOutput(self.assembly.width)
        placed = tuple(
            isinstance(a, Placeable) and a.place(shared, self._destinations[i])
            for i, a in enumerate(pending)
        )
        outputs = [a.wait() for a in pending]
        if not any(placed):
            return self.assembly(outputs)
        tokens = [o for o, p in zip(outputs, placed, strict=True) if p]
        rest = [o for o, p in zip(outputs, placed, strict=True) if not p]
        return gather_columns(shared, tokens, rest, self._rest_assembly(placed))

    def _rest_assembly(self, placed: tuple[bool, ...]) -> ColumnAssembly | None:
        if placed not in self._rest:
            parts = [i for i, p in enumerate(placed) if not p]
            self._rest[placed] = (
                ColumnAssembly([self.assembly.widths[i] for i in parts]).place(
                    [d for i in parts for d in self._destinations[i]], self.assembly.width
                )
                if parts
                else None
            )
        return self._rest[placed]


def gather_columns(
    shared: SharedOutput,
    tokens: Sequence[Tensor],
    rest: Sequence[Tensor],
    rest_assembly: ColumnAssembly | None,
) -> Tensor:
    """The whole output, differentiable in every part: the placed collectives' ``tokens`` (their
    columns already written) and the other outputs ``rest`` copied by ``rest_assembly`` (a placed
    assembly of their widths; ``None`` when there are none)."""
    out: Tensor = _Gather.apply(shared, rest_assembly, len(tokens), *tokens, *rest)
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        shared: SharedOutput,
        rest_assembly: ColumnAssembly | None,
        placed: int,
        *parts: Tensor,
    ) -> Tensor:
        ctx.shared = shared
        ctx.rest_assembly = rest_assembly
        ctx.tokens = [(t.shape, t.dtype, t.device) for t in parts[:placed]]
        rest = parts[placed:]
        if rest:
            assert rest_assembly is not None
            out = shared.values(rest[0], rest[0].shape[0])
            rest_assembly.assemble(rest, out=out)
        values = shared.filled()
        assert values is not None, "gather_columns: no part was written"
        return values

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        ctx.shared.set_grad(grad)
        tokens = [torch.empty(s, dtype=d, device=v) for s, d, v in ctx.tokens]
        rest = ctx.rest_assembly.split(grad) if ctx.rest_assembly is not None else []
        return (None, None, None, *tokens, *rest)
