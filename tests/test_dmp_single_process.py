"""One process, and TorchRec's DistributedModelParallel keyword arguments.

* Without a process group DMP refuses up front and says how to run one process; that advice
  (a one-rank gloo group on a ``HashStore``) trains every sharding type like the unsharded
  model, checked in a fresh interpreter so this test session's state stays untouched.
* ``local_world_size=`` sets the node size of the default sharders; ``init_parameters=False``
  leaves the dense rest on ``meta`` and ``init_data_parallel`` then refuses clearly; a
  ``data_parallel_wrapper`` is what makes the dense rest data-parallel; TorchRec's
  ``get_module`` / ``get_unwrapped_module`` unwrap DMP (and DDP) as TorchRec's do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks
from test_dmp_in_backward import DIM, LR, ROWS, STEPS, TOL, Model, batch, reference
from torch import nn

from embshard_dist.dmp.dense import DefaultDataParallelWrapper
from embshard_dist.dmp.model_parallel import (
    DistributedModelParallel,
    get_module,
    get_unwrapped_module,
)
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.sharded.plan_helpers import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from embshard_optim import apply_optimizer_in_backward
from embshard_types.env import ShardingEnv
from embshard_types.plan import ShardingPlan

ONE_RANK_HELPERS = {
    "table_wise": lambda: table_wise(rank=0),
    "row_wise": row_wise,
    "column_wise": lambda: column_wise(ranks=[0]),
    "data_parallel": data_parallel,
    "table_row_wise": lambda: table_row_wise(host_index=0),
    "table_column_wise": lambda: table_column_wise(host_index=0),
    "grid_shard": lambda: grid_shard(host_indexes=[0]),
}


def test_no_process_group_is_refused_with_working_advice() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group\('gloo', store=torch"):
        DistributedModelParallel(Model(), env=ShardingEnv.from_local(1, 0))


def train_one_process(kind: str) -> float:
    """In a process whose one-rank group is up: the largest difference to the reference."""
    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": LR})
    per_table = {t: ONE_RANK_HELPERS[kind]() for t in ROWS}
    plan = construct_module_sharding_plan(
        model.ebc, per_table, world_size=1, local_size=1, device_type="cpu"
    )
    dmp = DistributedModelParallel(model, plan=ShardingPlan({"ebc": plan}))
    dense = torch.optim.SGD(dmp.module.over.parameters(), lr=0.1)
    for step in range(STEPS):
        dmp(batch(step, 0)).backward()
        dense.step()
        dense.zero_grad()
    expected = reference(1)
    worst = 0.0
    for key, value in dmp.state_dict().items():
        if key.startswith("ebc."):
            table = key.split(".")[2]
            local = value.local_shards() if hasattr(value, "local_shards") else None
            full = torch.zeros(ROWS[table], DIM)
            for shard in local or ():
                (r0, c0), t = shard.metadata.shard_offsets, shard.tensor
                full[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t.detach()
            got = full if local is not None else value.detach()
            worst = max(worst, float((got - expected[table]).abs().max()))
        else:
            worst = max(worst, float((value - expected[key]).abs().max()))
    return worst


_CHILD = """
import json, sys
import torch.distributed as dist
sys.path.insert(0, {tests!r})
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from test_dmp_single_process import ONE_RANK_HELPERS, train_one_process
print(json.dumps({{kind: train_one_process(kind) for kind in ONE_RANK_HELPERS}}))
"""


def test_the_advised_one_rank_group_trains_every_sharding_type() -> None:
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tests=tests)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    worst = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(worst) == sorted(ONE_RANK_HELPERS)
    for kind, diff in worst.items():
        assert diff <= TOL, (kind, diff)


class RecordingWrapper(DefaultDataParallelWrapper):
    """DDP, and a note that it was asked to wrap."""

    calls = 0

    def wrap(self, dmp: nn.Module, env: ShardingEnv, device: torch.device) -> None:
        RecordingWrapper.calls += 1
        super().wrap(dmp, env, device)


def keyword_arguments() -> dict[str, Any]:
    world = dist.get_world_size()
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    model = Model()
    # One rank per node: node 1 is rank 1 alone, which only that node size allows.
    per_table = {t: table_row_wise(host_index=1) for t in ROWS}
    plan = construct_module_sharding_plan(
        model.ebc, per_table, world_size=world, local_size=1, device_type="cpu"
    )
    dmp = DistributedModelParallel(
        model,
        plan=ShardingPlan({"ebc": plan}),
        local_world_size=1,
        init_data_parallel=False,
        data_parallel_wrapper=RecordingWrapper(),
    )
    out["wrapped_before"] = type(dmp._dmp_wrapped_module).__name__
    dmp.init_data_parallel()
    out["wrapped_after"] = type(dmp._dmp_wrapped_module).__name__
    out["wrapper_calls"] = RecordingWrapper.calls
    # TorchRec's unwrapping helpers: get_module keeps the DDP wrapper, get_unwrapped_module not.
    out["get_module"] = type(get_module(dmp)).__name__
    out["unwrapped_is_model"] = get_unwrapped_module(dmp) is model is dmp.module
    out["plain_is_itself"] = get_unwrapped_module(model.ebc) is model.ebc
    out["fused_keys"] = sorted(dmp.fused_optimizer.params)
    try:
        DistributedModelParallel(
            Model(), sharders=[EmbeddingBagCollectionSharder()], local_world_size=1
        )
    except ValueError as e:
        out["own_sharders"] = str(e)
    try:
        DistributedModelParallel(Model(), env=ShardingEnv.from_local(1, 0))
    except ValueError as e:
        out["local_env"] = str(e)
    with torch.device("meta"):
        over = nn.Linear(DIM * len(ROWS), 1)
    model = Model()
    model.over = over
    lazy = DistributedModelParallel(model, init_parameters=False, init_data_parallel=False)
    out["meta_left"] = lazy.module.over.weight.is_meta
    try:
        lazy.init_data_parallel()
    except ValueError as e:
        out["meta_refused"] = str(e)
    return out


def test_torchrec_keyword_arguments() -> None:
    results = run_on_ranks(2, keyword_arguments)
    # Node 1 (rank 1 alone) holds every table; rank 0 holds none.
    assert results[0]["fused_keys"] == []
    assert results[1]["fused_keys"] == [f"ebc.embedding_bags.{t}.weight" for t in ROWS]
    for result in results:
        assert result["wrapped_before"] == "Model"
        assert result["wrapped_after"] == "DistributedDataParallel"
        assert result["wrapper_calls"] == 1
        assert result["get_module"] == "DistributedDataParallel"
        assert result["unwrapped_is_model"] and result["plain_is_itself"]
        assert "local_world_size only configures the default sharders" in result["own_sharders"]
        assert "default group of 2 ranks, not 1" in result["local_env"]
        assert result["meta_left"] is True
        assert "['over.weight', 'over.bias'] are still on the meta" in result["meta_refused"]
