"""The fast pooled path of the torch fused TBE: same training as the general path, picked by auto.

The general path (per-id gradients, ``aggregate`` and embshard-optim's rules) is the reference:
a kernel whose ``fast`` path is removed takes it. Both must train alike to float32
rounding (the per-row gradient sums add the same terms, not always in the same order).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from kernel_testing import bit_identical, one_group, random_kjt, snapshot, table

from embshard_kernels import fast_pooled
from embshard_kernels.fast_pooled import fast_path_refusal, table_runs
from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.path_probe import ENV_VAR
from embshard_kernels.tbe import FbgemmFusedTBE
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_optim.specs import OptimizerSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

SPECS = {
    "sgd": OptimizerSpec.from_name("sgd", lr=0.3),
    "rowwise_adagrad": OptimizerSpec.from_name("rowwise_adagrad", lr=0.1, eps=1e-3),
}
ROWS = {"f1": 7, "f2": 7, "f3": 5, "f4": 9}


def _config(  # type: ignore[no-untyped-def]
    spec: OptimizerSpec, pooling: str = "sum", weighted: bool = False, one_run: bool = False
):
    # widths 8, 8, 4: two runs (one_run: 8, 8, 8, the sample-major backward); table "a"
    # serves two features
    return one_group(
        table("a", 7, 8, ["f1", "f2"], pooling=pooling, weighted=weighted, optimizer=spec),
        table("b", 5, 8, ["f3"], pooling=pooling, weighted=weighted, optimizer=spec),
        table(
            "c", 9, 8 if one_run else 4, ["f4"], pooling=pooling, weighted=weighted, optimizer=spec
        ),
    )


def _pair(  # type: ignore[no-untyped-def]
    spec: OptimizerSpec, pooling: str, weighted: bool, one_run: bool = False
):
    """A kernel on the fast path and one forced onto the general path, same weights."""
    fast = BatchedFusedEmbeddingBag(_config(spec, pooling, weighted, one_run), backend="torch")
    general = BatchedFusedEmbeddingBag(_config(spec, pooling, weighted, one_run), backend="torch")
    general.load_state_dict(fast.state_dict())
    tbe = general.emb_module
    assert isinstance(tbe, TorchFusedTBE) and tbe.fast is not None
    tbe.fast = None
    return fast, general


def _train(kernel: BatchedFusedEmbeddingBag, kjt: KeyedJaggedTensor, seed: int) -> None:
    out = kernel(kjt)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))


def _kjt(step: int, weighted: bool, batch_sizes: list[int] | None = None) -> KeyedJaggedTensor:
    features = list(ROWS.items())
    return random_kjt(features, 5, max_len=6, weighted=weighted, seed=step, batch_sizes=batch_sizes)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize(
    "pooling,weighted,variable",
    [("sum", False, False), ("sum", True, False), ("mean", False, False), ("sum", False, True)],
)
@pytest.mark.parametrize("one_run", [False, True], ids=["two_runs", "one_run"])
def test_fast_path_trains_like_the_general_path(
    name: str, pooling: str, weighted: bool, variable: bool, one_run: bool
) -> None:
    fast, general = _pair(SPECS[name], pooling, weighted, one_run)
    initial = snapshot(fast.split_embedding_weights())
    for step in range(4):
        sizes = [3, 5, 1, 4] if variable else None
        kjt = _kjt(step, weighted, sizes)
        _train(fast, kjt, 100 + step)
        _train(general, kjt, 100 + step)
    got, want = fast.split_embedding_weights(), general.split_embedding_weights()
    assert any((g - w).abs().max() > 1e-3 for g, w in zip(got, initial, strict=True))
    got_state = [s for t in fast.emb_module.get_optimizer_state() for s in t.values()]
    want_state = [s for t in general.emb_module.get_optimizer_state() for s in t.values()]
    for a, b in zip(got + got_state, want + want_state, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_per_sample_weight_gradient_takes_the_general_path() -> None:
    fast, general = _pair(SPECS["rowwise_adagrad"], "sum", True)
    kjt = _kjt(0, True)
    grads = []
    for kernel in (fast, general):
        weights = kjt.weights().clone().requires_grad_(True)
        batch = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=weights, lengths=kjt.lengths())
        _train(kernel, batch, 7)
        grads.append(weights.grad)
    assert grads[0] is not None and bit_identical([grads[0]], [grads[1]])
    assert bit_identical(fast.split_embedding_weights(), general.split_embedding_weights())


def test_an_empty_batch_changes_nothing() -> None:
    fast, _ = _pair(SPECS["rowwise_adagrad"], "sum", False)
    before = snapshot(fast.split_embedding_weights())
    empty = KeyedJaggedTensor(
        list(ROWS), torch.zeros(0, dtype=torch.long), lengths=torch.zeros(8, dtype=torch.long)
    )
    _train(fast, empty, 0)
    assert bit_identical(fast.split_embedding_weights(), before)


def test_the_fast_path_serves_only_pooled_fp32_sgd_and_rowwise_adagrad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where both could run, speed decides (here forced with EMBSHARD_FUSED_PATH; the measured
    choice is tested in test_fused_path_choice.py); elsewhere FBGEMM always."""

    def tbe(spec: OptimizerSpec, **kwargs: object) -> object:
        tables = [replace(t, **kwargs) for t in _config(spec).embedding_tables]  # type: ignore[arg-type]
        return BatchedFusedEmbeddingBag(one_group(*tables)).emb_module

    monkeypatch.setenv("EMBSHARD_FUSED_PATH", "torch")
    for name in ("rowwise_adagrad", "sgd"):
        fast = tbe(SPECS[name])
        assert isinstance(fast, TorchFusedTBE) and fast.fast is not None, name
    assert isinstance(tbe(OptimizerSpec.from_name("adagrad", lr=0.1)), FbgemmFusedTBE)
    assert isinstance(tbe(SPECS["rowwise_adagrad"], data_type="fp16"), FbgemmFusedTBE)
    forced = BatchedFusedEmbeddingBag(_config(SPECS["rowwise_adagrad"]), backend="fbgemm")
    assert isinstance(forced.emb_module, FbgemmFusedTBE)
    sequence = one_group(table("s", 4, 8, pooling="none", optimizer=SPECS["rowwise_adagrad"]))
    assert isinstance(BatchedFusedEmbedding(sequence).emb_module, FbgemmFusedTBE)
    monkeypatch.setenv("EMBSHARD_FUSED_PATH", "fbgemm")
    assert isinstance(tbe(SPECS["rowwise_adagrad"]), FbgemmFusedTBE)


def test_refusals_say_why() -> None:
    config = _config(SPECS["rowwise_adagrad"])
    decayed = replace(SPECS["rowwise_adagrad"], weight_decay=0.1)
    assert fast_path_refusal(config, SPECS["rowwise_adagrad"], None) is None
    assert "weight decay" in str(fast_path_refusal(config, decayed, None))
    assert "CPU" in str(fast_path_refusal(config, SPECS["sgd"], "meta"))
    adam = OptimizerSpec.from_name("adam", lr=0.1)
    assert "ADAM" in str(fast_path_refusal(config, adam, None))
    sequence = one_group(table("s", 4, 8, pooling="none", optimizer=SPECS["sgd"]))
    assert "pooling" in str(fast_path_refusal(sequence, SPECS["sgd"], None))


def test_table_runs_group_consecutive_tables_of_one_width() -> None:
    shapes = [(3, 8), (2, 8), (4, 4), (0, 4), (5, 8)]
    starts = [0, 24, 40, 56, 56]
    runs = table_runs(shapes, starts, [0, 0, 1, 2, 3, 4])
    assert [(r.start, r.first_row, r.rows, r.width) for r in runs] == [
        (0, 0, 5, 8),
        (40, 5, 4, 4),
        (56, 9, 5, 8),
    ]
    assert [(r.features, r.row_bases) for r in runs] == [
        (range(0, 3), (0, 0, 3)),
        (range(3, 5), (0, 4)),
        (range(5, 6), (0,)),
    ]
    with pytest.raises(ValueError, match="table by table"):
        table_runs(shapes, starts, [1, 0, 2, 3, 4])


@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("one_run", [False, True], ids=["two_runs", "one_run"])
def test_backward_prepared_during_the_forward_trains_alike(
    pooling: str, weighted: bool, one_run: bool
) -> None:
    spec = SPECS["rowwise_adagrad"]
    prepared = BatchedFusedEmbeddingBag(_config(spec, pooling, weighted, one_run), backend="torch")
    plain = BatchedFusedEmbeddingBag(_config(spec, pooling, weighted, one_run), backend="torch")
    plain.load_state_dict(prepared.state_dict())
    tbe = prepared.emb_module
    assert isinstance(tbe, TorchFusedTBE)
    for step in range(3):
        kjt = _kjt(step, weighted)
        out = prepared(kjt)
        tbe.prepare_backward()  # as a sharded collection does while its all-to-all flies
        assert tbe.fast is not None and len(tbe.fast._prepared) == 1
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(step)))
        assert len(tbe.fast._prepared) == 0  # used once, then dropped
        _train(plain, kjt, step)
    assert bit_identical(prepared.split_embedding_weights(), plain.split_embedding_weights())


def test_the_next_forward_before_this_backward_keeps_both_plans() -> None:
    """A semi-synchronous step: forward i+1 (prepared) runs before backward i; each backward
    uses its own forward's plan, and the update equals the unprepared one."""
    spec = SPECS["rowwise_adagrad"]
    prepared = BatchedFusedEmbeddingBag(_config(spec, "sum", False, False), backend="torch")
    plain = BatchedFusedEmbeddingBag(_config(spec, "sum", False, False), backend="torch")
    plain.load_state_dict(prepared.state_dict())
    tbe, ref = prepared.emb_module, plain.emb_module
    assert isinstance(tbe, TorchFusedTBE) and isinstance(ref, TorchFusedTBE)
    assert tbe.fast is not None
    used: list[object] = []
    take = tbe.fast._take_prepared

    def spy(batches: Any) -> Any:
        plans = take(batches)
        used.append(plans)
        return plans

    tbe.fast._take_prepared = spy  # type: ignore[method-assign]
    outs, ref_outs = [], []
    for step in range(2):
        outs.append(prepared(_kjt(step, False)))
        tbe.prepare_backward()
        ref_outs.append(plain(_kjt(step, False)))
    assert len(tbe.fast._prepared) == 2
    for step, (out, ref_out) in enumerate(zip(outs, ref_outs, strict=True)):
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        out.backward(grad)
        ref_out.backward(grad)
    assert len(used) == 2 and all(plans is not None for plans in used)
    assert len(tbe.fast._prepared) == 0
    assert bit_identical(prepared.split_embedding_weights(), plain.split_embedding_weights())


@pytest.mark.parametrize("path", ["fbgemm", "torch"])
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("one_run", [False, True], ids=["two_runs", "one_run"])
def test_rows_updated_chunk_by_chunk_equal_one_chunk(
    path: str,
    name: str,
    pooling: str,
    weighted: bool,
    one_run: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rows are independent: summing and writing 2 rows at a time (FBGEMM's row loop or the
    # torch rules) gives the very weights and state of one chunk.
    monkeypatch.setenv(ENV_VAR, path)
    spec = SPECS[name]
    chunked = BatchedFusedEmbeddingBag(_config(spec, pooling, weighted, one_run), backend="torch")
    whole = BatchedFusedEmbeddingBag(_config(spec, pooling, weighted, one_run), backend="torch")
    whole.load_state_dict(chunked.state_dict())
    assert (chunked.emb_module.fast.row_update is not None) == (path == "fbgemm")
    for step in range(3):
        kjt = _kjt(step, weighted)
        monkeypatch.setattr(fast_pooled, "SUM_CHUNK_BYTES", 2 * 4 * 8)  # 2 rows of width 8
        _train(chunked, kjt, 100 + step)
        monkeypatch.setattr(fast_pooled, "SUM_CHUNK_BYTES", 1 << 30)
        _train(whole, kjt, 100 + step)
    assert bit_identical(chunked.split_embedding_weights(), whole.split_embedding_weights())
    for a, b in zip(
        chunked.emb_module.get_optimizer_state(),
        whole.emb_module.get_optimizer_state(),
        strict=True,
    ):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
