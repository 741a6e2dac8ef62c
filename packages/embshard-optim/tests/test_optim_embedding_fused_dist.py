"""The fused optimizer's sharded state on two real gloo processes.

Two tables of 8 x 4 on two ranks, one split by rows and one by columns, each with a point-wise
state (``momentum1``) and a row-wise one (``momentum2``). Every shard holds the values of an
unsharded reference, so gathering each ``ShardedTensor`` must give the reference back.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _optim_helpers import FakeKernel, free_port

from embshard_optim.embedding_fused import EmbeddingFusedOptimizer, TableShardInfo
from embshard_types.shard_spec import ShardSpec

ROWS, DIM = 8, 4
WEIGHT = torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM)
LAYOUTS = {
    "rw": [((0, 0), (4, 4)), ((4, 0), (4, 4))],  # rank r holds the r-th entry
    "cw": [((0, 0), (8, 2)), ((0, 2), (8, 2))],
}


def _specs(table: str) -> tuple[ShardSpec, ...]:
    return tuple(
        ShardSpec.on(rank, "cpu", offsets, sizes)
        for rank, (offsets, sizes) in enumerate(LAYOUTS[table])
    )


def _rowwise_reference(table: str) -> torch.Tensor:
    """The row-wise state, globally: column block b holds rows ``100 * b + row``."""
    blocks = len({offsets[1] for offsets, _ in LAYOUTS[table]})
    return torch.cat([100.0 * b + torch.arange(ROWS, dtype=torch.float32) for b in range(blocks)])


def _kernel(rank: int, fill: bool) -> tuple[FakeKernel, list[TableShardInfo]]:
    weights, states, infos = [], [], []
    for table in LAYOUTS:
        specs = _specs(table)
        (r0, c0), (nr, nc) = specs[rank].offsets, specs[rank].sizes
        block = sorted({s.offsets[1] for s in specs}).index(c0)
        weight = WEIGHT[r0 : r0 + nr, c0 : c0 + nc].clone()
        m1 = 10 * weight
        m2 = 100.0 * block + torch.arange(r0, r0 + nr, dtype=torch.float32)
        if not fill:
            weight, m1, m2 = torch.zeros_like(weight), torch.zeros_like(m1), torch.zeros_like(m2)
        weights.append(weight)
        states.append({"exp_avg": m1, "exp_avg_sq": m2})  # names the kernel happens to use
        infos.append(
            TableShardInfo(
                name=table,
                num_embeddings=ROWS,
                embedding_dim=DIM,
                local_shard=specs[rank],
                all_shards=specs,
            )
        )
    return FakeKernel(weights, states), infos


def _gathered(st: torch.Tensor, rank: int) -> torch.Tensor | None:
    out = torch.empty(st.size()) if rank == 0 else None
    st.gather(dst=0, out=out)  # type: ignore[attr-defined]
    return out


def _check_sharded_tensors(rank: int) -> None:
    kernel, infos = _kernel(rank, fill=True)
    opt = EmbeddingFusedOptimizer(kernel, infos, learning_rate=0.1)
    assert sorted(opt.params) == ["cw.weight", "rw.weight"]
    for position, table in enumerate(LAYOUTS):
        weight = opt.params[f"{table}.weight"]
        states = opt.state[weight]
        assert sorted(states) == [f"{table}.momentum1", f"{table}.momentum2"]
        m1, m2 = states[f"{table}.momentum1"], states[f"{table}.momentum2"]

        # Metadata: weight and point-wise state follow the table's shards ...
        expected = [(list(o), list(s), f"rank:{r}/cpu") for r, (o, s) in enumerate(LAYOUTS[table])]
        for st in (weight, m1):
            md = st.metadata()
            assert list(md.size) == [ROWS, DIM]
            got = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in md.shards_metadata]
            assert got == expected, (table, got)
        # ... and the row-wise state is 1-D, column blocks laid end to end.
        md = m2.metadata()
        if table == "rw":
            want = [([0], [4], "rank:0/cpu"), ([4], [4], "rank:1/cpu")]
            assert list(md.size) == [ROWS]
        else:
            want = [([0], [8], "rank:0/cpu"), ([8], [8], "rank:1/cpu")]
            assert list(md.size) == [2 * ROWS]
        got = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in md.shards_metadata]
        assert got == want, (table, got)

        # The local shards are the kernel's own tensors, not copies.
        assert weight.local_shards()[0].tensor.data_ptr() == kernel.weights[position].data_ptr()
        kernel_m2 = kernel.states[position]["exp_avg_sq"]
        assert m2.local_shards()[0].tensor.data_ptr() == kernel_m2.data_ptr()

        # Gathered, they are the unsharded reference.
        for st, reference in ((weight, WEIGHT), (m1, 10 * WEIGHT), (m2, _rowwise_reference(table))):
            full = _gathered(st, rank)
            if rank == 0:
                assert torch.equal(full, reference), (table, full, reference)

    # Learning-rate changes reach the kernel.
    opt.param_groups[0]["lr"] = 0.5
    opt.step()
    assert kernel.learning_rates[-1] == 0.5

    # The state dict loads into a fresh optimizer over zeroed buffers, in place.
    saved = opt.state_dict()
    fresh_kernel, fresh_infos = _kernel(rank, fill=False)
    fresh = EmbeddingFusedOptimizer(fresh_kernel, fresh_infos, learning_rate=0.01)
    fresh.load_state_dict(saved)
    for before, after in zip(kernel.states, fresh_kernel.states, strict=True):
        for key in before:
            assert torch.equal(before[key], after[key])
    assert fresh_kernel.learning_rates[-1] == 0.5
    assert fresh.param_groups[0]["lr"] == 0.5


def _check_dtensors(rank: int) -> None:
    from torch.distributed.tensor import DTensor, Shard

    kernel, infos = _kernel(rank, fill=True)
    opt = EmbeddingFusedOptimizer(kernel, infos, learning_rate=0.1, state_format="dtensor")
    for position, table in enumerate(LAYOUTS):
        weight = opt.params[f"{table}.weight"]
        m2 = opt.state[weight][f"{table}.momentum2"]
        assert isinstance(weight, DTensor) and isinstance(m2, DTensor)
        assert tuple(weight.shape) == (ROWS, DIM)
        assert weight.placements == ((Shard(0),) if table == "rw" else (Shard(1),))
        assert tuple(m2.shape) == ((ROWS,) if table == "rw" else (2 * ROWS,))
        local = m2.to_local()
        want = (4 * rank,) if table == "rw" else (8 * rank,)
        assert [tuple(o) for o in local.local_offsets()] == [want]
        assert (
            local.local_shards()[0].data_ptr() == kernel.states[position]["exp_avg_sq"].data_ptr()
        )
    saved = opt.state_dict()
    fresh_kernel, fresh_infos = _kernel(rank, fill=False)
    fresh = EmbeddingFusedOptimizer(
        fresh_kernel, fresh_infos, learning_rate=0.1, state_format="dtensor"
    )
    fresh.load_state_dict(saved)
    for before, after in zip(kernel.states, fresh_kernel.states, strict=True):
        assert all(torch.equal(before[k], after[k]) for k in before)


def _worker(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        _check_sharded_tensors(rank)
        _check_dtensors(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # leave without the interpreter's teardown, where a gloo worker thread can still need the
    # GIL and abort the process ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_fused_state_is_sharded_like_the_tables_on_two_processes() -> None:
    mp.spawn(_worker, args=(2, free_port()), nprocs=2, join=True)
