"""Table configs as a kernel sees them, and the grouping of tables into one TBE each.

Configs are frozen and validated (errors name the table). :func:`group_tables` groups tables
exactly when one TBE can serve them all, keeps their order, and never puts two shards of one
table in one group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from embshard_kernels.fused_params import FusedParams
from embshard_types.configs import BaseEmbeddingConfig
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, DataType, PoolingType


@dataclass(frozen=True, kw_only=True)
class ShardedTableConfig:
    """One table, or one shard of a table, as a batched kernel holds it.

    Args:
        num_embeddings, embedding_dim: the whole table's rows and columns.
        feature_names: the input features that read this table, in output order.
        init_range: uniform init bounds; ``None`` means ``±sqrt(1/num_embeddings)``.
        compute_kernel: ``DEFAULT`` means ``FUSED``.
        is_weighted: the features carry per-id weights (pooled ``SUM`` tables only).
        local_rows, local_cols: the part held here (default: all).
        local_metadata: the shard held here (default: the whole table on rank 0).
        global_metadata: every shard of the table (default: just ``local_metadata``).

    Raises:
        ValueError: an invalid size or enum, local sizes that exceed the table or disagree with
            the metadata, or per-id weights with ``MEAN`` / ``NONE`` pooling.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = ()
    data_type: DataType = DataType.FP32
    pooling: PoolingType = PoolingType.SUM
    init_range: tuple[float, float] | None = None
    compute_kernel: ComputeKernel = ComputeKernel.FUSED
    is_weighted: bool = False
    local_rows: int | None = None
    local_cols: int | None = None
    local_metadata: ShardSpec | None = None
    global_metadata: tuple[ShardSpec, ...] = field(default=())
    fused_params: FusedParams | None = None

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty string, got {self.name!r}")
        if "." in self.name:
            raise ValueError(
                f"{where}: a table name may not contain '.' (it is a module name in state dict "
                "keys such as 'embedding_bags.{name}.weight'); rename the table"
            )
        for attr in ("num_embeddings", "embedding_dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{where}: {attr} must be a positive int, got {value!r}")
        features = tuple(self.feature_names) or (self.name,)
        if len(set(features)) != len(features):
            raise ValueError(f"{where}: feature names repeat: {list(features)}")
        object.__setattr__(self, "feature_names", features)
        object.__setattr__(self, "data_type", DataType.parse(self.data_type, what=where))
        pooling = PoolingType.parse(self.pooling, what=where)
        object.__setattr__(self, "pooling", pooling)
        object.__setattr__(
            self, "compute_kernel", ComputeKernel.parse(self.compute_kernel, what=where)
        )
        if self.init_range is None:
            bound = (1.0 / self.num_embeddings) ** 0.5
            object.__setattr__(self, "init_range", (-bound, bound))
        if self.is_weighted and pooling is not PoolingType.SUM:
            raise ValueError(
                f"{where}: per-id weights need SUM pooling, got {pooling.value!r} "
                "(torch.nn.functional.embedding_bag defines per-sample weights only for 'sum', and "
                "FBGEMM's CPU backward of weighted MEAN disagrees with its forward); use SUM"
            )
        rows = self.num_embeddings if self.local_rows is None else self.local_rows
        cols = self.embedding_dim if self.local_cols is None else self.local_cols
        if not 0 <= rows <= self.num_embeddings or not 0 < cols <= self.embedding_dim:
            raise ValueError(
                f"{where}: local shard [{rows}, {cols}] does not fit the table "
                f"[{self.num_embeddings}, {self.embedding_dim}]"
            )
        object.__setattr__(self, "local_rows", rows)
        object.__setattr__(self, "local_cols", cols)
        local = self.local_metadata or ShardSpec((0, 0), (rows, cols), "rank:0/cpu")
        if tuple(local.sizes) != (rows, cols):
            raise ValueError(
                f"{where}: local_metadata sizes {local.sizes} disagree with local_rows/local_cols "
                f"({rows}, {cols})"
            )
        object.__setattr__(self, "local_metadata", local)
        object.__setattr__(self, "global_metadata", tuple(self.global_metadata) or (local,))

    @classmethod
    def from_config(
        cls,
        config: BaseEmbeddingConfig,
        *,
        compute_kernel: ComputeKernel = ComputeKernel.FUSED,
        is_weighted: bool = False,
        fused_params: FusedParams | None = None,
        local_metadata: ShardSpec | None = None,
        global_metadata: Sequence[ShardSpec] = (),
    ) -> ShardedTableConfig:
        """Build from an ``EmbeddingBagConfig`` / ``EmbeddingConfig``: the whole table, or the
        shard ``local_metadata`` says (of ``global_metadata``)."""
        sizes = None if local_metadata is None else local_metadata.sizes
        return cls(
            name=config.name,
            num_embeddings=config.num_embeddings,
            embedding_dim=config.embedding_dim,
            feature_names=config.feature_names,
            data_type=config.data_type,
            pooling=getattr(config, "pooling", PoolingType.SUM),
            init_range=config.init_range,
            compute_kernel=compute_kernel,
            is_weighted=is_weighted,
            local_rows=None if sizes is None else sizes[0],
            local_cols=None if sizes is None else sizes[1],
            local_metadata=local_metadata,
            global_metadata=tuple(global_metadata),
            fused_params=fused_params,
        )

    @property
    def weight_init_min(self) -> float:
        assert self.init_range is not None
        return self.init_range[0]

    @property
    def weight_init_max(self) -> float:
        assert self.init_range is not None
        return self.init_range[1]

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    @property
    def rows(self) -> int:
        """Local rows (``local_rows``, always set after construction)."""
        assert self.local_rows is not None
        return self.local_rows

    @property
    def cols(self) -> int:
        """Local columns (``local_cols``, always set after construction)."""
        assert self.local_cols is not None
        return self.local_cols


@dataclass(frozen=True)
class GroupedEmbeddingConfig:
    """Tables served by one batched kernel, which share every other field; ``embedding_tables``
    in output order.

    Raises:
        ValueError: no tables, a table disagrees with the group, a name repeats, or sequence
            tables have different widths.
    """

    data_type: DataType
    pooling: PoolingType
    is_weighted: bool
    compute_kernel: ComputeKernel
    embedding_tables: tuple[ShardedTableConfig, ...]
    fused_params: FusedParams | None = None

    def __post_init__(self) -> None:
        tables = tuple(self.embedding_tables)
        object.__setattr__(self, "embedding_tables", tables)
        if not tables:
            raise ValueError("a GroupedEmbeddingConfig needs at least one table")
        own = {name: getattr(self, name) for name in _SHARED_FIELDS}
        for table in tables:
            differ = [name for name, value in own.items() if getattr(table, name) != value]
            if table.pooling is PoolingType.NONE and table.cols != tables[0].cols:
                differ.append("width")
            if differ:
                raise ValueError(
                    f"table {table.name!r} does not fit this group: its {', '.join(differ)} "
                    f"{'differs' if len(differ) == 1 else 'differ'} from the group's (one kernel "
                    "needs one data type, pooling, weightedness, compute kernel and fused params, "
                    "and one width for sequence tables); use group_tables()"
                )
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names repeat within one group: {names}; use group_tables()")

    def feature_names(self) -> list[str]:
        """Every table's features, table by table (the kernel's output order)."""
        return [f for t in self.embedding_tables for f in t.feature_names]

    def num_features(self) -> int:
        return sum(t.num_features for t in self.embedding_tables)

    def table_names(self) -> list[str]:
        return [t.name for t in self.embedding_tables]

    def feature_table_map(self) -> list[int]:
        """For each feature, the index of its table in ``embedding_tables``."""
        return [i for i, t in enumerate(self.embedding_tables) for _ in t.feature_names]

    def embedding_dims(self) -> list[int]:
        """The local width of each feature's output."""
        return [t.cols for t in self.embedding_tables for _ in t.feature_names]

    def dim_sum(self) -> int:
        """Total width of one pooled output row."""
        return sum(self.embedding_dims())


_SHARED_FIELDS = ("data_type", "pooling", "is_weighted", "compute_kernel", "fused_params")


def _group_key(table: ShardedTableConfig) -> tuple[object, ...]:
    width = table.cols if table.pooling is PoolingType.NONE else None
    return (
        table.data_type,
        table.pooling,
        table.is_weighted,
        table.compute_kernel,
        table.fused_params,
        width,
    )


def group_tables(tables: Iterable[ShardedTableConfig]) -> list[GroupedEmbeddingConfig]:
    """Group ``tables`` (held here, in output order) so that each group runs as one TBE.

    Groups come in order of their first table, tables keep their order; a second shard of a
    table already in a group starts another group.
    """
    groups: list[tuple[tuple[object, ...], list[ShardedTableConfig]]] = []
    for table in tables:
        key = _group_key(table)
        target = next(
            (
                members
                for k, members in groups
                if k == key and all(m.name != table.name for m in members)
            ),
            None,
        )
        if target is None:
            groups.append((key, [table]))
        else:
            target.append(table)
    return [
        GroupedEmbeddingConfig(
            data_type=members[0].data_type,
            pooling=members[0].pooling,
            is_weighted=members[0].is_weighted,
            compute_kernel=members[0].compute_kernel,
            embedding_tables=tuple(members),
            fused_params=members[0].fused_params,
        )
        for _, members in groups
    ]
