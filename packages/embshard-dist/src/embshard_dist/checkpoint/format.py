"""The on-disk layout of an embshard checkpoint and its versioned metadata.

A checkpoint directory holds ``embshard.json`` (written last: it marks a complete checkpoint),
torch.distributed.checkpoint's ``.metadata`` and per-rank chunks, and ``rng/`` per-rank
generator states. Tensors are stored under plan-independent keys, so any plan on any number of
processes can read them. A directory of checkpoints holds ``step-NNNNNNNN`` sub-directories and
a ``latest`` file; :func:`resolve_checkpoint` accepts either.

Guarantees: :func:`read_metadata` refuses, with a ``ValueError`` saying what to do, anything
that is not a complete checkpoint of this or an older :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DCP_METADATA_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST_FILE",
    "METADATA_FILE",
    "CheckpointMetadata",
    "StateInfo",
    "TableInfo",
    "TensorInfo",
    "dense_optim_key",
    "dtype_name",
    "model_key",
    "optim_key",
    "parse_dtype",
    "read_metadata",
    "resolve_checkpoint",
    "rng_file",
    "step_dir_name",
]

FORMAT_NAME = "embshard-checkpoint"
FORMAT_VERSION = 1
"""The version this embshard writes; it reads this version and older ones."""

METADATA_FILE = "embshard.json"
DCP_METADATA_FILE = ".metadata"
LATEST_FILE = "latest"

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
OBJECT = "object"
"""The ``dtype`` of a stored value that is not a tensor (e.g. an optimizer's ``None``)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, *, what: str) -> torch.dtype:
    """The torch dtype called ``name`` (see :func:`dtype_name`).

    Raises:
        ValueError: an unknown name (``what`` says where it was read).
    """
    if name not in _DTYPES:
        raise ValueError(f"{what}: unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def model_key(fqn: str) -> str:
    """Storage key of the model state-dict entry ``fqn`` (table weight or dense tensor)."""
    return f"model/{fqn}"


def optim_key(param: str, state: str) -> str:
    """Storage key of fused optimizer state ``state`` (e.g. ``momentum1``) of table ``param``."""
    return f"optim/{param}/{state}"


def dense_optim_key(param: str, state: str) -> str:
    """Storage key of dense optimizer state ``state`` (e.g. ``exp_avg``) of parameter ``param``."""
    return f"dense_optim/{param}/{state}"


def rng_file(rank: int) -> str:
    """The file (relative to the checkpoint) holding rank ``rank``'s generator states."""
    return f"rng/rank-{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    """The sub-directory of a checkpoint directory holding step ``step``."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class StateInfo:
    """One optimizer state of a table: one value per row, or one per element."""

    rowwise: bool
    dtype: str


@dataclass(frozen=True)
class TableInfo:
    """One embedding table in a checkpoint.

    Args:
        key: its model state-dict key, ``"{module}.embedding_bags.{name}.weight"``.
        module: the path of its collection in the model (``""`` for the model itself).
        sharding: how the saving plan sharded it (``None``: unsharded source).
        states: its fused optimizer states by name (empty: none saved).
    """

    key: str
    module: str
    name: str
    rows: int
    dim: int
    dtype: str
    sharding: str | None
    states: dict[str, StateInfo] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a stored tensor (dtype ``"object"``: a stored non-tensor value)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class CheckpointMetadata:
    """What ``embshard.json`` records.

    Args:
        step: the number of training steps taken when it was saved.
        world_size: processes that saved it (1 for an imported one).
        dense: the model's other state-dict tensors (``{}`` when not saved).
        dense_optimizer: the dense optimizer's state, ``{param: {state: TensorInfo}}``.
        dense_param_groups: its param groups' hyperparameters (JSON form), each with its
            ``params`` names.
        plan: the saving plan (``ShardingPlan.to_dict()``), ``None`` when imported.
        files: every file of the checkpoint but ``embshard.json``, with its size in bytes.
        source: ``"save"`` or ``"import"``.
        checksums: each file's xxh3-64 digest (hex); empty in checkpoints written before
            embshard recorded them (they load unverified).
        extra_state: names of the user state saved beside the model (``extra_state=``), one
            copy per rank.
        step_known: whether the saver gave ``step`` (else ``step`` is 0 and a load leaves the
            fused optimizers' step counters alone).
    """

    version: int
    step: int
    world_size: int
    tables: tuple[TableInfo, ...]
    dense: dict[str, TensorInfo]
    has_optimizer: bool
    dense_optimizer: dict[str, dict[str, TensorInfo]]
    dense_param_groups: list[dict[str, Any]]
    fused_hyperparameters: dict[str, dict[str, Any]]
    plan: dict[str, Any] | None
    files: dict[str, int]
    created: str
    source: str
    checksums: dict[str, str] = field(default_factory=dict)
    extra_state: tuple[str, ...] = ()
    step_known: bool = True

    def table(self, key: str) -> TableInfo | None:
        """The table whose state-dict key is ``key``, if any."""
        return next((t for t in self.tables if t.key == key), None)

    def to_json(self) -> str:
        """The metadata as JSON text."""
        data = asdict(self)
        data["format"] = FORMAT_NAME
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str) -> CheckpointMetadata:
        """Parse metadata written by :meth:`to_json` (this version or an older one).

        Raises:
            ValueError: not JSON, not an embshard checkpoint, a newer format version, or a
                missing / malformed field.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e}); the checkpoint is damaged") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ValueError(f"{where}: not an embshard checkpoint metadata file")
        version = data.get("version")
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"{where}: format version {version!r} is not a positive integer")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"{where}: the checkpoint has format version {version}, newer than the "
                f"versions this embshard reads (up to {FORMAT_VERSION}); upgrade embshard to "
                "load it"
            )
        try:
            return cls(
                version=version,
                step=int(data["step"]),
                world_size=int(data["world_size"]),
                tables=tuple(_table(t) for t in data["tables"]),
                dense={k: _tensor(v) for k, v in data["dense"].items()},
                has_optimizer=bool(data["has_optimizer"]),
                dense_optimizer={
                    p: {s: _tensor(v) for s, v in states.items()}
                    for p, states in data["dense_optimizer"].items()
                },
                dense_param_groups=list(data["dense_param_groups"]),
                fused_hyperparameters=dict(data["fused_hyperparameters"]),
                plan=data["plan"],
                files={str(k): int(v) for k, v in data["files"].items()},
                created=str(data["created"]),
                source=str(data["source"]),
                checksums={str(k): str(v) for k, v in data.get("checksums", {}).items()},
                extra_state=tuple(str(n) for n in data.get("extra_state", ())),
                step_known=bool(data.get("step_known", True)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(
                f"{where}: malformed checkpoint metadata ({type(e).__name__}: {e}); the "
                "checkpoint is damaged or was not written by embshard"
            ) from e


def _table(data: Mapping[str, Any]) -> TableInfo:
    return TableInfo(
        key=str(data["key"]),
        module=str(data["module"]),
        name=str(data["name"]),
        rows=int(data["rows"]),
        dim=int(data["dim"]),
        dtype=str(data["dtype"]),
        sharding=None if data["sharding"] is None else str(data["sharding"]),
        states={
            str(n): StateInfo(rowwise=bool(s["rowwise"]), dtype=str(s["dtype"]))
            for n, s in data["states"].items()
        },
    )


def _tensor(data: Mapping[str, Any]) -> TensorInfo:
    return TensorInfo(shape=tuple(int(x) for x in data["shape"]), dtype=str(data["dtype"]))


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint ``path`` names: itself, or the one its ``latest`` file points to.

    Raises:
        ValueError: ``path`` is neither a checkpoint nor a directory whose ``latest`` names one.
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"no checkpoint at {str(root)!r}: not a directory")
    if (root / METADATA_FILE).is_file():
        return root
    latest = root / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{latest}: names no checkpoint ({name!r})")
        target = root / name
        if not (target / METADATA_FILE).is_file():
            raise ValueError(
                f"{latest} names {name!r}, which is not a complete checkpoint (no "
                f"{METADATA_FILE}); the directory was changed by hand"
            )
        return target
    raise ValueError(
        f"no checkpoint at {str(root)!r}: it holds neither {METADATA_FILE} (a checkpoint) nor "
        f"a {LATEST_FILE!r} file (a directory of checkpoints); a save that was interrupted "
        "leaves no metadata file"
    )


def read_metadata(path: str | os.PathLike[str]) -> CheckpointMetadata:
    """The metadata of the checkpoint at ``path`` (a checkpoint or a directory of them).

    Raises:
        ValueError: see :func:`resolve_checkpoint` and :meth:`CheckpointMetadata.from_json`.
    """
    where = resolve_checkpoint(path) / METADATA_FILE
    return CheckpointMetadata.from_json(where.read_text(), where=str(where))
