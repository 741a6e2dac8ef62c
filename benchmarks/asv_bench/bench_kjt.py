"""asv: KeyedJaggedTensor operations on one rank's W1 and W2 batch (of a 2-rank run).

W1: 4 features, 1,024 samples, 10-30 uniform ids per bag; W2: 26 features, 512 samples, 1-40
Zipf ids per bag (``benchmarks/compare/workloads.py``, fixed seed). KeyedJaggedTensor caches
what it derives (offsets, per-key sizes, dicts), so every operation but ``construct`` and
``from_lengths_sync`` times a fresh tensor built from lengths *plus* the operation, as a model
meets each new batch: subtract ``construct`` for the operation alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS = [
    "construct",
    "from_lengths_sync",
    "offsets",
    "split",
    "permute",
    "to_dict",
    "concat",
    "bucketize_rw",
    "input_check",
]


def _op(name: str, workload: Any, keys: list[str], values: Any, lengths: Any) -> Callable[[], Any]:
    """The timed call for operation ``name`` (each builds its own fresh tensor)."""
    from embshard_dist.strategies.bucketize import bucketize_kjt
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
    from embshard_types.sparse.kjt_checks import KJTChecker

    n = len(keys)

    def fresh() -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)

    bounds = [[0, (t.rows + 1) // 2, t.rows] for t in workload.tables]
    checker = KJTChecker(keys, [t.rows for t in workload.tables], weighted=False)
    calls: dict[str, Callable[[], Any]] = {
        "construct": fresh,
        "from_lengths_sync": lambda: KeyedJaggedTensor.from_lengths_sync(keys, values, lengths),
        "offsets": lambda: fresh().offsets(),
        "split": lambda: fresh().split([n // 2, n - n // 2]),
        "permute": lambda: fresh().permute(list(range(n - 1, -1, -1))),
        "to_dict": lambda: fresh().to_dict(),
        "concat": lambda: KeyedJaggedTensor.concat(fresh().split([n // 2, n - n // 2])),
        "bucketize_rw": lambda: bucketize_kjt(fresh(), bounds),
        "input_check": lambda: checker.check(fresh()),
    }
    return calls[name]


class KJTOps:
    params = [OPS, ["W1", "W2"]]
    param_names = ["op", "workload"]
    timeout = 300

    def setup(self, op: str, workload: str) -> None:
        from compare.workloads import w1, w2

        wl = {"W1": w1, "W2": w2}[workload]()
        batch = wl.batches(rank=0, world_size=2, count=1)[0]
        self.call = _op(op, wl, list(batch.keys), batch.values, batch.lengths)

    def time_op(self, op: str, workload: str) -> None:
        self.call()
