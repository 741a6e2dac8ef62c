"""The tables a planner places: found in a model, or given as a list of table configs.

Guarantees: the order of the tables is deterministic (module order, then config order); two
tables with the same ``(path, name)`` raise ``ValueError``; :func:`qualified_name` is how every
planner message names a table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from embshard_types.configs import BaseEmbeddingConfig
from embshard_types.vocab import DataType, PoolingType

__all__ = [
    "PlannerTable",
    "TableSource",
    "dense_parameter_bytes",
    "find_collections",
    "find_tables",
    "qualified_name",
]


def qualified_name(path: str, name: str) -> str:
    """``"path.name"``, or ``name`` for a table of the root module."""
    return f"{path}.{name}" if path else name


@dataclass(frozen=True)
class PlannerTable:
    """One table to place.

    Args:
        path: the path of the module holding it (``""``: the root).
        features: the features that read it (default: the table's name).
        pooling: how bags are pooled (``none``: a sequence table, one output row per id).
    """

    name: str
    rows: int
    dim: int
    path: str = ""
    features: tuple[str, ...] = ()
    data_type: DataType = DataType.FP32
    pooling: PoolingType = PoolingType.SUM
    is_weighted: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty string, got {self.name!r}")
        where = f"table {qualified_name(self.path, self.name)!r}"
        if not isinstance(self.path, str):
            raise ValueError(f"{where}: path must be a string, got {self.path!r}")
        for attr in ("rows", "dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {attr} must be a positive int, got {value!r}")
        if isinstance(self.features, str):
            raise TypeError(f"{where}: features must be a sequence of names, got a string")
        features = tuple(self.features) or (self.name,)
        if any(not isinstance(f, str) or not f for f in features):
            raise ValueError(f"{where}: feature names must be non-empty strings: {features}")
        object.__setattr__(self, "features", features)
        object.__setattr__(self, "data_type", DataType.parse(self.data_type, what=where))
        object.__setattr__(self, "pooling", PoolingType.parse(self.pooling, what=where))
        if not isinstance(self.is_weighted, bool):
            raise ValueError(f"{where}: is_weighted must be a bool, got {self.is_weighted!r}")

    @property
    def key(self) -> str:
        """The qualified name (``"path.name"``) used in messages and constraint look-ups."""
        return qualified_name(self.path, self.name)

    @property
    def sequence(self) -> bool:
        """Whether every id is an output row (a sequence table, pooling ``none``)."""
        return self.pooling is PoolingType.NONE

    @property
    def element_bytes(self) -> float:
        """Bytes per stored weight element (``0.5`` for INT4)."""
        return self.data_type.bits / 8

    @classmethod
    def from_config(
        cls, config: BaseEmbeddingConfig, path: str = "", *, is_weighted: bool = False
    ) -> PlannerTable:
        """The planner's view of an ``EmbeddingBagConfig`` (or ``EmbeddingConfig``)."""
        return cls(
            name=config.name,
            rows=config.num_embeddings,
            dim=config.embedding_dim,
            path=path,
            features=tuple(config.feature_names),
            data_type=config.data_type,
            pooling=_pooling_of(config),
            is_weighted=is_weighted,
        )


def _pooling_of(config: BaseEmbeddingConfig) -> PoolingType:
    return PoolingType.parse(getattr(config, "pooling", PoolingType.SUM))


TableSource = nn.Module | Sequence[PlannerTable | BaseEmbeddingConfig | tuple[str, Any]]
"""A model, or a list of ``PlannerTable`` / table configs / ``(module path, config)`` pairs."""


def _collection_types() -> tuple[type[nn.Module], ...]:
    from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
    from embshard_kernels.quantize import QuantEmbeddingBagCollection, QuantEmbeddingCollection

    return (
        EmbeddingBagCollection,
        EmbeddingCollection,
        QuantEmbeddingBagCollection,
        QuantEmbeddingCollection,
    )


def _configs(module: nn.Module) -> Iterable[BaseEmbeddingConfig]:
    getter = getattr(module, "embedding_bag_configs", None) or module.embedding_configs
    return getter()  # type: ignore[operator]


def _is_weighted(module: nn.Module) -> bool:
    flag = getattr(module, "is_weighted", False)
    return bool(flag() if callable(flag) else flag)


def find_collections(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> every embedding collection of ``model`` (not nested in another one)."""
    kinds = _collection_types()
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if any(p == "" or path.startswith(p + ".") for p in found):
            continue
        if isinstance(module, kinds):
            found[path] = module
    return found


def find_tables(source: TableSource) -> list[PlannerTable]:
    """The tables of a model or of a list of configs.

    Args:
        source: a model, or a list of ``PlannerTable``, table configs (module path ``""``) or
            ``(path, config)`` pairs.

    Raises:
        ValueError: no tables, or two tables with the same qualified name.
        TypeError: an entry of the list is none of the accepted kinds.
    """
    tables: list[PlannerTable] = []
    if isinstance(source, nn.Module):
        for path, module in find_collections(source).items():
            weighted = _is_weighted(module)
            tables.extend(
                PlannerTable.from_config(c, path, is_weighted=weighted) for c in _configs(module)
            )
        if not tables:
            raise ValueError(
                f"found no embedding collection in {type(source).__name__}; the planner "
                "places the tables of embshard_kernels.collections.EmbeddingBagCollection and "
                "EmbeddingCollection modules (or pass a list of table configs)"
            )
    else:
        for i, entry in enumerate(source):
            tables.append(_as_table(entry, i))
    seen: set[str] = set()
    for t in tables:
        if t.key in seen:
            raise ValueError(
                f"table {t.key!r} is given twice; table names must be unique within a module"
            )
        seen.add(t.key)
    return tables


def _as_table(entry: Any, index: int) -> PlannerTable:
    if isinstance(entry, PlannerTable):
        return entry
    if isinstance(entry, BaseEmbeddingConfig):
        return PlannerTable.from_config(entry)
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
        path, config = entry
        if isinstance(config, BaseEmbeddingConfig):
            return PlannerTable.from_config(config, path)
    raise TypeError(
        f"table entry {index} is {entry!r}; give a PlannerTable, an EmbeddingBagConfig or a "
        "(module path, EmbeddingBagConfig) pair"
    )


def dense_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters outside the embedding collections, held by every rank."""
    inside = {id(p) for m in find_collections(model).values() for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
