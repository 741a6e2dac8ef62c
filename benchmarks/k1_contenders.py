"""The K1 contenders: embshard's fused collection, FBGEMM's TBE called directly, and per-table
``torch.nn.EmbeddingBag`` with sparse Adagrad. Each exposes ``step()`` (forward + backward +
update) and ``forward()``; all start from the same weights and see the same ids. embshard's
collection takes its ``backend`` (``"auto"``: the fused path ``choose_fused_path`` picks here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from workloads import K1


def _kjt(w: K1, ids: torch.Tensor):  # type: ignore[no-untyped-def]
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    lengths = torch.full((w.num_tables * w.batch,), w.ids_per_bag, dtype=torch.long)
    return KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(w.num_tables)], values=ids.reshape(-1), lengths=lengths
    )


def embshard_collection(
    w: K1,
    optimizer: str = "rowwise_adagrad",
    backend: Literal["auto", "fbgemm", "torch"] = "auto",
) -> tuple[Callable[[], None], Callable[[], None]]:
    from embshard_kernels.collections import EmbeddingBagCollection
    from embshard_optim.specs import OptimizerSpec
    from embshard_types.configs import EmbeddingBagConfig

    weights, ids, grad = w.tensors()
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=w.rows, embedding_dim=w.dim, feature_names=(f"f{t}",)
        )
        for t in range(w.num_tables)
    ]
    spec = OptimizerSpec.from_name(optimizer, lr=w.lr, eps=w.eps)
    ebc = EmbeddingBagCollection(tables, optimizer=spec, backend=backend)
    with torch.no_grad():
        for t, weight in enumerate(weights):
            ebc.state_dict()[f"embedding_bags.t{t}.weight"].copy_(weight)
    kjt = _kjt(w, ids)

    def step() -> None:
        ebc(kjt).values().backward(grad)

    def forward() -> None:
        with torch.no_grad():
            ebc(kjt)

    return step, forward


def fused_path(optimizer: str = "rowwise_adagrad") -> str:
    """The fused path ``backend="auto"`` takes for ``optimizer`` here, and why."""
    import os

    from embshard_kernels.path_probe import ENV_VAR
    from embshard_kernels.tbe import measured_fused_path
    from embshard_optim.specs import OptimType

    forced = os.environ.get(ENV_VAR, "auto")
    if forced.lower() not in ("", "auto"):
        return f"{forced} ({ENV_VAR})"
    probe = measured_fused_path(OptimType.parse(optimizer))
    return (
        f"{probe.chosen.value} (probe: FBGEMM {probe.fbgemm_s * 1e3:.2f} ms, "
        f"torch fast path {probe.torch_fast_s * 1e3:.2f} ms per step)"
    )


def fbgemm_tbe(
    w: K1, optimizer: str = "rowwise_adagrad"
) -> tuple[Callable[[], None], Callable[[], None]]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    optim = {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "sgd": EmbOptimType.EXACT_SGD}[
        optimizer
    ]
    weights, ids, grad = w.tensors()
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(w.rows, w.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * w.num_tables,
        optimizer=optim,
        learning_rate=w.lr,
        eps=w.eps,
    )
    with torch.no_grad():
        for dst, src in zip(tbe.split_embedding_weights(), weights, strict=True):
            dst.copy_(src)
    indices = ids.reshape(-1)
    offsets = torch.arange(0, indices.numel() + 1, w.ids_per_bag, dtype=torch.long)

    def step() -> None:
        tbe(indices, offsets).backward(grad)

    def forward() -> None:
        with torch.no_grad():
            tbe(indices, offsets)

    return step, forward


def torch_embedding_bags(w: K1) -> tuple[Callable[[], None], Callable[[], None]]:
    weights, ids, grad = w.tensors()
    bags = [
        torch.nn.EmbeddingBag(w.rows, w.dim, mode="sum", sparse=True) for _ in range(w.num_tables)
    ]
    with torch.no_grad():
        for bag, weight in zip(bags, weights, strict=True):
            bag.weight.copy_(weight)
    opt = torch.optim.Adagrad([b.weight for b in bags], lr=w.lr, eps=w.eps)
    inputs = [ids[t].view(w.batch, w.ids_per_bag) for t in range(w.num_tables)]
    grads = grad.split(w.dim, dim=1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        outs = [bag(x) for bag, x in zip(bags, inputs, strict=True)]
        torch.autograd.backward(outs, list(grads))
        opt.step()

    def forward() -> None:
        with torch.no_grad():
            for bag, x in zip(bags, inputs, strict=True):
                bag(x)

    return step, forward
