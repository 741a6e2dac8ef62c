"""Optimizers whose parameters and state are keyed by parameter name.

A :class:`KeyedOptimizer`'s state dict names parameters instead of numbering them, so it is the
same on every rank and world size. ``load_state_dict`` checks everything first (all problems in
one ``ValueError``), then copies in place, so sharded state stays in the kernels' buffers.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from embshard_optim.state_io import copy_state, state_mismatches


class MergedState(Mapping[Any, Any]):
    """A live, read-only view of several ``state`` mappings (searched in order) as one; a
    look-up never creates an entry in a ``defaultdict`` part."""

    def __init__(self, parts: Sequence[Mapping[Any, Any]]) -> None:
        self._parts = list(parts)

    def __getitem__(self, key: Any) -> Any:
        for part in self._parts:
            if key in part:
                return part[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return any(key in part for part in self._parts)

    def __iter__(self) -> Iterator[Any]:
        for part in self._parts:
            yield from part

    def __len__(self) -> int:
        return sum(len(part) for part in self._parts)


class KeyedOptimizer(torch.optim.Optimizer):
    """An optimizer whose parameters, state and state dict are keyed by parameter name.

    This base holds parameters and state; :class:`KeyedOptimizerWrapper` steps them with a
    ``torch.optim`` optimizer, ``FusedOptimizer`` subclasses with a fused kernel.

    Args:
        params: parameter name -> parameter (a ``Tensor``, ``ShardedTensor`` or ``DTensor``).
        state: parameter -> ``{state_key: value}``, kept by reference.
        param_groups: ``torch.optim``-style groups, kept by reference.

    Raises:
        ValueError: a parameter appears under two names, a state or group refers to a tensor
            that is not among ``params``.
    """

    # Parameters map to any mapping of states (a live view for combined optimizers).
    state: Mapping[Any, Any]  # type: ignore[assignment]

    def __init__(
        self,
        params: Mapping[str, Tensor],
        state: Mapping[Any, Any],
        param_groups: Sequence[dict[str, Any]],
    ) -> None:
        self._init_optimizer_base()
        self.params: dict[str, Tensor] = dict(params)
        self.state = state
        self.param_groups = param_groups  # type: ignore[assignment]
        self._check_consistent()

    def _init_optimizer_base(self) -> None:
        """What ``torch.optim.Optimizer.__init__`` sets up, minus its parameter handling."""
        torch._C._log_api_usage_once("embshard_optim.keyed_optimizer")
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._save_param_groups = True
        self._patch_step_function()

    def _check_consistent(self) -> None:
        seen = _names_by_id(self.params)
        strays = [p for p in self.state if id(p) not in seen]
        if strays:
            raise ValueError(
                f"{len(strays)} optimizer state entries belong to tensors that are not among "
                f"the named parameters {sorted(self.params)}"
            )
        for index, group in enumerate(self.param_groups):
            unnamed = [p for p in group["params"] if id(p) not in seen]
            if unnamed:
                raise ValueError(
                    f"param group {index} holds {len(unnamed)} tensors that are not among the "
                    f"named parameters {sorted(self.params)}"
                )

    def _key_of(self) -> dict[int, str]:
        return _names_by_id(self.params)

    def _keyed_state(self) -> dict[str, Mapping[str, Any]]:
        """Name -> state of every parameter whose state is not empty."""
        key_of = self._key_of()
        return {key_of[id(param)]: s for param, s in self.state.items() if s}

    # -- state dict ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {name: state}, "param_groups": [...]}``; tensors are not copied."""
        result: dict[str, Any] = {
            "state": {key: _copy_structure(s) for key, s in self._keyed_state().items()}
        }
        if self._save_param_groups:
            key_of = self._key_of()
            result["param_groups"] = [
                {
                    "params": sorted(key_of[id(p)] for p in group["params"]),
                    **{k: copy.deepcopy(v) for k, v in group.items() if k != "params"},
                }
                for group in self.param_groups
            ]
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict saved by an optimizer over the same named parameters.

        Tensors are copied in place (local shards included); group hyperparameters replaced.

        Raises:
            ValueError: listing every missing, unexpected or mis-shaped key, before any change.
        """
        if not isinstance(state_dict, Mapping) or "state" not in state_dict:
            raise ValueError("an optimizer state dict must be a mapping with a 'state' entry")
        current = self._keyed_state()
        saved = state_dict["state"]
        problems = self._state_problems(current, saved)
        group_pairs: list[tuple[dict[str, Any], Mapping[str, Any]]] = []
        if self._save_param_groups:
            if "param_groups" not in state_dict:
                problems.append(
                    "the state dict has no 'param_groups'; load one saved with param groups, or "
                    "call save_param_groups(False) first"
                )
            else:
                group_pairs = self._match_groups(state_dict["param_groups"], problems)
        if problems:
            raise ValueError(
                "cannot load the optimizer state dict:\n  - " + "\n  - ".join(problems)
            )
        for key, param_state in current.items():
            copy_state(param_state, saved[key])  # type: ignore[arg-type]
        for group, saved_group in group_pairs:
            for hyper, value in saved_group.items():
                if hyper != "params":
                    group[hyper] = copy.deepcopy(value)
        self.post_load_state_dict()

    def _state_problems(
        self, current: Mapping[str, Mapping[str, Any]], saved: Mapping[str, Any]
    ) -> list[str]:
        problems = []
        missing = sorted(set(current) - set(saved))
        if missing:
            problems.append(f"state is missing parameters {missing}")
        extra = sorted(set(saved) - set(current))
        stateless = [key for key in extra if key in self.params]
        unknown = [key for key in extra if key not in self.params]
        if stateless:
            problems.append(
                f"parameters {stateless} have no optimizer state yet; call init_state() before "
                "load_state_dict()"
            )
        if unknown:
            problems.append(f"state has unexpected parameters {unknown}")
        for key in sorted(set(current) & set(saved)):
            problems += state_mismatches(current[key], saved[key], f"state[{key!r}]")
        return problems

    def _match_groups(
        self, saved_groups: Sequence[Mapping[str, Any]], problems: list[str]
    ) -> list[tuple[dict[str, Any], Mapping[str, Any]]]:
        key_of = self._key_of()
        mine = {tuple(sorted(key_of[id(p)] for p in g["params"])): g for g in self.param_groups}
        theirs = {tuple(sorted(g.get("params", ()))): g for g in saved_groups}
        for names in sorted(set(mine) - set(theirs)):
            problems.append(f"param_groups: no saved group holds parameters {list(names)}")
        for names in sorted(set(theirs) - set(mine)):
            problems.append(f"param_groups: unexpected saved group of parameters {list(names)}")
        pairs = []
        for names in sorted(set(mine) & set(theirs)):
            group, saved_group = mine[names], theirs[names]
            missing = sorted(set(group) - set(saved_group))
            extra = sorted(set(saved_group) - set(group))
            if missing or extra:
                problems.append(
                    f"param_groups[{list(names)}]: missing hyperparameters {missing}, "
                    f"unexpected {extra}"
                )
            pairs.append((group, saved_group))
        return pairs

    def post_load_state_dict(self) -> None:
        """Called after :meth:`load_state_dict` has copied everything (override to react)."""

    def save_param_groups(self, save: bool) -> None:
        """Whether :meth:`state_dict` includes (and :meth:`load_state_dict` requires) groups."""
        self._save_param_groups = save

    # -- state materialisation -------------------------------------------------------------

    def init_state(self, sparse_grad_parameter_names: Collection[str] | None = None) -> None:
        """Create zero state for every trainable parameter that has none yet.

        One step on zero gradients for those parameters only, then the new state is zeroed and
        parameters and gradients restored exactly (``sparse_grad_parameter_names``: parameters
        whose optimizer expects sparse gradients).
        """
        sparse = set(sparse_grad_parameter_names or ())
        unknown = sorted(sparse - set(self.params))
        if unknown:
            raise ValueError(f"init_state: unknown sparse parameters {unknown}")
        pending = {
            key: p for key, p in self.params.items() if p.requires_grad and not self.state.get(p)
        }
        if not pending:
            return
        grads = {key: p.grad for key, p in self.params.items()}
        with torch.no_grad():
            values = {key: p.detach().clone() for key, p in pending.items()}
        try:
            for key, param in self.params.items():
                if key in pending:
                    zero = torch.zeros_like(param)
                    param.grad = zero.to_sparse() if key in sparse else zero
                else:
                    param.grad = None
            self.step()
        finally:
            with torch.no_grad():
                for key, param in pending.items():
                    param.copy_(values[key])
                    _zero_tensors(self.state.get(param, {}))
            for key, param in self.params.items():
                param.grad = grads[key]

    # -- stepping --------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Raises ``NotImplementedError``: a bare KeyedOptimizer holds state only and cannot step."""
        raise NotImplementedError(
            f"{type(self).__name__} holds named state only and cannot step; wrap a torch.optim "
            "optimizer with KeyedOptimizerWrapper, or use a FusedOptimizer"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: a keyed optimizer's parameters are fixed when it is built."""
        raise TypeError(
            f"{type(self).__name__} cannot add param groups after construction; build a new "
            "optimizer over the extra parameters and join them with CombinedOptimizer"
        )


def _names_by_id(params: Mapping[str, Tensor]) -> dict[int, str]:
    """``id(tensor) -> name``, refusing non-string names and a tensor under two names."""
    seen: dict[int, str] = {}
    for key, param in params.items():
        if not isinstance(key, str):
            raise ValueError(f"parameter names must be strings, got {key!r}")
        if id(param) in seen:
            raise ValueError(
                f"one tensor is registered under two names, {seen[id(param)]!r} and {key!r}"
            )
        seen[id(param)] = key
    return seen


def _copy_structure(value: Any) -> Any:
    """Copy nested dicts, keep their tensors and other leaves by reference."""
    if isinstance(value, Mapping):
        return {k: _copy_structure(v) for k, v in value.items()}
    return value


def _zero_tensors(value: Any) -> None:
    if isinstance(value, Mapping):
        for v in value.values():
            _zero_tensors(v)
    elif isinstance(value, Tensor):
        value.zero_()


class KeyedOptimizerWrapper(KeyedOptimizer):
    """A :class:`KeyedOptimizer` stepped by the ``torch.optim`` optimizer that
    ``optim_factory(list of params)`` builds (e.g. ``lambda ps: torch.optim.Adam(ps)``)."""

    def __init__(
        self,
        params: Mapping[str, Tensor],
        optim_factory: Callable[[list[Tensor]], torch.optim.Optimizer],
    ) -> None:
        if not params:
            raise ValueError("KeyedOptimizerWrapper needs at least one named parameter")
        _names_by_id(params)
        self._optimizer = optim_factory(list(params.values()))
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)

    @classmethod
    def from_class(
        cls, params: Mapping[str, Tensor], optim_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> KeyedOptimizerWrapper:
        """``KeyedOptimizerWrapper(params, lambda ps: optim_cls(ps, **kwargs))``."""
        return cls(params, lambda ps: optim_cls(ps, **kwargs))

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped ``torch.optim`` optimizer."""
        return self._optimizer

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of the wrapped optimizer."""
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the wrapped optimizer's parameters."""
        self._optimizer.zero_grad(set_to_none=set_to_none)


class OptimizerWrapper(KeyedOptimizer):
    """A keyed optimizer that delegates to another and may add named parameters of its own.

    The base of warm-up and clipping wrappers: ``state`` is a live view of the wrapped
    optimizer's and ``extra_state``; param groups are the wrapped optimizer's own.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        extra_params: Mapping[str, Tensor] | None = None,
        extra_state: Mapping[Any, Any] | None = None,
    ) -> None:
        extra_params = dict(extra_params or {})
        clash = sorted(set(extra_params) & set(optimizer.params))
        if clash:
            raise ValueError(f"{type(self).__name__}: parameter names {clash} are already used")
        self._optimizer = optimizer
        state = MergedState([optimizer.state, dict(extra_state or {})])
        super().__init__({**optimizer.params, **extra_params}, state, optimizer.param_groups)
        self._save_param_groups = optimizer._save_param_groups

    @property
    def wrapped(self) -> KeyedOptimizer:
        """The optimizer this one delegates to."""
        return self._optimizer

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of the wrapped optimizer."""
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def init_state(self, sparse_grad_parameter_names: Collection[str] | None = None) -> None:
        """The wrapped optimizer's ``init_state`` (this wrapper's own state always exists)."""
        self._optimizer.init_state(sparse_grad_parameter_names)

    def post_load_state_dict(self) -> None:
        """Let the wrapped optimizer react to the load."""
        self._optimizer.post_load_state_dict()

    def save_param_groups(self, save: bool) -> None:
        """Set on this wrapper and the wrapped optimizer."""
        self._save_param_groups = save
        self._optimizer.save_param_groups(save)
