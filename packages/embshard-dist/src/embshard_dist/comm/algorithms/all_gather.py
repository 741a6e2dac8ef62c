"""All-gather into the caller's buffer: the backend's own, or an all-to-all (see ``dispatch``).

Both leave rank ``r``'s block at ``out[r * n : (r + 1) * n]``, bit for bit (nothing is combined).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist
from torch import Tensor

from embshard_dist.comm.timeouts import PendingCollective, Timeout, issue

__all__ = ["AllGather", "PendingGather", "all_gather_as_all_to_all", "all_gather_by_backend"]


@dataclass
class PendingGather:
    """An issued all-gather; :meth:`wait` leaves every rank's block in the output."""

    pending: PendingCollective
    finish: Callable[[], None] | None = None

    def wait(self) -> None:
        """Wait for the exchange, then place what a middle rank received; idempotent.

        Raises:
            CollectiveError: the backend reported an error or the time limit ran out.
        """
        self.pending.wait()
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


class AllGather(Protocol):
    """Start gathering every rank's ``local`` into ``out`` (checked by the caller)."""

    def __call__(
        self,
        collective: str,
        out: Tensor,
        local: Tensor,
        *,
        world: int,
        rank: int,
        group: dist.ProcessGroup | None,
        timeout: Timeout,
    ) -> PendingGather: ...


def all_gather_by_backend(
    collective: str,
    out: Tensor,
    local: Tensor,
    *,
    world: int,
    rank: int,
    group: dist.ProcessGroup | None,
    timeout: Timeout,
) -> PendingGather:
    """``all_gather_single`` of ``local`` into ``out``."""
    return PendingGather(
        issue(
            collective,
            lambda: dist.all_gather_single(out, local, group=group, async_op=True),
            group=group,
            timeout=timeout,
            device=local.device,
        )
    )


def all_gather_as_all_to_all(
    collective: str,
    out: Tensor,
    local: Tensor,
    *,
    world: int,
    rank: int,
    group: dist.ProcessGroup | None,
    timeout: Timeout,
) -> PendingGather:
    """One ``all_to_all_single`` that sends ``local`` to every peer (its own share empty); this
    rank copies its own block into its slot (not at all when ``local`` already sits there).

    The first and last rank receive straight into ``out``; a middle rank's peers' blocks lie on
    both sides of its own, so it receives into a buffer and copies them out in ``wait()``.
    """
    n = local.numel()
    flat, mine = out.view(-1), local.reshape(-1)
    own = flat[rank * n : (rank + 1) * n]
    if own.data_ptr() != mine.data_ptr():
        own.copy_(mine)
    send = mine if world == 2 else mine.repeat(world - 1)
    splits = [0 if r == rank else n for r in range(world)]
    finish: Callable[[], None] | None = None
    if rank == 0:
        recv = flat[n:]
    elif rank == world - 1:
        recv = flat[: rank * n]
    else:
        recv = flat.new_empty((world - 1) * n)

        def finish() -> None:
            flat[: rank * n] = recv[: rank * n]
            flat[(rank + 1) * n :] = recv[rank * n :]

    pending = issue(
        collective,
        lambda: dist.all_to_all_single(recv, send, splits, splits, group=group, async_op=True),
        group=group,
        timeout=timeout,
        device=local.device,
    )
    return PendingGather(pending, finish)
