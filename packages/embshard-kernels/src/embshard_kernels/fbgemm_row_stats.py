"""FBGEMM's fused RowWiseAdagrad for column shards, with the statistic of the full row.

FBGEMM adds to a touched row's momentum the mean of g² over the columns it holds. A column
shard of a wider table must add the mean over the *full* row, as the unsharded table does
(the other columns' squares live on other ranks). :class:`FbgemmRowStatsTBE` runs FBGEMM's
lookup and fused backward unchanged; just before that backward, an identity node on the output
sums each touched row's gradient (the fast pooled path's plan: one sort, one ``embedding_bag``),
completes the squares with the ``row_reductions`` hooks (the calls ``TorchFusedTBE`` makes, in
the same order), and adds ``full mean - own mean`` to those rows' momentum; FBGEMM then adds its
own mean. The result is the unsharded update up to the rounding of the momentum (a few ulp).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from embshard_kernels.fast_pooled import FastPooledPath, RunBatch, row_square_sums
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_kernels.lookup import CallLayout
from embshard_kernels.tbe import FbgemmFusedTBE
from embshard_optim.sparse_rules.base import RowReduction
from embshard_optim.specs import OptimType


class FbgemmRowStatsTBE(nn.Module):
    """FBGEMM's pooled fused TBE (RowWiseAdagrad, CPU) with ``row_reductions`` as
    ``TorchFusedTBE`` takes them: ``row_reductions[table]`` completes the row sums of a column
    shard (``None``: the table is whole). The caller checked the group passes
    :func:`~embshard_kernels.fast_pooled.fast_path_refusal`.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        params: FusedParams,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if params.optimizer.optim_type is not OptimType.ROWWISE_ADAGRAD:
            raise ValueError(
                f"tables {config.table_names()}: FbgemmRowStatsTBE completes RowWiseAdagrad's "
                f"statistic only, not {params.optimizer.optim_type.name}; use the torch TBE"
            )
        self._spec = params.optimizer
        self.fbgemm = FbgemmFusedTBE(config, params.optimizer, params, device)
        module = self.fbgemm.module
        # the runs' rows index the momentum as FBGEMM lays it out: tables back to back
        # (FBGEMM keeps one offset per feature, its table's)
        rows = [t.rows for t in config.embedding_tables]
        expected = [sum(rows[:t]) for t in config.feature_table_map()]
        if [int(x) for x in module.momentum1_offsets] != expected:
            raise ValueError(
                f"tables {config.table_names()}: FBGEMM's row-wise state is not one block of "
                "the tables' rows in order; use the torch TBE"
            )
        _, starts = self.fbgemm.weight_buffer()
        self.fast = FastPooledPath(config, starts)
        self.num_features = len(config.feature_table_map())
        self.row_reductions: list[RowReduction | None] | None = None
        self._last_forward: tuple[list[RunBatch], CallLayout] | None = None

    def forward(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
    ) -> Tensor:
        out = self.fbgemm(indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
        self._last_forward = None
        if not out.requires_grad or self.row_reductions is None:
            return out
        layout = CallLayout.of(offsets, self.num_features, batch_size_per_feature_per_rank)
        batches = self.fast.batches(indices, offsets, per_sample_weights, layout)
        self._last_forward = (batches, layout)
        completed: Tensor = _CompleteRowStats.apply(out, self, batches, layout)
        return completed

    def complete_momentum(
        self, grad_output: Tensor, batches: list[RunBatch], layout: CallLayout
    ) -> None:
        """Add ``full mean - own mean`` of g² to every touched row's momentum (before FBGEMM's
        backward adds its own mean)."""
        reductions = self.fast.run_reductions(self.row_reductions)
        if reductions is None:  # a run of several tables that cannot share one row sum
            raise ValueError(
                "FbgemmRowStatsTBE: the row reductions of a run of several tables must share "
                "one row_sum; use the torch TBE for this group"
            )
        # FBGEMM's backward checks the momentum's version: write through an alias without one
        momentum = self.fbgemm.module.momentum1_host.data
        with torch.no_grad():
            touched = self.fast.touched_rows(grad_output, batches, layout)
            squares = row_square_sums(touched)
            full = self.fast.mean_squares(touched, self._spec, reductions, squares=squares)
            for (i, rows, summed), square, mean in zip(touched, squares, full, strict=True):
                assert mean is not None
                run = self.fast.runs[i]
                own = square.div_(summed.shape[1])
                momentum.index_add_(0, rows + run.first_row, mean - own)

    def prepare_backward(self) -> None:
        """Sort the last forward's ids for the backward's row sums (as ``TorchFusedTBE``)."""
        last, self._last_forward = self._last_forward, None
        if last is not None:
            self.fast.prepare(*last)

    # -- FusedTBE protocol: FBGEMM's ------------------------------------------------------

    def split_embedding_weights(self) -> list[Tensor]:
        return self.fbgemm.split_embedding_weights()

    def get_optimizer_state(self) -> list[dict[str, Tensor]]:
        return self.fbgemm.get_optimizer_state()

    def set_learning_rate(self, lr: float) -> None:
        self.fbgemm.set_learning_rate(lr)

    def get_learning_rate(self) -> float:
        return self.fbgemm.get_learning_rate()

    def flush(self) -> None:
        self.fbgemm.flush()

    def reset_cache_states(self) -> None:
        self.fbgemm.reset_cache_states()

    def weight_buffer(self) -> tuple[Tensor, list[int]]:
        return self.fbgemm.weight_buffer()

    def set_optimizer_step(self, step: int) -> None:
        self.fbgemm.set_optimizer_step(step)


class _CompleteRowStats(torch.autograd.Function):
    """Forward: identity. Backward: complete the momentum, pass the gradient on unchanged."""

    @staticmethod
    def forward(
        ctx: Any,
        out: Tensor,
        module: FbgemmRowStatsTBE,
        batches: list[RunBatch],
        layout: CallLayout,
    ) -> Tensor:
        ctx.module = module
        ctx.batches = batches
        ctx.layout = layout
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        ctx.module.complete_momentum(grad, ctx.batches, ctx.layout)
        return grad, None, None, None
