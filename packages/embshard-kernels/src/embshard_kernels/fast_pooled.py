"""A fast plain-torch path for pooled fused lookups: one sort and two ``embedding_bag`` per step.

For SUM / MEAN pooled float32 tables on the CPU, tables of one width next to each other form a
*run*; a step does one ``embedding_bag`` per run for the lookup, sorts the run's ids once
(:func:`embshard_kernels.row_sums.group_rows`), sums each touched row's gradient with a second
``embedding_bag`` over the bags' gradients (each distinct row a "bag" of the bags that read it,
adding them in id order), and applies embshard-optim's update function (SGD or RowWiseAdagrad)
to those rows, or has FBGEMM's row loop write them (``row_update``,
:mod:`embshard_kernels.fbgemm_rows`; a ``RowExchange`` hook's ``unsummed`` method may then hand
back rows that repeat, which the loop sums in order). Where no row is exchanged and no row
statistic completed, rows are summed and updated a chunk of ``SUM_CHUNK_BYTES`` at a time.
Untouched rows and state keep their values.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from embshard_kernels.fbgemm_mapping import device_type
from embshard_kernels.fbgemm_rows import FbgemmRowUpdate
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_kernels.lookup import CallLayout, arrange_pooled, split_pooled
from embshard_kernels.row_sums import group_rows
from embshard_optim.sparse_rules.adagrad import rowwise_adagrad_update
from embshard_optim.sparse_rules.base import RowReduction
from embshard_optim.sparse_rules.sgd import sgd_update
from embshard_optim.specs import OptimizerSpec, OptimType
from embshard_types.vocab import DataType, PoolingType

RowExchange = Callable[[str, Tensor, Tensor, int], tuple[Tensor, Tensor]]
"""``(label, rows, summed grads, run rows) -> (rows, grads)`` to apply, rows distinct (see
``update``). A hook may also have a method ``unsummed`` of the same signature whose rows may
repeat: the caller sums a repeated row's gradients in the order given (a zero adds nothing).
The fast path calls it instead where FBGEMM's row loop writes the rows and no row statistic is
completed."""


FAST_OPTIMIZERS = (OptimType.SGD, OptimType.ROWWISE_ADAGRAD)
"""Optimizers the fast path applies (RowWiseAdagrad without weight decay or max-norm)."""

SUM_CHUNK_BYTES = 4 << 20
"""Rows summed at once where they are updated chunk by chunk: a block glibc hands out again from
its heap. A larger block (over its mmap threshold, at most 32 MB) is mapped anew on every
allocation and its pages faulted in each step (134k rows x 64: 14 ms instead of 1.2)."""

PREPARED_FORWARDS = 2
"""Forwards whose backward plans are kept: this step's and the next one's."""


def fast_path_refusal(
    config: GroupedEmbeddingConfig, spec: OptimizerSpec, device: torch.device | str | None
) -> str | None:
    """Why :class:`FastPooledPath` cannot serve ``config`` with ``spec`` on ``device``, or ``None``."""
    if device_type(device) != "cpu":
        return "the fast pooled path runs on the CPU only"
    if config.pooling not in (PoolingType.SUM, PoolingType.MEAN):
        return f"the fast pooled path needs SUM or MEAN pooling, not {config.pooling.value!r}"
    if config.data_type is not DataType.FP32:
        return f"the fast pooled path needs fp32 weights, not {config.data_type.value!r}"
    if spec.optim_type not in FAST_OPTIMIZERS:
        return f"the fast pooled path has no {spec.optim_type.name}"
    if spec.weight_decay > 0.0 or spec.max_norm > 0.0:
        return "the fast pooled path applies no weight decay and no max-norm"
    return None


@dataclass(frozen=True)
class TableRun:
    """Consecutive tables of one width, seen as one ``[rows, width]`` block of the weights.

    Attributes:
        start: where the block starts in the flat weight buffer (elements).
        first_row: the block's first row among the group's rows (its state offset).
        features: the (consecutive) features that read a table of the run.
        row_bases: per feature of ``features``, the first row of its table in the block.
        tables: the group's tables in the run.
    """

    start: int
    first_row: int
    rows: int
    width: int
    features: range
    row_bases: tuple[int, ...]
    tables: range = range(0)


def table_runs(
    shapes: list[tuple[int, int]], starts: list[int], feature_table_map: list[int]
) -> list[TableRun]:
    """Split tables (``shapes[t]`` at flat offset ``starts[t]``) into runs of one width.

    Raises:
        ValueError: ``feature_table_map`` (per feature, its table) is not non-decreasing.
    """
    if any(a > b for a, b in itertools.pairwise(feature_table_map)):
        raise ValueError(f"feature_table_map {feature_table_map} must list features table by table")
    first_rows = [sum(r for r, _ in shapes[:t]) for t in range(len(shapes) + 1)]
    runs: list[TableRun] = []
    first = 0
    for t in range(1, len(shapes) + 1):
        if t < len(shapes) and shapes[t][1] == shapes[first][1]:
            continue
        features = [f for f, u in enumerate(feature_table_map) if first <= u < t]
        runs.append(
            TableRun(
                start=starts[first],
                first_row=first_rows[first],
                rows=first_rows[t] - first_rows[first],
                width=shapes[first][1],
                features=range(features[0], features[-1] + 1) if features else range(0),
                row_bases=tuple(
                    first_rows[feature_table_map[f]] - first_rows[first] for f in features
                ),
                tables=range(first, t),
            )
        )
        first = t
    return runs


@dataclass(frozen=True)
class SharedRowSums:
    """One ``row_sum`` for all the tables of a group (their column blocks share the ranks).

    ``row_sum`` takes the partial sums of every table's touched rows (tables in order, rows
    sorted) and returns the full-row sums; ``full_dims`` holds each table's full width.
    """

    row_sum: Callable[[Tensor], Tensor]
    full_dims: tuple[int, ...]


class RowPlan(NamedTuple):
    """A run's CSR ``[distinct rows x bags]`` pattern (see ``FastPooledPath._plan``): sorted
    int64 ``rows``, ``crow``, ``bags`` (column indices), ``values`` (``None``: all ones), and
    how bags are numbered (``sample_major_features``, 0: feature-major)."""

    rows: Tensor
    crow: Tensor
    bags: Tensor
    values: Tensor | None
    sample_major_features: int


class RunBatch(NamedTuple):
    """One run's part of a call: per id its row of the run (int32 below 2**31 rows, else
    int64), the bag offsets into them (same dtype) and the per-id weights (or ``None``)."""

    rows: Tensor
    offsets: Tensor
    weights: Tensor | None


class FastPooledPath:
    """Lookup and fused update of a pooled group (``config`` passed :func:`fast_path_refusal`;
    ``starts``: where each table starts in the flat weight buffer)."""

    def __init__(self, config: GroupedEmbeddingConfig, starts: list[int]) -> None:
        shapes = [(t.rows, t.cols) for t in config.embedding_tables]
        self.runs = table_runs(shapes, starts, config.feature_table_map())
        self.feature_dims = config.embedding_dims()
        self.pooling = config.pooling
        names = [t.name for t in config.embedding_tables]
        self.labels = ["+".join(names[t] for t in run.tables) for run in self.runs]
        """Per run, its tables' names joined by ``+`` (what a row exchange is told)."""
        total = sum(r for r, _ in shapes)
        self._index_dtype = torch.int32 if total < 2**31 else torch.int64
        self.row_update: FbgemmRowUpdate | None = None
        """Writes the update where set (FBGEMM's row loop), else embshard-optim's rules do."""
        # The plans of the latest forwards whose backward has not run (two: a semi-synchronous
        # pipeline looks up the next batch before this batch's backward).
        self._prepared: deque[tuple[list[RunBatch], list[RowPlan | None]]] = deque(
            maxlen=PREPARED_FORWARDS
        )
        first_rows = [sum(r for r, _ in shapes[:t]) for t in range(len(shapes))]
        self._table_firsts = [
            [first_rows[t] - first_rows[run.tables[0]] for t in run.tables] if run.tables else []
            for run in self.runs
        ]

    def run_weights(self, flat: Tensor, run: TableRun) -> Tensor:
        """The run's ``[rows, width]`` view of the flat weight buffer."""
        return flat[run.start : run.start + run.rows * run.width].view(run.rows, run.width)

    def batches(
        self, indices: Tensor, offsets: Tensor, weights: Tensor | None, layout: CallLayout
    ) -> list[RunBatch]:
        """Per run, the call's ids as rows of the run, its bag offsets and per-id weights."""
        out = []
        dtype = self._index_dtype
        for run in self.runs:
            lo, hi = run.features.start, run.features.stop
            ids_at = slice(layout.id_bounds[lo], layout.id_bounds[hi])
            bag_offsets = offsets[layout.bag_bounds[lo] : layout.bag_bounds[hi] + 1]
            rows = indices[ids_at].to(dtype, copy=True)
            # each feature's ids are one slice: add its table's first row there, in place
            first = layout.id_bounds[lo]
            for f, base in zip(run.features, run.row_bases, strict=True):
                if base:
                    rows[layout.id_bounds[f] - first : layout.id_bounds[f + 1] - first] += base
            out.append(
                RunBatch(
                    rows,
                    (bag_offsets - layout.id_bounds[lo]).to(dtype),
                    None if weights is None else weights[ids_at],
                )
            )
        return out

    def lookup(self, flat: Tensor, batches: list[RunBatch], layout: CallLayout) -> Tensor:
        """Pooled output in FBGEMM's layout (``[batch, sum of dims]`` or the flat one)."""
        blocks: list[Tensor] = [flat.new_zeros(0)] * len(self.feature_dims)
        mean = self.pooling is PoolingType.MEAN
        for run, batch in zip(self.runs, batches, strict=True):
            mode = "mean" if mean and batch.weights is None else "sum"
            pooled = F.embedding_bag(
                batch.rows,
                self.run_weights(flat, run),
                batch.offsets,
                mode=mode,
                per_sample_weights=batch.weights,
                include_last_offset=True,
            )
            if mean and batch.weights is not None:
                pooled = pooled / _divisors(batch).to(pooled.dtype)
            sizes = [layout.bag_bounds[f + 1] - layout.bag_bounds[f] for f in run.features]
            for f, block in zip(run.features, pooled.split(sizes), strict=True):
                blocks[f] = block
        return arrange_pooled(blocks, layout.batch_per_rank)

    def run_reductions(
        self, reductions: Sequence[RowReduction | None] | None
    ) -> list[RowReduction | None] | SharedRowSums | None:
        """How the update completes row statistics, from the reductions given per table.

        Returns :class:`SharedRowSums` when all tables share one ``row_sum``; else per run, its
        table's reduction (or ``None``); ``None`` when a run of several tables cannot take them.
        """
        if reductions is None:
            return [None] * len(self.runs)
        present = [r for r in reductions if r is not None]
        if len(present) == len(reductions) > 1 and len({id(r.row_sum) for r in present}) == 1:
            return SharedRowSums(present[0].row_sum, tuple(r.full_dim for r in present))
        out: list[RowReduction | None] = []
        for run in self.runs:
            mine = [reductions[t] for t in run.tables]
            if len(mine) == 1:
                out.append(mine[0])
            elif any(r is not None for r in mine):
                return None
            else:
                out.append(None)
        return out

    def update(
        self,
        flat: Tensor,
        state: dict[str, Tensor],
        grad_output: Tensor,
        batches: list[RunBatch],
        layout: CallLayout,
        spec: OptimizerSpec,
        exchange: RowExchange | None = None,
        reductions: Sequence[RowReduction | None] | SharedRowSums | None = None,
        step: int = 1,
    ) -> None:
        """Apply ``spec`` to every touched row with embshard-optim's update functions.

        Args:
            state: the flat row-wise optimizer state of all the group's rows.
            batches: the forward's :meth:`batches`.
            exchange: called for every run in order, even one without ids, with its label,
                touched rows (sorted, int64), summed gradients and row count; returns what to
                apply; its ``unsummed`` method, if it has one, where FBGEMM's row loop writes
                the rows and no row statistic is completed (that loop sums a repeated row's
                gradients in the order given).
            reductions: from :meth:`run_reductions` (``None``: nothing to complete).
            step: the 1-based step of this update.
        """
        completes = _completes_statistics(spec, reductions)
        if exchange is None and not completes:
            self._update_in_chunks(flat, state, grad_output, batches, layout, spec, step)
            return
        if self.row_update is not None:
            if exchange is not None and not completes:  # the loop sums repeated rows itself
                exchange = getattr(exchange, "unsummed", exchange)
            touched = self._touched_rows(grad_output, batches, layout, exchange)
            self._write_rows(self.row_update, flat, state, touched, spec, reductions, completes)
            return
        touched = self._touched_rows(grad_output, batches, layout, exchange)
        mean_squares = self._mean_squares(touched, spec, reductions)
        for (i, rows, summed), mean_square in zip(touched, mean_squares, strict=True):
            self._apply_rule(flat, state, i, rows, summed, spec, step, mean_square)

    def _apply_rule(
        self,
        flat: Tensor,
        state: dict[str, Tensor],
        i: int,
        rows: Tensor,
        summed: Tensor,
        spec: OptimizerSpec,
        step: int,
        mean_square: Tensor | None,
    ) -> None:
        """embshard-optim's rule on run ``i``'s ``rows`` (``summed``: this step's own sums,
        which the rule may scale in place)."""
        run = self.runs[i]
        at = slice(run.first_row, run.first_row + run.rows)  # the run's rows of the flat state
        run_state = {name: value[at] for name, value in state.items()}
        weight = self.run_weights(flat, run)
        if spec.optim_type is OptimType.SGD:
            sgd_update(spec, weight, run_state, rows, summed, step, consume_grad=True)
        else:
            rowwise_adagrad_update(
                spec,
                weight,
                run_state,
                rows,
                summed,
                step,
                mean_square=mean_square,
                consume_grad=True,
            )

    def _write_rows(
        self,
        row_update: FbgemmRowUpdate,
        flat: Tensor,
        state: dict[str, Tensor],
        touched: list[tuple[int, Tensor, Tensor]],
        spec: OptimizerSpec,
        reductions: Sequence[RowReduction | None] | SharedRowSums | None,
        completes: bool,
    ) -> None:
        """:meth:`update` by FBGEMM's row loop. Where a run's rows are column shards
        (``completes``: see :func:`_completes_statistics`), FBGEMM's RowWiseAdagrad would add
        the mean of g² over the shard's own columns: the momentum gets ``full mean - own mean``
        first, so it ends as the unsharded table's (within rounding)."""
        squares = _row_square_sums(touched) if completes else []
        full = self._mean_squares(touched, spec, reductions, squares) if completes else []
        for k, (i, rows, summed) in enumerate(touched):
            run = self.runs[i]
            at = slice(run.first_row, run.first_row + run.rows)
            momentum = state["momentum1"][at] if "momentum1" in state else None
            if completes and momentum is not None:
                mean = full[k]
                assert mean is not None
                momentum.index_add_(0, rows, mean - squares[k].div_(summed.shape[1]))
            row_update.apply(spec, self.run_weights(flat, run), momentum, rows, summed)

    def _touched_rows(
        self,
        grad_output: Tensor,
        batches: list[RunBatch],
        layout: CallLayout,
        exchange: RowExchange | None = None,
    ) -> list[tuple[int, Tensor, Tensor]]:
        """Per run with touched rows: ``(run, rows, summed gradients)`` of this call (rows
        int64, relative to the run, sorted and distinct unless the exchange returned repeats;
        sums new tensors the caller may overwrite).

        ``exchange`` (see :meth:`update`) is called for every run in order, even one without
        ids.
        """
        touched: list[tuple[int, Tensor, Tensor]] = []
        for i, bag_grads, plan in self._run_inputs(grad_output, batches, layout, exchange):
            rows, summed = _row_sums(bag_grads, plan)
            if exchange is not None:
                rows, summed = exchange(self.labels[i], rows, summed, self.runs[i].rows)
            if rows.numel():
                touched.append((i, rows, summed))
        return touched

    def _update_in_chunks(
        self,
        flat: Tensor,
        state: dict[str, Tensor],
        grad_output: Tensor,
        batches: list[RunBatch],
        layout: CallLayout,
        spec: OptimizerSpec,
        step: int,
    ) -> None:
        """:meth:`update` without exchange or completed statistics: each run's rows summed and
        written ``SUM_CHUNK_BYTES`` of sums at a time (rows are independent: the same result)."""
        for i, bag_grads, plan in self._run_inputs(grad_output, batches, layout):
            if plan is None:
                continue
            run = self.runs[i]
            momentum = None
            if self.row_update is not None and "momentum1" in state:
                momentum = state["momentum1"][run.first_row : run.first_row + run.rows]
            chunk = max(1, SUM_CHUNK_BYTES // (4 * run.width))
            count = plan.rows.numel()
            ends = [*plan.crow[: count + 1 : chunk].tolist(), int(plan.crow[count])]
            for k, lo in enumerate(range(0, count, chunk)):
                hi = min(lo + chunk, count)
                first, last = ends[k], ends[k + 1]
                part = RowPlan(
                    plan.rows[lo:hi],
                    plan.crow[lo : hi + 1] - first,
                    plan.bags[first:last],
                    None if plan.values is None else plan.values[first:last],
                    plan.sample_major_features,
                )
                rows, summed = _row_sums(bag_grads, part)
                if self.row_update is not None:
                    weight = self.run_weights(flat, run)
                    self.row_update.apply(spec, weight, momentum, rows, summed)
                    continue
                (mean_square,) = self._mean_squares([(i, rows, summed)], spec, None)
                self._apply_rule(flat, state, i, rows, summed, spec, step, mean_square)

    def _run_inputs(
        self,
        grad_output: Tensor,
        batches: list[RunBatch],
        layout: CallLayout,
        exchange: RowExchange | None = None,
    ) -> list[tuple[int, Tensor, RowPlan | None]]:
        """Per run (each one where ``exchange`` is set, else those with ids): ``(run, its bags'
        gradients, its pattern)`` (the prepared one, else worked out now; ``None``: no ids)."""
        grad_output = grad_output.float()
        # One run of every feature, one batch size: the gradient [batch, features * width] is,
        # as it is, a [batch * features, width] matrix of bags in sample-major order; the
        # sparse product reads it there instead of from a feature-major copy.
        sample_major = bool(self._sample_major_features(layout)) and grad_output.dim() == 2
        plans = self._take_prepared(batches)
        grads = (
            []
            if sample_major
            else split_pooled(grad_output, self.feature_dims, layout.batch_per_rank)
        )
        out: list[tuple[int, Tensor, RowPlan | None]] = []
        for i, (run, batch) in enumerate(zip(self.runs, batches, strict=True)):
            if batch.rows.numel() == 0 and exchange is None:
                continue
            if sample_major:
                bag_grads = grad_output.contiguous().view(-1, run.width)
                features = len(run.features)
            else:
                parts = [grads[f] for f in run.features]
                if not parts:
                    bag_grads = grad_output.new_zeros(0, run.width)
                else:
                    bag_grads = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
                features = 0
            plan = plans[i] if plans is not None else None
            if plan is None or plan.sample_major_features != features:
                plan = self._plan(batch, features)
            out.append((i, bag_grads, plan))
        return out

    def _mean_squares(
        self,
        touched: list[tuple[int, Tensor, Tensor]],
        spec: OptimizerSpec,
        reductions: Sequence[RowReduction | None] | SharedRowSums | None,
        squares: list[Tensor] | None = None,
    ) -> list[Tensor | None]:
        """Per touched run, the mean of g² over each full row (RowWiseAdagrad), else ``None``.

        ``squares``: the runs' :func:`_row_square_sums`, if the caller has them (left as they are).
        """
        if spec.optim_type is not OptimType.ROWWISE_ADAGRAD:
            return [None] * len(touched)
        if squares is None:
            squares = _row_square_sums(touched)
        if isinstance(reductions, SharedRowSums):
            # one call for the whole group: the runs' rows in order are its tables in order
            full = reductions.row_sum(torch.cat(squares) if squares else torch.zeros(0))
            out: list[Tensor | None] = []
            for (i, rows, _), part in zip(
                touched, full.split([s.numel() for s in squares]), strict=True
            ):
                out.append(part / self._full_dims_of(i, rows, reductions.full_dims))
            return out
        out = []
        for (i, _rows, summed), square in zip(touched, squares, strict=True):
            reduction = reductions[i] if reductions is not None else None
            if reduction is None:
                out.append(square / summed.shape[1])
            else:  # a column shard: the other columns' squares live on other ranks
                out.append(reduction.row_sum(square).div(reduction.full_dim))
        return out

    def _full_dims_of(self, i: int, rows: Tensor, full_dims: tuple[int, ...]) -> Tensor:
        """The full width of the table of each of run ``i``'s ``rows``."""
        run = self.runs[i]
        if len({full_dims[t] for t in run.tables}) == 1:  # one width: no per-row lookup
            return torch.tensor(float(full_dims[run.tables[0]]))
        firsts = torch.tensor(self._table_firsts[i])
        table = torch.searchsorted(firsts, rows, right=True) - 1
        dims = torch.tensor([float(full_dims[t]) for t in run.tables])
        return dims.index_select(0, table)

    def prepare(self, batches: list[RunBatch], layout: CallLayout) -> None:
        """Work out ahead of the backward what its sums need from the ids alone (e.g. while
        the output all-to-all is in flight); kept for the latest ``PREPARED_FORWARDS``
        forwards."""
        features = self._sample_major_features(layout)
        self._prepared.append((batches, [self._plan(b, features) for b in batches]))

    def _take_prepared(self, batches: list[RunBatch]) -> list[RowPlan | None] | None:
        """The plans prepared for ``batches`` (that very forward), removed; ``None`` if none."""
        for i, (prepared, plans) in enumerate(self._prepared):
            if prepared is batches:
                del self._prepared[i]
                return plans
        return None

    def _sample_major_features(self, layout: CallLayout) -> int:
        """The features of the one run when the gradient can be read sample-major, else 0."""
        if len(self.runs) == 1 and layout.batch_per_rank is None:
            return len(self.runs[0].features)
        return 0

    def _plan(self, batch: RunBatch, sample_major_features: int) -> RowPlan | None:
        """The sparse ``[distinct rows x bags]`` pattern of ``batch`` (``None``: no ids).

        Row ``r`` holds, at the bag of every id that reads ``r``, 1 or the id's weight (MEAN:
        divided by the bag's length); bags are numbered feature-major, or sample-major (bag
        ``f * B + i`` is ``i * F + f``) when ``sample_major_features`` is ``F`` > 0.
        """
        n = batch.rows.numel()
        if n == 0:
            return None
        unique, crow, order = group_rows(batch.rows, batch.rows.dtype)
        lengths = batch.offsets.diff()
        bags = torch.arange(lengths.numel(), dtype=batch.rows.dtype)
        if sample_major_features:
            bags = bags.view(-1, sample_major_features).t().reshape(-1)
        bag_of_id = torch.repeat_interleave(bags, lengths, output_size=n).index_select(0, order)
        values = None if batch.weights is None else batch.weights.index_select(0, order).float()
        if self.pooling is PoolingType.MEAN:
            inverse_lengths = 1.0 / lengths.clamp(min=1).float()
            scale = torch.repeat_interleave(inverse_lengths, lengths, output_size=n)
            scale = scale.index_select(0, order)
            values = scale if values is None else values.mul_(scale)
        return RowPlan(
            unique.long(),  # index_add_ is much slower with int32 indices
            crow,
            bag_of_id,
            values,
            sample_major_features,
        )


def _row_sums(bag_grads: Tensor, plan: RowPlan | None) -> tuple[Tensor, Tensor]:
    """The rows of ``plan`` (sorted, int64; none for ``None``) and each one's summed gradient
    (a new tensor): the product of the pattern with ``bag_grads`` (numbered as ``plan`` says),
    one ``embedding_bag`` whose bags are the rows and whose "ids" the bags that read them."""
    if plan is None:
        return torch.zeros(0, dtype=torch.int64, device=bag_grads.device), bag_grads.new_zeros(
            0, bag_grads.shape[1]
        )
    summed = F.embedding_bag(
        plan.bags,
        bag_grads,
        plan.crow,
        mode="sum",
        per_sample_weights=plan.values,
        include_last_offset=True,
    )
    return plan.rows, summed


def _completes_statistics(
    spec: OptimizerSpec, reductions: Sequence[RowReduction | None] | SharedRowSums | None
) -> bool:
    """Whether RowWiseAdagrad's row statistic is completed over column blocks (``reductions``
    from :meth:`FastPooledPath.run_reductions`)."""
    return spec.optim_type is OptimType.ROWWISE_ADAGRAD and (
        isinstance(reductions, SharedRowSums)
        or (reductions is not None and any(r is not None for r in reductions))
    )


def _row_square_sums(touched: list[tuple[int, Tensor, Tensor]]) -> list[Tensor]:
    """Per touched run (see :meth:`FastPooledPath._touched_rows`), each row's sum of g²."""
    # from the row norms: one pass, where (g * g).sum(1) allocates a copy
    return [torch.linalg.vector_norm(g, dim=1).square_() for _, _, g in touched]


def _divisors(batch: RunBatch) -> Tensor:
    """MEAN's divisor of each bag, ``[bags, 1]`` (its length, 1 for an empty bag)."""
    return batch.offsets.diff().clamp(min=1).unsqueeze(1)
