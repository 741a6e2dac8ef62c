"""GradientClippingOptimizer against torch.nn.utils on the unsharded equivalent.

The two-process test shards one parameter by rows as a plain tensor (named in
``sharded_params``) and another as a ``DTensor``, keeps a third replicated, and checks that the
clipped gradients and the step equal ``clip_grad_norm_`` on the whole model.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _optim_helpers import free_port

from embshard_optim.clipping import GradientClipping, GradientClippingOptimizer
from embshard_optim.keyed import KeyedOptimizerWrapper

NORMS = [2.0, 1.0, float("inf")]


def _params_and_grads(seed: int) -> tuple[dict[str, torch.nn.Parameter], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = {
        "a": torch.nn.Parameter(torch.randn(4, 3, generator=gen)),
        "b": torch.nn.Parameter(torch.randn(5, generator=gen)),
    }
    grads = [torch.randn(4, 3, generator=gen) * 3, torch.randn(5, generator=gen)]
    return params, grads


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("max_gradient", [0.5, 100.0])
def test_norm_clipping_matches_torch(norm_type: float, max_gradient: float) -> None:
    params, grads = _params_and_grads(0)
    reference = [p.detach().clone().requires_grad_() for p in params.values()]
    for p, r, g in zip(params.values(), reference, grads, strict=True):
        p.grad, r.grad = g.clone(), g.clone()
    opt = GradientClippingOptimizer(
        KeyedOptimizerWrapper.from_class(params, torch.optim.SGD, lr=0.1),
        GradientClipping.NORM,
        max_gradient=max_gradient,
        norm_type=norm_type,
    )
    torch.nn.utils.clip_grad_norm_(reference, max_gradient, norm_type=norm_type)
    opt.step()
    for p, r in zip(params.values(), reference, strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p.detach(), r.detach() - 0.1 * r.grad, rtol=1e-6, atol=1e-7)


def test_value_clipping_matches_torch() -> None:
    params, grads = _params_and_grads(1)
    reference = [g.clone() for g in grads]
    for p, g in zip(params.values(), grads, strict=True):
        p.grad = g.clone()
    opt = GradientClippingOptimizer(
        KeyedOptimizerWrapper.from_class(params, torch.optim.SGD, lr=0.1), "value", max_gradient=0.7
    )
    holders = [torch.zeros_like(g, requires_grad=True) for g in reference]
    for h, g in zip(holders, reference, strict=True):
        h.grad = g
    torch.nn.utils.clip_grad_value_(holders, 0.7)
    opt.step()
    for p, h in zip(params.values(), holders, strict=True):
        assert torch.equal(p.grad, h.grad)


def test_no_clipping_and_bad_arguments() -> None:
    params, grads = _params_and_grads(2)
    for p, g in zip(params.values(), grads, strict=True):
        p.grad = g.clone()
    inner = KeyedOptimizerWrapper.from_class(params, torch.optim.SGD, lr=0.1)
    GradientClippingOptimizer(inner).step()
    assert torch.equal(params["a"].grad, grads[0])
    with pytest.raises(ValueError, match=r"unknown parameters \['zz'\]"):
        GradientClippingOptimizer(inner, "norm", sharded_params=["zz"])
    with pytest.raises(ValueError, match="max_gradient must be positive"):
        GradientClippingOptimizer(inner, "norm", max_gradient=0.0)


# -- two processes -------------------------------------------------------------------------

FULL_A = torch.arange(24, dtype=torch.float32).view(8, 3) / 10  # row-sharded, plain tensor
FULL_C = torch.arange(12, dtype=torch.float32).view(6, 2) / 7 - 0.5  # row-sharded, DTensor
B = torch.linspace(-1, 1, 5)  # replicated


def _full_grads() -> list[torch.Tensor]:
    return [FULL_A * 2 - 1, FULL_C * -3, B * 4]


def _check_distributed(rank: int, norm_type: float) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    ga, gc, gb = _full_grads()
    a = torch.nn.Parameter(FULL_A[4 * rank : 4 * rank + 4].clone())
    c = torch.nn.Parameter(distribute_tensor(FULL_C.clone(), mesh, [Shard(0)]))
    b = torch.nn.Parameter(B.clone())
    a.grad = ga[4 * rank : 4 * rank + 4].clone()
    c.grad = distribute_tensor(gc.clone(), mesh, [Shard(0)])
    b.grad = gb.clone()
    opt = GradientClippingOptimizer(
        KeyedOptimizerWrapper.from_class({"a": a, "b": b, "c": c}, torch.optim.SGD, lr=0.5),
        GradientClipping.NORM,
        max_gradient=1.0,
        norm_type=norm_type,
        sharded_params=["a"],
    )
    opt.step()

    reference = [t.clone().requires_grad_() for t in (FULL_A, FULL_C, B)]
    for r, g in zip(reference, _full_grads(), strict=True):
        r.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type=norm_type)
    ra, rc, rb = (r.grad for r in reference)
    torch.testing.assert_close(a.grad, ra[4 * rank : 4 * rank + 4], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c.grad.to_local(), rc[3 * rank : 3 * rank + 3], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.grad, rb, rtol=1e-6, atol=1e-7)
    expected_a = FULL_A[4 * rank : 4 * rank + 4] - 0.5 * ra[4 * rank : 4 * rank + 4]
    torch.testing.assert_close(a.detach(), expected_a, rtol=1e-6, atol=1e-7)
    expected_c = FULL_C[3 * rank : 3 * rank + 3] - 0.5 * rc[3 * rank : 3 * rank + 3]
    torch.testing.assert_close(c.detach().to_local(), expected_c, rtol=1e-6, atol=1e-7)


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
        for norm_type in NORMS:
            _check_distributed(rank, norm_type)
    finally:
        dist.destroy_process_group()
    # leave without the interpreter's teardown, where a gloo worker thread can still need the
    # GIL and abort the process ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_norm_across_sharded_parameters_on_two_processes() -> None:
    mp.spawn(_worker, args=(2, free_port()), nprocs=2, join=True)
