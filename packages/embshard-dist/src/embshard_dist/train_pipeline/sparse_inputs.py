"""Which sharded modules a pipeline drives, and which KeyedJaggedTensor of a batch each reads.

TorchRec traces the model with ``torch.fx`` to learn which batch attribute feeds each sharded
module. embshard states the rule instead:

* by default every sharded module reads ``batch.sparse_features`` (TorchRec's ``Batch`` and
  :class:`~embshard_dist.models.dlrm.DLRMTrain`'s contract);
* ``sparse_of(batch)`` may return one KeyedJaggedTensor (read by every sharded module) or a
  mapping ``{module path: KeyedJaggedTensor}``; a module left out of the mapping runs its own
  input dist inside the forward, as without a pipeline.

The rule is checked where it can fail: a batch without the input, an unknown module path, a value
that is not a KeyedJaggedTensor (here), and a module called with anything but that very object
(:mod:`~embshard_dist.train_pipeline.pipelined_forward`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_types.interfaces import ShardedModule
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

__all__ = ["AnyShardedModule", "SparseInputs", "SparseOf", "find_sharded_modules"]

AnyShardedModule: TypeAlias = ShardedModule[Any, Any, Any, Any]
SparseOf: TypeAlias = Callable[[Any], KeyedJaggedTensor | Mapping[str, KeyedJaggedTensor]]
"""``batch -> KJT`` (for every sharded module) or ``batch -> {module path: KJT}``."""

_OWNER = "TrainPipelineSparseDist"


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


class SparseInputs:
    """Reads, from a batch, the KeyedJaggedTensor of every module to pipeline.

    Args:
        modules: the model's sharded modules by path (:func:`find_sharded_modules`).
        sparse_of: the rule (see the module docstring); default ``batch.sparse_features``.
    """

    def __init__(
        self, modules: Mapping[str, AnyShardedModule], sparse_of: SparseOf | None = None
    ) -> None:
        self._paths = list(modules)
        self._sparse_of = sparse_of

    def __call__(self, batch: Any) -> dict[str, KeyedJaggedTensor]:
        """Module path -> its input, in the model's module order.

        Raises:
            TypeError: the batch has no ``sparse_features`` (default rule), or the rule gave
                something other than a KeyedJaggedTensor.
            ValueError: the rule named a path that is not a sharded module of the model.
        """
        if self._sparse_of is None:
            return dict.fromkeys(self._paths, self._default(batch))
        given = self._sparse_of(batch)
        if isinstance(given, KeyedJaggedTensor):
            return dict.fromkeys(self._paths, given)
        if not isinstance(given, Mapping):
            raise TypeError(
                f"{_OWNER}: sparse_of(batch) must return a KeyedJaggedTensor or a dict "
                f"{{module path: KeyedJaggedTensor}}, got {type(given).__name__}"
            )
        unknown = sorted(set(given) - set(self._paths))
        if unknown:
            raise ValueError(
                f"{_OWNER}: sparse_of(batch) names {unknown}, which are not sharded modules of "
                f"the model; its sharded modules are {self._paths}"
            )
        for path, value in given.items():
            if not isinstance(value, KeyedJaggedTensor):
                raise TypeError(
                    f"{_OWNER}: sparse_of(batch)[{path!r}] must be a KeyedJaggedTensor, got "
                    f"{type(value).__name__}"
                )
        return {path: given[path] for path in self._paths if path in given}

    def _default(self, batch: Any) -> KeyedJaggedTensor:
        value = getattr(batch, "sparse_features", None)
        if isinstance(value, KeyedJaggedTensor):
            return value
        found = "has none" if value is None else f"is a {type(value).__name__}"
        raise TypeError(
            f"{_OWNER}: the pipeline reads the sharded modules' input from "
            f"batch.sparse_features, a KeyedJaggedTensor, but the {type(batch).__name__} batch "
            f"{found}; pass sparse_of=lambda batch: <the KeyedJaggedTensor the model gives its "
            f"sharded modules>, or a dict {{module path: KeyedJaggedTensor}} for the modules "
            f"{self._paths}"
        )
