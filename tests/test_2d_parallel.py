"""DMPCollection on 4 ranks: a sharding group of 2, replicated twice, against unsharded modules.

The tables (data-parallel, table-wise, row-wise, column-wise, table-row-wise and grid, with one
rank per node inside the sharding group) are sharded over each sharding group; every rank
trains on its own batch (uneven sizes). What is checked, step by step:

* after every sync the two replicas hold bit-identical weights and optimizer state (every
  local tensor all-gathered over the replica group);
* SGD synced every step: weights equal the unsharded module stepped on the global batch with
  ``L = (1/4) * sum_i L_i`` (the one rule) within 1e-6;
* RowWiseAdagrad synced every step and Adam synced every 2 steps (contiguous sharding groups):
  forward, weights and optimizer state equal the replica reference: per replica, an unsharded
  module stepped on that sharding group's batch with loss ``(1/2) * sum_{i in group} L_i``,
  the two averaged element-wise (weights and every state tensor) at each sync (what
  :mod:`embshard_dist.dmp.replicas` promises for adaptive optimizers); between syncs the
  replicas differ.

Also: the group helpers of :mod:`embshard_dist.strategies.nodes` inside a 2-D layout (sub-groups
created once per mirror sharding group), and their cache across a new default process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import free_port, run_on_ranks, run_ranks, test_device
from test_node_aware_sharding import (
    OPTIMIZERS,
    TABLES,
    _columns,
    _ps,
    check_close,
    compare_tables,
    global_batch,
    kjt_of,
)

from embshard_dist.dmp.collection import DMPCollection, create_2d_env, sharding_group_ranks
from embshard_dist.dmp.replicas import replica_tensors
from embshard_dist.strategies.layout import grid_specs
from embshard_dist.strategies.nodes import subgroup
from embshard_dist.train_pipeline import TrainPipelineSparseDist
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.vocab import ShardingType

WORLD = 4
GROUP = 2
SIZES = [3, 1, 2, 4]


@dataclass(frozen=True)
class Case:
    """One 2-D configuration."""

    optimizer: str
    interval: int
    contiguous: bool
    steps: int


def plan(row_wise: bool) -> ShardingPlan:
    """A plan for a sharding group of 2 ranks (one rank per node).

    ``t1`` is cut into two column blocks: column-wise for point-wise optimizers; grid (the
    same blocks) for row-wise ones, whose row sums then run in the sharding group itself.
    Column-wise's own row-sum groups are made with ``torch.distributed.new_group`` over one
    sharding group's ranks, which two sharding groups cannot do at once (their groups would
    share a name).
    """
    t1 = _columns("t1", [4, 8], [1, 0], ShardingType.COLUMN_WISE)
    if row_wise:
        specs = grid_specs(11, 12, [[1], [0]], test_device().type, shard_dims=[4, 8])
        t1 = _ps(ShardingType.GRID_SHARD, [s.rank for s in specs], specs)
    return ShardingPlan(
        {
            "": EmbeddingModuleShardingPlan(
                {
                    "t0": _ps(ShardingType.DATA_PARALLEL),
                    "t1": t1,
                    "t2": _ps(ShardingType.ROW_WISE),
                    "t3": _ps(ShardingType.TABLE_WISE, [1]),
                    "t4": _ps(ShardingType.TABLE_ROW_WISE, [0]),
                    "t5": _ps(ShardingType.GRID_SHARD, [1, 0]),
                    "t6": _ps(ShardingType.TABLE_WISE, [0]),
                }
            )
        }
    )


def groups_of(contiguous: bool) -> list[list[int]]:
    """The global ranks of each sharding group."""
    return sharding_group_ranks(WORLD, GROUP, use_inter_host_allreduce=contiguous)[0]


def samples(rank: int) -> tuple[int, int]:
    return sum(SIZES[:rank]), sum(SIZES[: rank + 1])


def select(data: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The samples ``rows`` of a batch made by ``global_batch``, in that order."""
    out = {}
    for feature, (lengths, ids, weights) in data.items():
        starts = torch.cumsum(lengths, 0) - lengths
        picked = [torch.arange(int(starts[i]), int(starts[i] + lengths[i])) for i in rows]
        index = torch.cat(picked) if picked else torch.empty(0, dtype=torch.long)
        out[feature] = (lengths[rows], ids[index], weights[index])
    return out


def replicas_identical(model: DMPCollection) -> bool:
    """Whether every local tensor is bit-identical across the replica group (collective)."""
    same = True
    for tensor in replica_tensors(model.sharded_modules.values()):
        gathered = [torch.empty_like(tensor) for _ in range(model.num_replicas)]
        dist.all_gather(gathered, tensor.contiguous(), group=model.replica_pg)
        same &= all(torch.equal(g, gathered[0]) for g in gathered)
    return same


def average(references: list[EmbeddingBagCollection]) -> None:
    """Average the references' weights and optimizer state element-wise, into each of them."""
    parts = [replica_tensors([r]) for r in references]
    with torch.no_grad():
        for tensors in zip(*parts, strict=True):
            mean = sum(t.clone() for t in tensors[1:]) + tensors[0]
            mean = mean / len(tensors)
            for t in tensors:
                t.copy_(mean)


def run_2d(case: Case) -> int:
    rank = dist.get_rank()
    spec = OPTIMIZERS[case.optimizer]
    configs = list(TABLES)
    torch.manual_seed(5)
    source = EmbeddingBagCollection(configs, optimizer=spec)
    model = DMPCollection(
        source,
        GROUP,
        test_device(),
        plan(case.optimizer == "rowwise_adagrad"),
        sync_interval=case.interval,
        node_group_size=1,
        use_inter_host_allreduce=case.contiguous,
    )
    assert model.num_replicas == WORLD // GROUP
    sharded = model.module
    groups = groups_of(case.contiguous) if case.optimizer != "sgd" else [list(range(WORLD))]
    mine = next(g for g in groups if rank in g)
    references = []
    for _ in groups:
        torch.manual_seed(5)
        references.append(EmbeddingBagCollection(configs, optimizer=spec))
    reference = references[groups.index(mine)]

    keys = [f for c in configs for f in c.feature_names]
    lo, hi = samples(rank)
    for step in range(case.steps):
        data = global_batch(configs, 50 + step, sum(SIZES))
        g = torch.Generator().manual_seed(900 + step)
        width = sum(c.embedding_dim * len(c.feature_names) for c in configs)
        factors = torch.randn(sum(SIZES), width, generator=g)
        out = model(kjt_of(data, keys, lo, hi, False).to(test_device()))
        (out.values() * factors[lo:hi].to(test_device())).sum().backward()
        for ranks, ref in zip(groups, references, strict=True):
            # One forward over the group's samples (one fused update per step).
            rows = [i for r in ranks for i in range(*samples(r))]
            expected = ref(kjt_of(select(data, rows), keys, 0, len(rows), False)).values()
            if ref is reference:
                at = sum(SIZES[r] for r in ranks[: ranks.index(rank)])
                check_close(out.values(), expected[at : at + hi - lo], f"{case} step {step} fwd")
            ((expected * factors[rows]).sum() / len(ranks)).backward()
            ref.fused_optimizer.step()
        synced = model.maybe_sync()
        assert synced == ((step + 1) % case.interval == 0)
        if synced and len(references) > 1:
            average(references)
        identical = replicas_identical(model)
        assert identical == synced, f"{case} step {step}: replicas identical={identical}"
    return compare_tables(sharded, reference, str(case))


def run_subgroups() -> list[int]:
    """Sub-groups of 2-D sharding groups: created for every mirror, cached, usable."""
    env = create_2d_env(GROUP, use_inter_host_allreduce=True)
    whole = subgroup(env.sharding_pg, [0, 1])
    assert whole is env.sharding_pg
    single = subgroup(env.sharding_pg, [1])
    assert subgroup(env.sharding_pg, [1]) is single  # cached
    sizes = []
    if env.rank == 1:
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value, group=single)
        sizes.append(dist.get_world_size(single))
        assert value.item() == dist.get_rank()
    value = torch.tensor([1.0])
    dist.all_reduce(value, group=env.replica_pg)
    sizes.append(int(value.item()))
    return sizes


def run_subgroup_after_new_world(port: int) -> list[float]:
    """A process that tears its default group down and starts a new one gets new sub-groups
    from :func:`subgroup`, not the destroyed ones it cached before."""
    rank = dist.get_rank()
    sums = []
    for round_ in range(2):
        if round_:
            dist.destroy_process_group()
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3
            )
        pair = subgroup(None, [1, 2])
        if rank > 0:
            assert dist.get_process_group_ranks(pair) == [1, 2]
            value = torch.tensor([float(rank + round_)])
            dist.all_reduce(value, group=pair)
            sums.append(value.item())
        value = torch.tensor([1.0])
        dist.all_reduce(value)
        sums.append(value.item())
    return sums


@pytest.mark.cpu_only("the ranks start a gloo group of their own")
def test_subgroups_follow_a_new_default_group() -> None:
    results = run_ranks(3, run_subgroup_after_new_world, free_port())
    assert results == [[3.0, 3.0]] + [[3.0, 3.0, 5.0, 3.0]] * 2


def run_all(cases: list[Case]) -> list[int]:
    torch.set_num_threads(1)
    return [run_2d(case) for case in cases] + run_subgroups()


CASES = [
    Case("sgd", interval=1, contiguous=False, steps=3),
    Case("rowwise_adagrad", interval=1, contiguous=False, steps=3),
    Case("adam", interval=2, contiguous=True, steps=4),
]


@pytest.mark.cpu_only("4 ranks, one per device")
def test_2d_replicas_match_references() -> None:
    results = run_on_ranks(WORLD, run_all, CASES, timeout_s=240)
    for rank, values in enumerate(results):
        compared, sizes = values[: len(CASES)], values[len(CASES) :]
        assert all(n > 0 for n in compared)
        assert sizes == ([1, 2] if rank % GROUP == 1 else [2])


def run_pipelined_2d(steps: int) -> list[bool]:
    """TrainPipelineSparseDist over a DMPCollection syncs its replicas every
    ``dmp_collection_sync_interval_batches`` batches, after the backward and before the
    optimizer step, as TorchRec's pipeline does: equal, bit for bit, to the plain loop that calls
    ``model.sync()`` there; ``None`` never syncs."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    spec = OPTIMIZERS["rowwise_adagrad"]
    configs = list(TABLES)
    keys = [f for c in configs for f in c.feature_names]
    lo, hi = samples(rank)

    def build() -> DMPCollection:
        torch.manual_seed(5)
        source = EmbeddingBagCollection(configs, optimizer=spec)
        return DMPCollection(
            source, GROUP, test_device(), plan(True), sync_interval=1000, node_group_size=1
        )

    def forward_of(model: DMPCollection) -> Any:
        width = sum(c.embedding_dim * len(c.feature_names) for c in configs)
        factors = torch.randn(hi - lo, width, generator=torch.Generator().manual_seed(rank))

        def forward(kjt: Any) -> tuple[torch.Tensor, torch.Tensor]:
            out = model(kjt).values()
            return (out * factors.to(out.device)).sum(), out.detach()

        return forward

    batches = [
        kjt_of(global_batch(configs, 70 + step, sum(SIZES)), keys, lo, hi, False)
        for step in range(steps)
    ]
    piped, plain, never = build(), build(), build()
    pipelines = [
        TrainPipelineSparseDist(
            model,
            model.optimizer(),
            test_device(),
            custom_model_fwd=forward_of(model),
            dmp_collection_sync_interval_batches=interval,
        )
        for model, interval in ((piped, 2), (never, None))
    ]
    outputs: list[list[torch.Tensor]] = [[], []]
    for which, pipeline in enumerate(pipelines):
        it = iter(batches)
        for _ in range(steps):
            outputs[which].append(pipeline.progress(it))
    optimizer, forward = plain.optimizer(), forward_of(plain)
    for step, kjt in enumerate(batches):
        optimizer.zero_grad()
        loss, out = forward(kjt.to(test_device()))
        loss.backward()
        if step % 2 == 0:
            plain.sync()
        optimizer.step()
        assert torch.equal(outputs[0][step], out), f"step {step}"
    mine = replica_tensors(piped.sharded_modules.values())
    theirs = replica_tensors(plain.sharded_modules.values())
    equal = all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    return [equal, replicas_identical(piped), replicas_identical(never)]


@pytest.mark.cpu_only("4 ranks, one per device")
def test_pipeline_syncs_replicas_on_torchrecs_schedule() -> None:
    results = run_on_ranks(WORLD, run_pipelined_2d, 5, timeout_s=240)
    assert results == [[True, True, False]] * WORLD


def test_sharding_group_layouts() -> None:
    strided = sharding_group_ranks(8, 4)
    assert strided == ([[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]])
    contiguous = sharding_group_ranks(8, 4, use_inter_host_allreduce=True)
    assert contiguous == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    with pytest.raises(ValueError, match="does not divide"):
        sharding_group_ranks(6, 4)
