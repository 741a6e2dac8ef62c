"""Short, readable text for tensors in the jagged types' ``repr`` / ``str``.

``describe`` never reads tensor data (safe in any ``repr``); ``preview`` reads at most
``limit`` entries (one device-to-host copy) and marks what it left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

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


def keyed_jagged_text(kjt: KeyedJaggedTensor) -> str:
    """Return ``repr(kjt)`` followed by one line per key with its lengths, ids and weights."""
    lines = [repr(kjt)]
    offsets = kjt.offset_per_key()
    bounds = kjt.lengths_offset_per_key()
    lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
    for k, key in enumerate(kjt.keys()):
        start, stop = offsets[k], offsets[k + 1]
        line = f"  {key!r}: lengths={preview(lengths[bounds[k] : bounds[k + 1]])}"
        line += f" values={preview(values[start:stop])}"
        if weights is not None:
            line += f" weights={preview(weights[start:stop])}"
        lines.append(line)
    return "\n".join(lines)
