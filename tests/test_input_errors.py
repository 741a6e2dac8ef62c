"""A bad input on one of 2 ranks: both ranks raise the same clear error within the step.

Each case feeds rank 1 a broken KeyedJaggedTensor (rank 0 a good one) to a sharded
EmbeddingBagCollection (table-wise, row-wise, data-parallel and mixed plans). Both ranks must
raise the same ``InvalidInputError`` naming rank 1, the feature, the table and the value, with
no collective timing out, weights and fused optimizer state bit-identical on both ranks, and the
next good step must still match the unsharded module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from test_sharded_ebc_training import OPTIMIZERS, global_batch, kjt_of, plan_for, tables

from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.env import ShardingEnv
from embshard_types.sparse.input_problems import InvalidInputError
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

TABLES = tables(weighted=True)
KEYS = [f for t in TABLES for f in t.feature_names]
NAN, INF = float("nan"), float("inf")


def _good(step: int, rank: int) -> KeyedJaggedTensor:
    data = global_batch(list(TABLES), step, 6)
    return kjt_of(data, KEYS, 3 * rank, 3 * rank + 3, True)


def _edit(kjt: KeyedJaggedTensor, **change: Any) -> KeyedJaggedTensor:
    """``kjt``'s tensors with some replaced, through the plain constructor (no validation)."""
    parts: dict[str, Any] = {
        "values": kjt.values(),
        "weights": kjt.weights(),
        "lengths": kjt.lengths(),
    }
    parts.update(change)
    keys = parts.pop("keys", kjt.keys())
    return KeyedJaggedTensor(keys, **parts)


def _with_value(t: torch.Tensor, i: int, v: Any) -> torch.Tensor:
    out = t.clone()
    out[i] = v
    return out


def _lengths_first_nonempty(kjt: KeyedJaggedTensor, delta: int) -> torch.Tensor:
    lengths = kjt.lengths().clone()
    i = int((lengths > 0).nonzero()[0, 0])
    lengths[i] += delta
    return lengths


# name -> (make the bad batch from a good one, fragments every rank's message must hold)
BAD: dict[str, tuple[Any, list[str]]] = {
    "negative length": (
        lambda k: _edit(k, lengths=_with_value(k.lengths(), 1, -1) + 0),
        ["rank 1", "f_a", "'t_sum'", "sample 1", "= -1 is negative"],
    ),
    "lengths sum to less than values": (
        lambda k: _edit(k, lengths=_lengths_first_nonempty(k, -1)),
        ["rank 1", "values not in any bag"],
    ),
    "lengths sum to more than values": (
        lambda k: _edit(k, lengths=_lengths_first_nonempty(k, +1)),
        ["rank 1", "too few values"],
    ),
    "offsets not from 0": (
        lambda k: KeyedJaggedTensor(
            k.keys(), k.values(), weights=k.weights(), offsets=k.offsets() + 1
        ),
        ["rank 1", "offsets must start at 0", "offsets[0] = 1"],
    ),
    "decreasing offsets": (
        lambda k: KeyedJaggedTensor(
            k.keys(),
            k.values(),
            weights=k.weights(),
            offsets=_with_value(k.offsets(), 2, int(k.offsets()[1]) - 1),
        ),
        ["rank 1", "offsets decrease", "f_a"],
    ),
    "nan weight": (
        lambda k: _edit(k, weights=_with_value(k.weights(), 0, NAN)),
        ["rank 1", "f_a", "'t_sum'", "is nan", "finite"],
    ),
    "inf weight": (
        lambda k: _edit(k, weights=_with_value(k.weights(), 0, INF)),
        ["rank 1", "f_a", "'t_sum'", "is inf"],
    ),
    "id out of range": (
        lambda k: _edit(k, values=_with_value(k.values(), 0, 13)),
        ["rank 1", "f_a", "'t_sum'", "id 13", "[0, 13)"],
    ),
    "negative id": (
        lambda k: _edit(k, values=_with_value(k.values(), 0, -4)),
        ["rank 1", "f_a", "'t_sum'", "id -4 is negative"],
    ),
    "float ids": (
        lambda k: _edit(k, values=k.values().float()),
        ["rank 1", "float32", "integer"],
    ),
    "unknown feature": (
        lambda k: _edit(k, keys=["f_typo", *k.keys()[1:]]),
        ["rank 1", "f_a", "'t_sum'", "missing from the input"],
    ),
    "not a KeyedJaggedTensor": (
        lambda k: k.to_dict(),
        ["rank 1", "not a KeyedJaggedTensor"],
    ),
}


def _state(model: Any) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        out[f"weight {key}"] = _local(value)
    for param, state in model.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[f"state {param} {name}"] = _local(value)
    return out


def _local(value: Any) -> torch.Tensor:
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return torch.cat([s.tensor.flatten() for s in shards]) if shards else torch.empty(0)
    if hasattr(value, "to_local"):
        return value.to_local().detach().clone().cpu()
    return value.detach().clone().cpu()


def _bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a
    )


def run_bad_inputs(plan: str, cases: list[str]) -> list[tuple[str, str, str, bool]]:
    """Per case: the exception type and message on this rank, and whether state is unchanged."""
    torch.set_num_threads(1)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return feed_bad_inputs(
        lambda source: EmbeddingBagCollectionSharder().shard(
            source, plan_for(plan, dist.get_world_size()), env, test_device()
        ),
        cases,
    )[1]


def feed_bad_inputs(
    shard: Callable[[EmbeddingBagCollection], Any], cases: list[str]
) -> tuple[Any, list[tuple[str, str, str, bool]]]:
    """Shard a collection with ``shard``, then per case: a good step, rank 1's bad batch (the
    others' good one), and this rank's exception type, message and whether state stayed the
    same; every good step must equal the unsharded module's. Returns the sharded module too."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = test_device()
    torch.manual_seed(7)
    reference = EmbeddingBagCollection(
        list(TABLES), is_weighted=True, optimizer=OPTIMIZERS["rowwise_adagrad"]
    )
    torch.manual_seed(7)
    sharded = shard(
        EmbeddingBagCollection(
            list(TABLES), is_weighted=True, optimizer=OPTIMIZERS["rowwise_adagrad"]
        )
    )
    results = []
    step = 0

    def good_step() -> None:
        nonlocal step
        out = sharded(_good(step, rank).to(device))
        expected = reference(kjt_of(global_batch(list(TABLES), step, 6), KEYS, 0, 6, True))
        torch.testing.assert_close(out.values().cpu(), expected.values()[3 * rank : 3 * rank + 3])
        out.values().sum().backward()
        (expected.values().sum() / world).backward()
        step += 1

    good_step()
    for case in cases:
        before = _state(sharded)
        make, _ = BAD[case]
        batch = _good(step, rank)
        given = make(batch) if rank == 1 else batch
        if isinstance(given, KeyedJaggedTensor):
            given = given.to(device)
        try:
            out = sharded(given)
            out.values().sum().backward()
            results.append((case, "no error", "", _bit_identical(before, _state(sharded))))
        except Exception as error:
            unchanged = _bit_identical(before, _state(sharded))
            results.append((case, type(error).__name__, str(error), unchanged))
        good_step()  # the ranks are still in step: the next batch trains as unsharded
    return sharded, results


@pytest.mark.parametrize("plan", ["tw", "rw", "dp", "mixed"])
def test_bad_input_on_one_rank_gives_every_rank_the_same_error(plan: str) -> None:
    cases = sorted(BAD)
    ranks = run_on_ranks(2, run_bad_inputs, plan, cases)
    for i, case in enumerate(cases):
        (name0, kind0, text0, same0), (name1, kind1, text1, same1) = ranks[0][i], ranks[1][i]
        assert name0 == name1 == case
        assert kind0 == kind1 and text0 == text1, (case, kind0, text0, kind1, text1)
        assert kind0 in ("InvalidInputError", "InvalidInputTypeError", "IdOutOfRangeError"), (
            case,
            kind0,
            text0,
        )
        for fragment in BAD[case][1]:
            assert fragment in text0, (case, fragment, text0)
        assert "timed out" not in text0
        assert same0 and same1, f"{case}: state changed"


def test_error_classes_keep_the_builtin_types() -> None:
    from embshard_types.sparse.input_problems import IdOutOfRangeError, InvalidInputTypeError

    assert issubclass(InvalidInputError, ValueError)
    assert issubclass(InvalidInputTypeError, TypeError)
    assert issubclass(IdOutOfRangeError, IndexError)
