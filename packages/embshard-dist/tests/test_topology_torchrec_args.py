"""``Topology`` takes TorchRec's constructor arguments, and ``Topology(world_size, device)`` is
the topology ``DistributedModelParallel`` derives for itself (so both plan tables alike)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from embshard_dist.planner.auto import runtime_topology
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.topology import Topology
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.configs import EmbeddingBagConfig

_MS = 1000.0  # TorchRec's bandwidths are bytes per millisecond


def _speeds(topo: Topology) -> dict[str, object]:
    skip = ("memory_per_rank", "host_memory_per_rank")  # DMP reads the memory free right now
    return {f.name: getattr(topo, f.name) for f in fields(topo) if f.name not in skip}


@pytest.fixture(autouse=True)
def _one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_hand_built_topology_is_the_one_dmp_derives(world_size: int) -> None:
    by_hand = Topology(world_size, "cpu")
    derived = runtime_topology(world_size, "cpu")
    assert _speeds(by_hand) == _speeds(derived)
    assert by_hand.local_world_size == world_size
    assert by_hand.memory_per_rank > 0


def test_hand_built_topology_plans_like_dmp() -> None:
    tables = [
        EmbeddingBagConfig(rows, dim, f"t{i}")
        for i, (rows, dim) in enumerate([(1000, 16), (5000, 32), (20_000, 64), (100_000, 16)] * 2)
    ]
    module = EmbeddingBagCollection(tables, device="meta")
    sharders = [EmbeddingBagCollectionSharder()]

    def kinds(topo: Topology) -> dict[str, str]:
        plan = EmbeddingShardingPlanner(topo, batch_size=512).plan(module, sharders)
        return {t: p.sharding_type.value for t, p in plan.plan[""].items()}

    by_hand = kinds(Topology(2, "cpu"))
    assert by_hand == kinds(runtime_topology(2, "cpu"))
    assert set(by_hand) == {t.name for t in tables}


def test_node_size_comes_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Topology(4, "cpu").local_world_size == 2
    assert Topology(4, "cpu", local_world_size=4).local_world_size == 4
    assert Topology(4, "cpu").local_world_size == runtime_topology(4, "cpu").local_world_size


def test_torchrec_arguments_map_to_fields() -> None:
    cpu = Topology(
        world_size=4,
        compute_device="cpu",
        ddr_cap=8 << 30,
        local_world_size=2,
        ddr_mem_bw=20e6,
        intra_host_bw=3e6,
        inter_host_bw=1e6,
        hbm_cap=32 << 30,  # no GPU memory on the CPU: unused, as in TorchRec
    )
    assert cpu.memory_per_rank == 8 << 30 and cpu.host_memory_per_rank == 0
    assert cpu.memory_bw == 20e6 * _MS
    assert (cpu.intra_node_bw, cpu.inter_node_bw) == (3e6 * _MS, 1e6 * _MS)
    assert cpu.num_nodes == 2
    # Given links, reduce-scatter follows them rather than the reference host's figure.
    assert cpu.within_node_reduce_bw == cpu.intra_node_bw

    gpu = Topology(2, "cuda", hbm_cap=40 << 30, ddr_cap=100 << 30, hbm_mem_bw=1e9)
    assert gpu.memory_per_rank == 40 << 30 and gpu.host_memory_per_rank == 100 << 30
    assert gpu.memory_bw == 1e9 * _MS
    assert gpu.compute_device == "cuda"


def test_torchrec_arguments_round_trip_and_resize() -> None:
    topo = Topology(2, "cpu", ddr_cap=1 << 30, intra_host_bw=5e5)
    assert Topology.from_dict(topo.to_dict()) == topo
    bigger = topo.with_world(4)
    assert bigger.world_size == 4 and bigger.memory_per_rank == 1 << 30
    assert bigger.intra_node_bw == topo.intra_node_bw


def test_conflicting_or_meaningless_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="both memory_per_rank and TorchRec's ddr_cap"):
        Topology(2, "cpu", memory_per_rank=1 << 30, ddr_cap=2 << 30)
    with pytest.raises(ValueError, match="both intra_node_bw and TorchRec's intra_host_bw"):
        Topology(2, "cpu", intra_node_bw=1e9, intra_host_bw=1e6)
    with pytest.raises(ValueError, match=r"ddr_mem_bw=.* has no embshard equivalent on CUDA"):
        Topology(2, "cuda", hbm_cap=1 << 30, ddr_mem_bw=1e6)
    with pytest.raises(ValueError, match=r"Topology\.memory_bw must be"):
        Topology(2, "cpu", ddr_mem_bw=-1.0)
