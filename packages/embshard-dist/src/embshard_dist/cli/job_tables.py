"""The tables of ``embshard train``'s model, and which Criteo feature each table reads.

``--tables N`` gives tables ``t0`` .. ``t{N-1}`` of ``--rows`` x ``--dim``; the 26 categorical
Criteo features are dealt out round-robin (``t_i`` reads ``cat_j`` for ``j % N == i``), so every
feature is read by exactly one table. ``--tables SPEC`` reads the table spec ``embshard plan``
reads: each table's ``features`` must be Criteo feature names (``cat_0`` .. ``cat_25``; a table
without ``features`` reads the feature of its own name), and the spec's constraints go to the
planner. Guarantees: every table has at least one feature, no feature is read twice, all tables
share one dimension (the demo model's dot interaction), and errors name the table and feature.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embshard_dist.data.criteo_format import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES
from embshard_dist.planner.constraints import ParameterConstraints
from embshard_types.configs import EmbeddingBagConfig

__all__ = ["JobTables", "generated_tables", "planner_constraints", "tables_from_spec"]


@dataclass(frozen=True)
class JobTables:
    """The model's tables, their planner constraints and each feature's table size."""

    configs: tuple[EmbeddingBagConfig, ...]
    constraints: Mapping[str, ParameterConstraints]
    """Per table name: constraints from the spec file (none for generated tables)."""

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.configs]

    @property
    def features(self) -> list[str]:
        """The features the model reads, in the model's order."""
        return [f for c in self.configs for f in c.feature_names]

    def rows_per_feature(self) -> tuple[int, ...]:
        """Table size of each of the 26 Criteo features (1 for a feature no table reads)."""
        size = {f: c.num_embeddings for c in self.configs for f in c.feature_names}
        return tuple(size.get(name, 1) for name in DEFAULT_CAT_NAMES)


def generated_tables(count: int, rows: int, dim: int) -> JobTables:
    """``count`` tables of ``rows`` x ``dim`` sharing out the 26 Criteo features.

    Raises:
        ValueError: more tables than features.
    """
    if not 1 <= count <= CAT_FEATURE_COUNT:
        raise ValueError(
            f"--tables {count}: the Criteo data has {CAT_FEATURE_COUNT} categorical features, "
            f"so 1 to {CAT_FEATURE_COUNT} tables; use a table spec file for other layouts"
        )
    configs = tuple(
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=tuple(DEFAULT_CAT_NAMES[i::count]),
        )
        for i in range(count)
    )
    return JobTables(configs, {})


def tables_from_spec(path: str) -> JobTables:
    """The tables of the table spec file at ``path`` (the format ``embshard plan`` reads).

    Raises:
        ValueError: the file is invalid, a feature is not a Criteo feature or is read twice,
            the tables' dimensions differ, or a table is not pooled.
    """
    from embshard_dist.planner.spec import load_table_spec
    from embshard_types.vocab import PoolingType

    spec = load_table_spec(path)
    configs: list[EmbeddingBagConfig] = []
    seen: dict[str, str] = {}
    for table in spec.tables:
        where = f"--tables {path}: table {table.name!r}"
        if table.pooling == PoolingType.NONE:
            raise ValueError(f"{where} is a sequence table (pooling none); the model pools bags")
        for feature in table.features:
            if feature not in DEFAULT_CAT_NAMES:
                raise ValueError(
                    f"{where} reads feature {feature!r}, which the Criteo data lacks; name "
                    f"features cat_0 .. cat_{CAT_FEATURE_COUNT - 1}"
                )
            if feature in seen:
                raise ValueError(f"{where} reads {feature!r}, already read by {seen[feature]!r}")
            seen[feature] = table.name
        configs.append(
            EmbeddingBagConfig(
                name=table.name,
                num_embeddings=table.rows,
                embedding_dim=table.dim,
                feature_names=tuple(table.features),
            )
        )
    dims = {c.embedding_dim for c in configs}
    if len(dims) > 1:
        shown = ", ".join(f"{c.name} {c.embedding_dim}" for c in configs)
        raise ValueError(f"--tables {path}: the model needs one embedding dim; got {shown}")
    by_name = {t.key: t.name for t in spec.tables}
    constraints = {by_name[key]: c for key, c in spec.constraints.items()}
    return JobTables(tuple(configs), constraints)


def planner_constraints(
    tables: JobTables, pinned: Mapping[str, Any]
) -> dict[str, ParameterConstraints]:
    """Per table: the spec's constraints (or one id per feature per sample), with the sharding
    types ``pinned`` by ``--sharding`` (``ShardingType`` per table name) in place of the spec's."""
    from dataclasses import replace

    out: dict[str, ParameterConstraints] = {}
    for config in tables.configs:
        base = tables.constraints.get(config.name) or ParameterConstraints(
            pooling_factors=(1.0,) * len(config.feature_names)
        )
        kind = pinned.get(config.name)
        out[config.name] = base if kind is None else replace(base, sharding_types=(kind,))
    return out
