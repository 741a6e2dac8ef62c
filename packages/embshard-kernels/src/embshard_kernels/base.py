"""What every batched embedding kernel shares: its tables, their weights, init, flush and purge.

A kernel serves one ``GroupedEmbeddingConfig`` with one table-batched module, held outside the
module tree; its children are one ``TableWeight`` per table, so state dicts speak
``{table}.weight`` and touch the live weights. ``split_embedding_weights()`` returns views.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_kernels.inputs import FeatureLayout
from embshard_kernels.slices import TableWeight


class BaseBatchedEmbedding(nn.Module):
    """Common half of the batched kernels (see the module docstring)."""

    _emb_module: Any

    def __init__(self, config: GroupedEmbeddingConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self._config = config
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._layout = FeatureLayout(config)
        # Off only when every batch reaching the kernel was already checked upstream (a sharded
        # collection checks the caller's batch at its boundary and routes it with its own code).
        self.check_inputs = True
        self.register_load_state_dict_post_hook(_purge_after_load)

    # -- construction helpers for subclasses ----------------------------------------------

    def _set_emb_module(self, module: Any) -> None:
        # Kept out of self._modules: its buffers must not appear in this module's state dict.
        object.__setattr__(self, "_emb_module", module)

    def _attach_tables(self, weights: list[nn.Parameter]) -> None:
        for table, weight in zip(self._config.embedding_tables, weights, strict=True):
            if hasattr(self, table.name) and table.name not in self._modules:
                raise ValueError(
                    f"table {table.name!r} clashes with an attribute of {type(self).__name__}; "
                    "rename the table"
                )
            self.add_module(table.name, TableWeight(weight))

    # -- the shared API -------------------------------------------------------------------

    @property
    def config(self) -> GroupedEmbeddingConfig:
        """The tables this kernel serves."""
        return self._config

    @property
    def emb_module(self) -> Any:
        """The table-batched module doing the lookups (FBGEMM's, or embshard's torch one)."""
        return self._emb_module

    @property
    def device(self) -> torch.device:
        return self._device

    def table_weight(self, name: str) -> TableWeight:
        """The module holding table ``name``'s weight."""
        module = self._modules.get(name)
        if not isinstance(module, TableWeight):
            raise KeyError(
                f"no table {name!r} in this kernel; its tables are {self._config.table_names()}"
            )
        return module

    def split_embedding_weights(self) -> list[Tensor]:
        """Per table, its ``[local_rows, local_cols]`` weight (live views)."""
        return [self.table_weight(t.name).weight for t in self._config.embedding_tables]

    def named_split_embedding_weights(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """``("{prefix}{table}.weight", weight)`` per table."""
        for table, weight in zip(
            self._config.embedding_tables, self.split_embedding_weights(), strict=True
        ):
            yield f"{prefix}{table.name}.weight", weight

    def named_parameters_by_table(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(table, weight)`` per table: ``TableBatchedEmbeddingSlice`` views of the buffer."""
        for table in self._config.embedding_tables:
            yield table.name, self.table_weight(table.name).weight

    def init_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw every table's weights uniformly from its init range (config order), from
        ``generator`` (default: torch's global one)."""
        with torch.no_grad():
            for table, weight in zip(
                self._config.embedding_tables, self.split_embedding_weights(), strict=True
            ):
                weight.uniform_(table.weight_init_min, table.weight_init_max, generator=generator)

    def flush(self) -> None:
        """Write cached rows back to the backing storage (no-op without a cache)."""
        flush = getattr(self._emb_module, "flush", None)
        if flush is not None:
            flush()

    def purge(self) -> None:
        """Drop cached rows, e.g. after ``load_state_dict`` wrote the backing storage."""
        reset = getattr(self._emb_module, "reset_cache_states", None)
        if reset is not None:
            reset()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Like ``nn.Module.state_dict``, after flushing any cache."""
        self.flush()
        return super().state_dict(*args, **kwargs)


def _purge_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """Loaded weights went to the backing storage: drop any stale cached rows."""
    assert isinstance(module, BaseBatchedEmbedding)
    module.purge()
