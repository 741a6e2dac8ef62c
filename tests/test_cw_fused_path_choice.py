"""Column-wise lookups choose the fused path per kernel: only kernels holding a block whose
row-wise optimizer needs the other blocks' row sums are forced onto the torch TBE (with the
row-sum hook set); a kernel of whole single-block tables takes the fused path of choice.

Checked on real gloo ranks with ``EMBSHARD_FUSED_PATH=fbgemm``, so the path of choice is FBGEMM.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from _mp import run_on_ranks, test_device
from test_sharded_ebc_training import OPTIMIZERS, TABLES, plan_for

from embshard_dist.sharded.embedding_bag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from embshard_dist.strategies.cw import CwSharding
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.path_probe import ENV_VAR
from embshard_kernels.tbe import FbgemmFusedTBE
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_types.env import ShardingEnv

ROW_SUM_TABLES = {"t_sum", "t_shared", "t_wide"}
"""Tables of the ``cw`` plan cut into several column blocks (``t_mean`` is one block)."""


def _cw_kernels() -> list[tuple[list[str], str, bool]]:
    """Per kernel of this rank's column-wise lookup: its tables, its TBE's class, and whether a
    row-sum hook is set."""
    saved = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "fbgemm"
    try:
        world = dist.get_world_size()
        module = EmbeddingBagCollection(
            list(TABLES), device="meta", optimizer=OPTIMIZERS["rowwise_adagrad"]
        )
        env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD)
        sharded = EmbeddingBagCollectionSharder().shard(
            module, plan_for("cw", world), env, test_device()
        )
    finally:
        if saved is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved
    assert isinstance(sharded, ShardedEmbeddingBagCollection)
    (index,) = [i for i, s in enumerate(sharded.shardings) if isinstance(s, CwSharding)]
    lookup = sharded._lookups[index]
    out = []
    for kernel, group in zip(lookup.kernels, lookup._groups, strict=True):
        tbe = getattr(kernel, "emb_module", None)
        hooked = isinstance(tbe, TorchFusedTBE) and any(
            r is not None for r in tbe.row_reductions or ()
        )
        out.append((group.table_names(), type(tbe).__name__, hooked))
    return out


def test_only_row_sum_kernels_take_the_torch_tbe() -> None:
    per_rank = run_on_ranks(2, _cw_kernels)
    seen = set()
    for rank, kernels in enumerate(per_rank):
        for tables, tbe, hooked in kernels:
            seen.update(tables)
            if ROW_SUM_TABLES.intersection(tables):
                assert (tbe, hooked) == (TorchFusedTBE.__name__, True), (rank, tables)
            else:
                assert (tbe, hooked) == (FbgemmFusedTBE.__name__, False), (rank, tables)
    assert seen == {t.name for t in TABLES}
