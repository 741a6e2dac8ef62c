"""Whole-batch checks of a KeyedJaggedTensor, whatever constructor built it.

:class:`KJTChecker` checks what a lookup relies on: the layout (no negative length, offsets from
0 and non-decreasing, lengths and offsets agreeing, the bags covering exactly the values), integer
ids in ``[0, rows)`` of their table, floating-point and finite weights, every wanted feature
present. A good batch costs a few whole-tensor reductions and one device read; only a bad one is
searched for the first offending entry. Keys the checker does not know are ignored (as TorchRec
ignores features a collection does not use), except that the layout must hold for the batch.
The result is an :class:`~embshard_types.sparse.input_problems.InputProblem`, or ``None``.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Sequence

import torch
from torch import Tensor

from embshard_types.sparse.input_problems import (
    NO_FEATURE,
    InputProblem,
    Problem,
    dtype_index,
)
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

CHECKS_ENV_VAR = "EMBSHARD_SKIP_INPUT_CHECKS"
"""Set to ``1`` to skip the collections' input checks, for inputs validated upstream."""


def input_checks_enabled() -> bool:
    """Whether collections check their input (on unless ``EMBSHARD_SKIP_INPUT_CHECKS=1``)."""
    return os.environ.get(CHECKS_ENV_VAR, "").strip() not in ("1", "true", "yes")


def _is_integer(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _dtype_code(t: Tensor) -> int:
    return dtype_index(str(t.dtype).removeprefix("torch."))


class _KeyPlan:
    """What the checker derives once per input key order and device."""

    def __init__(
        self, keys: Sequence[str], index: dict[str, int], rows: Sequence[int], device: torch.device
    ) -> None:
        self.feature_of_key = [index.get(k, -2 - i) for i, k in enumerate(keys)]
        present = set(keys)
        self.missing = next((f for f, name in enumerate(index) if name not in present), None)
        big = torch.iinfo(torch.int64).max
        self.limits = torch.tensor(
            [rows[f] if f >= 0 else big for f in self.feature_of_key],
            dtype=torch.int64,
            device=device,
        )
        self.all_used = all(f >= 0 for f in self.feature_of_key)


class KJTChecker:
    """Checks batches for a fixed list of features (see the module docstring).

    Args:
        features: the features looked up, in the order problems name them by.
        rows: per feature, the row count of its table (ids must be below it).
        weighted: whether the lookup reads per-sample weights (they must be present).
    """

    _MAX_CACHED = 16

    def __init__(self, features: Sequence[str], rows: Sequence[int], *, weighted: bool) -> None:
        if len(features) != len(rows):
            raise ValueError(f"KJTChecker: {len(features)} features but {len(rows)} row counts")
        self.features = list(features)
        self._index = {f: i for i, f in enumerate(self.features)}
        self._rows = [int(r) for r in rows]
        self._min_rows = min(self._rows, default=0)
        self._weighted = weighted
        self._plans: dict[tuple[tuple[str, ...], torch.device], _KeyPlan] = {}

    def check(self, kjt: object) -> InputProblem | None:
        """The first problem of ``kjt`` as a lookup of these features sees it, or ``None``."""
        if not isinstance(kjt, KeyedJaggedTensor):
            return InputProblem(Problem.NOT_A_KJT)
        plan = self._plan(kjt)
        values, weights = kjt.values(), kjt.weights_or_none()
        if not _is_integer(values):
            return InputProblem(Problem.IDS_NOT_INTEGER, value=_dtype_code(values))
        if weights is not None and self._weighted and not weights.is_floating_point():
            return InputProblem(Problem.WEIGHTS_NOT_FLOAT, value=_dtype_code(weights))
        if plan.missing is not None:
            return InputProblem(Problem.MISSING_FEATURE, feature=plan.missing)
        if self._weighted and weights is None and self.features:
            return InputProblem(Problem.WEIGHTS_MISSING)
        use_weights = weights if self._weighted else None
        given = (kjt.lengths_or_none() is not None, kjt.offsets_or_none() is not None)
        flags = _summary(kjt, given, values, use_weights)
        low, high = flags[5], flags[6]
        if flags[:5] != [0, 0, values.numel(), 0, 1]:
            layout = _layout_problem(kjt, plan, given, values.numel())
            if layout is not None:
                return layout
        if values.numel() and (
            low < 0 or (high >= self._min_rows and _some_key_over(kjt, plan, values))
        ):
            problem = self._id_problem(kjt, plan, values, low)
            if problem is not None:
                return problem
        if use_weights is not None and not flags[4]:
            return _weight_problem(kjt, plan, use_weights)
        return None

    def _plan(self, kjt: KeyedJaggedTensor) -> _KeyPlan:
        key = (tuple(kjt.keys()), kjt.device())
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self._MAX_CACHED:
                self._plans.clear()
            plan = self._plans[key] = _KeyPlan(key[0], self._index, self._rows, key[1])
        return plan

    def _id_problem(
        self, kjt: KeyedJaggedTensor, plan: _KeyPlan, values: Tensor, low: int
    ) -> InputProblem | None:
        sizes = torch.tensor(kjt.length_per_key(), device=values.device)
        limit = plan.limits.repeat_interleave(sizes, output_size=values.numel())
        bad = values >= limit
        if low < 0:
            used = _used_values(kjt, plan, values)
            bad |= values < 0 if used is None else (values < 0) & used
        found = bad.nonzero()
        if found.numel() == 0:
            return None
        p = int(found[0, 0])
        k, sample = _locate_value(kjt, p)
        f = plan.feature_of_key[k]
        return InputProblem(Problem.ID_OUT_OF_RANGE, f, sample, p, int(values[p]), self._rows[f])


_COMPARE_EACH_BELOW = 16_384
"""Batches with fewer ids compare every id with its key's row count (one expand of the limits);
larger ones take one max per key, which costs a call per key but reads each id once."""


def _some_key_over(kjt: KeyedJaggedTensor, plan: _KeyPlan, values: Tensor) -> bool:
    """Whether some key's largest id reaches its table's row count: for a small batch, every id
    against its key's limit; else one max per key's slice of ``values`` (views, one fused call),
    then one comparison."""
    sizes = kjt.length_per_key()
    if values.numel() < _COMPARE_EACH_BELOW:
        counts = torch.tensor(sizes, device=values.device)
        limits = plan.limits.repeat_interleave(counts, output_size=values.numel())
        return bool((values >= limits).any())
    filled = [i for i, n in enumerate(sizes) if n]
    slices = [s for s in values.split(sizes) if s.numel()]
    maxima = torch.stack(torch._foreach_max(slices))
    limits = plan.limits if len(filled) == len(sizes) else plan.limits[filled]
    return bool((maxima >= limits).any())


def _summary(
    kjt: KeyedJaggedTensor, given: tuple[bool, bool], values: Tensor, weights: Tensor | None
) -> list[int]:
    """``[min(min length, 0), offsets[0], offsets[-1], any offsets step != length, weights all
    finite, id min, id max]`` in one device read; a good batch gives ``[0, 0, len(values), 0, 1,
    ...]``. Decreasing offsets show as a negative length or a step that differs from one.
    """
    lengths, offsets = kjt.lengths(), kjt.offsets()
    zero = torch.zeros((), dtype=torch.int64, device=values.device)
    parts = [
        lengths.min().clamp(max=0).long() if lengths.numel() else zero,
        offsets[0].long(),
        offsets[-1].long(),
        ((offsets.diff() != lengths).any().long() if all(given) and lengths.numel() else zero),
        torch.isfinite(weights).all().long() if weights is not None else zero + 1,
    ]
    if values.numel():
        low, high = torch.aminmax(values)
        parts += [low.long(), high.long()]
    else:
        parts += [zero, zero]
    return [int(x) for x in torch.stack(parts).tolist()]


def _layout_problem(
    kjt: KeyedJaggedTensor, plan: _KeyPlan, given: tuple[bool, bool], num_values: int
) -> InputProblem | None:
    """The first layout problem, searched for after the summary found one.

    Args:
        given: whether the caller gave (lengths, offsets); derived ones agree by construction.
    """
    lengths, offsets = kjt.lengths(), kjt.offsets()
    bounds = kjt.lengths_offset_per_key()

    def at_segment(code: Problem, i: int, value: int, limit: int = 0) -> InputProblem:
        k = min(bisect_right(bounds, i) - 1, len(bounds) - 2)
        if k < 0:
            return InputProblem(code, NO_FEATURE, -1, i, value, limit)
        return InputProblem(code, plan.feature_of_key[k], i - bounds[k], i, value, limit)

    if given[0]:
        negative = (lengths < 0).nonzero()
        if negative.numel():
            i = int(negative[0, 0])
            return at_segment(Problem.NEGATIVE_LENGTH, i, int(lengths[i]))
    if given[1]:
        first = int(offsets[0])
        if first != 0:
            return InputProblem(Problem.OFFSETS_NOT_FROM_ZERO, position=0, value=first)
        steps = offsets.diff()
        drops = (steps < 0).nonzero()
        if drops.numel():
            i = int(drops[0, 0])
            return at_segment(Problem.OFFSETS_DECREASE, i, int(offsets[i + 1]), int(offsets[i]))
        differ = (steps != lengths).nonzero()
        if differ.numel():
            i = int(differ[0, 0])
            return at_segment(Problem.LENGTHS_OFFSETS_DIFFER, i, int(lengths[i]), int(steps[i]))
    total = int(offsets[-1])
    if total > num_values:
        ends = offsets.index_select(0, torch.tensor(bounds[1:], device=offsets.device))
        k = int((ends > num_values).nonzero()[0, 0]) if ends.numel() else -1
        feature = plan.feature_of_key[k] if k >= 0 else NO_FEATURE
        return InputProblem(Problem.TOO_FEW_VALUES, feature, value=total, limit=num_values)
    if total < num_values:
        return InputProblem(Problem.UNCOVERED_VALUES, value=total, limit=num_values)
    return None


def _used_values(kjt: KeyedJaggedTensor, plan: _KeyPlan, like: Tensor) -> Tensor | None:
    """Per value, whether its key is a checked feature (``None``: every key is)."""
    if plan.all_used:
        return None
    used = torch.tensor([f >= 0 for f in plan.feature_of_key], device=like.device)
    sizes = torch.tensor(kjt.length_per_key(), device=like.device)
    return used.repeat_interleave(sizes, output_size=like.numel())


def _locate_value(kjt: KeyedJaggedTensor, position: int) -> tuple[int, int]:
    """``(key index, sample)`` of the value at ``position`` (the layout must be good)."""
    offsets = kjt.offsets()
    segment = int(torch.searchsorted(offsets, torch.tensor(position), right=True)) - 1
    bounds = kjt.lengths_offset_per_key()
    k = bisect_right(bounds, segment) - 1
    return k, segment - bounds[k]


def _weight_problem(kjt: KeyedJaggedTensor, plan: _KeyPlan, weights: Tensor) -> InputProblem | None:
    """The first non-finite weight of a checked feature (others are ignored), or ``None``."""
    bad = ~torch.isfinite(weights)
    used = _used_values(kjt, plan, weights)
    if used is not None:
        bad &= used
    found = bad.nonzero()
    if found.numel() == 0:
        return None
    p = int(found[0, 0])
    k, sample = _locate_value(kjt, p)
    w = float(weights[p])
    code = 0 if w != w else (1 if w > 0 else 2)
    return InputProblem(Problem.WEIGHT_NOT_FINITE, plan.feature_of_key[k], sample, p, code)
