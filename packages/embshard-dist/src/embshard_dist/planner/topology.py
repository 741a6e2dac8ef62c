"""The machine a plan is made for: ranks, memory per rank, and the speeds that decide step time.

Speeds come from a topology file written by ``embshard calibrate``, else from the fallbacks
of :func:`default_topology`; ``source`` records which. Bandwidths are bytes per second and
count sent plus received bytes; memory is bytes per rank.

Guarantees: a topology is frozen and validated at construction (``ValueError`` naming the
field); ``from_dict(to_dict())`` and ``load(save())`` round-trip; a newer file format raises.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, InitVar, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from embshard_dist.planner.speeds import (
    KernelThroughput,
    ShardingOverhead,
    check_keys,
    check_positive,
)
from embshard_dist.strategies.nodes import resolve_local_world_size
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = [
    "SPARSE_UPDATE",
    "TOPOLOGY_FORMAT_VERSION",
    "KernelThroughput",
    "ShardingOverhead",
    "Topology",
    "default_topology",
]

TOPOLOGY_FORMAT_VERSION = 2
"""Version of the dict / JSON format ``Topology.to_dict`` writes (2 added kernels'
``update_bytes_per_s`` and ``miss_bytes_per_s`` and ``sharding_overheads``; version 1 files
read as before)."""

SPARSE_UPDATE = "sparse_update"
"""Key of ``Topology.kernels`` for embshard's plain-torch sparse update rules (data-parallel
tables, and fused tables whose optimizer FBGEMM cannot run on the device)."""

_GIB = 1024**3

_F = TypeVar("_F", KernelThroughput, ShardingOverhead)


def _figures(
    data: Any, field_name: str, key_of: Callable[[Any], str], kind: type[_F], what: str
) -> MappingProxyType[str, _F]:
    """A frozen mapping of checked figures, keys normalised by ``key_of``, values of ``kind``."""
    if not isinstance(data, Mapping):
        raise TypeError(f"Topology.{field_name} must be a mapping, got {data!r}")
    out: dict[str, _F] = {}
    for key, value in data.items():
        k = key_of(key)
        if isinstance(value, Mapping):
            value = kind.from_dict(value, what=f"{what} {k!r}")
        if not isinstance(value, kind):
            raise TypeError(
                f"Topology.{field_name}[{k!r}] must be a {kind.__name__}, got {value!r}"
            )
        out[k] = value
    return MappingProxyType(out)


def _sharding_type_key(key: Any) -> str:
    return ShardingType.parse(key, what="topology sharding_overheads").value


def _kernel_key(key: ComputeKernel | str) -> str:
    if isinstance(key, ComputeKernel):
        return key.value
    if key == SPARSE_UPDATE:
        return key
    return ComputeKernel.parse(key, what="topology kernels").value


@dataclass(frozen=True)
class Topology:
    """Ranks, memory and speeds of the machine(s) a plan is made for.

    ``Topology(world_size, compute_device)`` is the topology ``DistributedModelParallel`` plans
    for when given none: ranks per node from ``LOCAL_WORLD_SIZE`` (else one node), this host's
    memory shared by a node's ranks (CPU) or the GPU's memory (CUDA), and the device's default
    speeds. Fields left out take those defaults; speeds given without ``reduce_scatter_bw`` /
    ``sharding_overheads`` leave them unset (the given figures are used throughout).

    Args:
        compute_device: ``"cpu"`` or ``"cuda"``. Left out, it means ``"cpu"`` with embshard's
            generic figures instead of the derived ones (one node, 16 GiB, uncalibrated speeds),
            as before TorchRec's constructor was accepted; give it to plan as DMP does.
        local_world_size: ranks per node (default: ``LOCAL_WORLD_SIZE``, else ``world_size``);
            must divide ``world_size``.
        memory_per_rank: bytes of compute-device memory each rank may use.
        host_memory_per_rank: on CUDA, bytes of host memory per rank for UVM tables.
        reduce_scatter_bw: bandwidth of reduce-scatter / all-gather within a node, when it differs
            from ``intra_node_bw``.
        kernels: throughput per compute kernel value and for :data:`SPARSE_UPDATE`; a missing
            kernel falls back to ``"fused"``.
        sharding_overheads: calibrated cost per sharding type value beyond its bytes; a missing
            type costs ``collective_latency_s`` per collective it issues.
        source: where the numbers come from (``"defaults"``, or the calibration's host/date).
        hbm_cap, ddr_cap, hbm_mem_bw, ddr_mem_bw, intra_host_bw, inter_host_bw: TorchRec's
            spellings, keyword only. Caps are bytes per rank (``hbm_cap``: GPU memory on CUDA;
            ``ddr_cap``: host memory, the compute memory on CPU); bandwidths are TorchRec's bytes
            per millisecond (converted to bytes per second). Give each figure one way. On the
            CPU ``hbm_cap`` / ``hbm_mem_bw`` are unused, as in TorchRec.

    Raises:
        ValueError: an invalid value (naming the field), a figure given in both spellings, or
            ``ddr_mem_bw`` on CUDA (no equivalent there).
    """

    world_size: int
    compute_device: str = None  # type: ignore[assignment]
    local_world_size: int | None = None
    # None fields below are derived in __post_init__ (see the class docstring).
    memory_per_rank: int = None  # type: ignore[assignment]
    host_memory_per_rank: int = None  # type: ignore[assignment]
    memory_bw: float = None  # type: ignore[assignment]
    intra_node_bw: float = None  # type: ignore[assignment]
    inter_node_bw: float = None  # type: ignore[assignment]
    reduce_scatter_bw: float | None = None
    collective_latency_s: float = None  # type: ignore[assignment]
    kernels: Mapping[str, KernelThroughput] = field(default=None, hash=False)  # type: ignore[arg-type]
    sharding_overheads: Mapping[str, ShardingOverhead] = field(default=None, hash=False)  # type: ignore[arg-type]
    source: str = None  # type: ignore[assignment]
    _: KW_ONLY
    hbm_cap: InitVar[int | None] = None
    ddr_cap: InitVar[int | None] = None
    hbm_mem_bw: InitVar[float | None] = None
    ddr_mem_bw: InitVar[float | None] = None
    intra_host_bw: InitVar[float | None] = None
    inter_host_bw: InitVar[float | None] = None

    def __post_init__(
        self,
        hbm_cap: int | None,
        ddr_cap: int | None,
        hbm_mem_bw: float | None,
        ddr_mem_bw: float | None,
        intra_host_bw: float | None,
        inter_host_bw: float | None,
    ) -> None:
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ValueError(f"Topology.world_size must be a positive int, got {ws!r}")
        generic = self.compute_device is None
        if generic:
            object.__setattr__(self, "compute_device", "cpu")
        if self.local_world_size is None:
            local = ws if generic else resolve_local_world_size(ws)
        else:
            local = self.local_world_size
        if isinstance(local, bool) or not isinstance(local, int) or local < 1 or ws % local:
            raise ValueError(
                f"Topology.local_world_size must be a positive int dividing world_size {ws} "
                f"(ranks per node), got {self.local_world_size!r}"
            )
        object.__setattr__(self, "local_world_size", local)
        if self.compute_device not in ("cpu", "cuda"):
            raise ValueError(
                f"Topology.compute_device must be 'cpu' or 'cuda', got {self.compute_device!r}"
            )
        self._take_torchrec_figures(
            hbm_cap, ddr_cap, hbm_mem_bw, ddr_mem_bw, intra_host_bw, inter_host_bw
        )
        self._derive_defaults(local, generic)
        for name in ("memory_per_rank", "host_memory_per_rank"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Topology.{name} must be a non-negative int, got {value!r}")
            object.__setattr__(self, name, value)
        if self.memory_per_rank == 0:
            raise ValueError("Topology.memory_per_rank must be positive")
        for name in ("memory_bw", "intra_node_bw", "inter_node_bw", "collective_latency_s"):
            if name == "collective_latency_s" and self.collective_latency_s == 0:
                continue
            check_positive(f"Topology.{name}", getattr(self, name))
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.reduce_scatter_bw is not None:
            check_positive("Topology.reduce_scatter_bw", self.reduce_scatter_bw)
            object.__setattr__(self, "reduce_scatter_bw", float(self.reduce_scatter_bw))
        kernels = _figures(self.kernels, "kernels", _kernel_key, KernelThroughput, "kernel")
        if ComputeKernel.FUSED.value not in kernels:
            raise ValueError(
                "Topology.kernels needs an entry for 'fused' (the fallback of every kernel)"
            )
        object.__setattr__(self, "kernels", kernels)
        overheads = _figures(
            self.sharding_overheads,
            "sharding_overheads",
            _sharding_type_key,
            ShardingOverhead,
            "sharding overhead",
        )
        object.__setattr__(self, "sharding_overheads", overheads)
        if not isinstance(self.source, str):
            raise TypeError(f"Topology.source must be a str, got {self.source!r}")

    def _take_torchrec_figures(
        self,
        hbm_cap: int | None,
        ddr_cap: int | None,
        hbm_mem_bw: float | None,
        ddr_mem_bw: float | None,
        intra_host_bw: float | None,
        inter_host_bw: float | None,
    ) -> None:
        """Set the fields TorchRec's arguments name (bandwidths: bytes/ms -> bytes/s).

        As in TorchRec, ``hbm_cap`` and ``hbm_mem_bw`` are unused on the CPU (no GPU memory).
        """
        cuda = self.compute_device == "cuda"
        if cuda and ddr_mem_bw is not None:
            raise ValueError(
                f"Topology: ddr_mem_bw={ddr_mem_bw!r} has no embshard equivalent on CUDA (host "
                "memory speed enters through the fused_uvm kernels' throughput in kernels=); "
                "drop it or calibrate with `embshard calibrate`"
            )
        memory = hbm_cap if cuda else ddr_cap
        given: dict[str, Any] = {
            "memory_per_rank": memory,
            "host_memory_per_rank": ddr_cap if cuda else None,
            "memory_bw": _per_second(hbm_mem_bw if cuda else ddr_mem_bw),
            "intra_node_bw": _per_second(intra_host_bw),
            "inter_node_bw": _per_second(inter_host_bw),
        }
        spelled = {
            "memory_per_rank": "hbm_cap" if cuda else "ddr_cap",
            "host_memory_per_rank": "ddr_cap",
            "memory_bw": "hbm_mem_bw" if cuda else "ddr_mem_bw",
            "intra_node_bw": "intra_host_bw",
            "inter_node_bw": "inter_host_bw",
        }
        for field_name, value in given.items():
            if value is None:
                continue
            if getattr(self, field_name) is not None:
                raise ValueError(
                    f"Topology: both {field_name} and TorchRec's {spelled[field_name]} are "
                    "given; give one"
                )
            object.__setattr__(self, field_name, value)

    def _derive_defaults(self, local: int, generic: bool) -> None:
        """Fill the fields left at ``None`` as ``DistributedModelParallel`` derives them (or
        with the generic CPU figures when ``compute_device`` was left out)."""
        cuda = self.compute_device == "cuda"
        if generic:
            for name, value in _GENERIC_CPU.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)
            return
        if self.memory_per_rank is None:
            memory = _cuda_memory_bytes() if cuda else _host_memory_bytes() // local
            object.__setattr__(self, "memory_per_rank", memory)
        if self.host_memory_per_rank is None:
            host = _host_memory_bytes() // local if cuda else 0
            object.__setattr__(self, "host_memory_per_rank", host)
        defaults = _device_speeds(self.compute_device)
        speeds_given = self.kernels is not None
        links_given = self.intra_node_bw is not None
        for name, value in defaults.items():
            if getattr(self, name) is not None:
                continue
            if name == "sharding_overheads" and speeds_given:
                value = MappingProxyType({})  # calibrated kernels: no reference overheads
            elif name == "reduce_scatter_bw" and links_given:
                continue  # follows the given intra_node_bw
            object.__setattr__(self, name, value)

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node (``local_world_size`` resolved)."""
        assert self.local_world_size is not None
        return self.local_world_size

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self.world_size // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of ``node``, in order."""
        m = self.ranks_per_node
        return list(range(node * m, (node + 1) * m))

    @property
    def within_node_reduce_bw(self) -> float:
        """Bandwidth of reduce-scatter / all-gather within a node."""
        return self.reduce_scatter_bw or self.intra_node_bw

    def throughput(self, kernel: ComputeKernel | str) -> KernelThroughput:
        """The throughput of ``kernel`` (``"fused"``'s when it was not measured)."""
        key = _kernel_key(kernel)
        if key == ComputeKernel.DEFAULT.value:
            key = ComputeKernel.FUSED.value
        return self.kernels.get(key) or self.kernels[ComputeKernel.FUSED.value]

    def overhead(self, sharding_type: ShardingType | str) -> ShardingOverhead | None:
        """The calibrated overhead of ``sharding_type``, or ``None`` when it was not measured."""
        return self.sharding_overheads.get(ShardingType.parse(sharding_type).value)

    def with_world(self, world_size: int, local_world_size: int | None = None) -> Topology:
        """The same machine speeds for another number of ranks."""
        return replace(self, world_size=world_size, local_world_size=local_world_size)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with a format ``"version"``."""
        out: dict[str, Any] = {"version": TOPOLOGY_FORMAT_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = (
                {k: v.to_dict() for k, v in sorted(value.items())}
                if f.name in ("kernels", "sharding_overheads")
                else value
            )
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """Inverse of ``to_dict``.

        Raises:
            ValueError: unknown fields, a missing or newer ``version``, invalid values.
        """
        names = tuple(f.name for f in fields(cls))
        check_keys(data, ("version", *names), "topology")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(
                f"topology has no valid 'version' (got {version!r}); write it with "
                "Topology.save or `embshard calibrate`"
            )
        if version > TOPOLOGY_FORMAT_VERSION:
            raise ValueError(
                f"topology format version {version} is newer than this embshard-dist reads "
                f"({TOPOLOGY_FORMAT_VERSION}); upgrade embshard-dist"
            )
        if "world_size" not in data:
            raise ValueError("topology lacks field 'world_size'")
        kwargs = {k: v for k, v in data.items() if k != "version"}
        return cls(**kwargs)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the topology as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        world_size: int | None = None,
        local_world_size: int | None = None,
    ) -> Topology:
        """Read a topology file, optionally for another number of ranks (the speeds stay).

        Raises:
            ValueError: the file is not valid JSON or not a topology (the message names it).
        """
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"topology file {str(path)!r} is not valid JSON: {e}") from e
        try:
            topo = cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"topology file {str(path)!r}: {e}") from e
        if world_size is not None:
            topo = topo.with_world(world_size, local_world_size)
        return topo


_CPU_KERNELS: dict[str, KernelThroughput] = {
    # Generic CPU figures: FBGEMM's CPU TBE forward and backward against copy bandwidth.
    ComputeKernel.FUSED.value: KernelThroughput(5.0e9, 1.8e9),
    ComputeKernel.DENSE.value: KernelThroughput(5.0e9, 1.2e9),
    ComputeKernel.QUANT.value: KernelThroughput(4.0e9, 1.0e9),
    SPARSE_UPDATE: KernelThroughput(1.5e9, 0.45e9),
}

_REFERENCE_CPU_KERNELS: dict[str, KernelThroughput] = {
    **_CPU_KERNELS,
    # `embshard calibrate` on the reference CPU host: embshard's fast pooled path.
    ComputeKernel.FUSED.value: KernelThroughput(14.4e9, 11.1e9, 5.5e9, 5.4e9),
    SPARSE_UPDATE: KernelThroughput(1.5e9, 2.0e9),
}

_REFERENCE_CPU_OVERHEADS: dict[str, ShardingOverhead] = {
    # The same calibrations: per step and per table seconds, compute scale.
    "data_parallel": ShardingOverhead(0.006, 0.0001, 1.3),
    "table_wise": ShardingOverhead(0.0085, 0.0, 0.95),
    "row_wise": ShardingOverhead(0.0076, 0.0001, 1.05),
    "column_wise": ShardingOverhead(0.0099, 0.0, 1.35),
    "table_row_wise": ShardingOverhead(0.0092, 0.0, 1.1),
    "table_column_wise": ShardingOverhead(0.0104, 0.0001, 1.3),
    "grid_shard": ShardingOverhead(0.0078, 0.0002, 1.05),
}

_CUDA_KERNELS: dict[str, KernelThroughput] = {
    # Typical figures of a current datacentre GPU; calibrate to replace them.
    ComputeKernel.FUSED.value: KernelThroughput(1.2e12, 5.0e11),
    ComputeKernel.DENSE.value: KernelThroughput(1.2e12, 3.0e11),
    ComputeKernel.FUSED_UVM.value: KernelThroughput(2.5e10, 1.2e10),
    ComputeKernel.FUSED_UVM_CACHING.value: KernelThroughput(3.0e11, 1.2e11),
    ComputeKernel.KEY_VALUE.value: KernelThroughput(5.0e9, 2.5e9),
    ComputeKernel.QUANT.value: KernelThroughput(1.0e12, 5.0e11),
    SPARSE_UPDATE: KernelThroughput(3.0e11, 1.0e11),
}


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * _GIB


def default_topology(
    world_size: int,
    *,
    compute_device: str = "cpu",
    local_world_size: int | None = None,
    memory_per_rank: int | None = None,
) -> Topology:
    """The fallback topology when no calibration file is given (see :class:`Topology`).

    On the CPU the ranks of a node share the host's memory and the speeds are a reference CPU
    host's; on CUDA the memory is the first visible GPU's and the speeds are typical of a
    current GPU with NVLink within a node. Calibrate for the machine at hand's own figures.
    """
    return Topology(
        world_size,
        compute_device,
        local_world_size=world_size if local_world_size is None else local_world_size,
        memory_per_rank=memory_per_rank or None,  # type: ignore[arg-type]
    )


def _device_speeds(compute_device: str) -> dict[str, Any]:
    """The speeds a topology takes for fields it is not given, per device."""
    if compute_device == "cuda":
        return {
            "memory_bw": 3.0e12,
            "intra_node_bw": 2.0e11,
            "inter_node_bw": 2.5e10,
            "reduce_scatter_bw": None,
            "collective_latency_s": 3e-5,
            "kernels": MappingProxyType(dict(_CUDA_KERNELS)),
            "sharding_overheads": MappingProxyType({}),
            "source": "defaults (typical GPU)",
        }
    return {
        "memory_bw": 9.0e9,
        "intra_node_bw": 0.91e9,
        "inter_node_bw": 0.91e9,
        "reduce_scatter_bw": 0.52e9,
        "collective_latency_s": 1.5e-3,
        "kernels": MappingProxyType(dict(_REFERENCE_CPU_KERNELS)),
        "sharding_overheads": MappingProxyType(dict(_REFERENCE_CPU_OVERHEADS)),
        "source": "defaults (2-core CPU reference host, calibrated with other jobs running)",
    }


_GENERIC_CPU: dict[str, Any] = {
    "memory_per_rank": 16 * _GIB,
    "host_memory_per_rank": 0,
    "memory_bw": 11e9,
    "intra_node_bw": 2e9,
    "inter_node_bw": 1e9,
    "collective_latency_s": 2e-4,
    "kernels": MappingProxyType(dict(_CPU_KERNELS)),
    "sharding_overheads": MappingProxyType({}),
    "source": "defaults",
}


def _per_second(bytes_per_ms: float | None) -> float | None:
    """TorchRec's bandwidths are bytes per millisecond; embshard's bytes per second."""
    return None if bytes_per_ms is None else float(bytes_per_ms) * 1000.0


def _cuda_memory_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return 80 * _GIB
