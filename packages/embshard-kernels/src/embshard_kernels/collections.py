"""The unsharded user modules: EmbeddingBagCollection (pooled) and EmbeddingCollection (sequence).

With an optimizer spec they run the fused kernels (``fused_optimizer`` exposes the state), without
one the dense kernels. State dict keys are ``embedding_bags.{table}.weight`` /
``embeddings.{table}.weight``, live views of the kernels' weights. Built on ``meta``, then
``to_empty`` + ``reset_parameters()``, a collection equals one built directly with the same seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from embshard_kernels.fbgemm_mapping import data_type_to_dtype
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouped_kernels import GroupedKernels
from embshard_kernels.grouping import ShardedTableConfig
from embshard_kernels.slices import TableBatchedEmbeddingSlice, TableWeight
from embshard_kernels.tbe import Backend
from embshard_optim.combined import CombinedOptimizer
from embshard_optim.fused import EmptyFusedOptimizer
from embshard_optim.keyed import KeyedOptimizer
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor
from embshard_types.vocab import ComputeKernel


def _table_configs(
    what: str,
    tables: Sequence[BaseEmbeddingConfig],
    config_type: type,
    *,
    is_weighted: bool,
    optimizer: OptimizerSpec | None,
    compute_kernel: ComputeKernel | str | None,
    fused_params: FusedParams | None,
) -> list[ShardedTableConfig]:
    tables = list(tables)
    if not tables:
        raise ValueError(f"{what} needs at least one table config")
    for t in tables:
        if not isinstance(t, config_type):
            raise TypeError(
                f"{what} takes {config_type.__name__}s, got {type(t).__name__} for {t!r}"
            )
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: table names repeat: {names}")
    owner: dict[str, str] = {}
    for t in tables:
        for f in t.feature_names:
            if f in owner:
                raise ValueError(
                    f"{what}: feature {f!r} is read by tables {owner[f]!r} and {t.name!r}; "
                    "give each table its own feature names"
                )
            owner[f] = t.name
    if fused_params is not None and optimizer is not None:
        fused_params = replace(fused_params, optimizer=optimizer)
    elif optimizer is not None:
        fused_params = FusedParams(optimizer=optimizer)
    if compute_kernel is None:
        kernel = ComputeKernel.FUSED if fused_params is not None else ComputeKernel.DENSE
    else:
        kernel = ComputeKernel.parse(compute_kernel, what=what)
    return [
        ShardedTableConfig.from_config(
            t, compute_kernel=kernel, is_weighted=is_weighted, fused_params=fused_params
        )
        for t in tables
    ]


class _KernelCollection(nn.Module):
    """Tables held by grouped kernels, exposed as ``{_ATTR}.{table}.weight``."""

    _ATTR: ClassVar[str]
    _INIT_PER_TABLE: ClassVar[bool]

    def __init__(
        self,
        tables: list[ShardedTableConfig],
        configs: Sequence[BaseEmbeddingConfig],
        device: torch.device | str | None,
        backend: Backend,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self._tables = tables
        self._configs = list(configs)
        self._grouped = GroupedKernels(tables, backend=backend)
        self._fused_optim: KeyedOptimizer | None = None
        if dev.type == "meta":
            holders: dict[str, Any] = {
                t.name: TableWeight(
                    nn.Parameter(
                        torch.empty(
                            t.rows, t.cols, dtype=data_type_to_dtype(t.data_type), device=dev
                        )
                    )
                )
                for t in tables
            }
        else:
            holders = self._grouped.build(dev)
        setattr(self, self._ATTR, nn.ModuleDict(holders))
        if dev.type != "meta":
            self.reset_parameters()
        self.register_load_state_dict_post_hook(_purge_after_load)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Like ``nn.Module.state_dict``, after the kernels flushed any cached rows."""
        for kernel in self._grouped.kernels:
            kernel.flush()
        return super().state_dict(*args, **kwargs)

    def _weights(self) -> dict[str, nn.Parameter]:
        """Table name -> its weight parameter (as held under ``{_ATTR}.{table}.weight``)."""
        holders: nn.ModuleDict = getattr(self, self._ATTR)
        return {name: cast(TableWeight, h).weight for name, h in holders.items()}

    @property
    def device(self) -> torch.device:
        return next(iter(self._weights().values())).device

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw every table as TorchRec's modules do at construction: the normal init of
        ``nn.EmbeddingBag`` / ``nn.Embedding``, then the config's ``init_fn(weight)`` when it has
        one, else uniform in ``[weight_init_min, weight_init_max]`` (bags: every normal fill
        first, then the configs in order; sequence tables: table by table). The same seed gives
        the same tables as TorchRec's collection, and a meta collection materialised with this
        equals one built directly (TorchRec's own ``reset_parameters`` skips the normal fill)."""
        weights = self._weights()
        with torch.no_grad():
            if self._INIT_PER_TABLE:
                for config in self._configs:
                    weights[config.name].normal_(generator=generator)
                    config.initialize(weights[config.name], generator=generator)
                return
            for config in self._configs:
                weights[config.name].normal_(generator=generator)
            for config in self._configs:
                config.initialize(weights[config.name], generator=generator)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The optimizers fused into the kernels (empty for dense tables)."""
        if self._fused_optim is None:
            fused = [
                (self._ATTR, k.fused_optimizer)
                for k in self._live_kernels()
                if hasattr(k, "fused_optimizer")
            ]
            self._fused_optim = CombinedOptimizer(fused) if fused else EmptyFusedOptimizer()
        return self._fused_optim

    def kernels(self) -> list[nn.Module]:
        """The batched kernels (one per table group)."""
        return list(self._live_kernels())

    def _live_kernels(self) -> list[Any]:
        if not self._grouped.kernels:
            raise RuntimeError(
                f"{type(self).__name__} is on the meta device; materialise it with "
                "to_empty(device=...) and reset_parameters() (or shard it) before running it"
            )
        return self._grouped.kernels

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _KernelCollection:
        super()._apply(fn, recurse)
        self._rebind()
        return self

    def _rebind(self) -> None:
        """After a device / dtype move, put the weights back into kernels on the new device."""
        weights = self._weights()
        device = self.device
        if device.type == "meta":
            self._grouped.drop()
            self._fused_optim = None
            return
        if (
            self._grouped.kernels
            and self._grouped.device == device
            and all(_is_live(w) for w in weights.values())
        ):
            return
        values = {name: w.detach() for name, w in weights.items()}
        setattr(self, self._ATTR, nn.ModuleDict(self._grouped.build(device, values)))
        self._fused_optim = None


def _purge_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """Loaded weights went to the kernels' backing storage: drop stale cached rows."""
    assert isinstance(module, _KernelCollection)
    for kernel in module._grouped.kernels:
        kernel.purge()


def _is_live(weight: Tensor) -> bool:
    if not isinstance(weight, TableBatchedEmbeddingSlice):
        return False
    base = weight.original_tensor
    expected = base.data_ptr() + weight.start_offset * base.element_size()
    return weight.data_ptr() == expected and weight.device == base.device


class EmbeddingBagCollection(_KernelCollection):
    """Pooled embedding tables: each feature's bags become one row per sample.

    Args:
        is_weighted: input features carry per-id weights (SUM pooling only).
        device: where the tables live (``"meta"``: shapes only, materialise later).
        optimizer: fused into the backward; without one the tables are dense parameters.
        compute_kernel: override the kernel (``fused``, ``dense``; ``key_value`` on CUDA).
        backend: fused kernels: ``"auto"``, ``"fbgemm"`` or ``"torch"``.

    Raises:
        ValueError / TypeError: bad configs (named), or a kernel the device cannot run.
    """

    _ATTR = "embedding_bags"
    _INIT_PER_TABLE = False

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        optimizer: OptimizerSpec | None = None,
        compute_kernel: ComputeKernel | str | None = None,
        fused_params: FusedParams | None = None,
        backend: Backend = "auto",
    ) -> None:
        configs = _table_configs(
            "EmbeddingBagCollection",
            tables,
            EmbeddingBagConfig,
            is_weighted=is_weighted,
            optimizer=optimizer,
            compute_kernel=compute_kernel,
            fused_params=fused_params,
        )
        super().__init__(configs, tables, device, backend)
        self._is_weighted = is_weighted
        self._keys = [f for t in configs for f in t.feature_names]
        dims = {f: t.cols for t in configs for f in t.feature_names}
        self._dims = [dims[f] for f in self._keys]
        kernel_order = self._grouped.feature_order()
        self._reorder: list[tuple[int, int]] | None = None
        if kernel_order != self._keys:
            starts, at = {}, 0
            for f in kernel_order:
                starts[f] = at
                at += dims[f]
            self._reorder = [(starts[f], dims[f]) for f in self._keys]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return cast(list[EmbeddingBagConfig], list(self._configs))

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature's bags: a KeyedTensor ``[batch, sum of dims]``, config order.

        Raises:
            ValueError / TypeError / IndexError: a missing feature, float ids, an id out of
                range, missing weights, or batch sizes that vary per feature (named).
        """
        _check_input(features, "EmbeddingBagCollection")
        kernels = self._live_kernels()
        if features.variable_stride_per_key():
            raise ValueError(
                "EmbeddingBagCollection returns one row per sample for every feature, so all "
                f"features need one batch size; got {features.stride_per_key()} for "
                f"{features.keys()}. Use a kernel (BatchedFusedEmbeddingBag) for FBGEMM's "
                "flat variable-batch output"
            )
        parts = self._grouped.route(features)
        outputs = [k(p) for k, p in zip(kernels, parts, strict=True)]
        values = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self._reorder is not None:
            values = torch.cat([values.narrow(1, s, n) for s, n in self._reorder], dim=1)
        return KeyedTensor(self._keys, self._dims, values)


class EmbeddingCollection(_KernelCollection):
    """Sequence embedding tables: one row per id.

    Args: as :class:`EmbeddingBagCollection` (no ``is_weighted``), with ``EmbeddingConfig``s.
    """

    _ATTR = "embeddings"
    _INIT_PER_TABLE = True

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        *,
        optimizer: OptimizerSpec | None = None,
        compute_kernel: ComputeKernel | str | None = None,
        fused_params: FusedParams | None = None,
        backend: Backend = "auto",
    ) -> None:
        configs = _table_configs(
            "EmbeddingCollection",
            tables,
            EmbeddingConfig,
            is_weighted=False,
            optimizer=optimizer,
            compute_kernel=compute_kernel,
            fused_params=fused_params,
        )
        super().__init__(configs, tables, device, backend)
        self._keys = [f for t in configs for f in t.feature_names]

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return cast(list[EmbeddingConfig], list(self._configs))

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Per feature (config order), a JaggedTensor of its ids' rows with the input's lengths.

        Raises:
            ValueError / TypeError / IndexError: a missing feature, float ids or an id out of
                range (named).
        """
        _check_input(features, "EmbeddingCollection")
        kernels = self._live_kernels()
        out: dict[str, JaggedTensor] = {}
        for kernel, part in zip(kernels, self._grouped.route(features), strict=True):
            rows = kernel(part)
            offsets, bounds, lengths = (
                part.offset_per_key(),
                part.lengths_offset_per_key(),
                part.lengths(),
            )
            for i, feature in enumerate(part.keys()):
                out[feature] = JaggedTensor(
                    rows[offsets[i] : offsets[i + 1]], lengths=lengths[bounds[i] : bounds[i + 1]]
                )
        return {f: out[f] for f in self._keys}


def _check_input(features: object, module: str) -> None:
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(
            f"{module} takes a KeyedJaggedTensor, got {type(features).__name__}; build one "
            "with KeyedJaggedTensor.from_lengths_sync(keys=..., values=..., lengths=...)"
        )
