"""Quantized comms through ``DistributedModelParallel``: 10 training steps per codec on 2 ranks.

A DLRM whose ``EmbeddingBagCollection`` is sharded under a mixed plan (two table-wise tables, one
row-wise, one column-wise) trains for 10 steps with SGD (lr 0.5), once with FP32 comms and
once each with FP16, BF16 and INT8 row-wise codecs given to ``DistributedModelParallel`` as a
``qcomm_codecs_registry``. The codecs are chosen per comm op and per direction: the pooled
all-to-all (table-wise and column-wise outputs) and the reduce-scatter (row-wise outputs) both
carry the codec forward and backward, and one extra run sends forward FP16 and backward BF16.

Checks, per codec, against the FP32-comms run (same seeds, same plan, same batches):

* weights: after 10 steps every table weight and dense parameter stays within ``WEIGHT_TOL``
  of the FP32-comms run (largest absolute difference over all weights; in those 10 steps the
  FP32 run moves weights by up to ~0.04-0.1): FP16 2e-5, BF16 3e-3, FP16 forward / BF16
  backward 1e-4, INT8 1e-2 (measured: 2.6e-6, 2.5e-3, 1.8e-5, 5.5e-3 with the tables drawn in
  TorchRec's order; INT8 was 1.1e-3 with the earlier draw: the deviation depends on which
  near-zero gradients the codec flips); and the final losses agree to ``LOSS_TOL`` (1e-3). SGD keeps the deviation proportional to the codec's
  error; Adagrad / Adam normalise the first steps' gradients element by element, so a
  near-zero gradient whose sign the codec flips moves a weight by a whole learning rate;
* the codec really ran: the weights differ from the FP32 run (else the registry was dropped);
* bytes: the bytes each rank hands to the embedding collectives per step (counted on the real
  sends of the pooled all-to-all and reduce-scatter, both directions) are exactly half of FP32
  for the 16-bit codecs and 0.28-0.35 of it for INT8 (32 codes plus an 8-byte scale and bias per
  32 floats: 40 / 128 = 0.3125 for full rows).

``pytest -s`` prints the table of bytes per step and deviations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from torch import Tensor

from embshard_dist.comm import _exchange, reduce_scatter
from embshard_dist.comm.qcomms import get_qcomm_codecs_registry
from embshard_dist.data.synthetic import SyntheticClicks
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.models.demo import DemoConfig as DLRMConfig
from embshard_dist.models.demo import DemoDLRM as DLRM
from embshard_dist.planner.simple import SimplePlanner
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.vocab import CommOp

WORLD, STEPS, BATCH, DIM, LR = 2, 10, 16, 16, 0.5
ROWS = (40, 50, 60, 30)
PLAN = {"t0": "table_wise", "t1": "table_wise", "t2": "row_wise", "t3": "column_wise"}
CONFIG = DLRMConfig(num_dense=4, bottom_mlp=(16,), top_mlp=(8,))

# codec name -> (forward, backward) precision of both embedding collectives
CODECS: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32"),
    "fp16": ("fp16", "fp16"),
    "bf16": ("bf16", "bf16"),
    "fp16/bf16": ("fp16", "bf16"),
    "int8": ("int8", "int8"),
}
WEIGHT_TOL = {"fp16": 2e-5, "bf16": 3e-3, "fp16/bf16": 1e-4, "int8": 1e-2}
LOSS_TOL = 1e-3
BYTES_RATIO = {
    "fp16": (0.5, 0.5),
    "bf16": (0.5, 0.5),
    "fp16/bf16": (0.5, 0.5),
    "int8": (0.28, 0.35),
}
OPS = (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM)
        for i, rows in enumerate(ROWS)
    ]


class _CountingDist:
    """``torch.distributed`` as the embedding collectives see it, adding up the bytes sent.

    Every call still goes to the real collective; only the send buffer's size is recorded,
    under the name of the collective being issued (``pooled_all_to_all.forward``...).
    """

    def __init__(self, counts: dict[str, int], current: list[str]) -> None:
        self._counts, self._current = counts, current

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _add(self, send: Tensor) -> None:
        name = self._current[0]
        self._counts[name] = self._counts.get(name, 0) + send.numel() * send.element_size()

    def all_to_all_single(self, recv: Tensor, send: Tensor, *args: Any, **kw: Any) -> Any:
        self._add(send)
        return dist.all_to_all_single(recv, send, *args, **kw)

    def reduce_scatter_single(self, out: Tensor, send: Tensor, *args: Any, **kw: Any) -> Any:
        self._add(send)
        return dist.reduce_scatter_single(out, send, *args, **kw)  # type: ignore[attr-defined]

    def all_gather_single(self, recv: Tensor, send: Tensor, *args: Any, **kw: Any) -> Any:
        self._add(send)
        return dist.all_gather_single(recv, send, *args, **kw)  # type: ignore[attr-defined]


def _named_issue(original: Callable[..., Any], current: list[str]) -> Callable[..., Any]:
    @functools.wraps(original)
    def issue(collective: str, start: Callable[[], Any], **kw: Any) -> Any:
        def named_start() -> Any:
            current[0] = collective
            return start()

        return original(collective, named_start, **kw)

    return issue


class _ByteCounter:
    """Counts the embedding collectives' sends while active (restores the modules on exit)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._current = ["?"]
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _ByteCounter:
        fake = _CountingDist(self.counts, self._current)
        for module in (_exchange, reduce_scatter):
            for attr, value in (
                ("dist", fake),
                ("issue", _named_issue(module.issue, self._current)),
            ):
                self._saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, value)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, attr, value in reversed(self._saved):
            setattr(module, attr, value)


def _weights(dmp: DistributedModelParallel) -> Iterator[tuple[str, Tensor]]:
    """(name and offsets, local tensor) of every weight piece this rank holds."""
    for key, value in dmp.state_dict().items():
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                yield f"{key}@{tuple(shard.metadata.shard_offsets)}", shard.tensor
        elif isinstance(value, Tensor) and value.is_floating_point():
            yield key, value


def _train(codec: str) -> dict[str, Any]:
    rank = dist.get_rank()
    device = test_device()
    spec = OptimizerSpec.from_name("sgd", lr=LR)
    torch.manual_seed(0)
    model = DLRM(_tables(), CONFIG)
    planner = SimplePlanner(WORLD, device_type=device.type, sharding=PLAN, optimizer=spec)
    plan = planner.plan(model, [EmbeddingBagCollectionSharder(optimizer=spec)])
    registry = get_qcomm_codecs_registry(
        dict.fromkeys(OPS, CODECS[codec]), int8_backend="auto", device=device
    )
    dmp = DistributedModelParallel(
        model, device=device, plan=plan, optimizer=spec, qcomm_codecs_registry=registry
    )
    opt = dmp.optimizer()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = SyntheticClicks(_tables(), num_dense=4, batch_size=BATCH, max_ids=5, seed=3)
    initial = {k: t.detach().cpu().clone() for k, t in _weights(dmp)}
    losses = []
    with _ByteCounter() as counter:
        for step in range(STEPS):
            batch = data.batch(step, rank, WORLD)
            out = dmp(batch.dense.to(device), batch.sparse.to(device))
            loss = loss_fn(out, batch.labels.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    kinds = sorted({str(ps.sharding_type) for ps in plan["sparse_arch"].values()})  # type: ignore[union-attr]
    return {
        "initial": initial,
        "weights": {k: t.detach().cpu().clone() for k, t in _weights(dmp)},
        "bytes": {k: v // STEPS for k, v in counter.counts.items()},
        "losses": losses,
        "kinds": kinds,
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    return {name: run_on_ranks(WORLD, _train, name, timeout_s=120) for name in CODECS}


def _deviation(runs: dict[str, list[dict[str, Any]]], codec: str) -> float:
    worst = 0.0
    for mine, ref in zip(runs[codec], runs["fp32"], strict=True):
        assert mine["weights"].keys() == ref["weights"].keys()
        for key, value in ref["weights"].items():
            worst = max(worst, (mine["weights"][key] - value).abs().max().item())
    return worst


def _moved(runs: dict[str, list[dict[str, Any]]]) -> float:
    return max(
        (value - r["initial"][key]).abs().max().item()
        for r in runs["fp32"]
        for key, value in r["weights"].items()
    )


def test_plan_mixes_all_to_all_and_reduce_scatter(runs: dict[str, list[dict[str, Any]]]) -> None:
    first = runs["fp32"][0]
    assert len(first["kinds"]) == 3, first["kinds"]
    for name, ranks in runs.items():
        for r in ranks:
            sent = set(r["bytes"])
            # both collectives, both directions, ran on every rank
            assert {n.split(".")[0] for n in sent} == {"pooled_all_to_all", "reduce_scatter"}, sent
            assert {n.split(".")[1] for n in sent} == {"forward", "backward"}, (name, sent)


def test_report(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Prints bytes per step per rank and the largest deviation from FP32 comms."""
    fp32 = [sum(r["bytes"].values()) for r in runs["fp32"]]
    print(f"\nembedding-collective bytes sent per step per rank (world {WORLD}, batch {BATCH}):")
    for name, ranks in runs.items():
        per_rank = [sum(r["bytes"].values()) for r in ranks]
        detail = ", ".join(f"{k} {v}" for k, v in sorted(ranks[0]["bytes"].items()))
        dev = (
            f" | max |w - w0| {_moved(runs):.2e}"
            if name == "fp32"
            else f" | max |w - w_fp32| {_deviation(runs, name):.2e}"
        )
        print(
            f"  {name:>9}: {per_rank} B ({per_rank[0] / fp32[0]:.3f} of fp32){dev}"
            f"\n             rank 0: {detail}"
        )
    assert all(b > 0 for b in fp32)


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "fp32"])
def test_weights_stay_close_to_fp32_comms(
    runs: dict[str, list[dict[str, Any]]], codec: str
) -> None:
    worst = _deviation(runs, codec)
    assert worst <= WEIGHT_TOL[codec], f"{codec}: weights differ from FP32 comms by {worst}"
    assert worst > 0, f"{codec}: identical to FP32 comms; the codec was not used"
    for mine, ref in zip(runs[codec], runs["fp32"], strict=True):
        assert abs(mine["losses"][-1] - ref["losses"][-1]) <= LOSS_TOL, codec


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "fp32"])
def test_bytes_per_step_ratio(runs: dict[str, list[dict[str, Any]]], codec: str) -> None:
    lo, hi = BYTES_RATIO[codec]
    for mine, ref in zip(runs[codec], runs["fp32"], strict=True):
        assert mine["bytes"].keys() == ref["bytes"].keys()
        for op, sent in mine["bytes"].items():
            ratio = sent / ref["bytes"][op]
            assert lo - 1e-9 <= ratio <= hi + 1e-9, f"{codec} {op}: {ratio:.4f} of fp32"


def test_registry_with_own_sharders_is_refused() -> None:
    with pytest.raises(ValueError, match="give the registry to them"):
        DistributedModelParallel(
            DLRM(_tables(), CONFIG),
            env=ShardingEnv.from_local(1, 0),
            sharders=[EmbeddingBagCollectionSharder()],
            qcomm_codecs_registry=get_qcomm_codecs_registry({OPS[0]: ("fp16", "fp16")}),
        )
