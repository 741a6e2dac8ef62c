"""Gradient accumulation for the fused kernels: ``k`` micro-batches, one optimizer step.

A fused kernel applies its optimizer inside the backward. Inside :func:`defer_sparse_updates`,
a fused kernel's forward only looks its rows up, and its backward keeps the call (ids, offsets,
per-sample weights) and the gradient of its output instead of updating anything. The backward of
the first forward taken outside the context then joins the kept calls and its own into one
(:func:`~embshard_kernels.call_concat.concat_calls`) and runs the TBE's own fused backward on it
once: one update on the summed gradient of all the micro-batches, with one duplicate-id sum over
their concatenation, so exactly the kernel's step on the concatenated batch (bit for bit with
SGD; the adaptive rules see the same summed gradient and count one step).

FBGEMM's TBE updates inside its backward and cannot hold gradients back: while accumulating, its
lookups run without autograd and the replay runs FBGEMM's forward and backward once on the joined
call (an extra lookup, the exact route). The torch TBE replays its update directly. Hooks a
sharded collection sets on a TBE (row-gradient exchanges, row reductions: collectives) run in the
replay only, at the same micro-batch on every rank.

Limits: per-sample weights that need a gradient cannot be deferred (``ValueError``); one forward
per kernel per micro-batch; kept gradients are not part of any state dict (see
:func:`pending_micro_batches`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from embshard_kernels.call_concat import KernelCall, concat_calls
from embshard_kernels.inputs import TBEInput

__all__ = [
    "GradAccumulation",
    "defer_sparse_updates",
    "grad_accumulations",
    "pending_micro_batches",
]

ATTR = "_grad_accumulation"
"""The attribute of a fused kernel's table weights naming its :class:`GradAccumulation`."""


class GradAccumulation:
    """One fused kernel's gradient accumulation: whether it defers, and the calls it kept.

    Args:
        tbe: the kernel's fused TBE (``apply_call`` is used where it has one).
        feature_dims: the kernel's width of each feature.
        sequence: the kernel returns one row per id.
        tables: the kernel's table names (for messages).
    """

    def __init__(
        self, tbe: Any, feature_dims: Sequence[int], *, sequence: bool, tables: Sequence[str]
    ) -> None:
        self._tbe = tbe
        self._dims = list(feature_dims)
        self._sequence = sequence
        self.tables = list(tables)
        self._depth = 0
        self._kept: list[KernelCall] = []
        # what the deferred lookups hang off in the autograd graph (never gets a gradient)
        self._anchor = torch.zeros((), requires_grad=True)

    @property
    def deferring(self) -> bool:
        """Forwards taken now keep their gradient for a later update."""
        return self._depth > 0

    @property
    def pending(self) -> int:
        """Micro-batches whose gradient is kept and not yet applied."""
        return len(self._kept)

    def engaged(self) -> bool:
        """Forwards must go through :meth:`lookup` (deferring, or gradients are kept)."""
        return self._depth > 0 or bool(self._kept)

    def enter(self) -> None:
        self._depth += 1

    def exit(self) -> None:
        self._depth -= 1

    def lookup(self, args: TBEInput) -> Tensor:
        """The kernel's output for ``args``; its backward keeps the gradient or applies all.

        Raises:
            ValueError: per-sample weights that need a gradient (before anything changes).
        """
        if not torch.is_grad_enabled():  # no backward will come: a plain lookup
            out: Tensor = self._tbe(*args)
            return out
        weights = args.per_sample_weights
        if weights is not None and weights.requires_grad:
            raise ValueError(
                f"tables {self.tables}: gradient accumulation cannot defer the update of a "
                "kernel whose per-sample weights need a gradient; train those features without "
                "accumulation (accumulate_grad_batches=1)"
            )
        kept: Tensor = _DeferredLookup.apply(self._anchor, self, args, not self.deferring)
        return kept

    def check_applied(self, what: str = "save") -> None:
        """Raise unless every kept gradient has been applied.

        Raises:
            RuntimeError: micro-batches' gradients are kept (a state dict would lose them).
        """
        if self._kept:
            raise RuntimeError(
                f"cannot {what} the state of tables {self.tables}: {len(self._kept)} "
                "micro-batch(es) of accumulated gradients are not applied yet and would be "
                "lost; finish the accumulation first (run the backward of a forward taken "
                "outside defer_sparse_updates / no_sync), then save or load"
            )

    def keep(self, call: KernelCall) -> None:
        self._kept.append(call)

    def apply(self) -> None:
        """Apply every kept gradient in one fused step (every rank together, in a sharded
        collection: the TBE's hooks may run collectives)."""
        calls, self._kept = self._kept, []
        if not calls:
            return
        call = concat_calls(calls, self._dims, sequence=self._sequence)
        apply_call = getattr(self._tbe, "apply_call", None)
        if apply_call is not None:
            apply_call(
                call.indices,
                call.offsets,
                call.per_sample_weights,
                call.batch_size_per_feature_per_rank,
                call.grad_output,
            )
            return
        with torch.enable_grad():  # FBGEMM: its own forward and fused backward, once
            out = self._tbe(
                call.indices,
                call.offsets,
                call.per_sample_weights,
                call.batch_size_per_feature_per_rank,
            )
            torch.autograd.backward(out, call.grad_output.to(out.dtype))


class _DeferredLookup(torch.autograd.Function):
    """Forward: the plain lookup. Backward: keep the call and its gradient; maybe apply all."""

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, owner: GradAccumulation, args: TBEInput, apply: bool
    ) -> Tensor:
        del anchor
        ctx.owner = owner
        ctx.apply_all = apply
        # copies: the ids may sit in buffers a later batch reuses before this backward runs
        ctx.args = TBEInput(
            args.indices.clone(),
            args.offsets.clone(),
            None if args.per_sample_weights is None else args.per_sample_weights.detach().clone(),
            args.batch_size_per_feature_per_rank,
        )
        out: Tensor = owner._tbe(*args)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, None, None, None]:
        args: TBEInput = ctx.args
        owner: GradAccumulation = ctx.owner
        owner.keep(KernelCall(*args, grad_output=grad_output.detach().clone()))
        if ctx.apply_all:
            owner.apply()
        return None, None, None, None


def grad_accumulations(module: nn.Module) -> list[GradAccumulation]:
    """The gradient accumulation of every fused kernel whose table weights ``module`` holds.

    Raises:
        ValueError: ``module`` holds key-value tables (FBGEMM's SSD TBE cannot accumulate).
    """
    found: dict[int, GradAccumulation] = {}
    for param in module.parameters():
        acc = getattr(param, ATTR, None)
        if isinstance(acc, GradAccumulation):
            found.setdefault(id(acc), acc)
    from embshard_kernels.key_value import KeyValueEmbedding, KeyValueEmbeddingBag

    for name, sub in module.named_modules():
        if isinstance(sub, KeyValueEmbedding | KeyValueEmbeddingBag):
            raise ValueError(
                f"gradient accumulation: {name or 'the module'} is a key-value kernel "
                f"({type(sub).__name__}), whose SSD TBE applies its update inside the backward "
                "and cannot keep gradients; use fused tables, or accumulate_grad_batches=1"
            )
    return list(found.values())


@contextmanager
def defer_sparse_updates(module: nn.Module) -> Iterator[list[GradAccumulation]]:
    """Inside: the fused kernels of ``module`` keep their gradients instead of updating.

    The backward of the first forward taken outside applies the kept gradients and its own in
    one optimizer step (see the module docstring). Contexts nest. Dense parameters are not
    touched: their ``.grad`` accumulates as usual until the optimizer steps.

    Yields:
        the accumulations entered.

    Raises:
        ValueError: as :func:`grad_accumulations`, before anything changes.
    """
    accumulations = grad_accumulations(module)
    for acc in accumulations:
        acc.enter()
    try:
        yield accumulations
    finally:
        for acc in accumulations:
            acc.exit()


def pending_micro_batches(module: nn.Module) -> int:
    """The most micro-batches any fused kernel of ``module`` holds gradients of (0: none)."""
    return max((acc.pending for acc in grad_accumulations(module)), default=0)
