"""TorchRec's ``LowRankCrossNet`` (DCN v2 with low-rank cross weights), as in
``torchrec.modules.crossnet``.

Each layer computes ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``. Guarantees: the parameters
(``W_kernels.{l}``, ``V_kernels.{l}``, ``bias.{l}``) are registered and initialised in TorchRec's
order (Xavier-normal W for every layer, then V, then zero biases, on the CPU), so the same torch
seed gives the same weights.
"""

from __future__ import annotations

import torch
from torch import nn


class LowRankCrossNet(nn.Module):
    """Cross layers of rank ``low_rank`` over ``in_features``-wide inputs.

    Args:
        in_features: width of the input (and of the output).
        num_layers: cross layers.
        low_rank: the inner dimension of each ``W_l V_l`` product (at least 1).
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        if low_rank < 1:
            raise ValueError(f"LowRankCrossNet: low_rank must be at least 1, got {low_rank}")
        if num_layers < 0:
            raise ValueError(f"LowRankCrossNet: num_layers must be >= 0, got {num_layers}")
        self._num_layers = num_layers
        self._low_rank = low_rank
        self.W_kernels = nn.ParameterList(
            [
                nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank)))
                for _ in range(num_layers)
            ]
        )
        self.V_kernels = nn.ParameterList(
            [
                nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features)))
                for _ in range(num_layers)
            ]
        )
        self.bias = nn.ParameterList(
            [nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers)]
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``[batch, in_features]`` -> ``[batch, in_features]``."""
        x0 = input
        x = x0
        for w, v, b in zip(self.W_kernels, self.V_kernels, self.bias, strict=True):
            x = x0 * (nn.functional.linear(nn.functional.linear(x, v), w) + b) + x
        return x
