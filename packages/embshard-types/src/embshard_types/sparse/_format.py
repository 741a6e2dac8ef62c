"""Short text for tensors in the jagged types' ``repr`` / ``str``.

``describe`` never reads tensor data; ``preview`` reads at most ``limit`` entries.
"""

from __future__ import annotations

from torch import Tensor

PREVIEW_LIMIT = 12


def describe(tensor: Tensor | None) -> str:
    """Return e.g. ``"int64[7] cpu"`` (dtype, shape, device) without reading data."""
    if tensor is None:
        return "None"
    dtype = str(tensor.dtype).removeprefix("torch.")
    shape = ",".join(str(s) for s in tensor.shape)
    return f"{dtype}[{shape}] {tensor.device}"


def preview(tensor: Tensor, limit: int = PREVIEW_LIMIT) -> str:
    """Return the first ``limit`` entries of ``tensor`` as a list, with ``...`` if cut."""
    head = tensor[:limit].tolist()
    text = ", ".join(str(round(v, 4) if isinstance(v, float) else v) for v in head)
    more = tensor.shape[0] - len(head) if tensor.dim() else 0
    suffix = f", ... (+{more})" if more > 0 else ""
    return f"[{text}{suffix}]"
