"""Which sharded modules a pipeline drives, and which KeyedJaggedTensor of a batch each reads.

TorchRec traces the model with ``torch.fx`` to learn which part of a batch feeds each sharded
module. embshard learns it from the first batch instead: that batch runs as the plain loop (each
sharded module distributes its own input inside the forward) while a hook records the object each
module is called with, and the pipeline finds that very object in the batch, as an attribute, key
or item (:func:`find_in_batch`); from the next batch on it reads each module's input at the path
found and distributes it ahead. A module called with something the batch does not hold (a
KeyedJaggedTensor the model builds or transforms), called twice, called with keywords or not
called runs its own input dist inside the forward, as TorchRec leaves a module it cannot trace
unpipelined; a warning names it and why. Every rank must learn the same paths (checked once).

``sparse_of(batch)`` states the rule instead, and pipelines from the first batch: one
KeyedJaggedTensor (read by every sharded module) or a mapping ``{module path:
KeyedJaggedTensor}``; a module left out of the mapping runs its own input dist inside the forward.

The rule is checked where it can fail: a batch without the input, an unknown module path, a value
that is not a KeyedJaggedTensor (here), and a module called with anything but that very object
(:mod:`~embshard_dist.train_pipeline.pipelined_forward`).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from embshard_dist.comm.collectives import all_gather_ints
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_types.interfaces import ShardedModule
from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor

__all__ = [
    "AnyShardedModule",
    "BatchPath",
    "SparseInputs",
    "SparseOf",
    "find_in_batch",
    "find_sharded_modules",
]

logger = logging.getLogger(__name__)

AnyShardedModule: TypeAlias = ShardedModule[Any, Any, Any, Any]
SparseOf: TypeAlias = Callable[[Any], KeyedJaggedTensor | Mapping[str, KeyedJaggedTensor]]
"""``batch -> KJT`` (for every sharded module) or ``batch -> {module path: KJT}``."""

_OWNER = "TrainPipelineSparseDist"
_MAX_DEPTH = 4
_LEAVES = (Tensor, KeyedJaggedTensor, JaggedTensor, KeyedTensor, nn.Module, str, bytes, int, float)


def find_sharded_modules(model: nn.Module) -> dict[str, AnyShardedModule]:
    """The outermost sharded modules of ``model`` by path, in the order the model holds them.

    Paths are those of the user's model: a ``DistributedModelParallel`` (and a DDP wrapper)
    adds nothing, so DMP over a model with ``sparse_arch`` gives ``"sparse_arch"``.
    """
    found: dict[str, AnyShardedModule] = {}
    _walk(model, "", found)
    return found


def _walk(module: nn.Module, prefix: str, found: dict[str, AnyShardedModule]) -> None:
    if isinstance(module, ShardedModule):
        found[prefix] = module
        return
    if isinstance(module, DistributedModelParallel):
        _walk(module.module, prefix, found)
        return
    if isinstance(module, DistributedDataParallel):
        _walk(module.module, prefix, found)
        return
    for name, child in module.named_children():
        _walk(child, f"{prefix}.{name}" if prefix else name, found)


@dataclass(frozen=True)
class BatchPath:
    """Where a value lives in a batch: attribute names (``"attr"``) and keys or indices
    (``"item"``), from the batch down."""

    steps: tuple[tuple[Literal["attr", "item"], Any], ...]

    def read(self, batch: Any) -> Any:
        """The value at this path in ``batch``.

        Raises:
            TypeError: ``batch`` does not have this path.
        """
        value = batch
        for kind, name in self.steps:
            try:
                value = getattr(value, name) if kind == "attr" else value[name]
            except (AttributeError, KeyError, IndexError, TypeError) as error:
                raise TypeError(
                    f"{_OWNER}: the first batch held a sharded module's input at {self}, but "
                    f"this {type(batch).__name__} batch has no {self}; give every batch the "
                    "same structure, or pass sparse_of"
                ) from error
        return value

    def __str__(self) -> str:
        text = "batch"
        for kind, name in self.steps:
            text += f".{name}" if kind == "attr" else f"[{name!r}]"
        return text


def find_in_batch(batch: Any, target: object, max_depth: int = _MAX_DEPTH) -> BatchPath | None:
    """The shortest path from ``batch`` to the very object ``target`` (identity, not
    equality) through attributes, dataclass fields, mapping keys and sequence items, at most
    ``max_depth`` steps deep; ``None`` if the batch does not hold it."""
    queue: deque[tuple[Any, BatchPath]] = deque([(batch, BatchPath(()))])
    seen: set[int] = set()
    while queue:
        value, path = queue.popleft()
        if value is target:
            return path
        if id(value) in seen or len(path.steps) >= max_depth or isinstance(value, _LEAVES):
            continue
        seen.add(id(value))
        for step, child in _children(value):
            queue.append((child, BatchPath((*path.steps, step))))
    return None


def _children(value: Any) -> Iterator[tuple[tuple[Literal["attr", "item"], Any], Any]]:
    if isinstance(value, Mapping):
        for key, child in value.items():
            yield ("item", key), child
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        for name in value._fields:
            yield ("attr", name), getattr(value, name)
    elif isinstance(value, (list, tuple)):
        for index, child in enumerate(value):
            yield ("item", index), child
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield ("attr", f.name), getattr(value, f.name)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for name, child in vars(value).items():
            yield ("attr", name), child


class SparseInputs:
    """Reads, from a batch, the KeyedJaggedTensor of every module to pipeline.

    Args:
        modules: the model's sharded modules by path (:func:`find_sharded_modules`).
        sparse_of: the rule (see the module docstring); ``None``: learned from the first batch.
    """

    def __init__(
        self, modules: Mapping[str, AnyShardedModule], sparse_of: SparseOf | None = None
    ) -> None:
        self._modules = dict(modules)
        self._sparse_of = sparse_of
        self._learned: dict[str, BatchPath] | None = None

    @property
    def ready(self) -> bool:
        """Whether the inputs of a batch can be read (``sparse_of`` given, or learned)."""
        return self._sparse_of is not None or self._learned is not None

    @property
    def learned(self) -> dict[str, BatchPath] | None:
        """Module path -> where its input lives in a batch, once learned (``None`` before, and
        with ``sparse_of``); modules left unpipelined are absent."""
        return None if self._learned is None else dict(self._learned)

    def learning(self, batch: Any) -> AbstractContextManager[None]:
        """Around the first batch's forward: record each module's call and learn from it."""
        if self.ready:
            return nullcontext()
        return self._learn_from(batch)

    @contextmanager
    def _learn_from(self, batch: Any) -> Iterator[None]:
        calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {
            path: [] for path in self._modules
        }

        def recorder(path: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                calls[path].append((args, kwargs))

            return hook

        handles = [
            module.register_forward_pre_hook(recorder(path), with_kwargs=True)
            for path, module in self._modules.items()
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        learned: dict[str, BatchPath] = {}
        skipped: dict[str, str] = {}
        for path, made in calls.items():
            found, why = _path_of(batch, made)
            if found is None:
                skipped[path] = why
            else:
                learned[path] = found
        _agree(learned)
        if skipped:
            logger.warning(
                "%s: these sharded modules run their own input dist inside the forward "
                "(not pipelined): %s; pass sparse_of to name their inputs",
                _OWNER,
                "; ".join(f"{path!r}: {why}" for path, why in skipped.items()),
            )
        self._learned = learned

    def __call__(self, batch: Any) -> dict[str, KeyedJaggedTensor]:
        """Module path -> its input, in the model's module order (empty before learning).

        Raises:
            TypeError: the batch lacks a learned path, or the rule gave something other than a
                KeyedJaggedTensor.
            ValueError: the rule named a path that is not a sharded module of the model.
        """
        if self._sparse_of is None:
            return self._read_learned(batch)
        given = self._sparse_of(batch)
        if isinstance(given, KeyedJaggedTensor):
            return dict.fromkeys(self._modules, given)
        if not isinstance(given, Mapping):
            raise TypeError(
                f"{_OWNER}: sparse_of(batch) must return a KeyedJaggedTensor or a dict "
                f"{{module path: KeyedJaggedTensor}}, got {type(given).__name__}"
            )
        unknown = sorted(set(given) - set(self._modules))
        if unknown:
            raise ValueError(
                f"{_OWNER}: sparse_of(batch) names {unknown}, which are not sharded modules of "
                f"the model; its sharded modules are {list(self._modules)}"
            )
        for path, value in given.items():
            if not isinstance(value, KeyedJaggedTensor):
                raise TypeError(
                    f"{_OWNER}: sparse_of(batch)[{path!r}] must be a KeyedJaggedTensor, got "
                    f"{type(value).__name__}"
                )
        return {path: given[path] for path in self._modules if path in given}

    def _read_learned(self, batch: Any) -> dict[str, KeyedJaggedTensor]:
        out: dict[str, KeyedJaggedTensor] = {}
        for path, where in (self._learned or {}).items():
            value = where.read(batch)
            if not isinstance(value, KeyedJaggedTensor):
                raise TypeError(
                    f"{_OWNER}: the sharded module {path!r} reads {where}, a KeyedJaggedTensor "
                    f"in the first batch, but this batch has a {type(value).__name__} there; "
                    "give every batch the same structure, or pass sparse_of"
                )
            out[path] = value
        return out


def _path_of(
    batch: Any, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
) -> tuple[BatchPath | None, str]:
    """Where the one argument of a module's one call lives in ``batch``, or why it cannot be
    pipelined."""
    if not calls:
        return None, "the first batch's forward did not call it"
    if len(calls) > 1:
        return None, f"the first batch's forward called it {len(calls)} times"
    args, kwargs = calls[0]
    if kwargs or len(args) != 1 or not isinstance(args[0], KeyedJaggedTensor):
        return None, "it was not called with one KeyedJaggedTensor as its only argument"
    found = find_in_batch(batch, args[0])
    if found is None:
        return None, (
            "its KeyedJaggedTensor is not an attribute, key or item of the batch (the model "
            "builds or transforms it)"
        )
    return found, ""


def _agree(learned: Mapping[str, BatchPath]) -> None:
    """Check that every rank learned the same paths (each pipelines the same modules, so every
    rank issues the same collectives).

    Raises:
        RuntimeError: the ranks learned different paths.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = zlib.crc32(repr(sorted((p, str(w)) for p, w in learned.items())).encode())
    digests = [row[0] for row in all_gather_ints([digest], name="pipeline_input_paths")]
    if len(set(digests)) > 1:
        mine = {p: str(w) for p, w in learned.items()}
        raise RuntimeError(
            f"{_OWNER}: the ranks found the sharded modules' inputs at different places of "
            f"their first batches (rank {dist.get_rank()}: {mine}); give every rank batches of "
            "the same structure, or pass sparse_of"
        )
