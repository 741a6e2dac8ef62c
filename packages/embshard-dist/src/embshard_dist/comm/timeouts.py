"""Collective timeouts and the one error every failed collective becomes.

Every collective is issued by :func:`issue` and waited for by :meth:`PendingCollective.wait`. On
the CPU (gloo) a wait blocks at most the limit (the call's ``timeout``, else
``EMBSHARD_COLLECTIVE_TIMEOUT_S``, else 120 s); a dead or hung peer raises
:class:`CollectiveError`. On accelerators the wait orders the stream; the group's own timeout
(NCCL's watchdog) bounds a hang. After the error the group is unusable: report it and exit.

Under ``torch.compile`` both run eagerly (:func:`at_collective`): a traced forward breaks its
graph at each collective's start and wait, and the break names :data:`COMPILE_BREAK_REASON`.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

ENV_TIMEOUT_VAR = "EMBSHARD_COLLECTIVE_TIMEOUT_S"
"""Environment variable that overrides the default time limit of a collective, in seconds."""

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
"""Time limit of a collective when neither the call nor the environment sets one."""

Timeout = float | int | timedelta | None
"""A time limit: seconds, a ``timedelta``, or ``None`` for the environment / default limit."""

COMPILE_BREAK_REASON = "embshard collective"
"""What ``torch.compile`` reports (in the break's reason) for a graph break at a collective."""

_F = TypeVar("_F", bound=Callable[..., object])


def at_collective(fn: _F) -> _F:
    """``fn`` (which starts or waits for collectives), run eagerly under ``torch.compile``: a
    traced graph breaks at its call, and the break's reason names :data:`COMPILE_BREAK_REASON`
    and ``fn``. Eager calls are unchanged.

    Importing torch's compiler costs a second and ~150 MB per process, so this does not: the
    wrapper carries the marks ``torch.compiler.disable`` sets (dynamo reads them where it meets
    the call), dynamo is told never to trace the wrapper's own frame, and once ``torch._dynamo``
    is loaded (only then can a call be compiled) ``fn`` runs through ``torch.compiler.disable``.
    Where this torch lacks the hook for the frame, ``fn`` is disabled at once instead.
    """
    reason = f"{COMPILE_BREAK_REASON}: {fn.__qualname__}"
    if not _skip_frames_of(_lazy_wrapper):
        return cast(_F, torch.compiler.disable(fn, reason=reason))
    return cast(_F, _lazy_wrapper(fn, reason))


def _lazy_wrapper(fn: Callable[..., object], reason: str) -> Callable[..., object]:
    disabled: Callable[..., object] | None = None

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn, reason=reason)
        return disabled(*args, **kwargs)

    marks: Any = wrapper
    marks._torchdynamo_disable = True
    marks._torchdynamo_disable_msg = reason
    return wrapper


@functools.cache
def _skip_frames_of(factory: Callable[..., Callable[..., object]]) -> bool:
    """Tell dynamo never to trace a frame of the functions ``factory`` makes (they share one
    code object); ``False`` where this torch has no such hook."""
    try:
        from torch._C._dynamo import eval_frame

        code = factory(lambda: None, "").__code__
        strategy = eval_frame._FrameExecStrategy(
            eval_frame._FrameAction.SKIP, eval_frame._FrameAction.DEFAULT
        )
        eval_frame.set_code_exec_strategy(code, strategy)
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return False
    return True


def collective_timeout(timeout: Timeout = None) -> timedelta:
    """The time limit of one collective: ``timeout`` (seconds or ``timedelta``), else the
    environment variable, else the default.

    Raises:
        ValueError: the limit (or the environment variable) is not a positive number.
    """
    if timeout is None:
        raw = os.environ.get(ENV_TIMEOUT_VAR, "").strip()
        if not raw:
            return timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(
                f"environment variable {ENV_TIMEOUT_VAR}={raw!r} is not a number of seconds; "
                "set it to e.g. 120 or unset it"
            ) from None
        where = f"environment variable {ENV_TIMEOUT_VAR}"
    elif isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
        where = "timeout argument"
    else:
        seconds = float(timeout)
        where = "timeout argument"
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{where} must be a positive, finite number of seconds, got {seconds}")
    return timedelta(seconds=seconds)


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (``None`` is the default, world group)."""
    return list(dist.get_process_group_ranks(group if group is not None else _world()))


def describe_group(group: dist.ProcessGroup | None) -> str:
    """A short human description of a process group, for error messages."""
    pg = group if group is not None else _world()
    if not isinstance(pg, dist.ProcessGroup):  # new_group's marker on ranks outside the group
        return "a process group this rank is not a member of"
    try:
        name = str(pg.group_name)
    except RuntimeError:
        name = "?"
    ranks = group_ranks(group)
    shown = f"{ranks}" if len(ranks) <= 16 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)"
    return f"process group {name!r} with global ranks {shown}"


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group first"
        )
    return world


class CollectiveError(RuntimeError):
    """A collective failed or did not finish in time on this rank.

    Attributes:
        collective: what was being exchanged, e.g. ``"pooled_all_to_all.forward"``.
        rank, group, peer: this global rank, the group's description, the single peer (or None).
        timed_out: ``True`` when the limit ran out, ``False`` when the backend reported an error
            (typically a peer that died).
        timeout_s: the limit in seconds that applied.
    """

    def __init__(
        self,
        collective: str,
        *,
        rank: int,
        group: str,
        reason: str,
        timed_out: bool,
        timeout_s: float,
        peer: int | None = None,
    ) -> None:
        self.collective = collective
        self.rank = rank
        self.group = group
        self.peer = peer
        self.timed_out = timed_out
        self.timeout_s = timeout_s
        self.reason = reason
        peer_text = f" with peer rank {peer}" if peer is not None else ""
        if timed_out:
            what = (
                f"timed out after {timeout_s:g} s ({reason}). A peer rank is hung or dead, or the "
                "ranks issued collectives in different orders; check the other ranks' logs. "
                f"Pass timeout= or set {ENV_TIMEOUT_VAR} to change the limit"
            )
        else:
            what = (
                f"failed: {reason}. A peer rank probably died or failed first; "
                "check the other ranks' logs"
            )
        super().__init__(f"collective {collective!r} on rank {rank}{peer_text} in {group} {what}")

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only constructor: pickle (e.g. to send the error to a parent process) by state.
        return (_rebuild_collective_error, (str(self), self.__dict__.copy()))


def _rebuild_collective_error(message: str, state: dict[str, object]) -> CollectiveError:
    err = CollectiveError.__new__(CollectiveError)
    RuntimeError.__init__(err, message)
    err.__dict__.update(state)
    return err


def _this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else -1


def _looks_timed_out(message: str) -> bool:
    lowered = message.lower()
    return "timed out" in lowered or "timeout" in lowered


_WAITED = [0.0]


def waited_seconds() -> float:
    """Seconds this process has spent blocked in ``PendingCollective.wait`` so far (embshard's
    own collectives; torch's DDP all-reduce is not counted). Differences between two reads give
    the wait of what ran in between."""
    return _WAITED[0]


@dataclass
class PendingCollective:
    """An issued asynchronous collective (``work``) that has not been waited for yet; the other
    fields are :func:`issue`'s (``timeout`` resolved)."""

    work: dist.Work
    collective: str
    group: dist.ProcessGroup | None
    timeout: timedelta
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    peer: int | None = None
    _done: bool = False

    @at_collective
    def wait(self) -> None:
        """Wait for the collective; idempotent.

        Raises:
            CollectiveError: the backend reported an error or the time limit ran out.
        """
        if self._done:
            return
        start = time.monotonic()
        try:
            if self.device.type == "cpu":
                finished = self.work.wait(self.timeout)
            else:
                finished = self.work.wait()
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            _WAITED[0] += elapsed
            timed_out = _looks_timed_out(str(e)) or elapsed >= self.timeout.total_seconds()
            raise self._error(_first_line(str(e)), timed_out=timed_out) from e
        _WAITED[0] += time.monotonic() - start
        if finished is False:
            raise self._error("the backend reported that the work did not finish", timed_out=True)
        self._done = True

    def _error(self, reason: str, *, timed_out: bool) -> CollectiveError:
        return CollectiveError(
            self.collective,
            rank=_this_rank(),
            group=describe_group(self.group),
            reason=reason,
            timed_out=timed_out,
            timeout_s=self.timeout.total_seconds(),
            peer=self.peer,
        )


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "no message"
    return line if len(line) <= 400 else line[:400] + "..."


@at_collective
def issue(
    collective: str,
    start: Callable[[], dist.Work | None],
    *,
    group: dist.ProcessGroup | None,
    timeout: Timeout = None,
    device: torch.device | None = None,
    peer: int | None = None,
) -> PendingCollective:
    """Start an asynchronous collective and wrap its handle.

    Args:
        collective: the name used in errors (e.g. ``"kjt_all_to_all.values"``).
        start: issues the collective with ``async_op=True`` and returns its work.
        group: the process group the collective runs on (``None``: world).
        timeout: the per-call limit; see :func:`collective_timeout`.
        device: device of the exchanged tensors (default CPU: waits block the host with the
            limit; accelerator waits only order the current stream).
        peer: the single peer's global rank, if there is one.

    Raises:
        CollectiveError: the backend refused the collective at once (e.g. a closed connection).
        ValueError: this rank is not a member of ``group``.
    """
    limit = collective_timeout(timeout)
    try:
        work = start()
    except RuntimeError as e:
        raise CollectiveError(
            collective,
            rank=_this_rank(),
            group=describe_group(group),
            reason=_first_line(str(e)),
            timed_out=_looks_timed_out(str(e)),
            timeout_s=limit.total_seconds(),
            peer=peer,
        ) from e
    if work is None:
        raise ValueError(
            f"collective {collective!r}: rank {_this_rank()} is not a member of "
            f"{describe_group(group)}; issue it only on the group's ranks"
        )
    return PendingCollective(
        work=work,
        collective=collective,
        group=group,
        timeout=limit,
        device=device if device is not None else torch.device("cpu"),
        peer=peer,
    )
