"""TorchRec's dense building blocks: ``Perceptron`` (one linear layer and its activation) and
``MLP`` (a stack of them), as in ``torchrec.modules.mlp``.

Guarantees: parameter names (``_mlp.{i}._linear.weight`` / ``.bias``), their registration order
and their initialisation (``nn.Linear``'s, layer by layer) are TorchRec's, so the same torch seed
gives the same weights; an unknown activation name is refused with the names that are known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias, cast

import torch
from torch import nn

Activation: TypeAlias = str | nn.Module | type[nn.Module] | Callable[[torch.Tensor], torch.Tensor]
"""``"relu"``, ``"sigmoid"``, a module, a module class (one instance per layer) or a function."""

_NAMED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
}


def _activation(activation: Activation) -> Callable[[torch.Tensor], torch.Tensor]:
    """The callable one layer applies (a fresh instance when given a module class)."""
    if isinstance(activation, str):
        if activation not in _NAMED:
            raise ValueError(
                f"MLP: unknown activation {activation!r}; use one of {sorted(_NAMED)}, an "
                "nn.Module, an nn.Module class or a tensor function"
            )
        return _NAMED[activation]
    if isinstance(activation, type):
        if not issubclass(activation, nn.Module):
            raise TypeError(
                f"MLP: activation class {activation.__name__} is not an nn.Module; pass an "
                "nn.Module class, an instance, a tensor function or 'relu' / 'sigmoid'"
            )
        return cast(Callable[[torch.Tensor], torch.Tensor], activation())
    return cast(Callable[[torch.Tensor], torch.Tensor], activation)


class Perceptron(nn.Module):
    """``activation(linear(x))``.

    Args:
        in_size / out_size: the linear layer's input and output widths.
        bias: give the linear layer a bias.
        activation: applied after the linear layer (default ReLU).
        device / dtype: of the linear layer's parameters.
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: Activation = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._in_size = in_size
        self._out_size = out_size
        self._linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn = _activation(activation)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._activation_fn(self._linear(input))
        return out


class MLP(nn.Module):
    """Perceptrons of widths ``layer_sizes`` in sequence, the first reading ``in_size`` features.

    Args:
        in_size: input width.
        layer_sizes: the output width of each layer (at least one).
        bias: give each linear layer a bias.
        activation: after every layer (``activation_on_last=False``: all but the last).
        device / dtype: of the parameters.
    """

    def __init__(
        self,
        in_size: int,
        layer_sizes: Sequence[int],
        bias: bool = True,
        activation: Activation = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        activation_on_last: bool = True,
    ) -> None:
        super().__init__()
        sizes = list(layer_sizes)
        if not sizes:
            raise ValueError(
                f"MLP: layer_sizes is empty; give at least one width (in_size={in_size})"
            )
        inputs = [in_size, *sizes[:-1]]
        last = len(sizes) - 1
        self._mlp = nn.Sequential(
            *[
                Perceptron(
                    inputs[i],
                    sizes[i],
                    bias=bias,
                    activation=nn.Identity()
                    if i == last and not activation_on_last
                    else activation,
                    device=device,
                    dtype=dtype,
                )
                for i in range(len(sizes))
            ]
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._mlp(input)
        return out
