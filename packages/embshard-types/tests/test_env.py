"""Sharding environments: validation, local environments, and real gloo process groups (1-D and
2-D layouts, checked against the ranks torch.distributed itself assigns)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embshard_types.env import ShardingEnv, ShardingEnv2D, rank_device
from embshard_types.vocab import ShardingType


def test_from_local() -> None:
    env = ShardingEnv.from_local(4, 3)
    assert (env.world_size, env.rank, env.process_group, env.device_mesh) == (4, 3, None, None)
    assert env.output_dtensor is False
    assert repr(env) == "ShardingEnv(world_size=4, rank=3, pg=None)"


@pytest.mark.parametrize(
    ("world_size", "rank", "message"),
    [
        (2, 2, r"rank 2 is outside the world of size 2; a rank must be in \[0, 2\)"),
        (2, -1, r"rank -1 is outside the world of size 2"),
        (0, 0, "world_size must be a positive int, got 0"),
        (2.0, 0, "world_size must be a positive int, got 2.0"),
        (2, True, "rank must be an int, got True"),
    ],
)
def test_invalid_rank_or_world(world_size: Any, rank: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardingEnv(world_size, rank)
    with pytest.raises(ValueError, match=message):
        ShardingEnv.from_local(world_size, rank)


def test_rank_device() -> None:
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("cuda", 3) == torch.device("cuda", 3)
    assert rank_device("mtia", 0) == torch.device("mtia:0")
    assert rank_device("meta", 2) == torch.device("meta")
    with pytest.raises(ValueError, match="rank must be a non-negative int, got -1"):
        rank_device("cuda", -1)


def _remap_checks(env: ShardingEnv2D) -> dict[str, Any]:
    errors = {}
    for st in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL):
        try:
            env.remap_rank(0, st)
        except ValueError as e:
            errors[st.value] = str(e)
    try:
        env.remap_rank(env.global_world_size, "table_wise")
    except ValueError as e:
        errors["out_of_range"] = str(e)
    return errors


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    from torch.distributed.device_mesh import DeviceMesh

    try:
        world = dist.group.WORLD
        assert world is not None
        env = ShardingEnv.from_process_group(world)
        mesh = env.device_mesh
        assert mesh is not None
        result: dict[str, Any] = {
            "env": [env.world_size, env.rank, mesh.device_type, mesh.size(), mesh.ndim],
            "same_mesh": env.device_mesh is mesh,
        }
        try:
            ShardingEnv(2, 0, world)
        except ValueError as e:
            result["size_mismatch"] = str(e)
        try:
            ShardingEnv2D(world, world, mesh)
        except ValueError as e:
            result["mesh_1d"] = str(e)
        try:
            ShardingEnv2D(world, world, node_group_size=0)
        except ValueError as e:
            result["node_group_0"] = str(e)
        for inter_host in (False, True):
            grid = torch.arange(world_size).view(2, world_size // 2)
            # rows are the sharding groups: contiguous blocks, or strided ranks
            layout = grid if inter_host else grid.view(world_size // 2, 2).T
            mesh2d = DeviceMesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
            sharding_pg, replica_pg = mesh2d.get_group("shard"), mesh2d.get_group("replicate")
            env2d = ShardingEnv2D(
                sharding_pg,
                world,
                mesh2d,
                node_group_size=2,
                use_inter_host_allreduce=inter_host,
                replica_pg=replica_pg,
            )
            members = [0] * env2d.world_size
            dist.all_gather_object(members, rank, group=sharding_pg)
            result[f"2d_inter_host={inter_host}"] = {
                "sizes": [env2d.world_size, env2d.rank, env2d.global_world_size, env2d.global_rank],
                "groups": env2d.num_sharding_groups(),
                "remap": [
                    env2d.remap_rank(rank, st)
                    for st in ("table_wise", ShardingType.COLUMN_WISE, ShardingType.GRID_SHARD)
                ],
                "pg_rank": dist.get_rank(sharding_pg),
                "members": members,
                "members_remapped": [env2d.remap_rank(r, "table_wise") for r in members],
                "output_dtensor": env2d.output_dtensor,
                "is_global_pg": env2d.process_group is world,
                "errors": _remap_checks(env2d),
            }
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # leave without the interpreter's teardown, where a gloo worker thread can still need the
    # GIL and abort the process ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_environments_on_real_process_groups(tmp_path: Path) -> None:
    world_size = 4
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    mp.spawn(
        _worker,
        args=(world_size, str(tmp_path / "init"), str(tmp_path)),
        nprocs=world_size,
        join=True,
    )
    for rank in range(world_size):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["env"] == [world_size, rank, "cpu", world_size, 1]
        assert result["same_mesh"] is True
        assert "world_size 2 differs from the process group's size 4" in result["size_mismatch"]
        assert "device_mesh must be 2-D (replicate, shard), got 1-D" in result["mesh_1d"]
        assert "node_group_size must be a positive int, got 0" in result["node_group_0"]
        for inter_host in (False, True):
            r = result[f"2d_inter_host={inter_host}"]
            position = rank % 2 if inter_host else rank // 2
            assert r["sizes"] == [2, position, world_size, rank]
            assert r["groups"] == 2
            # remap_rank agrees with the rank torch.distributed gives in the sharding group
            assert r["remap"] == [r["pg_rank"]] * 3 == [position] * 3
            assert r["members_remapped"] == [0, 1]
            assert r["output_dtensor"] is True and r["is_global_pg"] is True
            assert (
                "remap_rank applies to column_wise, table_wise, grid_shard"
                in r["errors"]["row_wise"]
            )
            assert "not data_parallel" in r["errors"]["data_parallel"]
            assert "rank 4 is outside the world of size 4" in r["errors"]["out_of_range"]
