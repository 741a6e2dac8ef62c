"""Property suite: any KJT layout and values is refused clearly with state unchanged, or matches.

Hypothesis draws per-feature bag lengths (some negative), ids (some out of range or negative),
weights (some NaN / inf) and a layout damage (lengths or offsets off by one). Each batch goes to
an unsharded kernel and, on 2 gloo ranks, to a sharded collection (rank 1 gets the drawn batch,
rank 0 a good one): either every rank raises the same ``InvalidInputError`` and no weight or
optimizer state changes, or the output equals the unsharded module's. Never a crash, a hang or
a silent difference. Examples are bounded (``max_examples``) so the suite stays under a minute.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_input_errors import _bit_identical, _state
from test_sharded_ebc_training import OPTIMIZERS, plan_for, tables

from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.env import ShardingEnv
from embshard_types.sparse.input_problems import InvalidInputError
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

TABLES = tables(weighted=True)
KEYS = [f for t in TABLES for f in t.feature_names]
ROWS = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
BATCH = 3
EXAMPLES = 25


@st.composite
def batches(draw: Any) -> dict[str, Any]:
    """Lengths, ids, weights and a layout damage for one rank's batch of ``KEYS``."""
    lengths = draw(
        st.lists(st.integers(-1, 3), min_size=len(KEYS) * BATCH, max_size=len(KEYS) * BATCH)
    )
    ids: list[int] = []
    for k, key in enumerate(KEYS):
        count = sum(max(n, 0) for n in lengths[k * BATCH : (k + 1) * BATCH])
        ids += draw(st.lists(st.integers(-1, ROWS[key]), min_size=count, max_size=count))
    weights = draw(
        st.lists(
            st.sampled_from([0.5, 1.0, 2.0, float("nan"), float("inf")]),
            min_size=len(ids),
            max_size=len(ids),
        )
    )
    damage = draw(st.sampled_from(["none", "none", "extra value", "offsets", "offsets+1"]))
    return {"lengths": lengths, "ids": ids, "weights": weights, "damage": damage}


def to_kjt(b: dict[str, Any]) -> KeyedJaggedTensor:
    values = torch.tensor(b["ids"], dtype=torch.int64)
    weights = torch.tensor(b["weights"], dtype=torch.float32)
    lengths = torch.tensor(b["lengths"], dtype=torch.int64)
    if b["damage"] == "extra value":
        values, weights = (
            torch.cat([values, values.new_zeros(1)]),
            torch.cat([weights, weights.new_ones(1)]),
        )
    if b["damage"].startswith("offsets"):
        offsets = torch.cat([lengths.new_zeros(1), lengths.clamp(min=0).cumsum(0)])
        if b["damage"] == "offsets+1":
            offsets = offsets + 1
        return KeyedJaggedTensor(KEYS, values, weights=weights, offsets=offsets)
    return KeyedJaggedTensor(KEYS, values, weights=weights, lengths=lengths)


def good(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 3, (len(KEYS) * BATCH,), generator=g)
    ids = torch.cat(
        [
            torch.randint(
                0, ROWS[key], (int(lengths[k * BATCH : (k + 1) * BATCH].sum()),), generator=g
            )
            for k, key in enumerate(KEYS)
        ]
    )
    return KeyedJaggedTensor(
        KEYS, ids, weights=torch.rand(ids.shape, generator=g) + 0.1, lengths=lengths
    )


def _unsharded() -> EmbeddingBagCollection:
    torch.manual_seed(7)
    return EmbeddingBagCollection(TABLES, is_weighted=True, optimizer=OPTIMIZERS["rowwise_adagrad"])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=batches())
def test_unsharded_kernels_refuse_or_answer(batch: dict[str, Any]) -> None:
    module = _unsharded()
    before = _state(module)
    kjt = to_kjt(batch)
    try:
        kjt.validate()
        valid = all(w == w and abs(w) != float("inf") for w in batch["weights"]) and all(
            i >= 0 for i in batch["ids"]
        )
    except ValueError:
        valid = False
    try:
        module(kjt).values().sum().backward()
    except InvalidInputError:
        assert _bit_identical(before, _state(module))
        return
    assert valid, f"accepted a bad batch: {batch}"


def run_property(plan: str) -> int:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = test_device()
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharded = EmbeddingBagCollectionSharder().shard(
        _unsharded(), plan_for(plan, world), env, device
    )
    reference = _unsharded()
    seen = [0]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=batches())
    def one(batch: dict[str, Any]) -> None:
        seen[0] += 1
        mine = to_kjt(batch) if rank == 1 else good(seen[0])
        before = _state(sharded)
        try:
            out = sharded(mine.to(device)).values().detach().cpu()
        except InvalidInputError as error:
            assert error.rank == 1 and "rank 1" in str(error), str(error)
            assert _bit_identical(before, _state(sharded))
            return
        # Accepted: every rank's output must be the unsharded module's on its batch.
        expected = reference(to_kjt(batch) if rank == 1 else mine).values()
        torch.testing.assert_close(out, expected.detach())

    one()
    return seen[0]


def test_sharded_collection_refuses_or_matches_on_two_ranks() -> None:
    for plan in ("tw", "rw"):
        counts = run_on_ranks(2, run_property, plan, timeout_s=120)
        assert counts[0] == counts[1] > 0
