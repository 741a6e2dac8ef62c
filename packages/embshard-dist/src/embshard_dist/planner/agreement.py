"""Checking that every rank holds the same sharding plan, with one small all-gather.

Guarantees: equal plans have equal digests on every machine; :func:`check_plan_agreement`
raises the same ``ValueError`` on every rank when the plans differ.
"""

from __future__ import annotations

import hashlib
from typing import Any

from embshard_dist.comm.collectives import all_gather_ints
from embshard_types.plan import ShardingPlan

__all__ = ["check_plan_agreement", "plan_digest"]


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
    digests = [
        row[0]
        for row in all_gather_ints([plan_digest(plan)], group=group, name="check_plan_agreement")
    ]
    if len(set(digests)) > 1:
        groups: dict[int, list[int]] = {}
        for rank, d in enumerate(digests):
            groups.setdefault(d, []).append(rank)
        listed = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        raise ValueError(
            f"the ranks hold different sharding plans ({len(groups)} distinct: {listed}); give "
            "every rank the same model, options and plan (or plan on one rank and share it)"
        )
