"""Per-table views into a batched kernel's flat weight buffer.

``TableBatchedEmbeddingSlice`` is a ``[rows, dim]`` ``nn.Parameter`` aliasing one table's region
(no copy, either way; its ``grad`` is the same region of the buffer's gradient), and
``TableWeight`` holds it as ``weight`` so state dicts see ``{table}.weight``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn


class TableBatchedEmbeddingSlice(nn.Parameter):
    """A ``[num_embeddings, embedding_dim]`` parameter aliasing ``data[start_offset:end_offset]``.

    Raises:
        ValueError: the region does not fit ``data`` or does not hold ``rows * dim`` elements.
    """

    _original_tensor: Tensor
    _start_offset: int
    _end_offset: int
    _num_embeddings: int
    _embedding_dim: int

    def __new__(
        cls,
        data: Tensor,
        start_offset: int,
        end_offset: int,
        num_embeddings: int,
        embedding_dim: int,
    ) -> TableBatchedEmbeddingSlice:
        if data.dim() != 1:
            raise ValueError(f"a table slice views a 1-D buffer, got shape {tuple(data.shape)}")
        if not 0 <= start_offset <= end_offset <= data.numel():
            raise ValueError(
                f"slice [{start_offset}, {end_offset}) does not fit a buffer of {data.numel()}"
            )
        if end_offset - start_offset != num_embeddings * embedding_dim:
            raise ValueError(
                f"slice [{start_offset}, {end_offset}) holds {end_offset - start_offset} elements, "
                f"not {num_embeddings} x {embedding_dim}"
            )
        view = data.detach()[start_offset:end_offset].view(num_embeddings, embedding_dim)
        obj = torch.Tensor._make_subclass(cls, view, data.requires_grad)
        obj._original_tensor = data
        obj._start_offset = start_offset
        obj._end_offset = end_offset
        obj._num_embeddings = num_embeddings
        obj._embedding_dim = embedding_dim
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Everything happens in __new__; nn.Parameter has no __init__ work to do.
        pass

    @property
    def original_tensor(self) -> Tensor:
        """The flat buffer this slice aliases."""
        return self._original_tensor

    @property
    def start_offset(self) -> int:
        return self._start_offset

    @property
    def end_offset(self) -> int:
        return self._end_offset

    @property
    def grad(self) -> Tensor | None:
        """The table's region of the buffer's gradient (``None`` when it has none)."""
        full = self._original_tensor.grad
        if full is None:
            return None
        return full[self._start_offset : self._end_offset].view(
            self._num_embeddings, self._embedding_dim
        )

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        original = self._original_tensor
        if value is None:
            # Clearing one table's gradient clears the buffer's; optimizers clear all tables.
            original.grad = None
            return
        if original.grad is None:
            original.grad = torch.zeros_like(original)
        with torch.no_grad():
            original.grad[self._start_offset : self._end_offset].copy_(value.reshape(-1))

    @property
    def grad_fn(self) -> None:  # type: ignore[override]
        return None

    @property
    def is_leaf(self) -> bool:  # type: ignore[override]
        return True

    def __deepcopy__(self, memo: dict[int, Any]) -> TableBatchedEmbeddingSlice:
        if id(self) in memo:
            return memo[id(self)]
        result = TableBatchedEmbeddingSlice(
            copy.deepcopy(self._original_tensor, memo),
            self._start_offset,
            self._end_offset,
            self._num_embeddings,
            self._embedding_dim,
        )
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickles as the plain parameter it looks like (a copy of the table's rows).
        return (nn.Parameter, (self.detach().clone(), self.requires_grad))


class TableWeight(nn.Module):
    """Holds one table's weight as ``weight`` (so state dict keys read ``{table}.weight``)."""

    weight: nn.Parameter

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def extra_repr(self) -> str:
        return f"rows={self.weight.shape[0]}, dim={self.weight.shape[1]}"

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        _check_applied(self.weight, "save")
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        _check_applied(self.weight, "load")
        super()._load_from_state_dict(state_dict, prefix, *args)


def _check_applied(weight: Tensor, what: str) -> None:
    """Raise if a fused kernel still holds accumulated gradients for ``weight``'s table."""
    accumulation = getattr(weight, "_grad_accumulation", None)  # see embshard_kernels.accumulate
    if accumulation is not None:
        accumulation.check_applied(what)


def table_slices(
    buffer: Tensor, offsets: list[int], shapes: list[tuple[int, int]]
) -> list[TableBatchedEmbeddingSlice]:
    """One slice per table of ``buffer``: table ``t`` starts at ``offsets[t]``, has ``shapes[t]``."""
    return [
        TableBatchedEmbeddingSlice(buffer, start, start + rows * dim, rows, dim)
        for start, (rows, dim) in zip(offsets, shapes, strict=True)
    ]
