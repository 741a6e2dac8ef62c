"""Optional TensorBoard scalars of ``embshard train`` (``--tensorboard DIR``).

``torch.utils.tensorboard`` needs the ``tensorboard`` package; :func:`check_tensorboard` says
so up front (before any rank starts) when the option is given without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ScalarWriter", "check_tensorboard"]


def check_tensorboard() -> str | None:
    """Why ``--tensorboard`` cannot work here (``None``: it can)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as e:
        return (
            f"--tensorboard needs the tensorboard package ({e}); install it "
            "(uv pip install tensorboard, or pip install tensorboard) or leave the option out"
        )
    return None


class ScalarWriter:
    """Writes ``{tag: value}`` scalars at a step into ``log_dir`` (nothing when it is ``None``)."""

    def __init__(self, log_dir: str | None) -> None:
        self._writer: Any = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=log_dir)

    def add(self, prefix: str, values: dict[str, float], step: int) -> None:
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
