"""TorchRec 1.8's DLRM and embshard's, built from the same seeds, give the same forward.

Run in the compare environment (TorchRec installed beside embshard):
``.nox/compare/bin/python -m benchmarks.compare.parity`` or ``nox -s torchrec_parity``. Exit 0
when every check holds, 1 otherwise.

For each model (``DLRM``, ``DLRM_DCN``) and each plan (table-wise, row-wise), on ``--world-size``
gloo processes, each library builds its collection after ``torch.manual_seed(seed)`` and its model
after ``torch.manual_seed(seed + 1)``; then:

* the dense parameters and the tables must come out equal from the seed (nothing is copied:
  embshard's collections draw in TorchRec's order, a normal fill per table then the configs'
  init_fn);
* both unsharded models must give the same logits;
* both are sharded by their own ``DistributedModelParallel`` under the plan (TorchRec's sharded
  tables, which TorchRec does not take from the unsharded module, get its own unsharded tables),
  and each rank's logits on its batch must equal the other library's and the unsharded ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from benchmarks.compare.common import free_port, join_group

MODELS = ("dlrm", "dcn")
PLANS = ("table_wise", "row_wise")
ROWS = (100, 80, 120, 60)
DIM = 8
NUM_DENSE = 5
DENSE_SIZES = [16, DIM]
OVER_SIZES = [16, 8, 1]
DCN_LAYERS = 2
DCN_RANK = 4
EBC_PATH = "sparse_arch.embedding_bag_collection"
TABLES_PREFIX = f"{EBC_PATH}.embedding_bags."


def _quiet() -> None:
    """Silence the libraries' deprecation chatter (it would bury the results)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("torchrec", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _torchrec_model(kind: str, seed: int) -> nn.Module:
    import torchrec
    from torchrec.models import dlrm

    torch.manual_seed(seed)
    ebc = torchrec.EmbeddingBagCollection(
        tables=[
            torchrec.EmbeddingBagConfig(
                name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f{i}"]
            )
            for i, rows in enumerate(ROWS)
        ]
    )
    torch.manual_seed(seed + 1)
    if kind == "dcn":
        return dlrm.DLRM_DCN(ebc, NUM_DENSE, DENSE_SIZES, OVER_SIZES, DCN_LAYERS, DCN_RANK)
    return dlrm.DLRM(ebc, NUM_DENSE, DENSE_SIZES, OVER_SIZES)


def _embshard_model(kind: str, seed: int) -> nn.Module:
    from embshard_dist.models.dlrm import DLRM, DLRM_DCN
    from embshard_kernels.collections import EmbeddingBagCollection
    from embshard_types.configs import EmbeddingBagConfig

    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f{i}"]
            )
            for i, rows in enumerate(ROWS)
        ]
    )
    torch.manual_seed(seed + 1)
    if kind == "dcn":
        return DLRM_DCN(ebc, NUM_DENSE, DENSE_SIZES, OVER_SIZES, DCN_LAYERS, DCN_RANK)
    return DLRM(ebc, NUM_DENSE, DENSE_SIZES, OVER_SIZES)


def _batches(seed: int, rank: int, world: int) -> tuple[Any, Any, Any, Any, Tensor]:
    """Step 0's global dense and sparse input, and this rank's dense, sparse and labels."""
    from embshard_dist.data.synthetic import SyntheticClicks
    from embshard_types.configs import EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=r, embedding_dim=DIM, feature_names=[f"f{i}"]
        )
        for i, r in enumerate(ROWS)
    ]
    source = SyntheticClicks(tables, num_dense=NUM_DENSE, batch_size=8, max_ids=6, seed=seed)
    whole = source.global_batch(0, world)
    local = source.batch(0, rank, world)
    return whole.dense, whole.sparse, local.dense, local.sparse, local.labels


def _torchrec_kjt(kjt: Any) -> Any:
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(kjt.keys()), values=kjt.values(), lengths=kjt.lengths())


def _max_diff(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].detach() - b[k].detach()).abs().max().item() for k in a)


def _dense(model: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith(TABLES_PREFIX)}


def _tables(model: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.startswith(TABLES_PREFIX)}


def _write_tables(state: Mapping[str, Any], full: Mapping[str, Tensor]) -> None:
    """Copy each whole table in ``full`` into its local shards in a sharded ``state`` (in place)."""
    with torch.no_grad():
        for key, whole in full.items():
            if key not in state:
                raise KeyError(f"table {key!r} is not in the sharded state dict: {sorted(state)}")
            value = state[key]
            if hasattr(value, "local_shards"):  # ShardedTensor
                for shard in value.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(whole[r0 : r0 + nr, c0 : c0 + nc])
            elif hasattr(value, "to_local"):  # DTensor
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                shape, offset = compute_local_shape_and_global_offset(
                    value.shape, value.device_mesh, value.placements
                )
                value.to_local().copy_(
                    whole[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]
                )
            else:
                value.copy_(whole)


def _shard_torchrec(model: nn.Module, plan: str, world: int) -> nn.Module:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    tables = _tables(model)
    ebc = model.get_submodule(EBC_PATH)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    )
    generators = {
        f"t{i}": (
            sp.table_wise(rank=i % world, compute_kernel="fused")
            if plan == "table_wise"
            else sp.row_wise(compute_kernel="fused")
        )
        for i in range(len(ROWS))
    }
    module_plan = sp.construct_module_sharding_plan(
        ebc, generators, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    kinds = {ps.sharding_type for ps in module_plan.values()}
    if kinds != {plan}:
        raise RuntimeError(f"TorchRec planned {kinds} where {plan!r} was asked for")
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=ShardingPlan({EBC_PATH: module_plan}),
        sharders=[sharder],
    )
    _write_tables(dmp.state_dict(), tables)
    return dmp


def _shard_embshard(model: nn.Module, plan: str, world: int) -> nn.Module:
    from embshard_dist.dmp.model_parallel import DistributedModelParallel
    from embshard_dist.planner.simple import SimplePlanner
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
    from embshard_optim.specs import OptimizerSpec

    spec = OptimizerSpec.from_name("sgd", lr=0.1)
    sharders: list[Any] = [EmbeddingBagCollectionSharder(optimizer=spec)]
    planned = SimplePlanner(world, device_type="cpu", sharding=plan, optimizer=spec).plan(
        model, sharders
    )
    kinds = {p.sharding_type.value for m in planned.plan.values() for p in m.values()}
    if kinds != {plan}:
        raise RuntimeError(f"embshard planned {kinds} where {plan!r} was asked for")
    return DistributedModelParallel(model, plan=planned, sharders=sharders, optimizer=spec)


def _check(kind: str, plan: str, seed: int, rank: int, world: int) -> dict[str, Any]:
    """One model under one plan on this rank: the figures the parent judges."""
    theirs = _torchrec_model(kind, seed)
    mine = _embshard_model(kind, seed)
    out: dict[str, Any] = {
        "same parameter names": [n for n, _ in theirs.named_parameters()]
        == [n for n, _ in mine.named_parameters()],
        "dense parameters from the seed": _max_diff(_dense(theirs), _dense(mine)),
        "tables from the seed": _max_diff(_tables(theirs), _tables(mine)),
    }
    g_dense, g_sparse, dense, sparse, _ = _batches(seed, rank, world)
    with torch.no_grad():
        ref_theirs = theirs(g_dense, _torchrec_kjt(g_sparse))
        ref_mine = mine(g_dense, g_sparse)
        ref_local = mine(dense, sparse)
    out["unsharded forward"] = (ref_theirs - ref_mine).abs().max().item()
    sharded_theirs = _shard_torchrec(theirs, plan, world)
    sharded_mine = _shard_embshard(mine, plan, world)
    with torch.no_grad():
        got_theirs = sharded_theirs(dense, _torchrec_kjt(sparse))
        got_mine = sharded_mine(dense, sparse)
    out["sharded forward: TorchRec vs embshard"] = (got_theirs - got_mine).abs().max().item()
    out["sharded forward: embshard vs unsharded"] = (got_mine - ref_local).abs().max().item()
    out["sharded forward: TorchRec vs unsharded"] = (got_theirs - ref_local).abs().max().item()
    return out


def _run_rank(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    _quiet()
    join_group(rank, world, port, threads=1)
    results: dict[str, Any] = {}
    try:
        for kind in MODELS:
            for plan in PLANS:
                results[f"{kind}/{plan}"] = _check(kind, plan, seed, rank, world)
                dist.barrier()
    except Exception as e:  # reported by the parent with the rank
        results["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def judge(ranks: list[dict[str, Any]], tol: float) -> list[str]:
    """The failed checks, one line each (empty: parity holds)."""
    failures = []
    for rank, results in enumerate(ranks):
        if "error" in results:
            failures.append(f"rank {rank}: {results['error']}")
        for case, figures in results.items():
            if case == "error":
                continue
            if not figures["same parameter names"]:
                failures.append(f"rank {rank} {case}: parameter names differ")
            for name, value in figures.items():
                if name.startswith(("dense", "tables", "unsharded", "sharded")) and value > tol:
                    failures.append(f"rank {rank} {case}: {name} differs by {value:.3g} > {tol}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=1e-6)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(
                _run_rank,
                args=(args.world_size, free_port(), args.seed, out_dir),
                nprocs=args.world_size,
                join=True,
            )
        except Exception as e:  # a rank failed: its error is in its file when it got that far
            print(f"parity: a rank failed: {e}", file=sys.stderr)
        files = [Path(out_dir, f"rank{r}.json") for r in range(args.world_size)]
        ranks = [json.loads(f.read_text()) if f.exists() else {"error": "no result"} for f in files]
    for case, figures in ranks[0].items():
        if case == "error":
            continue
        print(case)
        for name, value in figures.items():
            shown = value if isinstance(value, bool) else f"{value:.3g}"
            print(f"  {name:42s} {shown}")
    failures = judge(ranks, args.tol)
    for line in failures:
        print(f"FAIL {line}")
    print("parity holds" if not failures else f"parity fails ({len(failures)} checks)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
