"""The update hooks of embshard's torch fused TBE (used by sharded collections).

``grad_exchange`` sees every block's summed row gradients in every backward (a table on the
general path, a run of same-width tables on the fast path), even a block the batch did not
touch, and what it returns is what the optimizer applies (a hook's ``unsummed`` method, where
FBGEMM's row loop writes the rows, may return rows that repeat); ``row_reductions`` hands each table's
rule a RowReduction (full-row statistics of a column shard). Both hold on both paths, and
also where FBGEMM's row loop writes the update (the momentum completed to the full row's first).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_same_rows, one_group, table
from torch import Tensor

from embshard_kernels.fused import BatchedFusedEmbeddingBag
from embshard_kernels.path_probe import ENV_VAR
from embshard_optim.sparse_rules.base import RowReduction
from embshard_optim.specs import OptimizerSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

SPEC = OptimizerSpec.from_name("rowwise_adagrad", lr=0.2)


def _kernel(
    dim: int = 4, general: bool = False, fbgemm: bool | None = None
) -> BatchedFusedEmbeddingBag:
    config = one_group(table("a", 5, dim, optimizer=SPEC), table("b", 3, dim, optimizer=SPEC))
    kernel = BatchedFusedEmbeddingBag(config, backend="torch")
    assert kernel.emb_module.fast is not None
    if fbgemm is not None:  # FBGEMM writes the rows where it is faster (EMBSHARD_FUSED_PATH)
        assert (kernel.emb_module.fast.row_update is not None) is fbgemm
    if general:  # the general path: per-table blocks
        kernel.emb_module.fast = None
    with torch.no_grad():
        for i, w in enumerate(kernel.split_embedding_weights()):
            w.copy_(torch.arange(w.numel(), dtype=torch.float32).view(w.shape) / (10 + i))
    return kernel


def _step(kernel: BatchedFusedEmbeddingBag, scale: float = 1.0) -> None:
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 3, 1]), lengths=torch.tensor([2, 1, 0, 0]))
    out = kernel(kjt)
    (out * scale * torch.arange(out.numel()).view(out.shape)).sum().backward()


class _Doubler:
    """Doubles every gradient: scales the sums, or (``unsummed``) hands every row back twice."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int], int, str]] = []

    def __call__(
        self, label: str, rows: Tensor, grads: Tensor, num_rows: int
    ) -> tuple[Tensor, Tensor]:
        self.calls.append((label, rows.tolist(), num_rows, "summed"))
        return rows, grads * 2

    def unsummed(
        self, label: str, rows: Tensor, grads: Tensor, num_rows: int
    ) -> tuple[Tensor, Tensor]:
        self.calls.append((label, rows.tolist(), num_rows, "unsummed"))
        return torch.cat([rows, rows]), torch.cat([grads, grads])


@pytest.mark.parametrize("hook", ["object", "function"])
@pytest.mark.parametrize("path", ["fast", "general", "fbgemm"])
def test_grad_exchange_sees_every_block_and_its_result_is_applied(
    path: str, hook: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hook with an ``unsummed`` method gets it called where FBGEMM's row loop sums repeated
    # rows itself; a plain function is called as it is everywhere.
    monkeypatch.setenv(ENV_VAR, "fbgemm" if path == "fbgemm" else "torch")
    doubled = _kernel(general=path == "general", fbgemm=path == "fbgemm")
    doubler = _Doubler()

    def plain(label: str, rows: Tensor, grads: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
        return doubler(label, rows, grads, num_rows)

    doubled.emb_module.grad_exchange = doubler if hook == "object" else plain
    _step(doubled)
    if path == "general":
        # table "b" had no ids, and was still offered
        assert doubler.calls == [("a", [1, 3], 5, "summed"), ("b", [], 3, "summed")]
    else:  # one run: rows of "a" then "b" (5 + id)
        how = "unsummed" if path == "fbgemm" and hook == "object" else "summed"
        assert doubler.calls == [("a+b", [1, 3], 8, how)]
    monkeypatch.setenv(ENV_VAR, "torch")
    reference = _kernel()
    _step(reference, scale=2.0)
    for a, b in zip(
        doubled.split_embedding_weights(), reference.split_embedding_weights(), strict=True
    ):
        # The same update, summed in a possibly different order (and rounded as FBGEMM does).
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("path", ["fast", "general", "fbgemm"])
def test_row_reductions_complete_row_statistics(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A width-4 shard whose missing columns are a copy of its own (same weights, same
    # gradients) must update like either half of the whole width-8 table.
    monkeypatch.setenv(ENV_VAR, "fbgemm" if path == "fbgemm" else "torch")
    half = _kernel(4, general=path == "general", fbgemm=path == "fbgemm")
    monkeypatch.setenv(ENV_VAR, "torch")
    whole = _kernel(8)
    calls: list[int] = []

    def row_sum(partial: Tensor) -> Tensor:
        calls.append(partial.numel())
        return 2 * partial

    reduction = RowReduction(row_sum, full_dim=8)
    half.emb_module.row_reductions = [reduction, reduction]
    with torch.no_grad():
        for h, w in zip(
            half.split_embedding_weights(), whole.split_embedding_weights(), strict=True
        ):
            w.copy_(torch.cat([h, h], dim=1))
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 3, 1]), lengths=torch.tensor([2, 1, 0, 0]))
    grad = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    (half(kjt) * grad).sum().backward()
    ga, gb = grad[:, :4], grad[:, 4:]
    (whole(kjt) * torch.cat([ga, ga, gb, gb], dim=1)).sum().backward()
    for h, w in zip(half.split_embedding_weights(), whole.split_embedding_weights(), strict=True):
        torch.testing.assert_close(h, w[:, :4], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(h, w[:, 4:], atol=1e-6, rtol=1e-6)
    for h, w in zip(
        half.emb_module.get_optimizer_state(), whole.emb_module.get_optimizer_state(), strict=True
    ):
        torch.testing.assert_close(h["momentum1"], w["momentum1"], atol=1e-6, rtol=1e-6)
    # the touched rows 1 and 3 of "a" ("b" has no ids): one call for the run
    assert calls == [2]


@pytest.mark.parametrize(("pooling", "weighted"), [("mean", False), ("sum", True)])
def test_fbgemm_rows_complete_row_statistics_over_steps(
    pooling: str, weighted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tables of two widths (two runs), MEAN pooling or per-id weights, a table read by two
    # features, over several steps: FBGEMM's row loop with the momentum completed equals the
    # torch rules within rounding.
    tables = (
        table("a", 7, 4, ("fa", "fa2"), optimizer=SPEC, pooling=pooling, weighted=weighted),
        table("b", 5, 8, optimizer=SPEC, pooling=pooling, weighted=weighted),
    )
    monkeypatch.setenv(ENV_VAR, "fbgemm")
    fbgemm = BatchedFusedEmbeddingBag(one_group(*tables), backend="torch")
    monkeypatch.setenv(ENV_VAR, "torch")
    torch_ = BatchedFusedEmbeddingBag(one_group(*tables), backend="torch")
    assert fbgemm.emb_module.fast.row_update is not None
    assert torch_.emb_module.fast.row_update is None
    for kernel in (fbgemm, torch_):
        # the other columns (on "other ranks") add 0.5 to every touched row's sum of squares
        kernel.emb_module.row_reductions = [
            RowReduction(lambda p: p + 0.5, full_dim=12),
            RowReduction(lambda p: p + 0.5, full_dim=24),
        ]
        with torch.no_grad():
            for i, w in enumerate(kernel.split_embedding_weights()):
                w.copy_(torch.linspace(-1, 1, w.numel()).view(w.shape) * (i + 1))
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        lengths = torch.randint(0, 4, (9,), generator=gen)  # 3 features x batch 3
        ids = torch.cat(
            [
                torch.randint(0, rows, (int(n),), generator=gen)
                for rows, n in zip((7, 7, 5), lengths.view(3, 3).sum(1), strict=True)
            ]
        )
        weights = torch.rand(ids.shape, generator=gen) + 0.5
        kjt = KeyedJaggedTensor(
            ["fa", "fa2", "b"], ids, weights=weights if weighted else None, lengths=lengths
        )
        grad = torch.randn(3, 16, generator=gen)
        for kernel in (fbgemm, torch_):
            kernel.emb_module.prepare_backward()  # sorts in the forward's shadow; no-op if none
            (kernel(kjt) * grad).sum().backward()
    assert_same_rows(fbgemm, torch_)
