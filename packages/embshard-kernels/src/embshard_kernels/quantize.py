"""Quantize a trained model's embedding collections for inference (TorchRec's ``quantize_embeddings``).

:func:`quantize_embeddings` replaces every unsharded :class:`EmbeddingBagCollection` /
:class:`EmbeddingCollection` in a model by :class:`QuantEmbeddingBagCollection` /
:class:`QuantEmbeddingCollection`: the same tables, features and outputs, each table group on
FBGEMM's IntNBit kernel (``quant.py``) with row-wise fp16 scale and bias as FBGEMM stores them.
Each dequantized element is within half a quantization step of the float weight it came from.
The float tables are released once quantized; nothing is trained afterwards. A collection on
``meta`` gives empty quantized tables (no float copy is ever made), to fill from a quantized
export (``embshard_dist.checkpoint.export.load_quantized_export``) for serving.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_kernels.grouped_kernels import GroupedKernels
from embshard_kernels.quant import (
    QUANT_TYPES,
    QuantBatchedEmbedding,
    QuantBatchedEmbeddingBag,
    QuantTableWeight,
    quant_config,
)
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor
from embshard_types.vocab import DataType

__all__ = ["QuantEmbeddingBagCollection", "QuantEmbeddingCollection", "quantize_embeddings"]


def _quant_type(dtype: DataType | str | torch.dtype) -> DataType:
    if isinstance(dtype, torch.dtype):
        by_torch = {torch.int8: DataType.INT8, torch.float16: DataType.FP16}
        if dtype not in by_torch:
            raise ValueError(
                f"quantize_embeddings: torch dtype {dtype} has no quantized table type; use "
                "torch.int8, torch.float16 or one of 'int8', 'int4', 'int2', 'fp16'"
            )
        return by_torch[dtype]
    data_type = DataType.parse(dtype, what="quantize_embeddings dtype")
    if data_type not in QUANT_TYPES:
        raise ValueError(
            f"quantize_embeddings: {data_type.value!r} is not a quantized table type; use one "
            f"of {[d.value for d in QUANT_TYPES]}"
        )
    return data_type


class QuantEmbeddingBagCollection(nn.Module):
    """Pooled quantized inference tables, built from a trained :class:`EmbeddingBagCollection`.

    Takes the same ``KeyedJaggedTensor`` and returns the same ``KeyedTensor`` layout (keys in
    config order) as the float collection. Kernels are in ``kernels`` (one per table group).
    """

    def __init__(self, ebc: EmbeddingBagCollection, data_type: DataType | str) -> None:
        super().__init__()
        dt = _quant_type(data_type)
        self.data_type = dt
        self._routing = GroupedKernels(ebc._tables, backend=ebc._grouped.backend)
        self.kernels = nn.ModuleList(
            _quant_kernels_of(ebc, self._routing, dt, QuantBatchedEmbeddingBag)
        )
        self._configs = [replace(c, data_type=dt) for c in ebc.embedding_bag_configs()]
        self._is_weighted = ebc.is_weighted()
        self._keys = list(ebc._keys)
        self._dims = list(ebc._dims)
        self._reorder = ebc._reorder

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The float collection's table configs, with the quantized data type."""
        return list(self._configs)

    def packed_tables(self) -> dict[str, QuantTableWeight]:
        """Per table, its packed rows and their fp16 scale and bias (live buffers)."""
        return _packed_tables(self.kernels)

    def load_packed(self, table: str, packed: Tensor, scale_shift: Tensor | None) -> None:
        """Copy rows quantized offline (``quant.quantize_rows``) into ``table``."""
        _load_packed(self.kernels, table, packed, scale_shift)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def quantization_error(self) -> dict[str, float]:
        """Per table, the largest absolute error of its dequantized weights."""
        return {
            name: e
            for k in _quant_kernels(self.kernels)
            for name, e in k.quantization_error.items()
        }

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature's bags: a KeyedTensor ``[batch, sum of dims]``, config order."""
        _check_input(features, type(self).__name__)
        parts = self._routing.route(features)
        outputs = [k(p) for k, p in zip(self.kernels, parts, strict=True)]
        values = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self._reorder is not None:
            values = torch.cat([values.narrow(1, s, n) for s, n in self._reorder], dim=1)
        return KeyedTensor(self._keys, self._dims, values)


class QuantEmbeddingCollection(nn.Module):
    """Sequence quantized inference tables, built from a trained :class:`EmbeddingCollection`.

    Returns, per feature (config order), a JaggedTensor of its ids' rows with the input's lengths.
    """

    def __init__(self, ec: EmbeddingCollection, data_type: DataType | str) -> None:
        super().__init__()
        dt = _quant_type(data_type)
        self.data_type = dt
        self._routing = GroupedKernels(ec._tables, backend=ec._grouped.backend)
        self.kernels = nn.ModuleList(
            _quant_kernels_of(ec, self._routing, dt, QuantBatchedEmbedding)
        )
        self._configs = [replace(c, data_type=dt) for c in ec.embedding_configs()]
        self._keys = list(ec._keys)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The float collection's table configs, with the quantized data type."""
        return list(self._configs)

    def packed_tables(self) -> dict[str, QuantTableWeight]:
        """Per table, its packed rows and their fp16 scale and bias (live buffers)."""
        return _packed_tables(self.kernels)

    def load_packed(self, table: str, packed: Tensor, scale_shift: Tensor | None) -> None:
        """Copy rows quantized offline (``quant.quantize_rows``) into ``table``."""
        _load_packed(self.kernels, table, packed, scale_shift)

    def quantization_error(self) -> dict[str, float]:
        """Per table, the largest absolute error of its dequantized weights."""
        return {
            name: e
            for k in _quant_kernels(self.kernels)
            for name, e in k.quantization_error.items()
        }

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Per feature, a JaggedTensor ``[ids, dim]`` of its ids' dequantized rows."""
        _check_input(features, type(self).__name__)
        out: dict[str, JaggedTensor] = {}
        for kernel, part in zip(self.kernels, self._routing.route(features), strict=True):
            rows: Tensor = kernel(part)
            offsets, bounds = part.offset_per_key(), part.lengths_offset_per_key()
            lengths = part.lengths()
            for i, feature in enumerate(part.keys()):
                out[feature] = JaggedTensor(
                    rows[offsets[i] : offsets[i + 1]], lengths=lengths[bounds[i] : bounds[i + 1]]
                )
        return {f: out[f] for f in self._keys}


def quantize_embeddings(
    module: nn.Module,
    dtype: DataType | str | torch.dtype = DataType.INT8,
    inplace: bool = True,
) -> nn.Module:
    """Replace every unsharded embedding collection in ``module`` by its quantized form.

    Args:
        module: a model, or a collection itself (then the quantized collection is returned).
        dtype: ``int8``, ``int4``, ``int2``, ``fp16`` (or ``fp32``; ``torch.int8`` and
            ``torch.float16`` also accepted).
        inplace: swap the children of ``module``; ``False`` works on a deep copy.

    Returns:
        The model with quantized collections (``module`` itself when ``inplace``).

    Raises:
        ValueError: an unknown ``dtype``, or a table whose width the type cannot pack (named).
    """
    data_type = _quant_type(dtype)
    if not inplace:
        import copy

        module = copy.deepcopy(module)
    if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
        return _quantized(module, data_type)
    for name, child in list(module.named_children()):
        if isinstance(child, (EmbeddingBagCollection, EmbeddingCollection)):
            setattr(module, name, _quantized(child, data_type))
        else:
            quantize_embeddings(child, data_type, inplace=True)
    return module


def _quantized(
    collection: EmbeddingBagCollection | EmbeddingCollection, data_type: DataType
) -> nn.Module:
    if isinstance(collection, EmbeddingBagCollection):
        return QuantEmbeddingBagCollection(collection, data_type)
    return QuantEmbeddingCollection(collection, data_type)


def _quant_kernels_of(
    collection: EmbeddingBagCollection | EmbeddingCollection,
    routing: GroupedKernels,
    data_type: DataType,
    kind: type[QuantBatchedEmbeddingBag] | type[QuantBatchedEmbedding],
) -> list[QuantBatchedEmbeddingBag | QuantBatchedEmbedding]:
    """The quantized kernels of ``collection``'s groups: quantized from its trained weights,
    or, for a collection on ``meta``, empty on the CPU (fill them with ``load_packed``)."""
    if collection.device.type == "meta":
        cpu = torch.device("cpu")
        return [kind(quant_config(g, data_type), cpu) for g in routing.groups]
    return [kind.from_float(k, data_type) for k in collection._live_kernels()]


def _quant_kernels(
    kernels: nn.ModuleList,
) -> list[QuantBatchedEmbeddingBag | QuantBatchedEmbedding]:
    return [k for k in kernels if isinstance(k, (QuantBatchedEmbeddingBag, QuantBatchedEmbedding))]


def _check_input(features: object, module: str) -> None:
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(
            f"{module} takes a KeyedJaggedTensor, got {type(features).__name__}; build one "
            "with KeyedJaggedTensor.from_lengths_sync(keys=..., values=..., lengths=...)"
        )


def _packed_tables(kernels: nn.ModuleList) -> dict[str, QuantTableWeight]:
    return {
        t.name: k.table_weight(t.name)
        for k in _quant_kernels(kernels)
        for t in k.config.embedding_tables
    }


def _load_packed(
    kernels: nn.ModuleList, table: str, packed: Tensor, scale_shift: Tensor | None
) -> None:
    for kernel in _quant_kernels(kernels):
        if table in kernel.config.table_names():
            kernel.load_packed(table, packed, scale_shift)
            return
    names = [n for k in _quant_kernels(kernels) for n in k.config.table_names()]
    raise KeyError(f"no table {table!r}; the tables are {names}")
