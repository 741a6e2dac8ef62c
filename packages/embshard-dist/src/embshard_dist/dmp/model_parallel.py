"""DistributedModelParallel: a model with its embedding modules sharded and the rest data-parallel.

In order: read the optimizers declared with ``apply_optimizer_in_backward``
(:mod:`embshard_dist.dmp.in_backward`), plan (given, or
:func:`~embshard_dist.planner.auto.default_plan`), check it on every rank and agree on the
verdict and the plan in one small collective (:mod:`embshard_dist.planner.agreement`: a plan
refused on any rank raises the same error on every rank), check that ranks agree on source
weights, shard, then materialise the dense rest and make it data-parallel (DDP by default).
A step on N ranks equals the unsharded model on the global batch with loss (1/N) sum_i L_i.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys

from embshard_dist.dmp.accumulation import check_applied, no_sync
from embshard_dist.dmp.dense import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DenseOptimizerFactory,
    dense_named_parameters,
    dense_optimizer_factory,
    meta_dense_names,
)
from embshard_dist.dmp.in_backward import (
    check_declared_against,
    declared_optimizers,
    sharders_with_declared,
)
from embshard_dist.dmp.weights import check_same_source_weights, materialize_dense, move_dense
from embshard_dist.planner.agreement import agree_on_plan
from embshard_dist.planner.auto import TopologySource, default_plan, runtime_topology
from embshard_dist.sharded.plan_checks import check_plan
from embshard_dist.sharded.shardable import table_shapes
from embshard_dist.sharded.sharder import CollectionSharder
from embshard_dist.strategies.nodes import resolve_local_world_size
from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_optim.combined import CombinedOptimizer
from embshard_optim.fused import EmptyFusedOptimizer
from embshard_optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper
from embshard_optim.specs import OptimizerSpec, OptimType
from embshard_types.comm_codec import QCommCodecsRegistry
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import ModuleSharder, ShardedModule
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan

__all__ = [
    "DEFAULT_EMBEDDING_OPTIMIZER",
    "DistributedModelParallel",
    "get_module",
    "get_unsharded_module_names",
    "get_unwrapped_module",
]

DEFAULT_EMBEDDING_OPTIMIZER = OptimizerSpec(OptimType.SGD, learning_rate=0.01)
"""The embedding optimizer when none is given: FBGEMM's (and TorchRec's) default."""


class DistributedModelParallel(nn.Module):
    """A model whose embedding modules are sharded across ranks and whose rest is data-parallel.

    The arguments up to ``data_parallel_wrapper`` are TorchRec's, in TorchRec's order.

    Args:
        module: the model, on ``meta``, the CPU or a GPU (same weights on every rank).
        env: the ranks to shard over (default: ``torch.distributed``'s default group).
        device: the compute device (default: this rank's current GPU under NCCL, else CPU).
        plan: default: planned here by the cost-based planner.
        sharders: default: embshard's collection sharders, given the embedding optimizer.
        init_data_parallel: wrap the dense rest now (else call :meth:`init_data_parallel`).
        init_parameters: give dense parameters left on ``meta`` storage and initialise them
            (``reset_parameters()``); ``False`` leaves them on ``meta``.
        data_parallel_wrapper: how the dense rest is made data-parallel (default:
            :class:`~embshard_dist.dmp.dense.DefaultDataParallelWrapper`, DDP).
        optimizer: the embedding optimizer (an ``OptimizerSpec`` or a name); default: the one
            declared with ``apply_optimizer_in_backward`` on the tables, else the one the
            collections were built with, else :data:`DEFAULT_EMBEDDING_OPTIMIZER`.
        dense_optimizer: a ``torch.optim`` class, a factory ``params -> optimizer``, or
            ``None`` for the torch optimizer of the embedding optimizer's kind.
        qcomm_codecs_registry: codecs for the default sharders only.
        topology: what the default plan is made for: a ``Topology``, or the path of a file
            written by ``embshard calibrate``.
        local_world_size: ranks per node, for the default sharders and plan (default:
            ``LOCAL_WORLD_SIZE``, else one node).

    Raises:
        ValueError: the plan does not fit, ranks disagree on plan or source weights, an
            in-backward optimizer that cannot be fused or that disagrees with ``optimizer`` or
            the sharders', options meant for the default sharders given with your own
            sharders, or no plan fits the tables.
        RuntimeError: neither ``torch.distributed`` nor ``env`` gives a process group.
        CollectiveError: a peer died or hung during the checks or the sharding.
    """

    def __init__(
        self,
        module: nn.Module,
        env: ShardingEnv | None = None,
        device: torch.device | str | None = None,
        plan: ShardingPlan | None = None,
        sharders: Sequence[ModuleSharder[Any]] | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: DataParallelWrapper | None = None,
        *,
        optimizer: OptimizerSpec | str | None = None,
        dense_optimizer: type[torch.optim.Optimizer] | DenseOptimizerFactory | None = None,
        output_dtensor: bool = False,
        qcomm_codecs_registry: QCommCodecsRegistry | None = None,
        topology: TopologySource | None = None,
        local_world_size: int | None = None,
    ) -> None:
        super().__init__()
        for what, noun, value in (
            ("qcomm_codecs_registry", "the registry", qcomm_codecs_registry),
            ("local_world_size", "the node size", local_world_size),
        ):
            if sharders is not None and value is not None:
                raise ValueError(
                    f"DistributedModelParallel: {what} only configures the default sharders; "
                    f"you passed your own sharders, so give {noun} to them "
                    f"(EmbeddingBagCollectionSharder({what}=...)) and drop it here"
                )
        if data_parallel_wrapper is not None and not isinstance(
            data_parallel_wrapper, DataParallelWrapper
        ):
            raise TypeError(
                "data_parallel_wrapper must be a DataParallelWrapper (e.g. "
                f"DefaultDataParallelWrapper(bucket_cap_mb=...)), got {data_parallel_wrapper!r}"
            )
        self._env = _resolve_env(env, output_dtensor)
        self._device = _resolve_device(device, self._env)
        if local_world_size is not None:
            resolve_local_world_size(self._env.world_size, local_world_size)
        probe = (
            list(sharders)
            if sharders is not None
            else _default_sharders(DEFAULT_EMBEDDING_OPTIMIZER, None, None)
        )
        declared = declared_optimizers(module, probe)
        self._spec = _resolve_spec(optimizer, module, declared)
        self._sharders = (
            list(sharders)
            if sharders is not None
            else _default_sharders(self._spec, qcomm_codecs_registry, local_world_size)
        )
        by_path = sharders_with_declared(
            module, self._sharders, declared, user_given=sharders is not None
        )
        self._dense_factory = dense_optimizer_factory(dense_optimizer, self._spec)
        if plan is None:
            if local_world_size is not None:
                topology = runtime_topology(
                    self._env.world_size,
                    self._device.type,
                    local_world_size=local_world_size,
                    topology=topology,
                )
            plan = default_plan(
                module,
                self._sharders,
                self._env,
                self._device.type,
                optimizer=self._spec,
                topology=topology,
            )
        targets = _checked_plan(module, plan, self._sharders, self._env, self._device.type)
        targets = {path: (m, by_path.get(path, sharder)) for path, (m, sharder) in targets.items()}
        pg = self._env.process_group
        if pg is not None:
            sources = {path: m for path, (m, _) in targets.items()}
            check_same_source_weights(sources, pg, table_of=_table_namer(targets))
        self._plan = plan
        self._sharded: dict[str, nn.Module] = {}
        for path, (source, sharder) in targets.items():
            module_plan = cast(EmbeddingModuleShardingPlan, plan[path])
            # The whole plan was checked above: build without re-checking.
            if isinstance(sharder, CollectionSharder):
                sharded = sharder.build(source, module_plan, self._env, self._device, path)
            else:
                sharded = sharder.shard(source, module_plan, self._env, self._device, path)
            module = _swap(module, path, sharded)
            self._sharded[path] = sharded
        paths = set(self._sharded)
        if init_parameters:
            materialize_dense(module, self._device, paths)
        move_dense(module, self._device, paths)
        self._dense_optim: KeyedOptimizer | None = None
        self._combined: KeyedOptimizer | None = None
        self._fused: KeyedOptimizer | None = None
        self._dmp_wrapped_module: nn.Module = module
        self._data_parallel_wrapper = data_parallel_wrapper or DefaultDataParallelWrapper()
        if init_data_parallel:
            self.init_data_parallel()

    def init_data_parallel(self, **ddp_kwargs: Any) -> None:
        """Make the dense rest data-parallel (once; later calls do nothing).

        Args:
            **ddp_kwargs: given: ``DistributedDataParallel`` with these options instead of the
                ``data_parallel_wrapper``.

        Raises:
            ValueError: dense parameters are still on ``meta`` (``init_parameters=False``).
        """
        if self._dmp_wrapped_module is not self.module:
            return
        meta = meta_dense_names(self.module, set(self._sharded))
        if meta:
            raise ValueError(
                f"DistributedModelParallel: dense parameters {meta[:5]} are still on the meta "
                "device (init_parameters=False), so they cannot be made data-parallel; "
                "materialise them (e.g. load a checkpoint into them), then call "
                "init_data_parallel(), or construct with init_parameters=True"
            )
        wrapper = (
            DefaultDataParallelWrapper(**ddp_kwargs) if ddp_kwargs else self._data_parallel_wrapper
        )
        wrapper.wrap(self, self._env, self._device)

    @property
    def module(self) -> nn.Module:
        """The model with its sharded sub-modules, without the DDP wrapper."""
        wrapped = self._dmp_wrapped_module
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            return cast(nn.Module, wrapped.module)
        return wrapped

    @property
    def plan(self) -> ShardingPlan:
        return self._plan

    @property
    def env(self) -> ShardingEnv:
        return self._env

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        """The embedding optimizer the default sharders were given."""
        return self._spec

    @property
    def sharded_modules(self) -> Mapping[str, nn.Module]:
        return dict(self._sharded)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """Every sharded module's fused optimizer, named ``"{module path}.{their name}"``."""
        if self._fused is None:
            parts = [
                (path, cast(KeyedOptimizer, m.fused_optimizer))
                for path, m in self._sharded.items()
                if hasattr(m, "fused_optimizer")
            ]
            self._fused = CombinedOptimizer(parts) if parts else EmptyFusedOptimizer()
        return self._fused

    @property
    def dense_optimizer(self) -> KeyedOptimizer:
        """The optimizer of the dense parameters (built on first use), named by parameter path."""
        if self._dense_optim is None:
            params = dense_named_parameters(self.module, set(self._sharded))
            if not params:
                self._dense_optim = EmptyFusedOptimizer()
            else:
                self._dense_optim = KeyedOptimizerWrapper(params, self._dense_factory)
        return self._dense_optim

    def optimizer(self) -> KeyedOptimizer:
        """One optimizer over the fused and dense ones (tables were updated in the backward)."""
        if self._combined is None:
            self._combined = CombinedOptimizer([self.fused_optimizer, self.dense_optimizer])
        return self._combined

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dmp_wrapped_module(*args, **kwargs)

    def no_sync(self) -> AbstractContextManager[None]:
        """Gradient accumulation, as ``DistributedDataParallel.no_sync`` but for the tables too.

        Forwards and backwards inside keep every fused kernel's row gradients (no update) and
        the dense gradients local (no all-reduce); the backward of the first forward outside
        applies them all in one step: ``k`` micro-batches, one optimizer step (see
        :mod:`embshard_dist.dmp.accumulation`). Step the dense optimizer after that backward
        only. ``state_dict`` and ``load_state_dict`` refuse while gradients are kept.

        Example::

            for j, micro_batch in enumerate(micro_batches):
                last = j == len(micro_batches) - 1
                with contextlib.nullcontext() if last else dmp.no_sync():
                    (dmp(micro_batch) / len(micro_batches)).backward()
            optimizer.step()
        """
        return no_sync(self)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The unwrapped model's parameters (local shards for sharded tables)."""
        yield from self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        yield from self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(  # type: ignore[override]
        self,
        *,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        """The unwrapped model's state dict; sharded tables are ``ShardedTensor`` / ``DTensor``.

        Raises:
            RuntimeError: inside a gradient accumulation (:meth:`no_sync`) whose kept gradients
                are not applied yet.
        """
        check_applied(self.module, "save")
        result: dict[str, Any] = self.module.state_dict(
            destination=destination,  # type: ignore[arg-type]
            prefix=prefix,
            keep_vars=keep_vars,
        )
        return result

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a state dict saved by :meth:`state_dict` of an equally sharded model.

        Raises:
            ValueError: with ``strict``, listing the missing and unexpected keys, before loading.
            RuntimeError: kept gradients of a gradient accumulation are not applied yet.
        """
        check_applied(self.module, "load")
        expected = set(self.state_dict(keep_vars=True))
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise ValueError(
                "cannot load the state dict into DistributedModelParallel: "
                f"missing keys {missing}, unexpected keys {unexpected}"
            )
        parts: dict[str, dict[str, Any]] = {path: {} for path in self._sharded}
        rest: dict[str, Any] = {}
        for key, value in state_dict.items():
            owner = _owner(key, self._sharded)
            if owner is None:
                rest[key] = value
            else:
                parts[owner][key[len(owner) + 1 :] if owner else key] = value
        for path, sub in parts.items():
            if sub:
                self._sharded[path].load_state_dict(sub, strict=False)
        if "" not in self._sharded and rest:
            self.module.load_state_dict(rest, strict=False, assign=assign)
        return _IncompatibleKeys(missing, unexpected)


def _owner(key: str, sharded: Mapping[str, nn.Module]) -> str | None:
    for path in sharded:
        if path == "" or key.startswith(path + "."):
            return path
    return None


_ONE_PROCESS = (
    "for one process, start a one-rank group first: "
    "torch.distributed.init_process_group('gloo', store=torch.distributed.HashStore(), "
    "rank=0, world_size=1)"
)


def _checked_plan(
    module: nn.Module,
    plan: ShardingPlan,
    sharders: Sequence[ModuleSharder[Any]],
    env: ShardingEnv,
    device_type: str,
) -> dict[str, tuple[nn.Module, ModuleSharder[Any]]]:
    """``check_plan``'s targets, once every rank's check passed on an equal plan.

    With a process group, each rank checks its own plan and the ranks agree in one small
    all-gather, so a plan refused on any rank (or plans that differ) raises the same
    ``ValueError`` on every rank before any module is built.
    """

    def check() -> dict[str, tuple[nn.Module, ModuleSharder[Any]]]:
        return check_plan(module, plan, sharders, env, device_type)

    if env.process_group is None:
        return check()
    return agree_on_plan(plan, check, env.process_group)


def _resolve_env(env: ShardingEnv | None, output_dtensor: bool) -> ShardingEnv:
    if env is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedModelParallel needs torch.distributed: call "
                "torch.distributed.init_process_group first (or launch with `embshard train` / "
                f"torchrun); {_ONE_PROCESS}"
            )
        world = dist.group.WORLD
        assert world is not None
        return ShardingEnv.from_process_group(world, output_dtensor)
    if not isinstance(env, ShardingEnv):
        raise TypeError(f"env must be a ShardingEnv, got {type(env).__name__}")
    if env.process_group is None and not dist.is_initialized():
        raise RuntimeError(
            f"DistributedModelParallel: {env!r} has no process group and torch.distributed is "
            "not initialised, but sharded collections exchange their inputs and outputs "
            f"through a process group even on one rank; {_ONE_PROCESS}, then pass no env "
            "(ShardingEnv.from_local is for planning and inference)"
        )
    if env.process_group is None and dist.get_world_size() != env.world_size:
        raise ValueError(
            f"DistributedModelParallel: {env!r} has no process group, so the sharded "
            f"collections would use torch.distributed's default group of "
            f"{dist.get_world_size()} ranks, not {env.world_size}; pass no env, or "
            "ShardingEnv.from_process_group(group) for a group of the ranks to shard over"
        )
    if output_dtensor:
        env.output_dtensor = True
    return env


def _resolve_device(device: torch.device | str | None, env: ShardingEnv) -> torch.device:
    if device is not None:
        return torch.device(device)
    pg = env.process_group
    if pg is not None and "nccl" in str(dist.get_backend(pg)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_spec(
    optimizer: OptimizerSpec | str | None,
    model: nn.Module,
    declared: Mapping[str, OptimizerSpec],
) -> OptimizerSpec:
    if optimizer is None and declared:
        return next(iter(declared.values()))
    if optimizer is None:
        # The first fused collection's optimizer, as the sharded collection itself would take.
        for m in model.modules():
            collection = isinstance(m, EmbeddingBagCollection | EmbeddingCollection)
            for table in getattr(m, "_tables", ()) if collection else ():
                if table.fused_params is not None:
                    return cast(OptimizerSpec, table.fused_params.optimizer)
        return DEFAULT_EMBEDDING_OPTIMIZER
    if isinstance(optimizer, str):
        optimizer = OptimizerSpec.from_name(optimizer)
    if not isinstance(optimizer, OptimizerSpec):
        raise TypeError(
            f"optimizer must be an OptimizerSpec or an optimizer name, got {optimizer!r}; build "
            "one with OptimizerSpec.from_name(...) or OptimizerSpec.from_torch(...)"
        )
    check_declared_against(declared, optimizer, "DistributedModelParallel's optimizer=")
    return optimizer


def _default_sharders(
    spec: OptimizerSpec, registry: QCommCodecsRegistry | None, local_world_size: int | None
) -> list[ModuleSharder[Any]]:
    from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
    from embshard_dist.sharded.quant_embedding_bag import QuantEmbeddingBagCollectionSharder

    return [
        EmbeddingBagCollectionSharder(
            optimizer=spec, qcomm_codecs_registry=registry, local_world_size=local_world_size
        ),
        EmbeddingCollectionSharder(optimizer=spec, qcomm_codecs_registry=registry),
        QuantEmbeddingBagCollectionSharder(qcomm_codecs_registry=registry),
    ]


def _table_namer(targets: Mapping[str, tuple[nn.Module, ModuleSharder[Any]]]) -> Any:
    names = {path: [s.name for s in table_shapes(m, sh)] for path, (m, sh) in targets.items()}

    def table_of(path: str, key: str) -> str | None:
        dotted = f".{key}."
        hits = [n for n in names.get(path, ()) if f".{n}." in dotted]
        return max(hits, key=len) if hits else None

    return table_of


def _swap(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``path`` in ``model``; returns the model (``new`` itself for ``""``)."""
    if path == "":
        return new
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)
    return model


def get_module(module: nn.Module) -> nn.Module:
    """``module`` without its ``DistributedModelParallel`` wrappers (TorchRec's ``get_module``):
    a DDP wrapper of the dense part is kept, so its own overrides still apply."""
    while isinstance(module, DistributedModelParallel):
        module = module._dmp_wrapped_module
    return module


def get_unwrapped_module(module: nn.Module) -> nn.Module:
    """``module`` without any ``DistributedModelParallel``, DDP or FSDP wrapper (TorchRec's
    ``get_unwrapped_module``): the user's model, its sharded sub-modules in place."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    while True:
        if isinstance(module, DistributedModelParallel):
            module = module._dmp_wrapped_module
        elif isinstance(module, nn.parallel.DistributedDataParallel | FullyShardedDataParallel):
            module = cast(nn.Module, module.module)
        else:
            return module


def get_unsharded_module_names(model: nn.Module) -> list[str]:
    """The paths of the modules of ``model`` that hold no sharded module but have a sibling that
    is or holds one (TorchRec's ``get_unsharded_module_names``: the dense parts beside the
    sharded ones, at the highest level where they separate); the order is not defined."""
    names: list[str] = []
    _holds_sharded(model, "", names)
    return names


def _holds_sharded(module: nn.Module, prefix: str, names: list[str]) -> bool:
    children = list(module.named_children())
    sharded = {
        name
        for name, child in children
        if isinstance(child, ShardedModule) or _holds_sharded(child, f"{prefix}{name}.", names)
    }
    if sharded:
        names.extend(f"{prefix}{name}" for name, _ in children if name not in sharded)
    return bool(sharded)
