"""Fused optimizers on the CPU equal a plain-torch reference of the same update (to 1e-6).

The reference keeps a dense float64 copy of every table and of its optimizer state, takes the
exact per-row gradient from autograd through ``F.embedding_bag`` / ``F.embedding``, and applies
each optimizer's formula (written out below, independently of embshard-optim's rules) to the
rows the batch touched. SGD, Adagrad and RowWiseAdagrad run on FBGEMM's TBE (forced); SGD and
RowWiseAdagrad also on the fast path of embshard's plain-torch TBE (RowWiseAdagrad's default on
pooled CPU tables); Adam, partial row-wise Adam, LAMB, partial row-wise LAMB, LARS-SGD and
RowWiseAdagrad with weight decay on its general path.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import (
    feature_weights,
    one_group,
    random_kjt,
    reference_pooled,
    reference_sequence,
    table,
)
from torch import Tensor

from embshard_kernels.fused import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from embshard_kernels.tbe import Backend, FbgemmFusedTBE
from embshard_kernels.torch_fused import TorchFusedTBE
from embshard_optim.specs import OptimizerSpec, OptimType, WeightDecayMode
from embshard_types.vocab import PoolingType

FBGEMM_SPECS = {
    "sgd": OptimizerSpec(OptimType.SGD, learning_rate=0.3),
    "adagrad": OptimizerSpec(OptimType.ADAGRAD, learning_rate=0.1, eps=1e-3),
    "rowwise_adagrad": OptimizerSpec(OptimType.ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3),
}
TORCH_SPECS = {
    "rowwise_adagrad_l2": OptimizerSpec(
        OptimType.ROWWISE_ADAGRAD,
        learning_rate=0.1,
        eps=1e-3,
        weight_decay=0.05,
        weight_decay_mode=WeightDecayMode.L2,
    ),
    "rowwise_adagrad_decoupled": OptimizerSpec(
        OptimType.ROWWISE_ADAGRAD,
        learning_rate=0.1,
        eps=1e-3,
        weight_decay=0.05,
        weight_decay_mode=WeightDecayMode.DECOUPLED,
    ),
    "adam": OptimizerSpec(OptimType.ADAM, learning_rate=0.05, eps=1e-4, weight_decay=0.01),
    "partial_rowwise_adam": OptimizerSpec(
        OptimType.PARTIAL_ROWWISE_ADAM, learning_rate=0.05, eps=1e-4
    ),
    "lamb": OptimizerSpec(OptimType.LAMB, learning_rate=0.05, eps=1e-4, weight_decay=0.01),
    "partial_rowwise_lamb": OptimizerSpec(
        OptimType.PARTIAL_ROWWISE_LAMB, learning_rate=0.05, eps=1e-4
    ),
    "lars_sgd": OptimizerSpec(OptimType.LARS_SGD, learning_rate=0.5, eta=0.01, weight_decay=0.01),
}


def _norm(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x, dim=1, keepdim=True)


def reference_update(
    spec: OptimizerSpec, w: Tensor, state: dict[str, Tensor], g: Tensor, step: int
) -> None:
    """Apply one step of ``spec`` to the touched rows ``w`` / ``state`` (in place, float64)."""
    lr, eps, wd = spec.learning_rate, spec.eps, spec.weight_decay
    b1, b2 = spec.beta1, spec.beta2
    kind = spec.optim_type
    if kind is OptimType.SGD:
        w -= lr * g
    elif kind is OptimType.ADAGRAD:
        state["momentum1"] += g * g
        w -= lr * g / (state["momentum1"].sqrt() + eps)
    elif kind is OptimType.ROWWISE_ADAGRAD:
        l2 = wd > 0 and spec.weight_decay_mode is WeightDecayMode.L2
        g_stat = g + wd * w if l2 else g
        state["momentum1"] += (g_stat * g_stat).mean(1)
        mult = (lr / (state["momentum1"].sqrt() + eps)).unsqueeze(1)
        if l2:
            w.copy_((1 - mult * wd) * w - mult * g)
        elif wd > 0:
            w.copy_((1 - lr * wd) * w - mult * g)
        else:
            w -= mult * g
    elif kind in (
        OptimType.ADAM,
        OptimType.PARTIAL_ROWWISE_ADAM,
        OptimType.LAMB,
        OptimType.PARTIAL_ROWWISE_LAMB,
    ):
        rowwise = kind in (OptimType.PARTIAL_ROWWISE_ADAM, OptimType.PARTIAL_ROWWISE_LAMB)
        m1, m2 = state["momentum1"], state["momentum2"]
        m1.mul_(b1).add_((1 - b1) * g)
        m2.mul_(b2).add_((1 - b2) * ((g * g).mean(1) if rowwise else g * g))
        v = (m2 / (1 - b2**step)).sqrt() + eps
        u = (m1 / (1 - b1**step)) / (v.unsqueeze(1) if rowwise else v)
        if kind in (OptimType.ADAM, OptimType.PARTIAL_ROWWISE_ADAM):
            w -= lr * (u + wd * w)
        else:
            r = u + wd * w
            w -= lr * (_norm(w) / _norm(r)) * r
    elif kind is OptimType.LARS_SGD:
        adjusted = lr * spec.eta * _norm(w) / (_norm(g) + wd * _norm(w))
        state["momentum1"].mul_(spec.momentum).add_(adjusted * (g + wd * w))
        w -= state["momentum1"]
    else:  # pragma: no cover - every OptimType is listed above
        raise AssertionError(kind)


class Reference:
    """Dense float64 tables and state, updated on touched rows only."""

    def __init__(self, spec: OptimizerSpec, weights: list[Tensor]) -> None:
        self.spec = spec
        self.weights = [w.detach().double().clone() for w in weights]
        self.states = [
            {
                name: torch.zeros(
                    w.shape[0] if spec.state_is_rowwise(name) else w.shape, dtype=torch.float64
                )
                for name in spec.state_names()
            }
            for w in self.weights
        ]
        self.step = 0

    def train_step(self, config, kjt, grad_out: Tensor, sequence: bool) -> None:
        params = [w.clone().requires_grad_(True) for w in self.weights]
        per_feature = feature_weights(config, params)
        if sequence:
            out = reference_sequence(kjt, per_feature)
        else:
            out = reference_pooled(kjt, per_feature, config.pooling, weighted=config.is_weighted)
        grads = torch.autograd.grad((out * grad_out.double()).sum(), params)
        self.step += 1
        for t, (w, g, state) in enumerate(zip(self.weights, grads, self.states, strict=True)):
            features = [
                f
                for f, ft in zip(config.feature_names(), config.feature_table_map(), strict=True)
                if ft == t
            ]
            ids = torch.cat([kjt[f].values() for f in features])
            rows = torch.unique(ids)
            if rows.numel() == 0:
                continue
            w_rows, g_rows = w[rows], g[rows]
            s_rows = {k: v[rows] for k, v in state.items()}
            reference_update(self.spec, w_rows, s_rows, g_rows, self.step)
            w[rows] = w_rows
            for k, v in s_rows.items():
                state[k][rows] = v


def _config(spec: OptimizerSpec, pooling: str, weighted: bool):
    return one_group(
        table("t1", 9, 8, ["f1", "f2"], pooling=pooling, weighted=weighted, optimizer=spec),
        table(
            "t2",
            6,
            8 if pooling == "none" else 4,
            ["f3"],
            pooling=pooling,
            weighted=weighted,
            optimizer=spec,
        ),
    )


def _run(
    spec: OptimizerSpec, pooling: str, weighted: bool, steps: int = 4, backend: Backend = "auto"
) -> None:
    config = _config(spec, pooling, weighted)
    sequence = pooling == "none"
    kernel = (BatchedFusedEmbedding if sequence else BatchedFusedEmbeddingBag)(
        config, backend=backend
    )
    ref = Reference(spec, kernel.split_embedding_weights())
    initial = [w.detach().clone() for w in kernel.split_embedding_weights()]
    rows = {"f1": 9, "f2": 9, "f3": 6}
    for step in range(steps):
        if step == 2:  # a learning-rate change made on the fused optimizer reaches the kernel
            kernel.fused_optimizer.param_groups[0]["lr"] = spec.learning_rate / 2
            kernel.fused_optimizer.step()
            from dataclasses import replace

            ref.spec = replace(spec, learning_rate=spec.learning_rate / 2)
        kjt = random_kjt(
            [(f, rows[f]) for f in ("f1", "f2", "f3")], 6, max_len=5, weighted=weighted, seed=step
        )
        out = kernel(kjt)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + step))
        out.backward(grad_out)
        ref.train_step(config, kjt, grad_out, sequence)

    for t, (got, want) in enumerate(
        zip(kernel.split_embedding_weights(), ref.weights, strict=True)
    ):
        assert (got - initial[t]).abs().max() > 1e-3, "the optimizer changed nothing"
        torch.testing.assert_close(
            got.double(), want, rtol=1e-6, atol=1e-6, msg=f"weights of table {t}"
        )
    states = kernel.emb_module.get_optimizer_state()
    exposed = kernel.fused_optimizer.state_dict()["state"]
    for t, table_config in enumerate(config.embedding_tables):
        assert sorted(states[t]) == sorted(spec.state_names())
        for name, want in ref.states[t].items():
            torch.testing.assert_close(
                states[t][name].double(), want, rtol=1e-6, atol=1e-6, msg=f"{name} of table {t}"
            )
            index = spec.state_names().index(name) + 1
            key = f"{table_config.name}.momentum{index}"
            assert torch.equal(exposed[f"{table_config.name}.weight"][key], states[t][name])


@pytest.mark.parametrize("name", sorted(FBGEMM_SPECS))
@pytest.mark.parametrize("pooling,weighted", [("sum", True), ("mean", False)])
def test_fbgemm_optimizers_match_reference(name: str, pooling: str, weighted: bool) -> None:
    spec = FBGEMM_SPECS[name]
    kernel = BatchedFusedEmbeddingBag(_config(spec, pooling, weighted), backend="fbgemm")
    assert isinstance(kernel.emb_module, FbgemmFusedTBE)
    _run(spec, pooling, weighted, backend="fbgemm")


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling,weighted", [("sum", True), ("sum", False), ("mean", False)])
def test_fast_pooled_path_matches_reference(name: str, pooling: str, weighted: bool) -> None:
    spec = FBGEMM_SPECS[name]
    kernel = BatchedFusedEmbeddingBag(_config(spec, pooling, weighted), backend="torch")
    assert isinstance(kernel.emb_module, TorchFusedTBE) and kernel.emb_module.fast is not None
    _run(spec, pooling, weighted, backend="torch")


@pytest.mark.parametrize("name", sorted(TORCH_SPECS))
def test_torch_fallback_optimizers_match_reference(name: str) -> None:
    spec = TORCH_SPECS[name]
    kernel = BatchedFusedEmbeddingBag(_config(spec, "sum", True))
    assert not isinstance(kernel.emb_module, FbgemmFusedTBE)
    _run(spec, "sum", True)


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam", "lamb"])
def test_sequence_fused_optimizers_match_reference(name: str) -> None:
    spec = {**FBGEMM_SPECS, **TORCH_SPECS}[name]
    _run(spec, "none", False)


def test_mean_pooling_fallback_matches_reference() -> None:
    _run(TORCH_SPECS["partial_rowwise_lamb"], "mean", False)


def test_per_sample_weight_gradient_matches_autograd() -> None:
    """The torch kernel's gradient w.r.t. per-id weights equals F.embedding_bag's."""
    spec = TORCH_SPECS["adam"]
    config = _config(spec, "sum", True)
    kernel = BatchedFusedEmbeddingBag(config)
    kjt = random_kjt([("f1", 9), ("f2", 9), ("f3", 6)], 4, weighted=True, seed=3)
    weights = kjt.weights().clone().requires_grad_(True)
    from embshard_kernels.inputs import to_tbe_input

    args = to_tbe_input(kjt, weighted=True)
    tables = [w.detach().clone() for w in kernel.split_embedding_weights()]
    out = kernel.emb_module(args.indices, args.offsets, weights)
    grad_out = torch.randn(out.shape)
    out.backward(grad_out)

    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    ref_weights = kjt.weights().clone().requires_grad_(True)
    ref_kjt = KeyedJaggedTensor(
        kjt.keys(), kjt.values(), weights=ref_weights, lengths=kjt.lengths()
    )
    ref = reference_pooled(ref_kjt, feature_weights(config, tables), PoolingType.SUM, weighted=True)
    (ref * grad_out).sum().backward()
    assert weights.grad is not None and ref_weights.grad is not None
    torch.testing.assert_close(weights.grad, ref_weights.grad, rtol=1e-5, atol=1e-6)
