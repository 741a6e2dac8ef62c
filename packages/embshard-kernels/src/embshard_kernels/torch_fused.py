"""A fused TBE in plain torch: the optimizer runs inside the backward, as in FBGEMM.

``TorchFusedTBE`` serves the :class:`~embshard_kernels.tbe.FusedTBE` protocol for what FBGEMM
cannot run faithfully, and on the fast pooled path. Weights and state change only in the
backward, only on touched rows, by embshard-optim's update functions on the per-row summed
gradients. Hooks ``grad_exchange`` and ``row_reductions`` let a sharded collection adjust them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from embshard_kernels import hugepages
from embshard_kernels.call_gather import CallGather, PooledCall, RunIds
from embshard_kernels.fast_pooled import FastPooledPath, RowExchange, RunBatch, fast_path_refusal
from embshard_kernels.fbgemm_mapping import data_type_to_dtype
from embshard_kernels.fbgemm_rows import FbgemmRowUpdate, row_update_refusal
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_kernels.lookup import CallLayout, pooled_lookup, sequence_lookup, split_pooled
from embshard_optim.sparse_rules import aggregate, rule_for
from embshard_optim.sparse_rules.base import RowReduction
from embshard_types.vocab import PoolingType

GradExchange = RowExchange
"""``(block label, rows, summed grads, block rows) -> (rows, grads)`` to apply (and an optional
``unsummed`` method: see ``RowExchange``)."""


class TorchFusedTBE(nn.Module):
    """Plain-torch fused TBE, on the fast pooled path where it fits, else table by table.

    ``grad_exchange`` (``None``: off) is called for every block of rows in every backward, even
    one with no touched row, in the same order on every rank: a table (label: its name) on the
    general path, a run (names joined by ``+``) on the fast path; it gets the touched rows
    (sorted, int64, relative to the block) and their summed gradients, and returns what to apply
    (a hook's ``unsummed`` method may return rows that repeat: see ``RowExchange``).
    ``row_reductions[table]`` completes row-wise statistics of a column shard. A backward that
    needs per-sample-weight gradients, or reductions a run cannot take, uses the general path.
    ``call_gather`` (replicated tables): on the fast path with one batch size, first offered the
    call; where it returns every rank's call joined, that call is applied, without a row exchange.

    Args:
        config: the tables.
        params: the optimizer (any ``OptimType``) and the output dtype.
        device: where the weights and state live.
        fast: use the fast pooled path (``None``: wherever it fits).
        fbgemm_rows: on the fast path, let FBGEMM's CPU kernels write the update of the summed
            rows where they can (:mod:`embshard_kernels.fbgemm_rows`).
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        params: FusedParams,
        device: torch.device | str | None = None,
        *,
        fast: bool | None = None,
        fbgemm_rows: bool = False,
    ) -> None:
        super().__init__()
        refusal = fast_path_refusal(config, params.optimizer, device)
        if fast and refusal is not None:
            raise ValueError(f"tables {config.table_names()}: {refusal}")
        dtype = data_type_to_dtype(config.data_type)
        shapes = [(t.rows, t.cols) for t in config.embedding_tables]
        starts = [0]
        for rows, cols in shapes:
            starts.append(starts[-1] + rows * cols)
        # rows are read and written scattered over the buffer: huge pages where possible
        self.weights = nn.Parameter(hugepages.zeros(starts[-1], dtype, device))
        self._starts = starts[:-1]
        self._shapes = shapes
        self.feature_table_map = config.feature_table_map()
        self.table_names = [t.name for t in config.embedding_tables]
        self.feature_dims = config.embedding_dims()
        self.pooling = config.pooling
        self.output_dtype = data_type_to_dtype(params.output_dtype)
        self.rule = rule_for(params.optimizer)
        fast = refusal is None if fast is None else fast
        self.fast = FastPooledPath(config, self._starts) if fast else None
        if (
            self.fast is not None
            and fbgemm_rows
            and row_update_refusal(params.optimizer, self.weights) is None
        ):
            self.fast.row_update = FbgemmRowUpdate(params.optimizer)
        if self.fast is not None:  # row-wise state only: one flat buffer, viewed per table
            total = sum(rows for rows, _ in shapes)
            self._row_state = self.rule.init_state(total, 1, dtype=torch.float32, device=device)
            firsts = [sum(rows for rows, _ in shapes[:t]) for t in range(len(shapes))]
            self.states = [
                {name: flat[first : first + rows] for name, flat in self._row_state.items()}
                for first, (rows, _) in zip(firsts, shapes, strict=True)
            ]
        else:
            self._row_state = {}
            self.states = [
                self.rule.init_state(rows, cols, dtype=torch.float32, device=device)
                for rows, cols in shapes
            ]
        self.step = 0
        self.grad_exchange: GradExchange | None = None
        self.call_gather: CallGather | None = None
        self._last_forward: tuple[list[RunBatch], CallLayout] | None = None
        self.row_reductions: list[RowReduction | None] | None = None

    def tables(self) -> list[Tensor]:
        """Per table, a ``[rows, dim]`` view of the weight buffer (no autograd history)."""
        flat = self.weights.detach()
        return [
            flat[s : s + r * c].view(r, c)
            for s, (r, c) in zip(self._starts, self._shapes, strict=True)
        ]

    def forward(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
    ) -> Tensor:
        layout = CallLayout.of(
            offsets, len(self.feature_table_map), batch_size_per_feature_per_rank
        )
        out: Tensor = _FusedLookup.apply(
            self.weights, indices, offsets, per_sample_weights, self, layout
        )
        if not out.requires_grad:  # no backward will come: nothing to prepare
            self._last_forward = None
        return out

    # -- FusedTBE protocol ----------------------------------------------------------------

    def split_embedding_weights(self) -> list[Tensor]:
        return self.tables()

    def get_optimizer_state(self) -> list[dict[str, Tensor]]:
        return [dict(state) for state in self.states]

    def set_learning_rate(self, lr: float) -> None:
        self.rule = rule_for(replace(self.rule.spec, learning_rate=float(lr)))

    def get_learning_rate(self) -> float:
        return self.rule.spec.learning_rate

    def flush(self) -> None:
        """Nothing is cached: a no-op."""

    def reset_cache_states(self) -> None:
        """Nothing is cached: a no-op."""

    def weight_buffer(self) -> tuple[Tensor, list[int]]:
        return self.weights, list(self._starts)

    def set_optimizer_step(self, step: int) -> None:
        """The next backward uses step ``step + 1``."""
        self.step = int(step)

    def prepare_backward(self) -> None:
        """Work out what the next backward needs from the last forward's ids alone (the fast
        path's sort of the ids), e.g. while the output all-to-all is in flight; a no-op when
        there is nothing to prepare."""
        last, self._last_forward = self._last_forward, None
        # a gathered call is sorted in the backward; one declined sorts its own ids there
        if last is not None and self.fast is not None and self.call_gather is None:
            self.fast.prepare(*last)

    def apply_call(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        batch_size_per_feature_per_rank: list[list[int]] | None,
        grad_output: Tensor,
    ) -> None:
        """The fused backward of a call whose output got ``grad_output``, without its lookup:
        exactly the update the call's own backward applies (gradient accumulation replays the
        joined micro-batches this way)."""
        layout = CallLayout.of(
            offsets, len(self.feature_table_map), batch_size_per_feature_per_rank
        )
        batches = (
            self.fast.batches(indices, offsets, per_sample_weights, layout)
            if self.fast is not None
            else None
        )
        with torch.no_grad():
            self.backward_and_update(
                grad_output,
                indices,
                offsets,
                per_sample_weights,
                layout,
                need_weight_grad=False,
                batches=batches,
            )

    # -- the two halves of a step ---------------------------------------------------------

    def lookup(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        layout: CallLayout,
        batches: list[RunBatch] | None = None,
    ) -> Tensor:
        if self.fast is not None and batches is not None:
            return self.fast.lookup(self.weights.detach(), batches, layout).to(self.output_dtype)
        tables = self.tables()
        if self.pooling is PoolingType.NONE:
            out = sequence_lookup(tables, self.feature_table_map, indices, offsets, layout)
        else:
            out = pooled_lookup(
                tables,
                self.feature_table_map,
                indices,
                offsets,
                per_sample_weights,
                self.pooling,
                layout=layout,
            )
        return out.to(self.output_dtype)

    def backward_and_update(
        self,
        grad_output: Tensor,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        layout: CallLayout,
        need_weight_grad: bool,
        batches: list[RunBatch] | None = None,
    ) -> Tensor | None:
        """Apply the optimizer to every touched row; return d(loss)/d(per_sample_weights).

        ``batches`` (from :meth:`FastPooledPath.batches` in the forward) selects the fast path
        when no per-sample weight needs a gradient and the row reductions fit its runs.
        """
        needs_weight_grad = per_sample_weights is not None and need_weight_grad
        if self.fast is not None and batches is not None and not needs_weight_grad:
            reductions = self.fast.run_reductions(self.row_reductions)
            if reductions is not None:
                self.step += 1
                joined = self._gather_call(
                    indices, offsets, per_sample_weights, grad_output, layout, batches
                )
                exchange = self.grad_exchange
                if joined is not None:
                    layout = CallLayout.of(joined.offsets, len(self.feature_table_map), None)
                    batches = self.fast.batches(
                        joined.indices, joined.offsets, joined.per_sample_weights, layout
                    )
                    grad_output, exchange = joined.grad_output, None
                self.fast.update(
                    self.weights.detach(),
                    self._row_state,
                    grad_output,
                    batches,
                    layout,
                    self.rule.spec,
                    exchange=exchange,
                    reductions=reductions,
                    step=self.step,
                )
                return None
        per_id = self._per_id_grads(grad_output.float(), offsets, per_sample_weights, layout)
        tables = self.tables()
        weight_grad = None
        if per_sample_weights is not None:
            if need_weight_grad:  # with the weights as they are before this update
                weight_grad = torch.cat(
                    [
                        (g * tables[t].index_select(0, layout.ids(indices, f)).float()).sum(1)
                        for f, (t, g) in enumerate(zip(self.feature_table_map, per_id, strict=True))
                    ]
                ).to(per_sample_weights.dtype)
            per_id = [
                g * layout.ids(per_sample_weights, f).unsqueeze(1).float()
                for f, g in enumerate(per_id)
            ]
        self.step += 1
        for t, table in enumerate(tables):
            features = [f for f, ft in enumerate(self.feature_table_map) if ft == t]
            ids = torch.cat([layout.ids(indices, f) for f in features])
            if ids.numel() == 0 and self.grad_exchange is None:
                continue
            rows, grads = aggregate(ids, torch.cat([per_id[f] for f in features]))
            if self.grad_exchange is not None:
                rows, grads = self.grad_exchange(
                    self.table_names[t], rows, grads, self._shapes[t][0]
                )
            reduction = self.row_reductions[t] if self.row_reductions is not None else None
            self.rule.apply(
                table,
                self.states[t],
                rows,
                grads,
                self.step,
                check_bounds=False,
                reduction=reduction,
            )
        return weight_grad

    def _gather_call(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        grad_output: Tensor,
        layout: CallLayout,
        batches: list[RunBatch],
    ) -> PooledCall | None:
        """Every rank's call joined by ``call_gather`` where it is set and takes the call; a
        call it cannot join (batch sizes per feature, completed statistics) is offered as
        ``None``, so that every rank declines alike."""
        if self.call_gather is None or self.fast is None:
            return None
        joinable = (
            layout.batch_per_rank is None
            and grad_output.dim() == 2
            and (self.row_reductions is None or all(r is None for r in self.row_reductions))
        )
        runs = [
            RunIds(batch.rows.numel(), run.rows, run.width)
            for run, batch in zip(self.fast.runs, batches, strict=True)
        ]
        call = PooledCall(indices, offsets, per_sample_weights, grad_output) if joinable else None
        return self.call_gather(call, len(self.feature_table_map), runs)

    def _per_id_grads(
        self,
        grad_output: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        layout: CallLayout,
    ) -> list[Tensor]:
        """Per feature, the gradient reaching each of its ids (before per-sample weights)."""
        if self.pooling is PoolingType.NONE:
            return [layout.ids(grad_output, f) for f in range(len(self.feature_table_map))]
        blocks = split_pooled(grad_output, self.feature_dims, layout.batch_per_rank)
        out = []
        for f, block in enumerate(blocks):
            lengths = layout.bag_offsets(offsets, f).diff()
            if self.pooling is PoolingType.MEAN:
                block = block / lengths.clamp(min=1).unsqueeze(1).to(block.dtype)
            bag_of_id = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=lengths.device), lengths
            )
            out.append(block.index_select(0, bag_of_id))
        return out


class _FusedLookup(torch.autograd.Function):
    """Forward: the lookup. Backward: the optimizer step on the touched rows."""

    @staticmethod
    def forward(
        ctx: Any,
        weights: Tensor,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        module: TorchFusedTBE,
        layout: CallLayout,
    ) -> Tensor:
        ctx.module = module
        ctx.layout = layout
        ctx.save_for_backward(indices, offsets, per_sample_weights)
        ctx.batches = (
            module.fast.batches(indices, offsets, per_sample_weights, layout)
            if module.fast is not None
            else None
        )
        module._last_forward = None if ctx.batches is None else (ctx.batches, layout)
        return module.lookup(indices, offsets, per_sample_weights, layout, ctx.batches)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        indices, offsets, per_sample_weights = ctx.saved_tensors
        weight_grad = ctx.module.backward_and_update(
            grad_output,
            indices,
            offsets,
            per_sample_weights,
            ctx.layout,
            need_weight_grad=ctx.needs_input_grad[3],
            batches=ctx.batches,
        )
        return None, None, None, weight_grad, None, None
