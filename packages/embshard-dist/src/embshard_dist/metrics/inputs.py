"""The checks a batch passes before any metric state changes.

A batch is predicted probabilities, labels and optional sample weights, one value per sample
(any shape; flattened). Predictions and labels must lie in ``[0, 1]`` and weights be finite and
non-negative; a batch that breaks a rule raises ``ValueError`` naming the metric, the tensor and
the rule, and the metric is left as it was.
"""

from __future__ import annotations

import torch

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Flat float64 predictions, labels and weights of one batch, on one device."""


def _check_range(t: torch.Tensor, what: str, where: str, upper: float | None) -> None:
    if t.numel() == 0:
        return
    low, high = float(t.min()), float(t.max())
    finite = bool(torch.isfinite(t).all())
    if not finite or low < 0 or (upper is not None and high > upper):
        bound = f"[0, {upper:g}]" if upper is not None else "finite and >= 0"
        raise ValueError(
            f"{where}: {what} must be {'in ' if upper is not None else ''}{bound}, "
            f"got values from {low} to {high}" + ("" if finite else " (with NaN or inf)")
        )


def prepare_batch(
    predictions: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    *,
    where: str,
    device: torch.device | None = None,
) -> Batch:
    """The checked batch as flat float64 tensors on ``device`` (default: the predictions').

    Raises:
        ValueError: the three do not hold one value per sample, or a value is out of range.
    """
    device = predictions.device if device is None else device
    p = predictions.detach().reshape(-1).to(device=device, dtype=torch.float64)
    y = labels.detach().reshape(-1).to(device=device, dtype=torch.float64)
    w = (
        torch.ones_like(p)
        if weights is None
        else weights.detach().reshape(-1).to(device=device, dtype=torch.float64)
    )
    if not p.shape == y.shape == w.shape:
        shapes = [f"predictions {tuple(predictions.shape)}", f"labels {tuple(labels.shape)}"]
        if weights is not None:
            shapes.append(f"weights {tuple(weights.shape)}")
        raise ValueError(f"{where}: {' and '.join(shapes)} must have one value per sample")
    _check_range(p, "predictions (probabilities)", where, 1.0)
    _check_range(y, "labels", where, 1.0)
    _check_range(w, "weights", where, None)
    return p, y, w
