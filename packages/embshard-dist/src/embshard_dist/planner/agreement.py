"""Every rank checks its sharding plan, the ranks agree, and every rank raises the same error.

One small all-gather carries each rank's plan digest and the verdict of its own plan check;
only when some rank's check failed does a second all-gather bring the failed ranks' messages.
Guarantees: equal plans have equal digests on every machine; a check that fails on any rank,
or plans that differ, make every rank raise the same ``ValueError`` after those collectives
(nobody is left waiting for a rank that left), naming the ranks and the problem.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from embshard_dist.comm.collectives import all_gather_ints, all_gather_v, collective_device
from embshard_types.plan import ShardingPlan

__all__ = ["agree_on_plan", "check_plan_agreement", "plan_digest"]

T = TypeVar("T")

_NAME = "check_plan_agreement"
_PASSED, _FAILED = 0, 1


def plan_digest(plan: ShardingPlan) -> int:
    """A 62-bit digest of ``plan`` (of its compact JSON), equal for equal plans."""
    blob = plan.to_json(indent=None).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 2


def check_plan_agreement(plan: ShardingPlan, group: Any = None) -> None:
    """Raise on every rank unless every rank of ``group`` holds an equal plan.

    Raises:
        ValueError: the plans differ; the message groups the ranks by plan.
        CollectiveError: a peer died or hung.
    """
    agree_on_plan(plan, lambda: None, group)


def agree_on_plan(plan: ShardingPlan, check: Callable[[], T], group: Any = None) -> T:
    """Run ``check`` (this rank's plan check) and agree with every rank on plan and verdict.

    Every rank of ``group`` must call this at the same point. It returns ``check()``'s result
    only when every rank's check passed and every rank holds an equal plan.

    Raises:
        ValueError: some rank's check failed (the message names each failed rank and its
            error; when every rank failed alike, that error itself is raised, on every rank),
            or the plans differ (the message groups the ranks by plan).
        CollectiveError: a peer died or hung.
    """
    result: T | None = None
    failure: Exception | None = None
    digest = 0
    try:
        digest = plan_digest(plan)
        result = check()
    except Exception as error:  # any local failure must reach the peers, whatever its type
        failure = error
    rows = all_gather_ints(
        [digest, _PASSED if failure is None else _FAILED], group=group, name=_NAME
    )
    failed = [rank for rank, row in enumerate(rows) if row[1] == _FAILED]
    if failed:
        texts = _gather_failures(failure, group)
        raise _failure_error(failure, failed, texts, rows)
    digests = [row[0] for row in rows]
    if len(set(digests)) > 1:
        raise ValueError(_differ_text(digests))
    return cast(T, result)


def _gather_failures(failure: Exception | None, group: Any) -> list[str]:
    """Every rank's ``"<type>: <message>"`` ("" for a rank that passed), in rank order."""
    text = "" if failure is None else f"{type(failure).__name__}: {failure}"
    blob = torch.frombuffer(bytearray(text.encode() or b"\0"), dtype=torch.uint8)
    local = blob.clone().to(collective_device(group))  # NCCL sends CUDA tensors only
    parts = all_gather_v(local, group=group, name=f"{_NAME}.errors")
    return [bytes(p.cpu().tolist()).decode(errors="replace").rstrip("\0") for p in parts]


def _failure_error(
    local: Exception | None, failed: list[int], texts: list[str], rows: list[list[int]]
) -> Exception:
    """The exception every rank raises when the ranks in ``failed`` failed their check."""
    distinct = {texts[r] for r in failed}
    if len(failed) == len(rows) and len(distinct) == 1 and local is not None:
        return local  # every rank refused the plan alike: its own error says it all
    passed = [r for r in range(len(rows)) if r not in failed]
    lines = [
        f"the sharding plan check failed on rank(s) {failed}"
        + (f" and passed on rank(s) {passed}" if passed else "")
        + "; every rank must be given the same, valid plan (plan on one rank and share it, or "
        "build the plan from the same model and options everywhere):"
    ]
    lines += [f"  rank {r}: {texts[r]}" for r in failed]
    if len({row[0] for row in rows}) > 1:
        lines.append(f"  also, {_differ_text([row[0] for row in rows])}")
    error = ValueError("\n".join(lines))
    if local is not None:
        error.__cause__ = local
    return error


def _differ_text(digests: list[int]) -> str:
    groups: dict[int, list[int]] = {}
    for rank, d in enumerate(digests):
        groups.setdefault(d, []).append(rank)
    listed = "; ".join(f"ranks {ranks}" for ranks in groups.values())
    return (
        f"the ranks hold different sharding plans ({len(groups)} distinct: {listed}); give "
        "every rank the same model, options and plan (or plan on one rank and share it)"
    )
