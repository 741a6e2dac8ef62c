"""KJTAllToAll on real gloo ranks against a plain-Python reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device

from embshard_dist.comm.kjt_all_to_all import KJTAllToAll, source_order
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

KEYS = ["a", "b", "c", "d", "e"]


def _bags(rank: int, batch_per_key: list[int]) -> list[list[list[int]]]:
    """bags[k][b]: the ids of key k, sample b, on ``rank`` (deterministic)."""
    g = torch.Generator().manual_seed(5000 + rank)
    out = []
    for k, batch in enumerate(batch_per_key):
        per_sample = []
        for _ in range(batch):
            n = int(torch.randint(0, 4, (1,), generator=g))
            per_sample.append((torch.randint(0, 100, (n,), generator=g) + 1000 * k).tolist())
        out.append(per_sample)
    return out


def _kjt(
    bags: list[list[list[int]]],
    weighted: bool,
    variable: bool,
    lengths_dtype: torch.dtype = torch.int32,
) -> KeyedJaggedTensor:
    lengths = [len(ids) for per_key in bags for ids in per_key]
    values = [v for per_key in bags for ids in per_key for v in ids]
    return KeyedJaggedTensor(
        keys=KEYS,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=lengths_dtype),
        weights=torch.tensor(values, dtype=torch.float32) / 7 if weighted else None,
        stride=None if variable else len(bags[0]),
        stride_per_key_per_rank=[[len(b)] for b in bags] if variable else None,
    )


def _batches(rank: int, batch_sizes: list[int], variable: bool) -> list[int]:
    base = batch_sizes[rank]
    return [base + (k % 2 if variable else 0) for k in range(len(KEYS))]


def _kjt_case(
    splits: list[int],
    batch_sizes: list[int],
    weighted: bool,
    variable: bool,
    lengths_dtype: torch.dtype = torch.int32,
) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    all_bags = [_bags(s, _batches(s, batch_sizes, variable)) for s in range(world)]
    a2a = KJTAllToAll(None, splits)
    kjt = _kjt(all_bags[rank], weighted, variable, lengths_dtype)
    tensors = a2a(kjt.to(test_device())).wait()
    out = tensors.wait()

    lo = sum(splits[:rank])
    my_keys = list(range(lo, lo + splits[rank]))
    assert out.keys() == [KEYS[k] for k in my_keys]
    exp_lengths = [len(ids) for k in my_keys for s in range(world) for ids in all_bags[s][k]]
    exp_values = [v for k in my_keys for s in range(world) for ids in all_bags[s][k] for v in ids]
    assert out.lengths().dtype == lengths_dtype
    assert out.lengths().tolist() == exp_lengths
    assert out.values().tolist() == exp_values
    if weighted:
        expected = torch.tensor(exp_values, dtype=torch.float32) / 7
        assert torch.equal(out.weights().cpu(), expected)
    else:
        assert out.weights_or_none() is None
    if variable:
        assert out.variable_stride_per_key()
        assert out.stride_per_key_per_rank() == [
            [len(all_bags[s][k]) for s in range(world)] for k in my_keys
        ]
    else:
        assert not out.variable_stride_per_key()
        assert out.stride() == sum(batch_sizes)
    assert out.length_per_key() == [
        sum(len(i) for s in range(world) for i in all_bags[s][k]) for k in my_keys
    ]
    return True


@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize(
    ("splits", "batch_sizes", "variable"),
    [
        ([2, 3], [3, 3], False),
        ([4, 1], [2, 5], False),  # a different batch on each rank
        ([2, 0, 3], [1, 3, 2], False),  # a rank that receives no keys
        ([1, 2, 2], [2, 0, 1], False),  # a rank with an empty batch
        ([3, 2], [2, 1], True),  # variable stride per key
        ([1, 1, 3], [1, 2, 0], True),
    ],
)
def test_kjt_all_to_all_matches_reference(
    splits: list[int],
    batch_sizes: list[int],
    variable: bool,
    weighted: bool,
    lengths_dtype: torch.dtype,
) -> None:
    """int32 lengths travel apart from the int64 ids; int64 lengths with them, in one message."""
    world = len(splits)
    results = run_on_ranks(world, _kjt_case, splits, batch_sizes, weighted, variable, lengths_dtype)
    assert results == [True] * world


def _disagreement_case(kind: str) -> str:
    rank = dist.get_rank()
    bags = _bags(rank, [2] * len(KEYS))
    kjt = _kjt(bags, weighted=(kind == "weights" and rank == 1), variable=False)
    if kind == "keys" and rank == 1:
        kjt = KeyedJaggedTensor(
            keys=["a", "b", "c", "e", "d"], values=kjt.values(), lengths=kjt.lengths(), stride=2
        )
    try:
        KJTAllToAll(None, [2, 3])(kjt.to(test_device())).wait()
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("weights", "some ranks' KJTs carry weights"),
        ("keys", "different keys, key order or splits"),
    ],
)
def test_kjt_all_to_all_disagreement_raises_on_every_rank(kind: str, message: str) -> None:
    messages = run_on_ranks(2, _disagreement_case, kind)
    assert all(message in m for m in messages), messages


def test_source_order() -> None:
    assert source_order(4) == [0, 1, 2, 3]
    assert source_order(4, 2) == [0, 2, 1, 3]
    assert source_order(6, 3) == [0, 2, 4, 1, 3, 5]
    with pytest.raises(ValueError, match="positive divisor"):
        source_order(4, 3)
