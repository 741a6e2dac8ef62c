"""A bad input on one of 2 ranks under table-row-wise, table-column-wise and grid sharding.

As ``test_input_errors`` does for the other types: rank 1 gets a broken KeyedJaggedTensor and
both ranks must raise the same error naming rank 1, with no timeout, weights and fused optimizer
state bit-identical, and the next good step matching the unsharded module. The node-aware input
dists carry the input checks' verdict in their KJT all-to-all's first exchange. Two layouts:
one rank per node (table-row-wise and grid then take their cross-node paths: a row block per
node, pooled sums crossing nodes) and one node of both ranks (rows cut inside the node).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from test_input_errors import BAD, KEYS, TABLES, _bit_identical, _good, _state, feed_bad_inputs
from test_sharded_ebc_training import OPTIMIZERS

from embshard_dist.comm.kjt_all_to_all import STATUS_WORDS, InputStatus
from embshard_dist.comm.timeouts import ENV_TIMEOUT_VAR
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.strategies.node_dist import NodeRowWiseInputDist
from embshard_dist.strategies.variable_batch import VariableBatchError, variable_batch_verdict
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ShardingType

TWRW, TWCW, GRID = (
    ShardingType.TABLE_ROW_WISE,
    ShardingType.TABLE_COLUMN_WISE,
    ShardingType.GRID_SHARD,
)
PLANS: dict[tuple[str, int], dict[str, tuple[ShardingType, list[int]]]] = {
    # one rank per node: rank r is node r
    ("twrw", 1): {"t_sum": (TWRW, [1]), "t_shared": (TWRW, [0]), "t_wide": (TWRW, [1]),
                  "t_mean": (TWRW, [0])},
    ("grid", 1): {"t_sum": (GRID, [0, 1]), "t_shared": (GRID, [1, 0]), "t_wide": (GRID, [0, 1]),
                  "t_mean": (GRID, [1])},
    ("twcw", 1): {"t_sum": (TWCW, [0]), "t_shared": (TWCW, [1]), "t_wide": (TWCW, [1]),
                  "t_mean": (TWCW, [0])},
    # one node of both ranks
    ("twrw", 2): {t.name: (TWRW, [0, 1]) for t in TABLES},
    ("grid", 2): {t.name: (GRID, [0, 1]) for t in TABLES},
    ("twcw", 2): {"t_sum": (TWCW, [0, 1]), "t_shared": (TWCW, [1, 0]), "t_wide": (TWCW, [0, 1]),
                  "t_mean": (TWCW, [1])},
}  # fmt: skip


def _plan(name: str, node_size: int) -> EmbeddingModuleShardingPlan:
    return EmbeddingModuleShardingPlan(
        {
            table: ParameterSharding(kind, "fused", ranks=ranks)
            for table, (kind, ranks) in PLANS[(name, node_size)].items()
        }
    )


def run_bad_inputs_in_nodes(
    plan: str, node_size: int, cases: list[str]
) -> tuple[list[tuple[str, str, str, bool]], list[bool]]:
    """Per case: this rank's exception type, message and whether state stayed the same; and
    per strategy whether its input dist carries the verdict."""
    torch.set_num_threads(1)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharder = EmbeddingBagCollectionSharder(local_world_size=node_size)
    sharded, results = feed_bad_inputs(
        lambda source: sharder.shard(source, _plan(plan, node_size), env, test_device()), cases
    )
    carriers = [getattr(d, "carries_input_status", False) for d in sharded._input_dists]
    return results, carriers


@pytest.mark.parametrize("node_size", [1, 2])
@pytest.mark.parametrize("plan", ["twrw", "grid", "twcw"])
def test_bad_input_on_one_rank_gives_every_rank_the_same_error(plan: str, node_size: int) -> None:
    cases = sorted(BAD)
    (results0, carriers0), (results1, carriers1) = run_on_ranks(
        2, run_bad_inputs_in_nodes, plan, node_size, cases
    )
    assert carriers0 == carriers1 and carriers0 and all(carriers0), carriers0
    for i, case in enumerate(cases):
        (name0, kind0, text0, same0), (name1, kind1, text1, same1) = results0[i], results1[i]
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


def test_node_row_wise_input_dist_is_a_status_carrier() -> None:
    assert NodeRowWiseInputDist.carries_input_status is True


def _variable_batch_on_rank_1(plan: str, node_size: int) -> tuple[str, str, bool]:
    """Rank 1 passes a batch whose sizes vary per feature, which these types cannot serve."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    device = test_device()
    torch.manual_seed(7)
    source = EmbeddingBagCollection(
        list(TABLES), is_weighted=True, optimizer=OPTIMIZERS["rowwise_adagrad"]
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharder = EmbeddingBagCollectionSharder(local_world_size=node_size)
    sharded = sharder.shard(source, _plan(plan, node_size), env, device)
    batch = _good(0, rank)
    if rank == 1:
        lengths = batch.lengths()
        strides = [3] * len(KEYS)
        strides[0] = 2  # the first feature has one bag fewer
        keep = torch.ones(lengths.numel(), dtype=torch.bool)
        keep[2] = False
        values_keep = torch.repeat_interleave(keep, lengths)
        batch = KeyedJaggedTensor(
            KEYS,
            batch.values()[values_keep],
            weights=batch.weights()[values_keep],
            lengths=lengths[keep],
            stride_per_key_per_rank=[[s] for s in strides],
            inverse_indices=(KEYS, torch.tensor([[0, 1, 1]] + [[0, 1, 2]] * (len(KEYS) - 1))),
        )
    before = _state(sharded)
    limit = os.environ.get(ENV_TIMEOUT_VAR)
    os.environ[ENV_TIMEOUT_VAR] = "3"  # a rank left waiting fails fast
    try:
        sharded(batch.to(device)).values().sum().backward()
        return "no error", "", _bit_identical(before, _state(sharded))
    except Exception as error:
        return type(error).__name__, str(error), _bit_identical(before, _state(sharded))
    finally:
        if limit is None:
            del os.environ[ENV_TIMEOUT_VAR]
        else:
            os.environ[ENV_TIMEOUT_VAR] = limit


@pytest.mark.parametrize(("plan", "node_size"), [("twrw", 1), ("grid", 2)])
def test_unsupported_variable_batch_on_one_rank_gives_every_rank_the_same_error(
    plan: str, node_size: int
) -> None:
    (kind0, text0, same0), (kind1, text1, same1) = run_on_ranks(
        2, _variable_batch_on_rank_1, plan, node_size
    )
    assert (kind0, text0) == (kind1, text1), (text0, text1)
    assert kind0 == "VariableBatchError"
    assert text0.startswith("the input on rank 1: the batch's sizes vary per feature")
    assert plan.replace("twrw", "table_row_wise").replace("grid", "grid_shard") in text0
    assert same0 and same1


def test_variable_batch_verdict_builds_one_error_from_the_words_on_every_rank() -> None:
    """The refusal travels as status words; any rank rebuilds the same error from them."""
    shardings = [type("S", (), {"sharding_type": ShardingType.TABLE_WISE})()]
    good = InputStatus((0,) * STATUS_WORDS, lambda rank, words: ValueError(f"input {words}"))
    batch = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1], [2]],
    )
    routed, status = variable_batch_verdict(batch, ["a", "b"], shardings, good)
    assert routed.keys() == ["a", "b"] and routed.values().numel() == 0  # an empty stand-in
    assert status.words[0] != 0
    error = status.error(1, list(status.words))
    assert isinstance(error, VariableBatchError) and error.rank == 1
    assert str(error).startswith("the input on rank 1: the batch's sizes vary per feature")
    assert "feature 'a': 1, feature 'b': 2" in str(error) and "no inverse_indices" in str(error)
    # a peer whose own batch was fine builds the same error from the same words
    _, peer = variable_batch_verdict(_good(0, 0), ["a", "b"], shardings, good)
    assert peer.words == good.words and str(peer.error(1, list(status.words))) == str(error)
    # the input checks' own problems still reach their own error builder
    assert str(peer.error(0, [5, 0, 0, 0, 0, 0])) == "input [5, 0, 0, 0, 0, 0]"
