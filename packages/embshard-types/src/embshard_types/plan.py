"""Sharding plans: how each table of each module is split across ranks.

``EmbeddingModuleShardingPlan`` maps a module's tables to ``ParameterSharding``s,
``ShardingPlan`` maps module paths to module plans; ``DMPCollectionConfig`` pairs a plan with a
2-D layout. Plans are immutable, hashable, validated at construction and round-trip exactly
through dict / JSON (versioned by ``PLAN_FORMAT_VERSION``; newer versions are refused).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Self

from torch import nn

from embshard_types.kernel_params import CacheParams, KeyValueParams, check_keys, error_context
from embshard_types.parameter_sharding import ParameterSharding, ShardingBucketMetadata
from embshard_types.sharded_module import ShardedModule
from embshard_types.text_table import tabulate
from embshard_types.vocab import ObjectPoolShardingType, ShardingType

__all__ = [
    "PLAN_FORMAT_VERSION",
    "CacheParams",
    "DMPCollectionConfig",
    "EmbeddingModuleShardingPlan",
    "KeyValueParams",
    "ModuleShardingPlan",
    "ObjectPoolShardingPlan",
    "ParameterSharding",
    "ShardingBucketMetadata",
    "ShardingPlan",
    "validate_plan_for_world",
]

PLAN_FORMAT_VERSION = 1


class ModuleShardingPlan(abc.ABC):
    """The sharding plan of one module. Subclasses register a ``kind`` for serialisation."""

    kind: ClassVar[str]
    _kinds: ClassVar[dict[str, type[ModuleShardingPlan]]] = {}

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            if kind in ModuleShardingPlan._kinds:
                raise ValueError(f"module plan kind {kind!r} is already registered")
            cls.kind = kind
            ModuleShardingPlan._kinds[kind] = cls

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict whose ``"kind"`` names its class."""

    @classmethod
    @abc.abstractmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of ``to_dict``."""

    @staticmethod
    def parse(data: Mapping[str, Any]) -> ModuleShardingPlan:
        """Read a module plan of any registered kind from its dict."""
        if not isinstance(data, Mapping):
            raise TypeError(f"module plan must be a mapping, got {data!r}")
        kind = data.get("kind")
        cls = ModuleShardingPlan._kinds.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ValueError(
                f"unknown module plan kind {kind!r}; expected one of {sorted(ModuleShardingPlan._kinds)}"
            )
        return cls.from_dict(data)


class EmbeddingModuleShardingPlan(
    ModuleShardingPlan, Mapping[str, ParameterSharding], kind="embedding"
):
    """The sharding of each table of an embedding module: table name -> ``ParameterSharding``."""

    def __init__(
        self, tables: Mapping[str, ParameterSharding] | Iterable[tuple[str, ParameterSharding]] = ()
    ) -> None:
        items = dict(tables)
        for name, sharding in items.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"table names must be non-empty strings, got {name!r}")
            if not isinstance(sharding, ParameterSharding):
                raise TypeError(f"table {name!r}: expected a ParameterSharding, got {sharding!r}")
        self._tables: dict[str, ParameterSharding] = items

    def __getitem__(self, table: str) -> ParameterSharding:
        return self._tables[table]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    def __hash__(self) -> int:
        return hash(frozenset(self._tables.items()))

    def __repr__(self) -> str:
        return f"EmbeddingModuleShardingPlan({self._tables!r})"

    def __str__(self) -> str:
        params = [
            [
                name,
                ps.sharding_type.value,
                ps.compute_kernel.value,
                "-" if ps.ranks is None else ", ".join(map(str, ps.ranks)),
            ]
            for name, ps in self.items()
        ]
        shards = [
            [name, list(s.offsets), list(s.sizes), s.placement]
            for name, ps in self.items()
            for s in ps.shards or ()
        ]
        table = tabulate(
            params, ["param", "sharding type", "compute kernel", "ranks"], empty="no tables"
        )
        if not params:
            return table
        if all(ps.sharding_type is ShardingType.DATA_PARALLEL for ps in self.values()):
            empty = "no sharded tables: every table is data-parallel (a copy on every rank)"
        else:
            empty = "no shard placements: the plan names the ranks only"
        shard_headers = ["param", "shard offsets", "shard sizes", "placement"]
        return table + "\n\n" + tabulate(shards, shard_headers, empty=empty)

    def check_world(self, world_size: int) -> None:
        """Raise ``ValueError`` unless every table's ranks are in ``[0, world_size)``."""
        for name, ps in self.items():
            ps.check_world(world_size, table=name)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "tables": {name: ps.to_dict() for name, ps in self.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        check_keys(data, ("kind", "tables"), "embedding module plan")
        tables = data.get("tables", {})
        if not isinstance(tables, Mapping):
            raise ValueError(f"embedding module plan: 'tables' must be a mapping, got {tables!r}")
        return cls({name: ParameterSharding.from_dict(d, table=name) for name, d in tables.items()})


@dataclass(frozen=True)
class ObjectPoolShardingPlan(ModuleShardingPlan, kind="object_pool"):
    """The sharding of an object pool (a keyed store of tensors)."""

    sharding_type: ObjectPoolShardingType
    inference: bool = False

    def __post_init__(self) -> None:
        st = ObjectPoolShardingType.parse(self.sharding_type, what="object pool")
        object.__setattr__(self, "sharding_type", st)
        if not isinstance(self.inference, bool):
            raise ValueError(f"object pool plan: inference must be a bool, got {self.inference!r}")

    def __str__(self) -> str:
        return tabulate(
            [[self.sharding_type.value, self.inference]], ["sharding type", "inference"]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "sharding_type": self.sharding_type.value,
            "inference": self.inference,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        check_keys(data, ("kind", "sharding_type", "inference"), "object pool plan")
        if "sharding_type" not in data:
            raise ValueError("object pool plan lacks field 'sharding_type'")
        return cls(data["sharding_type"], data.get("inference", False))


class ShardingPlan(Mapping[str, ModuleShardingPlan]):
    """The sharding of a whole model: module path (``"sparse.ebc"``) -> that module's plan.

    Args:
        plan: a plain mapping of table name -> ``ParameterSharding`` is taken as an
            ``EmbeddingModuleShardingPlan``.
    """

    def __init__(
        self,
        plan: Mapping[str, ModuleShardingPlan | Mapping[str, ParameterSharding]] | None = None,
    ) -> None:
        modules: dict[str, ModuleShardingPlan] = {}
        for path, module_plan in (plan or {}).items():
            if not isinstance(path, str):
                raise ValueError(f"module paths must be strings, got {path!r}")
            if isinstance(module_plan, ModuleShardingPlan):
                modules[path] = module_plan
            elif isinstance(module_plan, Mapping):
                with error_context(f"module {path!r}"):
                    modules[path] = EmbeddingModuleShardingPlan(module_plan)
            else:
                raise TypeError(
                    f"module {path!r}: expected a ModuleShardingPlan, got {module_plan!r}"
                )
        self._plan = modules

    @property
    def plan(self) -> Mapping[str, ModuleShardingPlan]:
        """Module path -> module plan (read-only)."""
        return MappingProxyType(self._plan)

    def get_plan_for_module(self, module_path: str) -> ModuleShardingPlan | None:
        """The plan of the module at ``module_path``, or ``None`` if it is not sharded."""
        return self._plan.get(module_path)

    def __getitem__(self, module_path: str) -> ModuleShardingPlan:
        return self._plan[module_path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)

    def __hash__(self) -> int:
        return hash(frozenset(self._plan.items()))

    def __repr__(self) -> str:
        return f"ShardingPlan({self._plan!r})"

    def __str__(self) -> str:
        return "\n\n".join(f"module: {path}\n\n{mp}" for path, mp in self._plan.items())

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict: ``{"version": 1, "modules": {path: module plan}}``."""
        return {
            "version": PLAN_FORMAT_VERSION,
            "modules": {path: mp.to_dict() for path, mp in self._plan.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardingPlan:
        """Inverse of ``to_dict``; ``ValueError`` names the module and table of a bad entry."""
        check_keys(data, ("version", "modules"), "sharding plan")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(
                f"sharding plan has no valid 'version' (got {version!r}); it was not written by "
                "ShardingPlan.to_dict"
            )
        if version > PLAN_FORMAT_VERSION:
            raise ValueError(
                f"sharding plan format version {version} is newer than the newest this "
                f"embshard-types reads ({PLAN_FORMAT_VERSION}); upgrade embshard-types"
            )
        modules = data.get("modules", {})
        if not isinstance(modules, Mapping):
            raise ValueError(f"sharding plan: 'modules' must be a mapping, got {modules!r}")
        parsed: dict[str, ModuleShardingPlan] = {}
        for path, module_data in modules.items():
            with error_context(f"module {path!r}"):
                parsed[path] = ModuleShardingPlan.parse(module_data)
        return cls(parsed)

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON; flat lists stay on one line, ``indent=None`` is most compact."""
        if indent is None:
            return json.dumps(self.to_dict(), separators=(",", ":"))
        return _dumps(self.to_dict(), indent, 0)

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardingPlan:
        """Inverse of ``to_json``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"sharding plan is not valid JSON: {e}") from e
        return cls.from_dict(data)


def _dumps(value: Any, indent: int, depth: int) -> str:
    """JSON with containers of containers spread over lines and flat lists kept on one."""
    inner, outer = " " * (indent * (depth + 1)), " " * (indent * depth)
    if isinstance(value, dict) and value:
        items = [
            f"{inner}{json.dumps(k)}: {_dumps(v, indent, depth + 1)}" for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{outer}}}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = [inner + _dumps(v, indent, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + f"\n{outer}]"
    return json.dumps(value)


def validate_plan_for_world(plan: ShardingPlan, world_size: int) -> None:
    """Raise ``ValueError`` (naming rank, table and module) unless every rank of ``plan`` is in
    ``[0, world_size)``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    for path, module_plan in plan.items():
        if isinstance(module_plan, EmbeddingModuleShardingPlan):
            for table, ps in module_plan.items():
                try:
                    ps.check_world(world_size, table=table)
                except ValueError as e:
                    message, _, hint = str(e).partition("; ")
                    raise ValueError(f"{message} in module {path!r}; {hint}") from None


def _positive(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DMPCollectionConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class DMPCollectionConfig:
    """How one kind of sub-module is sharded in a 2-D (sharded x replicated) layout.

    Args:
        module: the unsharded class of the sub-modules this config applies to.
        plan: their sharding plan; its ranks are positions within a sharding group.
        use_inter_host_allreduce: sharding groups are contiguous blocks of ranks, not strided.
    """

    module: type[nn.Module]
    plan: ShardingPlan = field(repr=False)
    sharding_group_size: int
    node_group_size: int | None = None
    use_inter_host_allreduce: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.module, type) or not issubclass(self.module, nn.Module):
            raise TypeError(
                f"DMPCollectionConfig.module must be an nn.Module class, got {self.module!r}"
            )
        if issubclass(self.module, ShardedModule):
            raise ValueError(
                f"DMPCollectionConfig.module must be the unsharded module class, got the sharded "
                f"{self.module.__name__}; use its unsharded_module_type"
            )
        if not isinstance(self.plan, ShardingPlan):
            raise TypeError(
                f"DMPCollectionConfig.plan must be a ShardingPlan, got {type(self.plan).__name__}"
            )
        _positive(self.sharding_group_size, "sharding_group_size")
        if self.node_group_size is not None:
            _positive(self.node_group_size, "node_group_size")
        if not isinstance(self.use_inter_host_allreduce, bool):
            raise ValueError(
                "DMPCollectionConfig.use_inter_host_allreduce must be a bool, "
                f"got {self.use_inter_host_allreduce!r}"
            )
        try:
            validate_plan_for_world(self.plan, self.sharding_group_size)
        except ValueError as e:
            raise ValueError(
                f"DMPCollectionConfig for {self.module.__name__}: the plan's ranks are positions "
                f"in a sharding group of {self.sharding_group_size}: {e}"
            ) from None

    def num_sharding_groups(self, world_size: int) -> int:
        """How many replicas of the sharded sub-modules a job of ``world_size`` ranks holds."""
        self.check_world(world_size)
        return world_size // self.sharding_group_size

    def check_world(self, world_size: int) -> None:
        """Raise ``ValueError`` unless both group sizes divide ``world_size``."""
        _positive(world_size, "check_world(world_size)")
        for name in ("sharding_group_size", "node_group_size"):
            size = getattr(self, name)
            if size is not None and world_size % size != 0:
                raise ValueError(
                    f"DMPCollectionConfig.{name} {size} does not divide the world size "
                    f"{world_size}; choose a size that does"
                )
