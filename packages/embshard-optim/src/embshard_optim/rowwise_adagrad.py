"""``RowWiseAdagrad``: TorchRec's ``torchrec.optim.RowWiseAdagrad`` as a dense ``torch.optim`` optimizer.

One accumulator per row of each 2-D parameter (the mean of the squared gradient over the row),
so every element of a row takes the same adaptive step. Its math is
:func:`embshard_optim.sparse_rules.adagrad.rowwise_adagrad_update` applied to all rows, the
function the sparse and fused paths also call. ``apply_optimizer_in_backward(RowWiseAdagrad, ...)``
on embedding tables is fused into the kernels' ``ROWWISE_ADAGRAD`` by
``DistributedModelParallel`` (``OptimizerSpec.from_torch`` looks the class up by name).

State per parameter, under TorchRec's names: ``step`` (a float tensor) and ``sum`` (``[rows, 1]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from embshard_optim.sparse_rules.adagrad import rowwise_adagrad_update
from embshard_optim.specs import OptimizerSpec, OptimType, WeightDecayMode

__all__ = ["RowWiseAdagrad"]


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row (TorchRec's ``RowWiseAdagrad``, same arguments).

    Per step ``t`` and row: ``g = grad + weight_decay * w`` (L2); ``sum += mean(g**2)``;
    ``w -= lr / (1 + (t - 1) * lr_decay) * g / (sqrt(sum) + eps)``. Every row is updated,
    including rows whose gradient is zero (FBGEMM's fused kernel touches only looked-up rows,
    which differs under weight decay).

    Args:
        params: 2-D parameters (or parameter groups) to optimize.
        lr: learning rate.
        lr_decay: the rate is divided by ``1 + (step - 1) * lr_decay``.
        weight_decay: L2 penalty added to the gradient.
        initial_accumulator_value: starting value of every row's accumulator.
        eps: added to the square root of the accumulator.
        maximize: ascend the objective instead.

    Raises:
        ValueError: a negative hyperparameter, or a parameter that is not 2-D (its index and
            shape named).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        for name, value in (
            ("lr", lr),
            ("lr_decay", lr_decay),
            ("weight_decay", weight_decay),
            ("initial_accumulator_value", initial_accumulator_value),
            ("eps", eps),
        ):
            if not value >= 0.0:
                raise ValueError(f"RowWiseAdagrad: {name} must be >= 0, got {value!r}")
        defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; refuses parameters that are not 2-D."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for i, p in enumerate(params):
            if isinstance(p, Tensor) and p.dim() != 2:
                raise ValueError(
                    f"RowWiseAdagrad: parameter {i} of group {len(self.param_groups)} has shape "
                    f"{tuple(p.shape)}; row-wise Adagrad needs 2-D parameters (embedding tables). "
                    "Give other parameters their own optimizer (e.g. torch.optim.Adagrad)"
                )
            if isinstance(p, Tensor) and p.is_complex():
                raise ValueError(
                    f"RowWiseAdagrad: parameter {i} of group {len(self.param_groups)} is complex "
                    f"({p.dtype}); use a real dtype"
                )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            self._init_state(p, group["initial_accumulator_value"])

    def _init_state(self, p: Tensor, initial: float) -> None:
        if "sum" in self.state[p]:
            return
        self.state[p]["step"] = torch.tensor(0.0)
        self.state[p]["sum"] = torch.full(
            (p.shape[0], 1), float(initial), dtype=p.dtype, device=p.device
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient; returns ``closure()``'s loss if given.

        Raises:
            RuntimeError: a sparse gradient (densify it, or use the fused kernels).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"RowWiseAdagrad: parameter of shape {tuple(p.shape)} has a sparse "
                        "gradient; it takes dense gradients (fused embedding kernels apply "
                        "row-wise Adagrad to the looked-up rows themselves)"
                    )
                self._step_one(p, group)
        return loss

    def _step_one(self, p: Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        state["step"] += 1
        step = int(state["step"].item())
        lr = group["lr"] / (1.0 + (step - 1) * group["lr_decay"])
        decay = group["weight_decay"]
        spec = OptimizerSpec(
            OptimType.ROWWISE_ADAGRAD,
            learning_rate=lr,
            eps=group["eps"],
            weight_decay=decay,
            weight_decay_mode=WeightDecayMode.L2 if decay > 0.0 else WeightDecayMode.NONE,
        )
        grad = p.grad
        assert grad is not None  # step() skips parameters without a gradient
        if group["maximize"]:
            grad = -grad
        rows = torch.arange(p.shape[0], device=p.device)
        rowwise_adagrad_update(spec, p, {"momentum1": state["sum"].view(-1)}, rows, grad, step)
