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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from embshard_dist.comm.collectives import collective_device
from embshard_dist.comm.gather import PendingGather, start_all_gather
from embshard_dist.comm.kjt_all_to_all import STATUS_WORDS, InputStatus
from embshard_types.awaitables import Awaitable
from embshard_types.sparse.input_problems import InputProblem, InvalidInputError
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
        problem = self._checker.check(features)
        if problem is None:
            assert isinstance(features, KeyedJaggedTensor)
            return features, InputStatus(_GOOD, self.error)
        return self._stand_in(), InputStatus(tuple(problem.encode()), self.error)

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
