"""The sharded collections' input checks: every rank checks its batch, all ranks agree.

:class:`InputGate` checks a rank's input before any kernel or collective runs
(:class:`~embshard_types.sparse.kjt_checks.KJTChecker`: layout, dtypes, finite weights, ids
in range, features present). The verdict travels in the first exchange of the KJT all-to-alls the
step runs anyway; a collection without one (all tables data-parallel) all-gathers the verdict
alone. A rank that refused its input routes an empty batch with the collection's keys, so it
issues the same collectives as its peers, and after that first exchange every rank raises the
same :class:`~embshard_types.sparse.input_problems.InvalidInputError`, naming the rank, the
feature, the table and the value; no phase 2 starts, no lookup runs, no state changes.
``EMBSHARD_SKIP_INPUT_CHECKS=1`` (or ``check_inputs=False``) skips the checks for inputs validated
upstream: bad input then fails on its own rank only, or not at all.

Under ``torch.compile`` the checks that read tensor data cannot be traced: a traced forward
checks what its trace fixes (type, dtypes, features, weights present; the verdict travels as in
eager mode) and bounds-checks the ids in the graph (FBGEMM's op, which raises on this rank only);
the layout and weight-finiteness checks are skipped there, as the kernels skip theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from embshard_dist.comm.collectives import collective_device
from embshard_dist.comm.gather import PendingGather, start_all_gather
from embshard_dist.comm.kjt_all_to_all import STATUS_WORDS, InputStatus
from embshard_kernels.dense import traced_bounds_check
from embshard_kernels.inputs import to_tbe_input
from embshard_types.awaitables import Awaitable
from embshard_types.sparse.input_problems import InputProblem, InvalidInputError, Problem
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.kjt_checks import KJTChecker, input_checks_enabled

assert STATUS_WORDS == InputProblem.WORDS  # the all-to-all header holds one problem record

_GOOD = (0,) * STATUS_WORDS


class InputGate:
    """Checks one collection's input on this rank and builds the verdict its peers receive.

    Args:
        features: the collection's features (the same list on every rank).
        rows: per feature, its table's row count.
        tables: feature -> table name.
        weighted: whether the collection reads per-sample weights.
        check_inputs: check at all (default: unless ``EMBSHARD_SKIP_INPUT_CHECKS=1``).
    """

    def __init__(
        self,
        features: Sequence[str],
        rows: Sequence[int],
        tables: dict[str, str],
        *,
        weighted: bool,
        check_inputs: bool | None = None,
    ) -> None:
        self._features = list(features)
        self._tables = dict(tables)
        self._weighted = weighted
        self._rows = dict(zip(self._features, (int(r) for r in rows), strict=True))
        self._checker = KJTChecker(self._features, rows, weighted=weighted)
        self.enabled = input_checks_enabled() if check_inputs is None else check_inputs

    def check(self, features: object, owner: str) -> tuple[KeyedJaggedTensor, InputStatus]:
        """The batch to route and this rank's verdict on ``features``.

        A refused input is replaced by an empty batch with the collection's keys (only the
        verdict matters then). With checks off, only a non-KJT is refused, here and now.

        Raises:
            TypeError: checks are off and ``features`` is not a KeyedJaggedTensor.
        """
        if not self.enabled:
            if not isinstance(features, KeyedJaggedTensor):
                raise TypeError(f"{owner} takes a KeyedJaggedTensor, got {type(features).__name__}")
            return features, InputStatus(_GOOD, self.error)
        if torch.compiler.is_compiling():
            problem = self._traced_check(features)
        else:
            problem = self._checker.check(features)
        if problem is None:
            assert isinstance(features, KeyedJaggedTensor)
            return features, InputStatus(_GOOD, self.error)
        return self._stand_in(), InputStatus(tuple(problem.encode()), self.error)

    def _traced_check(self, features: object) -> InputProblem | None:
        """The checks a traced graph can make (see the module docstring), in the checker's
        order; a batch that passes them has its ids bounds-checked in the graph."""
        if not isinstance(features, KeyedJaggedTensor):
            return InputProblem(Problem.NOT_A_KJT)
        values, weights = features.values(), features.weights_or_none()
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            return self._checker.check(features)  # a dtype problem: no tensor data is read
        if weights is not None and self._weighted and not weights.is_floating_point():
            return self._checker.check(features)
        keys = features.keys()
        missing = next((f for f, name in enumerate(self._features) if name not in keys), None)
        if missing is not None:
            return InputProblem(Problem.MISSING_FEATURE, feature=missing)
        if self._weighted and weights is None and self._features:
            return InputProblem(Problem.WEIGHTS_MISSING)
        if not features.variable_stride_per_key():
            # per-feature batch sizes would need FBGEMM's VBE offsets: the kernels check those
            args = to_tbe_input(features, weighted=self._weighted)
            rows = [self._rows.get(k, torch.iinfo(torch.int64).max) for k in keys]
            limits = torch.tensor(rows, dtype=torch.int64, device=values.device)
            traced_bounds_check(limits, args.indices, args.offsets, args.per_sample_weights)
        return None

    def error(self, rank: int, words: list[int]) -> InvalidInputError:
        """The error for ``rank``'s verdict ``words`` (the same on every rank)."""
        problem = InputProblem.decode(words)
        assert problem is not None
        return problem.error(self._features, self._tables, rank)

    def _stand_in(self) -> KeyedJaggedTensor:
        keys = self._features
        return KeyedJaggedTensor(
            keys,
            torch.empty(0, dtype=torch.int64),
            weights=torch.empty(0) if self._weighted else None,
            lengths=torch.empty(0, dtype=torch.int32),
            stride=0,
            length_per_key=[0] * len(keys),
        )

    def agreed(
        self,
        features: Awaitable[Awaitable[list[KeyedJaggedTensor]]],
        started: Sequence[Awaitable[Awaitable[KeyedJaggedTensor]]],
        input_dists: Sequence[nn.Module],
        status: InputStatus,
        group: dist.ProcessGroup | None,
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        """``features``, whose wait first learns every rank's verdict (and raises on a bad one).

        The verdicts come with the first all-to-all that carries them; with none, this starts
        an all-gather of the verdicts alone (only while checks are on).
        """
        for dist_, one in zip(input_dists, started, strict=True):
            if getattr(dist_, "carries_input_status", False):
                return _VerdictFirst(features, _CarriedVerdict(one))
        if not self.enabled or dist.get_world_size(group) == 1:
            if status.words[0]:
                raise status.error(dist.get_rank(group), list(status.words))
            return features
        return _VerdictFirst(features, _GatheredVerdict(status, group))


class _CarriedVerdict(Awaitable[None]):
    """Waits the first exchange of an all-to-all whose header carries the verdicts."""

    def __init__(self, carrier: Awaitable[Awaitable[KeyedJaggedTensor]]) -> None:
        super().__init__()
        self._carrier = carrier

    def _wait_impl(self) -> None:
        self._carrier.wait()


class _GatheredVerdict(Awaitable[None]):
    """An all-gather of every rank's verdict (for collections without an all-to-all)."""

    def __init__(self, status: InputStatus, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        device = collective_device(group)
        local = torch.tensor(status.words, dtype=torch.int64, device=device)
        self._out = local.new_empty(dist.get_world_size(group) * local.numel())
        self._status = status
        self._pending: PendingGather = start_all_gather(
            "input_checks.all_gather", self._out, local, group=group
        )

    def _wait_impl(self) -> None:
        self._pending.wait()
        for rank, words in enumerate(self._out.reshape(-1, STATUS_WORDS).tolist()):
            if words[0]:
                raise self._status.error(rank, words)


class _VerdictFirst(Awaitable[Awaitable[list[KeyedJaggedTensor]]]):
    """Waits the verdicts, then the features' first phase."""

    def __init__(
        self, features: Awaitable[Awaitable[list[KeyedJaggedTensor]]], verdict: Awaitable[None]
    ) -> None:
        super().__init__()
        self._features = features
        self._verdict = verdict

    def _wait_impl(self) -> Awaitable[list[KeyedJaggedTensor]]:
        self._verdict.wait()
        return self._features.wait()
