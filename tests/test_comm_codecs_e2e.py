"""Quantized comms codecs end to end: 10 training steps through real collectives on 2 gloo ranks.

Two toy sharded models, each trained with plain SGD for 10 steps:

* table-wise: rank ``s`` owns table ``s`` (widths 8 and 12), pools its bags for the global batch
  and sends them through ``PooledEmbeddingsAllToAll``;
* row-wise: one table split by rows, each rank pools the ids it owns for the global batch and
  ``PooledEmbeddingsReduceScatter`` sums the partials.

Each rank's loss is a squared error of a fixed linear read-out of its local batch. With FP32 comms
the sharded tables equal an unsharded reference stepped on the sum of the ranks' losses; with a
codec, the first forward stays within the codec's bound of FP32 comms, gradients reach every
shard, the weights after 10 steps stay within a stated tolerance of the FP32 run, and the bytes
each rank hands to the collectives per step are printed and compared with FP32
(``pytest -s`` shows the table).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from torch import Tensor

from embshard_dist.comm.codecs import wire_bytes
from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
from embshard_dist.comm.qcomms import get_qcomm_codecs
from embshard_dist.comm.reduce_scatter import PooledEmbeddingsReduceScatter
from embshard_types.comm_codec import QuantizedCommCodecs

WORLD, B, BAG, ROWS, STEPS, LR = 2, 4, 3, 24, 10, 0.05
TW_DIMS = [8, 12]
RW_DIM = 16

CODECS: dict[str, tuple[str, str, str]] = {
    # name: (forward, backward, int8 backend)
    "fp32": ("fp32", "fp32", "auto"),
    "fp16": ("fp16", "fp16", "auto"),
    "bf16": ("bf16", "bf16", "auto"),
    "fp16/bf16": ("fp16", "bf16", "auto"),
    "int8": ("int8", "int8", "auto"),  # FBGEMM's ops where they run (CPU here)
    "int8-torch": ("int8", "int8", "torch"),
}
# Largest |weight - weight with FP32 comms| after 10 steps (weights are ~U(-0.5, 0.5)).
WEIGHT_TOL = {"fp16": 2e-3, "bf16": 1e-2, "fp16/bf16": 1e-2, "int8": 4e-2, "int8-torch": 4e-2}
# Bytes per step relative to FP32: exactly half for 16-bit, (32 + 8) / 128 and a bit for INT8.
RATIO = {"fp16": (0.5, 0.5), "bf16": (0.5, 0.5), "fp16/bf16": (0.5, 0.5)}
INT8_RATIO = (0.25, 0.36)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _table(seed: int, rows: int, dim: int) -> Tensor:
    return torch.rand(rows, dim, generator=_gen(seed)) - 0.5


def _ids(step: int, table: int) -> Tensor:
    return torch.randint(0, ROWS, (WORLD * B, BAG), generator=_gen(1000 * step + table))


def _readout(width: int) -> tuple[Tensor, Tensor]:
    """Fixed read-out weights and per-step targets of the global batch."""
    return torch.randn(width, 1, generator=_gen(7)), torch.randn(WORLD * B, 1, generator=_gen(8))


def _loss(out: Tensor, rank: int, width: int) -> Tensor:
    w, y = (t.to(out.device) for t in _readout(width))
    return ((out @ w - y[rank * B : (rank + 1) * B]) ** 2).mean()


def _sgd(param: Tensor) -> None:
    assert param.grad is not None
    with torch.no_grad():
        param -= LR * param.grad
    param.grad = None


def _codecs(name: str) -> QuantizedCommCodecs:
    forward, backward, backend = CODECS[name]
    return get_qcomm_codecs(
        forward,
        backward,
        int8_backend=backend,  # type: ignore[arg-type]
        device=test_device(),
    )


# ---- table-wise: pooled all-to-all --------------------------------------------------------


def _tw_run(name: str) -> dict[str, Any]:
    rank = dist.get_rank()
    codecs = _codecs(name)
    a2a = PooledEmbeddingsAllToAll(None, TW_DIMS, codecs=codecs)
    device = test_device()
    table = _table(rank, ROWS, TW_DIMS[rank]).to(device).requires_grad_()
    first_out, first_grad = None, None
    for step in range(STEPS):
        pooled = table[_ids(step, rank).to(device)].sum(dim=1)  # [global batch, my width]
        out = a2a(pooled).wait()
        _loss(out, rank, sum(TW_DIMS)).backward()
        if step == 0:
            grad = table.grad.clone().cpu()  # type: ignore[union-attr]
            first_out, first_grad = out.detach().cpu(), grad
        _sgd(table)
    fwd = wire_bytes(codecs.forward, [B * TW_DIMS[rank]] * WORLD)
    bwd = wire_bytes(codecs.backward, [B * d for d in TW_DIMS])
    weight = table.detach().cpu()
    return {"out": first_out, "grad": first_grad, "weight": weight, "bytes": (fwd, bwd)}


def _tw_reference() -> list[Tensor]:
    tables = [_table(s, ROWS, d).requires_grad_() for s, d in enumerate(TW_DIMS)]
    for step in range(STEPS):
        pooled = [t[_ids(step, s)].sum(dim=1) for s, t in enumerate(tables)]
        loss = sum(
            _loss(torch.cat([p[r * B : (r + 1) * B] for p in pooled], 1), r, sum(TW_DIMS))
            for r in range(WORLD)
        )
        loss.backward()  # type: ignore[union-attr]
        for t in tables:
            _sgd(t)
    return [t.detach() for t in tables]


# ---- row-wise: reduce-scatter -------------------------------------------------------------


def _rw_run(name: str) -> dict[str, Any]:
    rank = dist.get_rank()
    codecs = _codecs(name)
    rs = PooledEmbeddingsReduceScatter(None, codecs=codecs)
    per_rank = ROWS // WORLD
    lo = rank * per_rank
    device = test_device()
    shard = _table(99, ROWS, RW_DIM)[lo : lo + per_rank].clone().to(device).requires_grad_()
    first_out, first_grad = None, None
    for step in range(STEPS):
        ids = _ids(step, 0).to(device)
        mine = ((ids >= lo) & (ids < lo + per_rank)).unsqueeze(-1)
        partial = (shard[(ids - lo).clamp(0, per_rank - 1)] * mine).sum(dim=1)
        out = rs(partial).wait()
        _loss(out, rank, RW_DIM).backward()
        if step == 0:
            grad = shard.grad.clone().cpu()  # type: ignore[union-attr]
            first_out, first_grad = out.detach().cpu(), grad
        _sgd(shard)
    fwd = wire_bytes(codecs.forward, [B * RW_DIM] * WORLD)
    bwd = wire_bytes(codecs.backward, [B * RW_DIM])  # the all-gather sends my gradient once
    weight = shard.detach().cpu()
    return {"out": first_out, "grad": first_grad, "weight": weight, "bytes": (fwd, bwd)}


def _rw_reference() -> list[Tensor]:
    table = _table(99, ROWS, RW_DIM).requires_grad_()
    for step in range(STEPS):
        pooled = table[_ids(step, 0)].sum(dim=1)
        sum(_loss(pooled[r * B : (r + 1) * B], r, RW_DIM) for r in range(WORLD)).backward()  # type: ignore[union-attr]
        _sgd(table)
    return list(table.detach().chunk(WORLD))


# ---- the checks ---------------------------------------------------------------------------


def _all_codecs(which: str) -> dict[str, dict[str, Any]]:
    run = _tw_run if which == "tw" else _rw_run
    return {name: run(name) for name in CODECS}


def _chunk_bound(forward: str, chunk: Tensor) -> Tensor:
    """Elementwise bound of the round-trip error of one chunk coded on its own."""
    if forward in ("fp16", "bf16"):
        return chunk.abs() * (2.0**-11 if forward == "fp16" else 2.0**-8) + 2.0**-24
    # int8: half a step of the chunk's widest row (a row spans at most the whole chunk)
    return torch.full_like(chunk, (chunk.max() - chunk.min()).item() / 510 + 1e-6)


def _forward_bound(which: str, name: str, rank: int) -> Tensor:
    """Bound of the first forward's error against FP32 comms on ``rank``, from what is sent."""
    forward, mine = CODECS[name][0], slice(rank * B, (rank + 1) * B)
    if which == "tw":  # output columns of source s are s's chunk, coded once
        chunks = [_table(s, ROWS, d)[_ids(0, s)].sum(dim=1)[mine] for s, d in enumerate(TW_DIMS)]
        return torch.cat([_chunk_bound(forward, c) for c in chunks], dim=1)
    ids, per_rank = _ids(0, 0), ROWS // WORLD
    table = _table(99, ROWS, RW_DIM)
    bound = torch.full((B, RW_DIM), 1e-6)  # the sum of the decoded partials rounds too
    for s in range(WORLD):  # the output sums every source's separately coded partial
        owned = ((ids >= s * per_rank) & (ids < (s + 1) * per_rank)).unsqueeze(-1)
        bound += _chunk_bound(forward, (table[ids] * owned).sum(dim=1)[mine])
    return bound


@pytest.mark.parametrize("which", ["tw", "rw"], ids=["pooled_all_to_all", "reduce_scatter"])
def test_codecs_train_close_to_fp32_comms(which: str) -> None:
    results = run_on_ranks(WORLD, _all_codecs, which)
    reference = _tw_reference() if which == "tw" else _rw_reference()
    lines = [f"{which}: codec, bytes/step fwd+bwd per rank, ratio vs fp32, weight diff"]
    for rank, per_codec in enumerate(results):
        base = per_codec["fp32"]
        torch.testing.assert_close(base["weight"], reference[rank], rtol=1e-5, atol=1e-6)
        base_bytes = sum(base["bytes"])
        for name, got in per_codec.items():
            if name == "fp32":
                continue
            err = (got["out"] - base["out"]).abs()
            assert torch.all(err <= _forward_bound(which, name, rank)), (name, err.max())
            assert got["grad"].abs().sum() > 0  # gradients reach the shard
            grad_err = (got["grad"] - base["grad"]).abs().max().item()
            assert grad_err <= 0.1 * base["grad"].abs().max().item(), (name, grad_err)
            diff = (got["weight"] - base["weight"]).abs().max().item()
            assert diff <= WEIGHT_TOL[name], (name, rank, diff)
            assert diff > 0, name  # the codec did change what travelled
            ratio = sum(got["bytes"]) / base_bytes
            low, high = RATIO.get(name, INT8_RATIO)
            assert low <= ratio <= high, (name, rank, ratio)
            lines.append(
                f"  rank {rank} {name:10s} {got['bytes'][0]:5d}+{got['bytes'][1]:5d} B "
                f"(fp32 {base['bytes'][0]}+{base['bytes'][1]})  x{ratio:.3f}  diff {diff:.1e}"
            )
        # FBGEMM's and the torch int8 codecs send the same bytes, so they train identically
        assert torch.equal(per_codec["int8"]["weight"], per_codec["int8-torch"]["weight"])
    print("\n".join(lines))
