"""``torch.distributed.checkpoint`` calls whose collectives are bounded and whose errors are clear.

``torch.distributed.checkpoint`` exchanges plans and results over the process group it is given,
with that group's own timeout. :func:`checkpoint_group` gives it a gloo group whose timeout is
embshard's collective limit (``EMBSHARD_COLLECTIVE_TIMEOUT_S``), and :func:`run_collective`
turns a failure of those exchanges (a rank that froze or died) into ``CollectiveError``.
:func:`failure_summary` keeps each rank's own reason (``No space left on device``, ...) from a
``CheckpointException``.

Guarantees: a frozen or dead rank makes every other rank raise ``CollectiveError`` within about
the limit (one limit per exchange still waiting); groups are made once per ranks and limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from embshard_dist.comm.timeouts import CollectiveError, collective_timeout, describe_group

__all__ = ["checkpoint_group", "failure_summary", "run_collective"]

T = TypeVar("T")

_groups: dict[tuple[tuple[int, ...], float], dist.ProcessGroup] = {}


def checkpoint_group(pg: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group over ``pg``'s ranks whose collectives time out at embshard's limit.

    A collective: every rank of the default group calls it (``new_group``) the first time a
    given set of ranks and limit is used.
    """
    ranks = tuple(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
    limit = collective_timeout()
    key = (ranks, limit.total_seconds())
    if key not in _groups:
        group = dist.new_group(ranks=list(ranks), backend="gloo", timeout=limit)
        assert group is not None
        _groups[key] = group
    return _groups[key]


def run_collective(collective: str, call: Callable[[], T], *, group: dist.ProcessGroup | None) -> T:
    """Run ``call`` (a ``torch.distributed.checkpoint`` save or load on ``group``).

    Raises:
        CollectiveError: one of its exchanges failed or timed out; names ``collective``, this
            rank and, in a group of two, the peer that froze or died.
        CheckpointException: a rank failed locally (every rank raises it).
    """
    from torch.distributed.checkpoint.api import CheckpointException

    limit = collective_timeout().total_seconds()
    start = time.monotonic()
    try:
        return call()
    except CheckpointException:
        raise
    except RuntimeError as e:  # local failures come wrapped above: this is an exchange
        message = str(e).strip()
        reason = message.splitlines()[0][:400] if message else type(e).__name__
        timed_out = "timed out" in message.lower() or time.monotonic() - start >= limit
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        me = dist.get_rank()
        others = [r for r in ranks if r != me]
        raise CollectiveError(
            collective,
            rank=me,
            group=describe_group(group),
            reason=reason,
            timed_out=timed_out,
            timeout_s=limit,
            peer=others[0] if len(others) == 1 else None,
        ) from e


def failure_summary(error: BaseException) -> str:
    """One line per failing rank of a ``CheckpointException``, else the error's first line.

    An ``OSError`` keeps its reason and file (e.g. ``[Errno 28] No space left on device``).
    """
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {rank}: {failure_summary(found[0] if isinstance(found, tuple) else found)}"
            for rank, found in sorted(failures.items())
        )
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    limit = 400 if isinstance(error, OSError) else 160
    return f"{type(error).__name__}: {first[:limit]}"
