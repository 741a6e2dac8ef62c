"""Sparse-type operations on W1 / W2 batches (``nox -s bench``).

Input: one rank's batch of the distributed workloads of ``compare/workloads.py`` (fixed seed):
W1 (4 features, batch 1,024, 10-30 uniform ids per bag) and W2 (26 features, batch 512, 1-40
Zipf ids per bag). Timed, each on its own:

- KeyedJaggedTensor construction from lengths (the constructor, and ``from_lengths_sync``, which
  validates the ids and computes the per-key sizes);
- ``offsets()`` from lengths and ``lengths()`` from offsets, ``split`` (two halves), ``permute``
  (reversed keys), ``to_dict`` and ``concat`` (of the two halves);
- KeyedTensor ``regroup`` (two pooled outputs of half the features each, regrouped into even and
  odd features) and ``to_dict``;
- ``embshard_dist.strategies.bucketize.bucketize_kjt``: row-wise routing of every id to one of 2
  row blocks per table;
- ``input_check``: the input check every sharded collection runs on the caller's batch before any
  kernel or collective (``embshard_types.sparse.kjt_checks.KJTChecker``: layout, id ranges per
  table), on a valid batch.

KeyedJaggedTensor and KeyedTensor cache what they derive (offsets, per-key sizes, dicts), so every
round times a fresh object built from the same tensors by ``setup`` (untimed) and asks it for
the derived value once, as a model does with each new batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("pytest_benchmark", reason="benchmarks need pytest-benchmark (nox -s bench)")

import torch
from compare.workloads import Workload, w1, w2

from embshard_dist.strategies.bucketize import bucketize_kjt
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor
from embshard_types.sparse.kjt_checks import KJTChecker

ROUNDS, WARMUP = 60, 5
WORKLOADS: dict[str, Callable[[], Workload]] = {"W1": w1, "W2": w2}


@functools.cache
def _input(name: str) -> tuple[Workload, list[str], torch.Tensor, torch.Tensor]:
    """The workload, its keys, and rank 0's ids and bag lengths (of a 2-rank run)."""
    workload = WORKLOADS[name]()
    batch = workload.batches(rank=0, world_size=2, count=1)[0]
    return workload, list(batch.keys), batch.values, batch.lengths


def _fresh(name: str, *, from_offsets: bool = False) -> KeyedJaggedTensor:
    _, keys, values, lengths = _input(name)
    if from_offsets:
        offsets = _offsets(name)
        return KeyedJaggedTensor(keys=keys, values=values, offsets=offsets)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


@functools.cache
def _offsets(name: str) -> torch.Tensor:
    _, _, _, lengths = _input(name)
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _halves(name: str) -> list[KeyedJaggedTensor]:
    keys = _input(name)[1]
    half = len(keys) // 2
    return _fresh(name).split([half, len(keys) - half])


@functools.cache
def _pooled(name: str) -> tuple[tuple[list[str], torch.Tensor], ...]:
    """Two pooled outputs ``[batch, dim]`` per feature: the first and the second half of keys."""
    workload, keys, _, _ = _input(name)
    dim = workload.tables[0].dim
    gen = torch.Generator().manual_seed(3)
    half = len(keys) // 2
    return tuple(
        (part, torch.randn(workload.batch_per_rank, dim * len(part), generator=gen))
        for part in (keys[:half], keys[half:])
    )


def _keyed_tensors(name: str) -> list[KeyedTensor]:
    dim = _input(name)[0].tables[0].dim
    return [KeyedTensor(part, [dim] * len(part), values) for part, values in _pooled(name)]


def _boundaries(name: str) -> list[list[int]]:
    workload = _input(name)[0]
    return [[0, (t.rows + 1) // 2, t.rows] for t in workload.tables]


def _case(op: str, name: str) -> tuple[Callable[..., Any], Callable[[], Any] | None]:
    """``(target, setup)``: ``setup`` (untimed) returns the target's ``(args, kwargs)``."""
    _, keys, values, lengths = _input(name)
    n = len(keys)

    def fresh() -> tuple[tuple[KeyedJaggedTensor], dict[str, Any]]:
        return (_fresh(name),), {}

    if op == "construct":
        return (lambda: KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)), None
    if op == "from_lengths_sync":
        return (lambda: KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)), None
    if op == "offsets_from_lengths":
        return (lambda kjt: kjt.offsets()), fresh
    if op == "lengths_from_offsets":
        return (lambda kjt: kjt.lengths()), lambda: ((_fresh(name, from_offsets=True),), {})
    if op == "split":
        return (lambda kjt: kjt.split([n // 2, n - n // 2])), fresh
    if op == "permute":
        return (lambda kjt: kjt.permute(list(range(n - 1, -1, -1)))), fresh
    if op == "to_dict":
        return (lambda kjt: kjt.to_dict()), fresh
    if op == "concat":
        return (lambda parts: KeyedJaggedTensor.concat(parts)), lambda: ((_halves(name),), {})
    if op == "kt_regroup":
        groups = [keys[0::2], keys[1::2]]
        return (lambda kts: KeyedTensor.regroup(kts, groups)), lambda: ((_keyed_tensors(name),), {})
    if op == "kt_to_dict":
        return (lambda kt: kt.to_dict()), lambda: ((_keyed_tensors(name)[0],), {})
    if op == "bucketize_rw":
        bounds = _boundaries(name)
        return (lambda kjt: bucketize_kjt(kjt, bounds)), fresh
    if op == "input_check":
        tables = _input(name)[0].tables
        checker = KJTChecker(keys, [t.rows for t in tables], weighted=False)
        return (lambda kjt: checker.check(kjt)), fresh
    raise ValueError(f"unknown op {op!r}")


OPS = [
    "construct",
    "from_lengths_sync",
    "offsets_from_lengths",
    "lengths_from_offsets",
    "split",
    "permute",
    "to_dict",
    "concat",
    "kt_regroup",
    "kt_to_dict",
    "bucketize_rw",
    "input_check",
]


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("op", OPS)
def test_kjt_op(benchmark, op: str, workload: str) -> None:  # type: ignore[no-untyped-def]
    target, setup = _case(op, workload)
    if setup is None:
        benchmark.pedantic(target, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    else:
        benchmark.pedantic(target, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
